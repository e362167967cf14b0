//! The whole model on this node as a batching backend: one KV cache per slot, allocated
//! once up front so serving never grows memory, and one logits row per wanting span.

use weft_kernels::ThreadPool;

use crate::batch::SeqSpan;
use crate::batcher::BatchBackend;
use crate::collective::Identity;
use crate::error::ModelError;
use crate::kv::KvCache;
use crate::model::Model;

pub struct LocalBatch {
    model: Model,
    caches: Vec<KvCache>,
    pool: ThreadPool,
    logits: Vec<f32>,
    n_ctx: usize,
}

impl LocalBatch {
    /// `slots` sequences of up to `n_ctx` tokens each.
    pub fn new(model: Model, pool: ThreadPool, slots: usize, n_ctx: usize) -> Self {
        let n_ctx = n_ctx.min(model.cfg.n_ctx_train).max(1);
        let caches = (0..slots.max(1)).map(|_| model.new_cache(n_ctx)).collect();
        LocalBatch {
            model,
            caches,
            pool,
            logits: Vec::new(),
            n_ctx,
        }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Bytes held by all slots' KV caches.
    pub fn kv_bytes(&self) -> usize {
        self.caches.iter().map(|c| c.bytes()).sum()
    }
}

impl BatchBackend for LocalBatch {
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn slots(&self) -> usize {
        self.caches.len()
    }
    fn max_rows(&self) -> usize {
        self.model.ubatch()
    }
    fn reset(&mut self, slot: usize) -> Result<(), ModelError> {
        let n = self.caches.len();
        self.caches
            .get_mut(slot)
            .ok_or_else(|| ModelError::Invalid(format!("slot {slot} of {n}")))?
            .clear();
        Ok(())
    }
    fn step(&mut self, tokens: &[u32], spans: &[SeqSpan]) -> Result<(), ModelError> {
        self.model.forward_batch(
            tokens,
            spans,
            &mut self.caches,
            &mut Identity,
            &self.pool,
            &mut self.logits,
        )
    }
    fn logits(&mut self, i: usize) -> &mut [f32] {
        let n = self.model.vocab_range().len();
        &mut self.logits[i * n..(i + 1) * n]
    }
}
