//! Byte-level BPE: merge ranks, the byte alphabet, ignore_merges, BOS rules, round trips.

use super::*;

fn id(t: &Tokenizer, s: &str) -> u32 {
    t.token_id(s).unwrap_or(u32::MAX)
}

const EXTRA: &[&str] = &["he", "Ġt", "Ġthe", "ll", "hell", "hello", "ab", "bc", "xyz"];
const MERGES: &[&str] = &[
    "h e", "Ġ t", "Ġt he", "l l", "he ll", "hell o", "b c", "a b",
];

#[test]
fn merges_apply_by_rank() {
    let t = tok(bpe_spec("qwen2", EXTRA, MERGES));
    assert_eq!(
        t.encode("hello the", false, false),
        vec![id(&t, "hello"), id(&t, "Ġthe")]
    );
    // "b c" (rank 6) beats "a b" (rank 7) although "ab" is further left.
    assert_eq!(
        t.encode("abc", false, false),
        vec![b'a' as u32, id(&t, "bc")]
    );
    // A word with no merges is one token per byte character.
    assert_eq!(
        t.encode("xyz", false, false),
        vec![b'x' as u32, b'y' as u32, b'z' as u32]
    );
}

#[test]
fn llama3_takes_whole_vocab_words() {
    let t = tok(bpe_spec("llama-bpe", EXTRA, MERGES));
    assert_eq!(t.encode("xyz", false, false), vec![id(&t, "xyz")]);
}

#[test]
fn bytes_map_through_the_gpt2_alphabet() {
    let t = tok(bpe_spec("qwen2", EXTRA, MERGES));
    // No merges for the emoji: one token per byte, and id = byte value in this fixture.
    let ids = t.encode("😀", false, false);
    assert_eq!(ids, vec![0xF0, 0x9F, 0x98, 0x80]);
    assert_eq!(t.token_text(b' ' as u32), "Ġ");
    assert_eq!(t.token_bytes(b' ' as u32), b" ");
    assert_eq!(t.token_bytes(id(&t, "Ġthe")), b" the");
    assert_eq!(t.token_bytes(0xF0), vec![0xF0]);
}

#[test]
fn bos_defaults_depend_on_pre_type() {
    let qwen = tok(bpe_spec("qwen2", EXTRA, MERGES));
    assert_eq!(qwen.encode("he", true, false), vec![id(&qwen, "he")]);

    let llama = tok(bpe_spec("llama-bpe", EXTRA, MERGES));
    let bos = llama.bos_id().unwrap_or(u32::MAX);
    assert_eq!(llama.encode("he", true, false), vec![bos, id(&llama, "he")]);
    assert_eq!(llama.encode("he", false, false), vec![id(&llama, "he")]);

    let mut spec = bpe_spec("qwen2", EXTRA, MERGES);
    spec.add_bos = Some(true);
    spec.add_eos = Some(true);
    let t = tok(spec);
    let (b, e) = (t.bos_id().unwrap_or(0), t.eos_id().unwrap_or(0));
    assert_eq!(t.encode("he", true, false), vec![b, id(&t, "he"), e]);
}

#[test]
fn special_tokens_and_eog_in_bpe() {
    let t = tok(bpe_spec("qwen2", EXTRA, MERGES));
    let start = id(&t, "<|im_start|>");
    let end = id(&t, "<|im_end|>");
    let ids = t.encode("<|im_start|>hello<|im_end|>", false, true);
    assert_eq!(ids, vec![start, id(&t, "hello"), end]);
    assert_eq!(t.decode(&ids), "hello");
    assert!(t.is_eog(end));
    assert!(t.is_eog(id(&t, "<|endoftext|>")));
    assert!(!t.is_eog(start));
}

#[test]
fn round_trips_varied_text() {
    for pre in ["qwen2", "llama-bpe", "default", "gpt-2"] {
        let t = tok(bpe_spec(pre, EXTRA, MERGES));
        for text in [
            "hello the world",
            "héllo wörld, ça va? 日本語のテキスト",
            "emoji 😀🎉 and ZWJ 👩‍👩‍👧",
            "  spaces  \t\ttabs\n\nnewlines\r\n 123456 it's I'M",
            "<|im_start|>not parsed",
        ] {
            let ids = t.encode(text, false, false);
            assert_eq!(t.decode(&ids), text, "{pre}: {ids:?}");
        }
    }
}

#[test]
fn long_text_is_fast() {
    let mut text = "Hello the world, it's 12345 héllo 😀\n\n  ".repeat(2000);
    // A long whitespace run is where a backtracking pre-tokenizer could turn quadratic.
    text.push_str(&" ".repeat(20_000));
    text.push('x');
    for pre in ["llama-bpe", "qwen2", "default"] {
        let t = tok(bpe_spec(pre, EXTRA, MERGES));
        let start = std::time::Instant::now();
        let ids = t.encode(&text, false, false);
        let elapsed = start.elapsed();
        assert_eq!(t.decode(&ids), text);
        assert!(elapsed.as_secs() < 5, "{pre} took {elapsed:?}");
    }
}
