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
        let mut caches: Vec<KvCache> = (0..slots.max(1)).map(|_| model.new_cache(n_ctx)).collect();
        let mut logits = vec![0f32; caches.len() * model.vocab_range().len()];
        // Touch every page now, so serving's memory is resident from the start and a
        // busy spell leaves nothing behind (zeroed allocations are mapped lazily).
        for c in caches.iter_mut() {
            for l in c.layers.iter_mut() {
                l.k.prefault();
                l.v.prefault();
            }
        }
        prefault(&mut logits);
        LocalBatch {
            model,
            caches,
            pool,
            logits,
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

/// Writes one float per 4 KiB page so the kernel maps the whole buffer.
fn prefault(buf: &mut [f32]) {
    for i in (0..buf.len()).step_by(1024) {
        // SAFETY: i < buf.len(); volatile so the store to calloc'd zeros is not elided.
        unsafe { std::ptr::write_volatile(buf.as_mut_ptr().add(i), 0.0) };
    }
}
