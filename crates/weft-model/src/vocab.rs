//! Builds the tokenizer a GGUF file describes.

use weft_gguf::{Array, GgufFile};
use weft_tokenizer::{Tokenizer, TokenizerSpec};

use crate::error::ModelError;

pub fn tokenizer_from_gguf(f: &GgufFile) -> Result<Tokenizer, ModelError> {
    let path = f.path().display().to_string();
    let wrong = |key: &str, want: &str| {
        ModelError::Tokenizer(format!("{path}: metadata '{key}' is not {want}"))
    };
    let strings = |key: &str| -> Result<Option<Vec<String>>, ModelError> {
        match f.get(key) {
            None => Ok(None),
            Some(_) => match f.get_array(key)? {
                Array::String(v) => Ok(Some(v.clone())),
                _ => Err(wrong(key, "an array of strings")),
            },
        }
    };
    let id = |key: &str| -> Result<Option<u32>, ModelError> {
        match f.get(key) {
            None => Ok(None),
            Some(v) => match v.as_int() {
                Some(i) if (0..=u32::MAX as i128).contains(&i) => Ok(Some(i as u32)),
                _ => Err(wrong(key, "a token id")),
            },
        }
    };
    let flag = |key: &str| -> Result<Option<bool>, ModelError> {
        match f.get(key) {
            None => Ok(None),
            Some(_) => Ok(Some(f.get_bool_or(key, false)?)),
        }
    };
    let tokens = strings("tokenizer.ggml.tokens")?.ok_or_else(|| {
        ModelError::Tokenizer(format!(
            "{path}: metadata 'tokenizer.ggml.tokens' is missing"
        ))
    })?;
    let scores = match f.get("tokenizer.ggml.scores") {
        None => None,
        Some(_) => Some(
            f.get_array("tokenizer.ggml.scores")?
                .as_f32s()
                .ok_or_else(|| wrong("tokenizer.ggml.scores", "an array of numbers"))?,
        ),
    };
    let token_types = match f.get("tokenizer.ggml.token_type") {
        None => None,
        Some(_) => Some(
            f.get_array("tokenizer.ggml.token_type")?
                .as_i64s()
                .ok_or_else(|| wrong("tokenizer.ggml.token_type", "an array of integers"))?
                .into_iter()
                .map(|x| x as i32)
                .collect(),
        ),
    };
    // End-of-turn texts (<end_of_turn>, <|im_end|>, ...) are recognised by the tokenizer
    // itself; only the file's explicit id is passed on.
    let eot_ids: Vec<u32> = id("tokenizer.ggml.eot_token_id")?.into_iter().collect();
    let spec = TokenizerSpec {
        model: f.get_str("tokenizer.ggml.model")?.to_string(),
        pre: f
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        tokens,
        scores,
        token_types,
        merges: strings("tokenizer.ggml.merges")?,
        bos_id: id("tokenizer.ggml.bos_token_id")?,
        eos_id: id("tokenizer.ggml.eos_token_id")?,
        unk_id: id("tokenizer.ggml.unknown_token_id")?,
        pad_id: id("tokenizer.ggml.padding_token_id")?,
        eot_ids,
        add_bos: flag("tokenizer.ggml.add_bos_token")?,
        add_eos: flag("tokenizer.ggml.add_eos_token")?,
        add_space_prefix: flag("tokenizer.ggml.add_space_prefix")?,
    };
    Tokenizer::new(spec).map_err(|e| ModelError::Tokenizer(format!("{path}: {e}")))
}
