//! A batched forward step's layout: several sequences, each with its own KV cache, share
//! one pass over the weights. Rows are grouped by sequence, in the order of the spans.

use crate::error::ModelError;
use crate::kv::KvCache;

/// One sequence's consecutive token rows in a batched step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    /// Index of the sequence's cache in the step's cache slice.
    pub cache: usize,
    /// Token rows this step appends to that cache.
    pub n_tokens: usize,
    /// Whether the step returns logits for this span's last row.
    pub logits: bool,
}

/// Checks `spans` against `caches` and the micro-batch; returns the total rows.
pub(crate) fn validate(
    spans: &[SeqSpan],
    caches: &[KvCache],
    ubatch: usize,
    n_layers: usize,
) -> Result<usize, ModelError> {
    let mut rows = 0usize;
    for (i, s) in spans.iter().enumerate() {
        let kv = caches.get(s.cache).ok_or_else(|| {
            ModelError::Invalid(format!(
                "span {i} names cache {} of {}",
                s.cache,
                caches.len()
            ))
        })?;
        if spans[..i].iter().any(|p| p.cache == s.cache) {
            return Err(ModelError::Invalid(format!(
                "cache {} appears twice in one step",
                s.cache
            )));
        }
        if s.n_tokens == 0 {
            return Err(ModelError::Invalid(format!("span {i} has no tokens")));
        }
        if kv.pos + s.n_tokens > kv.n_ctx {
            return Err(ModelError::ContextFull {
                pos: kv.pos + s.n_tokens,
                n_ctx: kv.n_ctx,
            });
        }
        if kv.layers.len() != n_layers {
            return Err(ModelError::Invalid(
                "KV cache was made for another shard".into(),
            ));
        }
        rows += s.n_tokens;
    }
    if rows == 0 || rows > ubatch {
        return Err(ModelError::Invalid(format!(
            "micro-batch of {rows} tokens (1..={ubatch})"
        )));
    }
    Ok(rows)
}
