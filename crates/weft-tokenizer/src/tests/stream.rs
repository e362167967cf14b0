//! Streaming detokenization never splits a character and agrees with whole decoding.

use super::*;
use crate::StreamDecoder;

#[test]
fn emoji_from_byte_tokens_waits_for_the_last_byte() {
    let t = spm();
    let mut d = StreamDecoder::new(&t);
    let out: Vec<String> = "😀".bytes().map(|b| d.push(BYTE0 + b as u32)).collect();
    assert_eq!(out, ["", "", "", "😀"]);
    assert_eq!(d.finish(), "");
}

#[test]
fn invalid_and_unfinished_bytes_become_replacement_chars() {
    let t = spm();
    let hi = t.token_id("▁hi").unwrap_or(0);
    let mut d = StreamDecoder::new(&t);
    assert_eq!(d.push(BYTE0 + 0xFF), "\u{FFFD}");
    assert_eq!(d.push(BYTE0 + 0xF0), "");
    assert_eq!(d.push(hi), "\u{FFFD} hi");
    assert_eq!(d.push(BYTE0 + 0xE6), "");
    assert_eq!(d.push(BYTE0 + 0x97), "");
    assert_eq!(d.finish(), "\u{FFFD}");
    assert_eq!(d.finish(), "");
}

#[test]
fn stream_concatenation_equals_decode() {
    let t = spm();
    let text = "hello 😀 wörld 日本 <tag> 👩‍👩‍👧";
    let mut ids = t.encode(text, true, false);
    // Splice in bytes that make invalid and truncated sequences, and a control token.
    ids.splice(
        3..3,
        [BYTE0 + 0xC3, BYTE0 + 0xFF, BOS, BYTE0 + 0xF0, BYTE0 + 0x9F],
    );
    let mut d = StreamDecoder::new(&t);
    let mut streamed: String = ids.iter().map(|&id| d.push(id)).collect();
    streamed.push_str(&d.finish());
    assert_eq!(streamed, t.decode(&ids));
}
