//! The model's vocabulary as llguidance sees it: each token's bytes, control tokens
//! marked as special so no grammar can spell them out of text.

use std::sync::Arc;

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use weft_tokenizer::Tokenizer;

pub struct VocabEnv {
    pub env: TokEnv,
    pub eos: u32,
}

/// A token's bytes for the trie: its decoded bytes, or for a control token the marker
/// byte and its name (llguidance's convention for special tokens).
fn token_word(tok: &Tokenizer, id: u32) -> Vec<u8> {
    if tok.is_control(id) {
        let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        w.extend_from_slice(tok.token_text(id).as_bytes());
        w
    } else {
        tok.token_bytes(id)
    }
}

pub fn token_env(tok: &Tokenizer) -> Result<VocabEnv, String> {
    let n = tok.vocab_size();
    let eos = tok
        .eos_id()
        .or_else(|| tok.eog_ids().first().copied())
        .ok_or("the tokenizer has no end-of-generation token, which a grammar needs")?;
    let words: Vec<Vec<u8>> = (0..n as u32).map(|id| token_word(tok, id)).collect();
    let info = TokRxInfo::new(n as u32, eos);
    let trie = TokTrie::from(&info, &words);
    Ok(VocabEnv {
        env: Arc::new(ApproximateTokEnv::new(trie)),
        eos,
    })
}
