//! SentencePiece merging, byte fallback, BOS/EOS rules and round trips.

use super::*;

fn id(t: &Tokenizer, s: &str) -> u32 {
    t.token_id(s).unwrap_or(u32::MAX)
}

#[test]
fn merges_by_score_into_words() {
    let t = spm();
    let ids = t.encode("hello world", false, false);
    assert_eq!(ids, vec![id(&t, "▁hello"), id(&t, "▁world")]);
    // With BOS (llama default) and the decode of it.
    let ids = t.encode("hello world", true, false);
    assert_eq!(ids, vec![BOS, id(&t, "▁hello"), id(&t, "▁world")]);
    assert_eq!(t.decode(&ids), " hello world");
}

#[test]
fn highest_score_pair_wins_and_ties_go_left() {
    // "abc": the higher-scoring pair merges first, leaving the other character alone.
    let pieces = |ab: f32, bc: f32| {
        vec![
            ("a", -1.0, 1),
            ("b", -1.0, 1),
            ("c", -1.0, 1),
            ("ab", ab, 1),
            ("bc", bc, 1),
        ]
    };
    for (ab, bc, want) in [
        (-1.0, -2.0, ["ab", "c"]),
        (-2.0, -1.0, ["a", "bc"]),
        (-1.5, -1.5, ["ab", "c"]),
    ] {
        let mut spec = spm_spec(&pieces(ab, bc));
        spec.add_space_prefix = Some(false);
        let t = tok(spec);
        let want: Vec<u32> = want.iter().map(|s| id(&t, s)).collect();
        assert_eq!(t.encode("abc", false, false), want, "ab={ab} bc={bc}");
    }
}

#[test]
fn merges_cascade_only_through_vocab_pieces() {
    // "he" outranks "ll", both merge before "hell", and "hel" is no piece so "helo" stops early.
    let mut spec = spm_spec(SPM_PIECES);
    spec.add_space_prefix = Some(false);
    let t = tok(spec);
    assert_eq!(t.encode("hello", false, false), vec![id(&t, "hello")]);
    assert_eq!(
        t.encode("helo", false, false),
        vec![id(&t, "he"), id(&t, "l"), id(&t, "o")]
    );
    assert_eq!(
        t.encode("hi hi", false, false),
        vec![id(&t, "hi"), id(&t, "▁hi")]
    );
}

#[test]
fn unknown_characters_fall_back_to_bytes() {
    let t = spm();
    let ids = t.encode("😀", false, false);
    // "▁" is a piece; the emoji is four byte tokens.
    let bytes: Vec<u32> = "😀".bytes().map(|b| BYTE0 + b as u32).collect();
    assert_eq!(ids[0], id(&t, "▁"));
    assert_eq!(&ids[1..], &bytes[..]);
    assert_eq!(t.decode(&ids), " 😀");
    // A known multi-byte character is one token.
    assert_eq!(
        t.encode("日", false, false),
        vec![id(&t, "▁"), id(&t, "日")]
    );
}

#[test]
fn bos_and_eos_rules() {
    let t = spm();
    assert_eq!(t.encode("", true, false), vec![BOS]);
    assert_eq!(t.encode("", false, false), Vec::<u32>::new());
    assert!(t.add_bos());

    let mut spec = spm_spec(SPM_PIECES);
    spec.add_bos = Some(false);
    spec.add_eos = Some(true);
    let t = tok(spec);
    assert_eq!(t.encode("hi", true, false), vec![id(&t, "▁hi"), EOS]);
    assert_eq!(t.encode("hi", false, false), vec![id(&t, "▁hi")]);
}

#[test]
fn defaults_special_ids_like_llama_cpp() {
    let mut spec = spm_spec(SPM_PIECES);
    spec.bos_id = None;
    spec.eos_id = None;
    spec.unk_id = None;
    let t = tok(spec);
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.unk_id()),
        (Some(1), Some(2), Some(0))
    );
    assert!(t.is_eog(2));
}

#[test]
fn round_trips_varied_text() {
    let mut spec = spm_spec(SPM_PIECES);
    spec.add_space_prefix = Some(false);
    let t = tok(spec);
    for text in [
        "hello world",
        "héllo wörld, ça va? 日本語のテキスト",
        "emoji 😀🎉 and ZWJ 👩‍👩‍👧",
        "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\r\n",
        "<start_of_turn>not parsed<tag>",
        "",
    ] {
        let ids = t.encode(text, false, false);
        assert_eq!(t.decode(&ids), text, "{ids:?}");
    }
    // With the (default) space prefix the decoded text gains exactly one leading space.
    let t = spm();
    let ids = t.encode("héllo 😀", false, false);
    assert_eq!(t.decode(&ids), " héllo 😀");
}

#[test]
fn token_bytes_of_each_kind() {
    let t = spm();
    assert_eq!(t.token_bytes(BYTE0 + 0x41), b"A");
    assert_eq!(t.token_bytes(id(&t, "▁hello")), b" hello");
    assert_eq!(t.token_bytes(BOS), b"");
    assert_eq!(t.token_bytes(UNK), b"");
    assert_eq!(t.token_bytes(id(&t, "<tag>")), b"<tag>");
    assert_eq!(t.token_bytes(u32::MAX), b"");
    assert_eq!(t.token_text(id(&t, "▁hello")), "▁hello");
    assert_eq!(t.token_text(u32::MAX), "");
    assert_eq!(t.vocab_size(), 3 + 256 + SPM_PIECES.len());
}

#[test]
fn long_text_is_fast() {
    // Quadratic merging would take seconds here; the queue makes it milliseconds.
    let t = spm();
    let text = "hello world hi héllo 😀 ".repeat(2000);
    let start = std::time::Instant::now();
    let ids = t.encode(&text, false, false);
    assert!(ids.len() > 10_000);
    assert_eq!(t.decode(&ids), format!(" {text}"));
    let elapsed = start.elapsed();
    assert!(elapsed.as_secs() < 5, "took {elapsed:?}");
}
