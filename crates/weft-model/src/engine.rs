//! One node running a whole model: generation with streaming and stop sequences, and
//! perplexity measured exactly as llama.cpp's llama-perplexity does.

use std::path::Path;
use std::sync::Arc;

use weft_gguf::GgufFile;
use weft_kernels::ThreadPool;
use weft_tokenizer::Tokenizer;

use crate::collective::Identity;
use crate::error::ModelError;
use crate::generate::{generate, Backend};
use crate::kv::KvCache;
use crate::local_batch::LocalBatch;
use crate::model::{Logits, Model, DEFAULT_UBATCH};
use crate::request::{GenerateRequest, Generated};
use crate::sampler::logprob_of;
use crate::shard::ShardSpec;
use crate::vocab::tokenizer_from_gguf;

/// A model, its tokenizer, a KV cache and a thread pool on one node.
pub struct Engine {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub pool: ThreadPool,
    pub kv: KvCache,
    logits: Vec<f32>,
}

impl Engine {
    /// Opens `path` and loads the whole model for sequences of up to `n_ctx` tokens.
    pub fn load(
        path: &Path,
        threads: usize,
        n_ctx: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self, ModelError> {
        let file = Arc::new(GgufFile::open(path)?);
        let tokenizer = tokenizer_from_gguf(&file)?;
        let cfg = crate::config::ModelConfig::from_gguf(&file)?;
        let shard = ShardSpec::full(&cfg);
        let model = Model::load_with_progress(file, shard, DEFAULT_UBATCH, progress)?;
        let n_ctx = n_ctx.min(model.cfg.n_ctx_train).max(1);
        let kv = model.new_cache(n_ctx);
        Ok(Engine {
            model,
            tokenizer,
            pool: ThreadPool::new(threads),
            kv,
            logits: Vec::new(),
        })
    }

    /// Stores keys and values as `ty` from now on: the cache is made again, empty.
    pub fn set_cache_type(&mut self, ty: crate::kv::CacheType) {
        let n_ctx = self.kv.n_ctx;
        self.model.set_cache_type(ty);
        // The old cache's memory goes first, so the two are never held at once.
        self.kv.layers = Vec::new();
        self.kv = self.model.new_cache(n_ctx);
    }

    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx
    }

    /// Turns this engine into a batching backend of `slots` sequences of `n_ctx` tokens.
    pub fn into_batch(self, slots: usize, n_ctx: usize) -> (LocalBatch, Tokenizer) {
        let Engine {
            model,
            tokenizer,
            pool,
            kv,
            ..
        } = self;
        drop(kv);
        (LocalBatch::new(model, pool, slots, n_ctx), tokenizer)
    }

    /// Runs `tokens` after what the cache holds and leaves the last token's logits.
    fn step(&mut self, tokens: &[u32], want: Logits) -> Result<(), ModelError> {
        self.model.forward(
            tokens,
            &mut self.kv,
            &mut Identity,
            &self.pool,
            want,
            &mut self.logits,
        )
    }

    /// Logits of the last token run (after `prefill`/`decode`).
    pub fn last_logits(&self) -> &[f32] {
        let n = self.model.vocab_range().len();
        &self.logits[self.logits.len() - n..]
    }

    /// Starts a new sequence with `prompt` and leaves its last logits.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<(), ModelError> {
        self.kv.clear();
        self.step(prompt, Logits::Last)
    }

    /// Appends `tokens` after what the cache holds and leaves the last one's logits.
    pub fn extend(&mut self, tokens: &[u32]) -> Result<(), ModelError> {
        self.step(tokens, Logits::Last)
    }

    /// Appends one token and leaves its logits.
    pub fn decode(&mut self, token: u32) -> Result<(), ModelError> {
        self.step(&[token], Logits::Last)
    }

    /// Generates from `req.prompt_ids`, calling `on_text` with each new piece of text
    /// (never part of a UTF-8 character, never part of a stop sequence).
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generated, ModelError> {
        let mut local = LocalBackend {
            model: &mut self.model,
            kv: &mut self.kv,
            pool: &self.pool,
            logits: &mut self.logits,
        };
        generate(&mut local, &self.tokenizer, req, on_text)
    }

    /// Perplexity of `tokens` as llama-perplexity computes it: non-overlapping chunks of
    /// `n_ctx` tokens, each starting with BOS in place of its first token, scoring only
    /// the second half of each chunk. Returns (ppl, chunks, scored tokens).
    pub fn perplexity(
        &mut self,
        tokens: &[u32],
        n_ctx: usize,
        progress: &mut dyn FnMut(usize, usize, f64),
    ) -> Result<(f64, usize, usize), ModelError> {
        if n_ctx < 4 || n_ctx > self.n_ctx() {
            return Err(ModelError::Invalid(format!(
                "ctx {n_ctx} must be between 4 and the loaded context {}",
                self.n_ctx()
            )));
        }
        let n_chunks = tokens.len() / n_ctx;
        if n_chunks == 0 {
            return Err(ModelError::Invalid(format!(
                "the text has {} tokens; perplexity needs at least ctx = {n_ctx}",
                tokens.len()
            )));
        }
        let bos = self.tokenizer.bos_id();
        let first = n_ctx / 2;
        let n_v = self.model.vocab_range().len();
        let mut nll = 0f64;
        let mut count = 0usize;
        let mut chunk = vec![0u32; n_ctx];
        for c in 0..n_chunks {
            chunk.copy_from_slice(&tokens[c * n_ctx..(c + 1) * n_ctx]);
            if let Some(b) = bos {
                chunk[0] = b;
            }
            self.kv.clear();
            self.step(&chunk, Logits::From(first))?;
            for j in first..n_ctx - 1 {
                let row = &self.logits[(j - first) * n_v..(j - first + 1) * n_v];
                let target = tokens[c * n_ctx + j + 1];
                nll -= logprob_of(row, target) as f64;
                count += 1;
            }
            progress(c + 1, n_chunks, (nll / count as f64).exp());
        }
        Ok(((nll / count as f64).exp(), n_chunks, count))
    }
}

/// A whole model on this node as a generation backend.
struct LocalBackend<'a> {
    model: &'a mut Model,
    kv: &'a mut KvCache,
    pool: &'a ThreadPool,
    logits: &'a mut Vec<f32>,
}

impl LocalBackend<'_> {
    fn step(&mut self, tokens: &[u32]) -> Result<(), ModelError> {
        self.model.forward(
            tokens,
            self.kv,
            &mut Identity,
            self.pool,
            Logits::Last,
            self.logits,
        )
    }
}

impl Backend for LocalBackend<'_> {
    fn n_ctx(&self) -> usize {
        self.kv.n_ctx
    }
    fn prefill(&mut self, prompt: &[u32]) -> Result<(), ModelError> {
        self.kv.clear();
        self.step(prompt)
    }
    fn decode(&mut self, token: u32) -> Result<(), ModelError> {
        self.step(&[token])
    }
    fn logits(&mut self) -> &mut [f32] {
        let n = self.model.vocab_range().len();
        let at = self.logits.len() - n;
        &mut self.logits[at..]
    }
}
