//! Unit tests over small synthetic vocabularies built here, asserting exact token ids.

mod bpe;
mod errors;
mod index;
mod pretok;
mod special;
mod spm;
mod stream;

use crate::{Tokenizer, TokenizerSpec};

/// Ids of the SentencePiece fixture's fixed part.
pub const UNK: u32 = 0;
pub const BOS: u32 = 1;
pub const EOS: u32 = 2;
/// Byte token <0xXX> has id BYTE0 + XX.
pub const BYTE0: u32 = 3;

/// A Llama-2-style SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte tokens, then scored
/// pieces and a few special tokens. Returns the spec and the text→id list of extra pieces.
pub fn spm_spec(pieces: &[(&str, f32, i32)]) -> TokenizerSpec {
    let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    let mut scores = vec![0.0, 0.0, 0.0];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    for &(text, score, ty) in pieces {
        tokens.push(text.to_string());
        scores.push(score);
        types.push(ty);
    }
    TokenizerSpec {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        bos_id: Some(BOS),
        eos_id: Some(EOS),
        unk_id: Some(UNK),
        ..Default::default()
    }
}

/// The standard SentencePiece pieces used by most tests (normal = 1, control = 3, user = 4).
pub const SPM_PIECES: &[(&str, f32, i32)] = &[
    ("▁", -1.0, 1),
    ("h", -2.0, 1),
    ("e", -2.0, 1),
    ("l", -2.0, 1),
    ("o", -2.0, 1),
    ("w", -2.0, 1),
    ("r", -2.0, 1),
    ("d", -2.0, 1),
    ("i", -2.0, 1),
    ("é", -2.0, 1),
    ("日", -2.0, 1),
    ("he", -3.0, 1),
    ("ll", -3.5, 1),
    ("hell", -4.0, 1),
    ("hello", -5.0, 1),
    ("▁hello", -6.0, 1),
    ("▁w", -3.0, 1),
    ("or", -3.0, 1),
    ("▁wor", -4.0, 1),
    ("ld", -3.0, 1),
    ("▁world", -5.0, 1),
    ("▁h", -9.0, 1),
    ("hi", -4.0, 1),
    ("▁hi", -5.0, 1),
    ("<start_of_turn>", 0.0, 3),
    ("<end_of_turn>", 0.0, 4),
    ("<tag>", 0.0, 4),
];

pub fn spm() -> Tokenizer {
    tok(spm_spec(SPM_PIECES))
}

pub fn tok(spec: TokenizerSpec) -> Tokenizer {
    match Tokenizer::new(spec) {
        Ok(t) => t,
        Err(e) => panic!("fixture failed to build: {e}"),
    }
}

/// The GPT-2 byte alphabet character for byte `b`.
pub fn byte_char(b: u8) -> char {
    let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable {
        b as char
    } else {
        let extra = (0..b)
            .filter(|&x| !matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF))
            .count() as u32;
        char::from_u32(256 + extra).unwrap_or('?')
    }
}

/// A byte-level BPE vocabulary: ids 0..=255 are the single byte characters (id = byte value),
/// then `extra` tokens in order, then three control tokens.
pub fn bpe_spec(pre: &str, extra: &[&str], merges: &[&str]) -> TokenizerSpec {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    tokens.extend(extra.iter().map(|s| s.to_string()));
    let mut types = vec![1; tokens.len()];
    for special in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"] {
        tokens.push(special.to_string());
        types.push(3);
    }
    TokenizerSpec {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        token_types: Some(types),
        merges: Some(merges.iter().map(|s| s.to_string()).collect()),
        eos_id: Some(tokens.len() as u32 - 1),
        bos_id: Some(tokens.len() as u32 - 1),
        tokens,
        ..Default::default()
    }
}
