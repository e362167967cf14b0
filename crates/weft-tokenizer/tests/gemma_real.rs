//! Checks against the real Gemma 3 tokenizer in a local GGUF, with ids produced by llama.cpp.
//! Skipped (with a note) when `${WEFT_HOME:-$HOME/.cache/weft}/models/gemma-3-270m-q4_k_m.gguf`
//! is absent, so the suite passes on machines without the model.

use std::path::PathBuf;
use std::time::Instant;

use weft_gguf::{Array, GgufFile};
use weft_tokenizer::{StreamDecoder, Tokenizer, TokenizerSpec};

fn model_path() -> PathBuf {
    // Like the shell's ${WEFT_HOME:-...}: an empty value counts as unset.
    let home = std::env::var_os("WEFT_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/weft")))
        .unwrap_or_else(|| PathBuf::from(".cache/weft"));
    home.join("models/gemma-3-270m-q4_k_m.gguf")
}

fn id_key(f: &GgufFile, key: &str) -> Option<u32> {
    f.get(key)
        .and_then(|v| v.as_int())
        .and_then(|i| u32::try_from(i).ok())
}

fn bool_key(f: &GgufFile, key: &str) -> Option<bool> {
    f.get(key).and_then(|v| v.as_int()).map(|i| i != 0)
}

fn spec_from_gguf(f: &GgufFile) -> TokenizerSpec {
    let strings = |key: &str| match f.get_array(key) {
        Ok(Array::String(v)) => Some(v.clone()),
        _ => None,
    };
    TokenizerSpec {
        model: f
            .get("tokenizer.ggml.model")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string(),
        pre: f
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .map(String::from),
        tokens: strings("tokenizer.ggml.tokens").unwrap_or_default(),
        scores: f
            .get_array("tokenizer.ggml.scores")
            .ok()
            .and_then(Array::as_f32s),
        token_types: match f.get_array("tokenizer.ggml.token_type") {
            Ok(Array::I32(v)) => Some(v.clone()),
            _ => None,
        },
        merges: strings("tokenizer.ggml.merges"),
        bos_id: id_key(f, "tokenizer.ggml.bos_token_id"),
        eos_id: id_key(f, "tokenizer.ggml.eos_token_id"),
        unk_id: id_key(f, "tokenizer.ggml.unknown_token_id"),
        pad_id: id_key(f, "tokenizer.ggml.padding_token_id"),
        eot_ids: ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
            .iter()
            .filter_map(|k| id_key(f, k))
            .collect(),
        add_bos: bool_key(f, "tokenizer.ggml.add_bos_token"),
        add_eos: bool_key(f, "tokenizer.ggml.add_eos_token"),
        add_space_prefix: bool_key(f, "tokenizer.ggml.add_space_prefix"),
    }
}

fn load() -> Option<Tokenizer> {
    let path = model_path();
    if !path.exists() {
        println!("skipping: {} not found", path.display());
        return None;
    }
    let f = GgufFile::open(&path).expect("open gguf");
    let start = Instant::now();
    let tok = Tokenizer::new(spec_from_gguf(&f)).expect("build tokenizer");
    println!("tokenizer built in {:?}", start.elapsed());
    Some(tok)
}

#[test]
fn gemma3_matches_llama_cpp() {
    let Some(tok) = load() else { return };
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos_id(), Some(2));
    assert_eq!(tok.eos_id(), Some(1));

    let ids = tok.encode("The capital of France is", true, false);
    assert_eq!(ids, [2, 818, 5279, 529, 7001, 563]);
    assert_eq!(tok.decode(&ids), "The capital of France is");

    let continuation = [506, 5279, 529, 506, 2891, 529, 7001, 236761];
    assert_eq!(
        tok.decode(&continuation),
        " the capital of the country of France."
    );
    let mut stream = StreamDecoder::new(&tok);
    let streamed: String = continuation.iter().map(|&id| stream.push(id)).collect();
    assert_eq!(
        streamed + &stream.finish(),
        " the capital of the country of France."
    );
}

#[test]
fn gemma3_special_tokens_and_round_trips() {
    let Some(tok) = load() else { return };
    let sot = tok.token_id("<start_of_turn>").expect("<start_of_turn>");
    let eot = tok.token_id("<end_of_turn>").expect("<end_of_turn>");
    assert_eq!((sot, eot), (105, 106));
    assert!(tok.is_eog(eot));
    assert!(tok.is_eog(1));
    assert!(!tok.is_eog(sot));

    let ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>", false, true);
    println!("chat ids: {ids:?}");
    assert_eq!(ids.first(), Some(&sot));
    assert_eq!(ids.last(), Some(&eot));
    assert_eq!(ids.iter().filter(|&&i| i == sot || i == eot).count(), 2);
    // "\n" is a user-defined token in Gemma and always splits out.
    assert!(ids.contains(&107));
    assert_eq!(tok.decode(&ids), "user\nhi");

    // Without parse_special the control texts stay text.
    let plain = tok.encode("<start_of_turn>user", false, false);
    assert!(!plain.contains(&sot));
    assert_eq!(tok.decode(&plain), "<start_of_turn>user");

    for text in [
        "Hello, world!",
        "héllo wörld — ça va? 日本語のテキスト、中文。",
        "emoji 😀🎉 and ZWJ 👩‍👩‍👧 and rare 𓀀",
        "  indented\n\n\tcode() { return 42; }\n",
        "<table><tr><td>html</td></tr></table>",
    ] {
        let ids = tok.encode(text, false, false);
        assert_eq!(tok.decode(&ids), text, "{ids:?}");
        let mut stream = StreamDecoder::new(&tok);
        let mut streamed: String = ids.iter().map(|&id| stream.push(id)).collect();
        streamed.push_str(&stream.finish());
        assert_eq!(streamed, text);
    }
}

#[test]
fn gemma3_long_text_encodes_quickly() {
    let Some(tok) = load() else { return };
    let unit = "The quick brown fox jumps over the lazy dog; 素早い茶色の狐 😀. ";
    let text: String = unit.chars().cycle().take(3000).collect();
    let start = Instant::now();
    let ids = tok.encode(&text, true, true);
    let elapsed = start.elapsed();
    println!("3000 chars -> {} tokens in {elapsed:?}", ids.len());
    assert_eq!(tok.decode(&ids[1..]), text);
}

/// Ids produced by llama.cpp (via llama-cpp-python 0.3.36, `add_special = false`) for the same
/// Gemma 3 file; they pin whitespace tokens, byte fallback, and special-token handling.
#[test]
fn gemma3_pinned_llama_cpp_ids() {
    let Some(tok) = load() else { return };
    let cases: &[(&str, bool, &[u32])] = &[
        (
            "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
            true,
            &[105, 2364, 107, 2202, 106, 107, 105, 4368, 107],
        ),
        (
            "a  b   c    d",
            false,
            &[236746, 138, 236763, 139, 236755, 140, 236753],
        ),
        (
            "line\nbreak\n\nparagraph\r\nwindows\r\n",
            false,
            &[1257, 107, 7284, 108, 35781, 251, 107, 33908, 251, 107],
        ),
        (
            "héllo wörld ça va? naïve café",
            false,
            &[
                236754, 7869, 844, 515, 4010, 671, 20924, 5380, 236881, 120362, 33443,
            ],
        ),
        (
            "emoji 😀🎉 👩\u{200d}👩\u{200d}👧 🇫🇷 family",
            false,
            &[
                67906, 163543, 242061, 236743, 243767, 237243, 243767, 237243, 244814, 236743,
                246598, 242644, 2523,
            ],
        ),
        (
            "<table><tr><td>a</td></tr></table>",
            false,
            &[168, 173, 175, 236746, 183, 181, 176],
        ),
        // "</s>" is user-defined in Gemma 3, but llama.cpp forces it to control by its text.
        ("</s> strike", false, &[954, 236751, 236813, 15161]),
        ("</s> strike", true, &[212, 15161]),
    ];
    for &(text, parse_special, want) in cases {
        assert_eq!(tok.encode(text, false, parse_special), want, "{text:?}");
    }
}
