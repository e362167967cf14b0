//! The pre-tokenizer regex sequences, checked on the pieces they produce.

use crate::pretok::PreTokenizer;

fn split(pre: Option<&str>, text: &str) -> Vec<String> {
    match PreTokenizer::new(pre) {
        Ok(p) => p.split(text).into_iter().map(String::from).collect(),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn llama3_groups_digits_in_threes() {
    assert_eq!(
        split(Some("llama-bpe"), "Hello world's 12345  !!\n\n  x"),
        ["Hello", " world", "'s", " ", "123", "45", " ", " !!\n\n", " ", " x"]
    );
    assert_eq!(split(Some("llama3"), "I'M"), ["I", "'M"]);
}

#[test]
fn qwen2_splits_single_digits() {
    assert_eq!(
        split(Some("qwen2"), "Hello world's 12345  !!"),
        ["Hello", " world", "'s", " ", "1", "2", "3", "4", "5", " ", " !!"]
    );
}

#[test]
fn gpt2_and_default_sequences() {
    assert_eq!(
        split(Some("gpt-2"), "Hello, world! 123456"),
        ["Hello", ",", " world", "!", " 123456"]
    );
    // llama.cpp's "default" (also used when the key is missing) is a four-regex sequence.
    let want = ["Hello", ",", " world", "!", " ", "123", "456"];
    assert_eq!(split(Some("default"), "Hello, world! 123456"), want);
    assert_eq!(split(None, "Hello, world! 123456"), want);
}

#[test]
fn pieces_cover_the_text() {
    let text = "Ünïcödé  \u{3000}text\twith 😀 emoji's and 9999 numbers\r\n";
    for pre in [
        "llama-bpe",
        "qwen2",
        "qwen35",
        "default",
        "gpt-4o",
        "tekken",
        "smollm",
        "falcon",
    ] {
        assert_eq!(split(Some(pre), text).concat(), text, "{pre}");
    }
}
