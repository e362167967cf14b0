//! Any single-sequence `Backend` (such as a cluster) as a one-slot batching backend: the
//! batcher then queues requests and runs them one at a time through it, whole prompts at
//! once (the backend splits them into micro-batches itself).

use crate::batch::SeqSpan;
use crate::batcher::BatchBackend;
use crate::error::ModelError;
use crate::generate::Backend;

pub struct SerialBatch<B: Backend> {
    inner: B,
    /// The slot was reset: its next step is a prompt that starts a new sequence.
    fresh: bool,
}

impl<B: Backend> SerialBatch<B> {
    pub fn new(inner: B) -> Self {
        SerialBatch { inner, fresh: true }
    }

    pub fn inner(&self) -> &B {
        &self.inner
    }
}

impl<B: Backend> BatchBackend for SerialBatch<B> {
    fn n_ctx(&self) -> usize {
        self.inner.n_ctx()
    }
    fn slots(&self) -> usize {
        1
    }
    fn max_rows(&self) -> usize {
        // A whole prompt in one step: with one slot nothing else is decoding beside it.
        self.inner.n_ctx()
    }
    fn reset(&mut self, slot: usize) -> Result<(), ModelError> {
        if slot != 0 {
            return Err(ModelError::Invalid(format!("slot {slot} of 1")));
        }
        self.fresh = true;
        Ok(())
    }
    fn step(&mut self, tokens: &[u32], spans: &[SeqSpan]) -> Result<(), ModelError> {
        match spans {
            [s] if s.cache == 0 && s.n_tokens == tokens.len() => {}
            _ => {
                return Err(ModelError::Invalid(format!(
                    "a one-slot backend takes one span on slot 0, not {spans:?}"
                )))
            }
        }
        if self.fresh {
            self.fresh = false;
            self.inner.prefill(tokens)
        } else if let [t] = tokens {
            self.inner.decode(*t)
        } else {
            Err(ModelError::Invalid(format!(
                "{} tokens appended mid-sequence; a one-slot backend takes one at a time",
                tokens.len()
            )))
        }
    }
    fn logits(&mut self, _i: usize) -> &mut [f32] {
        self.inner.logits()
    }
    fn log_normalizer(&self, _i: usize) -> Option<f32> {
        self.inner.log_normalizer()
    }
}
