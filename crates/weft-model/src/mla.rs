//! Multi-head latent attention (deepseek2), absorbed as llama.cpp runs it: each token
//! caches one normed latent vector and one RoPE key shared by all heads; a head's query
//! is carried into the latent space by its `attn_k_b` slice, attends over the latent
//! rows (keys: latent + RoPE key; values: the latent), and its result is carried out by
//! its `attn_v_b` slice. Prefill and decode run this one path, so a token batched or
//! alone gives the same bits. Legacy files with one `attn_kv_b` run the same path, its
//! key rows transposed and both parts dequantized to f32 once at load.
//!
//! Tensor parallelism: `attn_q`/`attn_q_b` rows of the rank's heads, `attn_k_b`/`attn_v_b`
//! of its heads, `attn_output` columns of its heads; `attn_q_a`, `attn_kv_a_mqa` and the
//! latent cache are whole on every rank (a token's latent is one row for all heads, so splitting it
//! would mean a gather per layer for a cache that is already small).

use std::ops::Range;
use std::sync::Arc;

use weft_gguf::{GgmlType, GgufFile};
use weft_kernels::ops::{self, Rope};
use weft_kernels::{quant, vecops, ThreadPool};

use crate::attention::{attend_rows, BatchRows, HeadGroups, HeadView, Strided};
use crate::config::{MlaConfig, ModelConfig};
use crate::error::ModelError;
use crate::kv::KvCache;
use crate::rows::{for_each_row, linear, linears_of_one_input};
use crate::weights::{load_vector, Linear};

/// The query projection: plain (`attn_q`) or low-rank (`attn_q_a`, its norm, `attn_q_b`).
enum QueryProj {
    Plain(Linear),
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
}

/// One layer's latent attention as this rank holds it (its heads), without `attn_output`.
pub(crate) struct MlaAttn {
    q: QueryProj,
    /// Whole on every rank: a token's latent (kv_lora_rank) then its RoPE key.
    kv_a: Linear,
    kv_a_norm: Vec<f32>,
    /// Per local head: kv_lora_rank rows of n_nope (query into the latent space).
    k_b: Vec<Linear>,
    /// Per local head: v_head rows of kv_lora_rank (latent result out to the value).
    v_b: Vec<Linear>,
    /// Legacy files: the weight type whose activation format the latent is rounded
    /// through before it is cached, as llama.cpp rounds it before decompressing.
    latent_rounding: Option<GgmlType>,
    cfg: MlaConfig,
}

/// Room on the stack for one latent in an 8-bit activation format (a legacy file's
/// latent rounding): kv_lora_rank up to about 3,500 in Q8_0 or Q8_K.
const LATENT_ACT_BYTES: usize = 4096;

/// Scratch for one micro-batch through an MLA layer, sized at load.
pub(crate) struct MlaScratch {
    q_low: Vec<f32>,
    /// Per row: each local head's query before absorption (n_nope + n_rope).
    q: Vec<f32>,
    /// Per row: the latent and RoPE key from `attn_kv_a_mqa`.
    kv: Vec<f32>,
    /// Per row and local head: the absorbed query (latent part, then RoPE part).
    qc: Vec<f32>,
    /// Per row and local head: attention's result in the latent space.
    lat: Vec<f32>,
}

impl MlaScratch {
    pub fn new(ubatch: usize, cfg: MlaConfig, n_heads: usize) -> Self {
        let w = cfg.cached_width();
        MlaScratch {
            q_low: vec![0.0; ubatch * cfg.q_lora_rank],
            q: vec![0.0; ubatch * n_heads * cfg.k_head()],
            kv: vec![0.0; ubatch * w],
            qc: vec![0.0; ubatch * n_heads * w],
            lat: vec![0.0; ubatch * n_heads * cfg.kv_lora_rank],
        }
    }
}

/// What one MLA step reads and writes of the model's workspace and caches.
pub(crate) struct MlaIo<'a> {
    /// Normed input rows (`m x n_embd`).
    pub xn: &'a [f32],
    /// Per row: each local head's value (`m x heads·v_head`), for `attn_output`.
    pub att: &'a mut [f32],
    pub acts: &'a mut [u8],
    pub tile: &'a mut [f32],
    pub s: &'a mut MlaScratch,
    pub row_pos: &'a [usize],
    pub row_seq: &'a [usize],
    pub caches: &'a mut [KvCache],
    /// This layer's index in the caches.
    pub layer: usize,
}

impl MlaAttn {
    /// Layer `il`'s latent attention for query heads `heads`.
    pub fn load(
        f: &Arc<GgufFile>,
        il: usize,
        cfg: &ModelConfig,
        mla: MlaConfig,
        heads: Range<usize>,
    ) -> Result<Self, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}");
        let (e, kh, nh) = (cfg.n_embd, mla.k_head(), cfg.n_head);
        let q_rows = heads.start * kh..heads.end * kh;
        let q = if mla.q_lora_rank == 0 {
            QueryProj::Plain(Linear::load_rows(
                f,
                &n("attn_q.weight"),
                e,
                nh * kh,
                q_rows,
            )?)
        } else {
            let r = mla.q_lora_rank;
            QueryProj::LowRank {
                a: Linear::load_rows(f, &n("attn_q_a.weight"), e, r, 0..r)?,
                norm: load_vector(f, &n("attn_q_a_norm.weight"), r)?,
                b: Linear::load_rows(f, &n("attn_q_b.weight"), r, nh * kh, q_rows)?,
            }
        };
        let (kvr, w) = (mla.kv_lora_rank, mla.cached_width());
        let per_head = |name: &str, dims: [usize; 3]| -> Result<Vec<Linear>, ModelError> {
            heads
                .clone()
                .map(|h| Linear::load_expert_rows(f, &n(name), h, dims, 0..dims[1]))
                .collect()
        };
        let mut latent_rounding = None;
        let (k_b, v_b) = if mla.combined_kv_b {
            // Legacy attn_kv_b: each head's n_nope key rows, then its v_head value rows,
            // all kv_lora_rank wide. llama.cpp decompresses every token's key and value
            // from its latent rounded to the weight's activation format (F16/BF16, or
            // the 8-bit dot type); weft applies the key rows transposed from the query
            // side and the value rows after attention, in f32, over the latent cached
            // after that same rounding, so the two differ in summation order only.
            let name = n("attn_kv_b.weight");
            let too_large = || ModelError::Tensor {
                path: f.path().display().to_string(),
                tensor: name.clone(),
                detail: "key and value lengths too large".into(),
            };
            let per = mla.n_nope.checked_add(mla.v_head).ok_or_else(too_large)?;
            let dims = [kvr, nh.checked_mul(per).ok_or_else(too_large)?];
            let mut k_b = Vec::with_capacity(heads.len());
            let mut v_b = Vec::with_capacity(heads.len());
            for h in heads.clone() {
                let (k0, v0) = (h * per, h * per + mla.n_nope);
                k_b.push(Linear::load_rows_f32(f, &name, dims, k0..v0, true)?);
                v_b.push(Linear::load_rows_f32(
                    f,
                    &name,
                    dims,
                    v0..(h + 1) * per,
                    false,
                )?);
            }
            // The shape is checked: kv_lora_rank is a whole number of the type's blocks.
            let ty = f.tensor(&name)?.ty;
            if quant::act_bytes(ty, kvr) > LATENT_ACT_BYTES {
                return Err(ModelError::Tensor {
                    path: f.path().display().to_string(),
                    tensor: name,
                    detail: format!("kv_lora_rank {kvr} is too wide for a legacy {ty} attn_kv_b"),
                });
            }
            latent_rounding = Some(ty);
            (k_b, v_b)
        } else {
            (
                per_head("attn_k_b.weight", [mla.n_nope, kvr, nh])?,
                per_head("attn_v_b.weight", [kvr, mla.v_head, nh])?,
            )
        };
        Ok(MlaAttn {
            q,
            kv_a: Linear::load_rows(f, &n("attn_kv_a_mqa.weight"), e, w, 0..w)?,
            kv_a_norm: load_vector(f, &n("attn_kv_a_norm.weight"), kvr)?,
            k_b,
            v_b,
            latent_rounding,
            cfg: mla,
        })
    }

    pub fn linears(&self) -> impl Iterator<Item = &Linear> {
        let (q, q_b) = match &self.q {
            QueryProj::Plain(w) => (w, None),
            QueryProj::LowRank { a, b, .. } => (a, Some(b)),
        };
        std::iter::once(q)
            .chain(q_b)
            .chain(std::iter::once(&self.kv_a))
            .chain(self.k_b.iter())
            .chain(self.v_b.iter())
    }

    /// Attention of the `m` rows of `io.xn` into `io.att` (before `attn_output`),
    /// appending each row's latent and RoPE key to its sequence's cache first.
    pub fn forward(&self, pool: &ThreadPool, io: MlaIo, rope: &Rope, eps: f32, m: usize) {
        let e = self.kv_a.n_in;
        let MlaIo {
            xn,
            att,
            acts,
            tile,
            s,
            row_pos,
            row_seq,
            caches,
            layer,
        } = io;
        let c = self.cfg;
        let nh = self.k_b.len();
        let (kh, kvr, w, vh) = (c.k_head(), c.kv_lora_rank, c.cached_width(), c.v_head);
        let (ql, cl, ll) = (nh * kh, nh * w, nh * kvr);
        match &self.q {
            QueryProj::Plain(wq) => linears_of_one_input(
                pool,
                xn,
                e,
                m,
                &mut [(wq, &mut s.q[..]), (&self.kv_a, &mut s.kv[..])],
                acts,
                tile,
            ),
            QueryProj::LowRank { a, norm, b } => {
                linears_of_one_input(
                    pool,
                    xn,
                    e,
                    m,
                    &mut [(a, &mut s.q_low[..]), (&self.kv_a, &mut s.kv[..])],
                    acts,
                    tile,
                );
                let r = c.q_lora_rank;
                for_each_row(pool, &mut s.q_low, r, r, m, &|_, row| {
                    ops::rms_norm_inplace(row, norm, eps)
                });
                linear(pool, b, &s.q_low, r, m, &mut s.q, ql, acts, tile);
            }
        }
        // The latent is normed, the RoPE key rotated, and both cached.
        let (kv_norm, rounding) = (&self.kv_a_norm, self.latent_rounding);
        for_each_row(pool, &mut s.kv, w, w, m, &|t, row| {
            let (latent, k_pe) = row.split_at_mut(kvr);
            ops::rms_norm_inplace(latent, kv_norm, eps);
            if let Some(ty) = rounding {
                let mut scratch = [0u8; LATENT_ACT_BYTES];
                quant::round_as_activation(ty, latent, &mut scratch);
            }
            rope.apply(k_pe, row_pos[t]);
        });
        for t in 0..m {
            let lkv = &mut caches[row_seq[t]].layers[layer];
            let at = lkv.slot(row_pos[t]) * lkv.stride;
            lkv.k.write(at, &s.kv[t * w..(t + 1) * w]);
        }
        // Each head's query: its RoPE part rotated behind the latent part, which its
        // attn_k_b slice writes from the no-RoPE part.
        let q = &s.q;
        for_each_row(pool, &mut s.qc, cl, cl, m, &|t, row| {
            for (h, qc) in row.chunks_exact_mut(w).enumerate() {
                let src = &q[t * ql + h * kh + c.n_nope..t * ql + (h + 1) * kh];
                let pe = &mut qc[kvr..];
                pe.copy_from_slice(src);
                rope.apply(pe, row_pos[t]);
            }
        });
        for (h, k_b) in self.k_b.iter().enumerate() {
            linear(
                pool,
                k_b,
                &s.q[h * kh..],
                ql,
                m,
                &mut s.qc[h * w..],
                cl,
                acts,
                tile,
            );
        }
        for_each_row(pool, &mut s.qc, cl, cl, m, &|_, row| {
            vecops::scale(row, c.kq_scale)
        });
        let view = HeadView {
            key: (0, w),
            value: (0, kvr),
        };
        // Every head reads the one latent row a position: one group of all the heads.
        let rows = BatchRows {
            pos: &row_pos[..m],
            seq: &row_seq[..m],
            caches,
            layer,
            window: None,
        };
        let heads = HeadGroups {
            heads: nh,
            group: nh,
            skew: 0,
        };
        attend_rows(
            pool,
            &rows,
            heads,
            &|_| view,
            &s.qc,
            Strided { row: cl, head: w },
            &mut s.lat,
            Strided { row: ll, head: kvr },
        );
        for (h, v_b) in self.v_b.iter().enumerate() {
            linear(
                pool,
                v_b,
                &s.lat[h * kvr..],
                ll,
                m,
                &mut att[h * vh..],
                nh * vh,
                acts,
                tile,
            );
        }
    }
}
