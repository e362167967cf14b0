//! The transformer, written once for every supported architecture and any shard: the
//! unsharded model is the same code with a full shard and the identity collective.

use std::ops::Range;
use std::sync::Arc;

use weft_gguf::GgufFile;
use weft_kernels::ops::{self, Rope};
use weft_kernels::{vecops, ThreadPool};

use crate::attention::{attend_rows, BatchRows, HeadGroups, HeadView, Strided};
use crate::batch::{self, SeqSpan};
use crate::collective::Collective;
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::kv::{CacheType, KvCache, SlotWidths};
use crate::mla::{MlaAttn, MlaIo, MlaScratch};
use crate::moe::{MoeFfn, MoeIo, MoeScratch};
use crate::rows::{for_each_chunk, for_each_row, linear, linears_of_one_input, SendPtr};
use crate::shard::{Granularity, ShardSpec};
use crate::weights::{load_vector, Embedding, Linear};

/// Default number of tokens one forward call processes at most (longer prompts are split).
pub const DEFAULT_UBATCH: usize = 128;
/// Output-head rows computed together when logits of many tokens are wanted.
const HEAD_GROUP: usize = 8;

struct Layer {
    attn_norm: Vec<f32>,
    attn: Attn,
    /// Row-parallel over the heads' values, for both kinds of attention.
    wo: Linear,
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
    post_ffw_norm: Option<Vec<f32>>,
    window: Option<usize>,
}

impl Layer {
    /// Every linear layer: the attention's, its output projection, the FFN's or experts'.
    fn linears(&self) -> impl Iterator<Item = &Linear> {
        std::iter::once(&self.wo)
            .chain(self.attn.linears())
            .chain(self.ffn.linears())
    }
}

/// A layer's attention up to its output projection: grouped-query heads with their own
/// keys and values, or latent attention (deepseek2).
enum Attn {
    Gqa(Box<GqaAttn>),
    Mla(Box<MlaAttn>),
}

struct GqaAttn {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
}

impl Attn {
    fn linears(&self) -> Box<dyn Iterator<Item = &Linear> + '_> {
        match self {
            Attn::Gqa(a) => Box::new([&a.wq, &a.wk, &a.wv].into_iter()),
            Attn::Mla(a) => Box::new(a.linears()),
        }
    }
}

/// A layer's feed-forward block: dense (gate and up column-parallel, down row-parallel)
/// or routed experts; both leave partial sums for the one all-reduce after the block.
enum Ffn {
    Dense(Box<DenseFfn>),
    Moe(Box<MoeFfn>),
}

struct DenseFfn {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Ffn {
    fn linears(&self) -> Box<dyn Iterator<Item = &Linear> + '_> {
        match self {
            Ffn::Dense(d) => Box::new([&d.gate, &d.up, &d.down].into_iter()),
            Ffn::Moe(m) => Box::new(m.linears()),
        }
    }

    /// Weight bytes read for one decoded token (routed experts: the expected share).
    fn active_bytes(&self) -> usize {
        match self {
            Ffn::Dense(_) => self.linears().map(|w| w.n_bytes()).sum(),
            Ffn::Moe(m) => m.active_bytes(),
        }
    }

    fn total_bytes(&self) -> usize {
        match self {
            Ffn::Dense(_) => self.linears().map(|w| w.n_bytes()).sum(),
            Ffn::Moe(m) => m.total_bytes(),
        }
    }
}

/// Which tokens' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
    /// Tokens at index >= n of the call (perplexity scores only the second half).
    From(usize),
}

/// Scratch buffers, sized once for `ubatch` tokens so a step never allocates.
struct Workspace {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    acts: Vec<u8>,
    tile: Vec<f32>,
    /// Routing and expert buffers (MoE models only).
    moe: Option<MoeScratch>,
    /// Latent attention's buffers (MLA models only).
    mla: Option<MlaScratch>,
    /// Per token row of the step: its position and the index of its sequence's cache.
    row_pos: Vec<usize>,
    row_seq: Vec<usize>,
}

/// One shard of a model, ready to run.
pub struct Model {
    pub cfg: ModelConfig,
    pub shard: ShardSpec,
    file: Arc<GgufFile>,
    embed: Embedding,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    head: Option<Linear>,
    rope_global: Rope,
    rope_local: Rope,
    kv_heads: Range<usize>,
    ubatch: usize,
    /// How the caches `new_cache` makes store keys and values.
    cache_type: CacheType,
    ws: Workspace,
}

/// Split granularity of a file's weights (attn_output and ffn_down are split on blocks).
pub fn granularity(file: &GgufFile, cfg: &ModelConfig) -> Result<Granularity, ModelError> {
    let bs = |name: &str| -> Result<usize, ModelError> { Ok(file.tensor(name)?.ty.block_size()) };
    let (mut heads, mut ffn, mut expert_ffn) = (1, 1, 1);
    for il in 0..cfg.n_layer {
        let ob = bs(&format!("blk.{il}.attn_output.weight"))?;
        let per_head = cfg.head_dim;
        let lcm = num_lcm(ob, per_head) / per_head;
        heads = num_lcm(heads, lcm);
        let experts = format!("blk.{il}.ffn_down_exps.weight");
        if file.has_tensor(&experts) {
            expert_ffn = num_lcm(expert_ffn, bs(&experts)?);
        } else {
            ffn = num_lcm(ffn, bs(&format!("blk.{il}.ffn_down.weight"))?);
        }
    }
    Ok(Granularity {
        heads,
        ffn,
        expert_ffn,
    })
}

fn num_lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

impl Model {
    /// Loads shard `shard` of `file`. Only the shard's rows are referenced (column-split
    /// weights are copied), so untouched parts of the file never become resident.
    pub fn load(file: Arc<GgufFile>, shard: ShardSpec, ubatch: usize) -> Result<Self, ModelError> {
        Self::load_with_progress(file, shard, ubatch, &mut |_, _| {})
    }

    /// As `load`, calling `progress(done, total)` after each layer.
    pub fn load_with_progress(
        file: Arc<GgufFile>,
        shard: ShardSpec,
        ubatch: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self, ModelError> {
        let cfg = ModelConfig::from_gguf(&file)?;
        let ubatch = ubatch.max(1);
        validate_shard(&cfg, &shard)?;
        let hd = cfg.head_dim;
        let e = cfg.n_embd;
        let kv_heads = shard.kv_heads(&cfg);
        let q_rows = shard.heads.start * hd..shard.heads.end * hd;
        let kv_rows = kv_heads.start * hd..kv_heads.end * hd;
        let first_rank = shard.tp_rank == 0;
        let f = &file;
        let mut layers = Vec::with_capacity(shard.layers.len());
        let total = shard.layers.len() + 1;
        for il in shard.layers.clone() {
            let n = |s: &str| format!("blk.{il}.{s}");
            let opt_vec = |s: &str, len: usize| -> Result<Option<Vec<f32>>, ModelError> {
                if f.has_tensor(&n(s)) {
                    load_vector(f, &n(s), len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let post_attn_norm = opt_vec("post_attention_norm.weight", e)?;
            let post_ffw_norm = opt_vec("post_ffw_norm.weight", e)?;
            if cfg.post_norms && (post_attn_norm.is_none() || post_ffw_norm.is_none()) {
                return Err(ModelError::Tensor {
                    path: f.path().display().to_string(),
                    tensor: n("post_attention_norm.weight"),
                    detail: "Gemma layers need post-attention and post-FFN norms".into(),
                });
            }
            let attn = match cfg.mla {
                Some(mla) => Attn::Mla(Box::new(MlaAttn::load(
                    f,
                    il,
                    &cfg,
                    mla,
                    shard.heads.clone(),
                )?)),
                None => Attn::Gqa(Box::new(GqaAttn {
                    wq: Linear::load_rows(f, &n("attn_q.weight"), e, cfg.q_dim(), q_rows.clone())?,
                    wk: Linear::load_rows(
                        f,
                        &n("attn_k.weight"),
                        e,
                        cfg.kv_dim(),
                        kv_rows.clone(),
                    )?,
                    wv: Linear::load_rows(
                        f,
                        &n("attn_v.weight"),
                        e,
                        cfg.kv_dim(),
                        kv_rows.clone(),
                    )?,
                    q_norm: opt_vec("attn_q_norm.weight", hd)?,
                    k_norm: opt_vec("attn_k_norm.weight", hd)?,
                })),
            };
            layers.push(Layer {
                attn_norm: load_vector(f, &n("attn_norm.weight"), e)?,
                attn,
                wo: Linear::load_cols(
                    f,
                    &n("attn_output.weight"),
                    cfg.q_dim(),
                    e,
                    q_rows.clone(),
                    first_rank,
                )?,
                post_attn_norm,
                ffn_norm: load_vector(f, &n("ffn_norm.weight"), e)?,
                ffn: load_ffn(f, il, &cfg, &shard)?,
                post_ffw_norm,
                window: cfg.window[il],
            });
            progress(layers.len(), total);
        }
        let embed = Embedding::load(f, "token_embd.weight", e, cfg.n_vocab)?;
        let head = if shard.is_last_stage(&cfg) {
            let name = if cfg.tied_output {
                "token_embd.weight"
            } else {
                "output.weight"
            };
            Some(Linear::load_rows(
                f,
                name,
                e,
                cfg.n_vocab,
                shard.vocab.clone(),
            )?)
        } else {
            None
        };
        let output_norm = load_vector(f, "output_norm.weight", e)?;
        progress(total, total);
        let q_local = shard.heads.len() * hd;
        let kv_local = kv_heads.len() * hd;
        let ff_local = layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Dense(d) => d.gate.n_out,
                Ffn::Moe(m) => m.n_ff_local.max(m.n_ff_shared_local()),
            })
            .max()
            .unwrap_or(0);
        let mla_widest = cfg.mla.map_or(0, |m| {
            (shard.heads.len() * m.k_head())
                .max(m.cached_width())
                .max(m.q_lora_rank)
        });
        let widest_out = e.max(q_local).max(ff_local).max(kv_local).max(mla_widest);
        let act_row = layers
            .iter()
            .flat_map(Layer::linears)
            .chain(head.iter())
            .map(|w| w.act_bytes())
            .max()
            .unwrap_or(0);
        let top_k = cfg.moe.map_or(0, |m| m.n_expert_used);
        let moe = cfg.moe.map(|m| {
            let held = shard.experts.len();
            let groups = shard.expert_groups.len();
            MoeScratch::new(ubatch, e, m, (held, groups), ff_local)
        });
        let mla = cfg
            .mla
            .map(|m| MlaScratch::new(ubatch, m, shard.heads.len()));
        // Latent attention has its own query buffers (MlaScratch).
        let gqa_rows = if cfg.mla.is_some() { 0 } else { ubatch };
        let ws = Workspace {
            x: vec![0.0; ubatch * e],
            xn: vec![0.0; ubatch * e],
            q: vec![0.0; gqa_rows * q_local],
            k: vec![0.0; gqa_rows * kv_local],
            v: vec![0.0; gqa_rows * kv_local],
            att: vec![0.0; ubatch * q_local],
            o: vec![0.0; ubatch * e],
            gate: vec![0.0; ubatch * ff_local],
            up: vec![0.0; ubatch * ff_local],
            acts: vec![0; ubatch.max(HEAD_GROUP).max(2 * top_k) * act_row],
            tile: vec![0.0; ubatch * widest_out],
            moe,
            mla,
            row_pos: vec![0; ubatch],
            row_seq: vec![0; ubatch],
        };
        Ok(Model {
            rope_global: Rope::scaled(
                cfg.rope_style,
                cfg.n_rot,
                cfg.rope_base,
                cfg.rope_freq_scale,
                cfg.rope_yarn,
                cfg.rope_mscale,
            ),
            // Sliding-window layers are not frequency-scaled (llama.cpp's
            // rope_freq_scale_train_swa stays 1 for Gemma 3's linear-scaled files).
            rope_local: Rope::scaled(
                cfg.rope_style,
                cfg.n_rot,
                cfg.rope_base_swa,
                1.0,
                None,
                cfg.rope_mscale,
            ),
            cfg,
            shard,
            file,
            embed,
            layers,
            output_norm,
            head,
            kv_heads,
            ubatch,
            cache_type: CacheType::default(),
            ws,
        })
    }

    /// Every layer's linear layers, routed experts included (tests of their layout).
    #[cfg(test)]
    pub(crate) fn layer_linears(&self) -> impl Iterator<Item = &Linear> {
        self.layers.iter().flat_map(Layer::linears)
    }

    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    pub fn ubatch(&self) -> usize {
        self.ubatch
    }

    /// Vocabulary rows whose logits this shard produces.
    pub fn vocab_range(&self) -> Range<usize> {
        self.shard.vocab.clone()
    }

    /// Bytes of weights this shard reads per decoded token: for routed experts, the
    /// router and the expected share of the k experts a token uses (active parameters).
    pub fn weight_bytes_per_token(&self) -> usize {
        self.layer_bytes(Ffn::active_bytes)
    }

    /// Bytes of every weight this shard holds (all its experts, not only the active).
    pub fn total_weight_bytes(&self) -> usize {
        self.layer_bytes(Ffn::total_bytes)
    }

    fn layer_bytes(&self, ffn: fn(&Ffn) -> usize) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| {
                std::iter::once(&l.wo)
                    .chain(l.attn.linears())
                    .map(|w| w.n_bytes())
                    .sum::<usize>()
                    + ffn(&l.ffn)
            })
            .sum();
        l + self.head.as_ref().map(|h| h.n_bytes()).unwrap_or(0)
    }

    /// Routed experts' bytes this shard holds, and the share a decoded token is expected
    /// to read (both 0 for a dense model).
    pub fn expert_bytes(&self) -> (usize, usize) {
        self.layers
            .iter()
            .filter_map(|l| match &l.ffn {
                Ffn::Moe(m) => Some((m.expert_bytes(), m.expected_expert_bytes())),
                Ffn::Dense(_) => None,
            })
            .fold((0, 0), |(a, b), (x, y)| (a + x, b + y))
    }

    /// Expert weight bytes read since the last call (MoE models; 0 otherwise): what a
    /// bench divides by the tokens decoded to show bytes read per token.
    pub fn take_expert_bytes_read(&mut self) -> u64 {
        self.ws
            .moe
            .as_mut()
            .map_or(0, |s| std::mem::take(&mut s.bytes_read))
    }

    /// Bytes of one `new_cache(n_ctx)`, before allocating it.
    pub fn cache_bytes(&self, n_ctx: usize) -> usize {
        let windows: Vec<_> = self.layers.iter().map(|l| l.window).collect();
        KvCache::planned_bytes(
            &windows,
            self.slot_widths(),
            n_ctx,
            self.ubatch,
            self.cache_type,
        )
    }

    /// Floats per cache slot of this shard's layers: its KV heads' keys and values, or
    /// MLA's latent and RoPE key (whole on every rank) with no values.
    fn slot_widths(&self) -> SlotWidths {
        match self.cfg.mla {
            Some(m) => SlotWidths {
                k: m.cached_width(),
                v: 0,
            },
            None => {
                let w = self.kv_heads.len() * self.cfg.head_dim;
                SlotWidths { k: w, v: w }
            }
        }
    }

    /// Stores the keys and values of caches made from now on as `ty` (f32 by default).
    pub fn set_cache_type(&mut self, ty: CacheType) {
        self.cache_type = ty;
    }

    pub fn cache_type(&self) -> CacheType {
        self.cache_type
    }

    /// A KV cache for one sequence of up to `n_ctx` tokens.
    pub fn new_cache(&self, n_ctx: usize) -> KvCache {
        let windows: Vec<_> = self.layers.iter().map(|l| l.window).collect();
        KvCache::new(
            &windows,
            self.slot_widths(),
            n_ctx,
            self.ubatch,
            self.cache_type,
        )
    }

    /// The hidden state of the last forward call's tokens (`m x n_embd`): what a pipeline
    /// stage sends on, and what the next stage writes before `forward_hidden`.
    pub fn hidden_mut(&mut self, m: usize) -> &mut [f32] {
        &mut self.ws.x[..m * self.cfg.n_embd]
    }

    /// Runs `tokens` (appended to `kv`) through the whole model and writes the logits of
    /// this shard's vocabulary rows into `out` (`rows x vocab_range().len()`).
    pub fn forward(
        &mut self,
        tokens: &[u32],
        kv: &mut KvCache,
        coll: &mut dyn Collective,
        pool: &ThreadPool,
        want: Logits,
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        // `logits` writes every value of its rows, so the buffer is never zeroed again: a
        // vocabulary of 262,144 made that a 1 MB memset a decoded token.
        let mut len = 0;
        let n_v = self.shard.vocab.len();
        let chunks: Vec<&[u32]> = tokens.chunks(self.ubatch).collect();
        for (ci, chunk) in chunks.iter().enumerate() {
            let m = chunk.len();
            let off = ci * self.ubatch;
            self.embed_tokens(chunk)?;
            self.forward_hidden(m, kv, coll, pool)?;
            let rows = match want {
                Logits::None => 0..0,
                Logits::All => 0..m,
                Logits::Last if ci + 1 == chunks.len() => m - 1..m,
                Logits::Last => 0..0,
                Logits::From(n) => n.max(off).min(off + m) - off..m,
            };
            if !rows.is_empty() {
                let at = len;
                len += rows.len() * n_v;
                if out.len() < len {
                    out.resize(len, 0.0);
                }
                self.logits(rows, pool, &mut out[at..len])?;
            }
        }
        out.truncate(len);
        Ok(())
    }

    /// Writes the (scaled) embeddings of `tokens` into the hidden state.
    pub fn embed_tokens(&mut self, tokens: &[u32]) -> Result<(), ModelError> {
        let e = self.cfg.n_embd;
        if tokens.len() > self.ubatch {
            return Err(ModelError::Invalid(format!(
                "{} tokens exceed the micro-batch of {}",
                tokens.len(),
                self.ubatch
            )));
        }
        for (t, &id) in tokens.iter().enumerate() {
            self.embed
                .lookup(id, self.cfg.embed_scale, &mut self.ws.x[t * e..(t + 1) * e])?;
        }
        Ok(())
    }

    /// Runs this shard's layers over the `m` tokens in the hidden state, appending them
    /// to `kv` at positions `kv.pos ..`.
    pub fn forward_hidden(
        &mut self,
        m: usize,
        kv: &mut KvCache,
        coll: &mut dyn Collective,
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let span = SeqSpan {
            cache: 0,
            n_tokens: m,
            logits: false,
        };
        self.forward_hidden_batch(&[span], std::slice::from_mut(kv), coll, pool)
    }

    /// Runs this shard's layers over the hidden state's rows, laid out as `spans`: each
    /// span's rows attend to, and are appended to, its own cache in `caches`.
    pub fn forward_hidden_batch(
        &mut self,
        spans: &[SeqSpan],
        caches: &mut [KvCache],
        coll: &mut dyn Collective,
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let m = batch::validate(spans, caches, self.ubatch, self.layers.len())?;
        let mut t = 0;
        for s in spans {
            let pos0 = caches[s.cache].pos;
            for j in 0..s.n_tokens {
                self.ws.row_pos[t] = pos0 + j;
                self.ws.row_seq[t] = s.cache;
                t += 1;
            }
        }
        for li in 0..self.layers.len() {
            self.layer(li, m, caches, coll, pool)?;
        }
        for s in spans {
            caches[s.cache].pos += s.n_tokens;
        }
        Ok(())
    }

    /// One batched step over `tokens` (laid out as `spans`): writes the logits of each
    /// span that asks for them (its last row), in span order, into `out`.
    pub fn forward_batch(
        &mut self,
        tokens: &[u32],
        spans: &[SeqSpan],
        caches: &mut [KvCache],
        coll: &mut dyn Collective,
        pool: &ThreadPool,
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let rows: usize = spans.iter().map(|s| s.n_tokens).sum();
        if rows != tokens.len() {
            return Err(ModelError::Invalid(format!(
                "{} tokens for spans of {rows} rows",
                tokens.len()
            )));
        }
        self.embed_tokens(tokens)?;
        self.forward_hidden_batch(spans, caches, coll, pool)?;
        let k = self.gather_logit_rows(spans);
        // As in `forward`: every value is written, so only new room is zeroed.
        out.resize(k * self.shard.vocab.len(), 0.0);
        if k > 0 {
            self.logits(0..k, pool, out)?;
        }
        Ok(())
    }

    /// Moves the last hidden row of each span that wants logits to the front of the
    /// hidden state, in span order; returns how many. Rows only move down, so ascending
    /// copies never overwrite a row still to be read.
    pub fn gather_logit_rows(&mut self, spans: &[SeqSpan]) -> usize {
        let e = self.cfg.n_embd;
        let (mut end, mut k) = (0, 0);
        for s in spans {
            end += s.n_tokens;
            if s.logits {
                let from = (end - 1) * e;
                self.ws.x.copy_within(from..from + e, k * e);
                k += 1;
            }
        }
        k
    }

    #[allow(clippy::too_many_arguments)]
    fn layer(
        &mut self,
        li: usize,
        m: usize,
        caches: &mut [KvCache],
        coll: &mut dyn Collective,
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let (e, hd) = (cfg.n_embd, cfg.head_dim);
        let layer = &self.layers[li];
        let ws = &mut self.ws;
        let nh = self.shard.heads.len();
        let nkv = self.kv_heads.len();
        let (ql, kvl) = (nh * hd, nkv * hd);

        // Attention block.
        norm_rows(pool, &ws.x, &mut ws.xn, e, m, &layer.attn_norm, cfg.eps);
        let rope = if layer.window.is_some() {
            &self.rope_local
        } else {
            &self.rope_global
        };
        let gqa = match &layer.attn {
            Attn::Gqa(a) => a,
            Attn::Mla(a) => {
                let s = ws.mla.as_mut().ok_or_else(|| {
                    ModelError::Invalid("an MLA layer in a model without MLA scratch".into())
                })?;
                let io = MlaIo {
                    xn: &ws.xn,
                    att: &mut ws.att,
                    acts: &mut ws.acts,
                    tile: &mut ws.tile,
                    s,
                    row_pos: &ws.row_pos,
                    row_seq: &ws.row_seq,
                    caches,
                    layer: li,
                };
                a.forward(pool, io, rope, cfg.eps, m);
                return self.finish_layer(li, m, coll, pool);
            }
        };
        linears_of_one_input(
            pool,
            &ws.xn,
            e,
            m,
            &mut [
                (&gqa.wq, &mut ws.q[..]),
                (&gqa.wk, &mut ws.k[..]),
                (&gqa.wv, &mut ws.v[..]),
            ],
            &mut ws.acts,
            &mut ws.tile,
        );
        let (attn_scale, eps) = (cfg.attn_scale, cfg.eps);
        let row_pos = &ws.row_pos;
        for_each_row(pool, &mut ws.q, ql, ql, m, &|t, qt| {
            if let Some(w) = &gqa.q_norm {
                qt.chunks_exact_mut(hd)
                    .for_each(|qh| ops::rms_norm_inplace(qh, w, eps));
            }
            rope.apply_heads(qt, hd, row_pos[t]);
            vecops::scale(qt, attn_scale);
        });
        for_each_row(pool, &mut ws.k, kvl, kvl, m, &|t, kt| {
            if let Some(w) = &gqa.k_norm {
                kt.chunks_exact_mut(hd)
                    .for_each(|kh| ops::rms_norm_inplace(kh, w, eps));
            }
            rope.apply_heads(kt, hd, row_pos[t]);
        });
        for t in 0..m {
            let lkv = &mut caches[ws.row_seq[t]].layers[li];
            let s = lkv.slot(ws.row_pos[t]) * lkv.stride;
            lkv.k.write(s, &ws.k[t * kvl..(t + 1) * kvl]);
            lkv.v.write(s, &ws.v[t * kvl..(t + 1) * kvl]);
        }
        let group = cfg.n_head / cfg.n_head_kv;
        let heads = HeadGroups {
            heads: nh,
            group,
            skew: self.shard.heads.start - self.kv_heads.start * group,
        };
        let rows = BatchRows {
            pos: &ws.row_pos[..m],
            seq: &ws.row_seq[..m],
            caches,
            layer: li,
            window: layer.window,
        };
        attend_rows(
            pool,
            &rows,
            heads,
            &|r| HeadView::gqa(r * hd, hd),
            &ws.q,
            Strided { row: ql, head: hd },
            &mut ws.att,
            Strided { row: ql, head: hd },
        );
        self.finish_layer(li, m, coll, pool)
    }

    /// The rest of layer `li` once `ws.att` holds its heads' values: the output
    /// projection and its all-reduce, then the FFN block and its all-reduce.
    fn finish_layer(
        &mut self,
        li: usize,
        m: usize,
        coll: &mut dyn Collective,
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let e = cfg.n_embd;
        let layer = &self.layers[li];
        let ws = &mut self.ws;
        let ql = layer.wo.n_in;
        linear(
            pool,
            &layer.wo,
            &ws.att,
            ql,
            m,
            &mut ws.o,
            e,
            &mut ws.acts,
            &mut ws.tile,
        );
        reduce_into_residual(
            coll,
            pool,
            ws,
            e,
            m,
            layer.post_attn_norm.as_deref(),
            cfg.eps,
        )?;

        // MLP block.
        norm_rows(pool, &ws.x, &mut ws.xn, e, m, &layer.ffn_norm, cfg.eps);
        match &layer.ffn {
            Ffn::Dense(d) => {
                let (gate, up, down) = (&d.gate, &d.up, &d.down);
                let fl = gate.n_out;
                linears_of_one_input(
                    pool,
                    &ws.xn,
                    e,
                    m,
                    &mut [(gate, &mut ws.gate[..]), (up, &mut ws.up[..])],
                    &mut ws.acts,
                    &mut ws.tile,
                );
                let (upv, gelu) = (&ws.up, cfg.gelu);
                for_each_chunk(pool, &mut ws.gate[..m * fl], 64, &|r, g| {
                    ops::gated_activation(g, &upv[r], gelu)
                });
                linear(
                    pool,
                    down,
                    &ws.gate,
                    fl,
                    m,
                    &mut ws.o,
                    e,
                    &mut ws.acts,
                    &mut ws.tile,
                );
            }
            Ffn::Moe(moe) => {
                let s = ws.moe.as_mut().ok_or_else(|| {
                    ModelError::Invalid("a MoE layer in a model without MoE scratch".into())
                })?;
                let io = MoeIo {
                    xn: &ws.xn,
                    o: &mut ws.o,
                    acts: &mut ws.acts,
                    tile: &mut ws.tile,
                    s,
                };
                moe.forward(pool, io, e, m);
            }
        }
        reduce_into_residual(
            coll,
            pool,
            ws,
            e,
            m,
            layer.post_ffw_norm.as_deref(),
            cfg.eps,
        )?;
        Ok(())
    }

    /// Logits of hidden-state rows `rows` for this shard's vocabulary slice.
    pub fn logits(
        &mut self,
        rows: Range<usize>,
        pool: &ThreadPool,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let head = self
            .head
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("this shard holds no output head".into()))?;
        let e = self.cfg.n_embd;
        let n_v = head.n_out;
        let ws = &mut self.ws;
        for t in rows.clone() {
            ops::rms_norm_inplace(
                &mut ws.x[t * e..(t + 1) * e],
                &self.output_norm,
                self.cfg.eps,
            );
        }
        let base = rows.start;
        let mut done = 0;
        while done < rows.len() {
            let g = (rows.len() - done).min(HEAD_GROUP);
            let x = &ws.x[(base + done) * e..];
            let ab = head.act_bytes();
            head.quantize_input(x, e, g, &mut ws.acts[..g * ab]);
            let o = &mut out[done * n_v..(done + g) * n_v];
            if g == 1 {
                head.matvec(pool, &ws.acts[..ab], o);
            } else {
                if ws.tile.len() < g * n_v {
                    ws.tile.resize(g * n_v, 0.0); // once, on the first many-token call
                }
                head.matmul(pool, &ws.acts[..g * ab], g, o, n_v, &mut ws.tile);
            }
            done += g;
        }
        if let Some(c) = self.cfg.final_softcap {
            ops::softcap(&mut out[..rows.len() * n_v], c);
        }
        Ok(())
    }
}

/// Layer `il`'s FFN: routed experts where the file has a router for the layer, else dense.
fn load_ffn(
    f: &Arc<GgufFile>,
    il: usize,
    cfg: &ModelConfig,
    shard: &ShardSpec,
) -> Result<Ffn, ModelError> {
    let router = format!("blk.{il}.ffn_gate_inp.weight");
    if f.has_tensor(&router) {
        let moe = cfg.moe.ok_or_else(|| ModelError::Tensor {
            path: f.path().display().to_string(),
            tensor: router.clone(),
            detail: format!(
                "a router in a model whose metadata declares no experts ({}.expert_count)",
                cfg.arch.name()
            ),
        })?;
        return Ok(Ffn::Moe(Box::new(MoeFfn::load(f, il, cfg, moe, shard)?)));
    }
    let (e, ff) = (cfg.n_embd, cfg.n_ff);
    let n = |s: &str| format!("blk.{il}.{s}");
    Ok(Ffn::Dense(Box::new(DenseFfn {
        gate: Linear::load_rows(f, &n("ffn_gate.weight"), e, ff, shard.ffn.clone())?,
        up: Linear::load_rows(f, &n("ffn_up.weight"), e, ff, shard.ffn.clone())?,
        down: Linear::load_cols(
            f,
            &n("ffn_down.weight"),
            ff,
            e,
            shard.ffn.clone(),
            shard.tp_rank == 0,
        )?,
    })))
}

fn validate_shard(cfg: &ModelConfig, s: &ShardSpec) -> Result<(), ModelError> {
    let bad = |d: String| Err(ModelError::Shard(d));
    if s.layers.start >= s.layers.end || s.layers.end > cfg.n_layer {
        return bad(format!("layers {:?} outside 0..{}", s.layers, cfg.n_layer));
    }
    if s.heads.is_empty() || s.heads.end > cfg.n_head {
        return bad(format!("heads {:?} outside 0..{}", s.heads, cfg.n_head));
    }
    if s.ffn.is_empty() || s.ffn.end > cfg.n_ff {
        return bad(format!("FFN columns {:?} outside 0..{}", s.ffn, cfg.n_ff));
    }
    if let Some(m) = cfg.moe {
        if s.experts.end > m.n_expert || s.expert_ffn.end > m.n_ff_exp {
            return bad(format!(
                "experts {:?} x expert columns {:?} outside 0..{} x 0..{}",
                s.experts, s.expert_ffn, m.n_expert, m.n_ff_exp
            ));
        }
        // Every expert must have a holder, and this rank's group must be what it holds,
        // or some routed choice would run on no rank.
        let covered = (0..m.n_expert).all(|x| s.expert_groups.iter().any(|g| g.contains(&x)));
        if s.expert_groups.get(s.expert_group) != Some(&s.experts) || !covered {
            return bad(format!(
                "expert group {} of {:?} does not hold experts {:?}, or leaves one of 0..{} unheld",
                s.expert_group, s.expert_groups, s.experts, m.n_expert
            ));
        }
    }
    if s.vocab.is_empty() || s.vocab.end > cfg.n_vocab {
        return bad(format!(
            "vocabulary rows {:?} outside 0..{}",
            s.vocab, cfg.n_vocab
        ));
    }
    Ok(())
}

/// xn = rms_norm(x) for each of the `m` token rows.
fn norm_rows(
    pool: &ThreadPool,
    x: &[f32],
    xn: &mut [f32],
    e: usize,
    m: usize,
    w: &[f32],
    eps: f32,
) {
    for_each_row(pool, xn, e, e, m, &|t, out| {
        ops::rms_norm(&x[t * e..(t + 1) * e], w, eps, out)
    });
}

/// Sums the row-parallel partial outputs `ws.o` across the group, then adds them
/// (post-normed for Gemma) to the residual stream `ws.x`.
fn reduce_into_residual(
    coll: &mut dyn Collective,
    pool: &ThreadPool,
    ws: &mut Workspace,
    e: usize,
    m: usize,
    norm: Option<&[f32]>,
    eps: f32,
) -> Result<(), ModelError> {
    coll.all_reduce_sum(&mut ws.o[..m * e])
        .map_err(ModelError::Collective)?;
    residual(pool, &mut ws.x, &mut ws.o, e, m, norm, eps);
    Ok(())
}

/// x += norm(o) (Gemma's post-norms) or x += o, token rows in parallel.
#[allow(clippy::too_many_arguments)]
fn residual(
    pool: &ThreadPool,
    x: &mut [f32],
    o: &mut [f32],
    e: usize,
    m: usize,
    norm: Option<&[f32]>,
    eps: f32,
) {
    assert!(o.len() >= m * e, "partial outputs shorter than the rows");
    let op = SendPtr::new(o.as_mut_ptr());
    for_each_row(pool, x, e, e, m, &|t, xt| {
        // SAFETY: row t of `o` (inside it, checked above) is touched only by this task.
        let ot = unsafe { std::slice::from_raw_parts_mut(op.get().add(t * e), e) };
        if let Some(w) = norm {
            ops::rms_norm_inplace(ot, w, eps);
        }
        for (xv, ov) in xt.iter_mut().zip(ot.iter()) {
            *xv += ov;
        }
    });
}
