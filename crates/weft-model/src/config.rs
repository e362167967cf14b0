//! Hyper-parameters of a model, read from GGUF metadata and checked against its tensors.

use weft_gguf::{FormatError, GgufError, GgufFile};
use weft_kernels::ops::{RopeStyle, YarnRamp};

/// The model families weft runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Gemma3,
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    DeepSeek2,
}

impl Arch {
    pub fn from_name(name: &str) -> Option<Arch> {
        Some(match name {
            "gemma3" => Arch::Gemma3,
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            "deepseek2" => Arch::DeepSeek2,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Gemma3 => "gemma3",
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::DeepSeek2 => "deepseek2",
        }
    }

    pub const SUPPORTED: &'static str = "gemma3, llama, mistral, qwen2, qwen3, qwen3moe, deepseek2";
}

/// Everything the forward pass needs to know about the model's shape.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub eps: f32,
    pub rope_style: RopeStyle,
    pub n_rot: usize,
    pub rope_base: f32,
    pub rope_base_swa: f32,
    pub rope_freq_scale: f32,
    /// YaRN's frequency ramp on the global layers, where the file asks for YaRN.
    pub rope_yarn: Option<YarnRamp>,
    /// Magnitude of RoPE's sines and cosines (YaRN, `rope.scaling.attn_factor`).
    pub rope_mscale: f32,
    /// Per layer: the sliding window in tokens, or `None` for full attention.
    pub window: Vec<Option<usize>>,
    /// Multiplier of the token embedding (Gemma scales by sqrt(n_embd)).
    pub embed_scale: f32,
    /// Query scale applied before attention.
    pub attn_scale: f32,
    pub final_softcap: Option<f32>,
    pub gelu: bool,
    pub qk_norm: bool,
    pub post_norms: bool,
    pub qkv_bias: bool,
    pub tied_output: bool,
    /// Mixture-of-experts shape, for architectures with routed experts.
    pub moe: Option<MoeConfig>,
    /// Multi-head latent attention (deepseek2): `head_dim` is then the value head size
    /// (the width each head hands the output projection) and `n_head_kv` is 1.
    pub mla: Option<MlaConfig>,
}

/// Multi-head latent attention: each token caches one latent vector and one shared RoPE
/// key, and decode attends over them with the key and value up-projections absorbed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaConfig {
    /// Rank of the query's low-rank projection; 0 where the file has a plain `attn_q`.
    pub q_lora_rank: usize,
    /// Width of the cached latent vector.
    pub kv_lora_rank: usize,
    /// Per head: the query/key part without RoPE, and the RoPE part (shared by all heads on
    /// the key side).
    pub n_nope: usize,
    pub n_rope: usize,
    /// Per head: the value width after the up-projection.
    pub v_head: usize,
    /// Scale of the query-key products (YaRN's mscale² over sqrt of the full key width).
    pub kq_scale: f32,
    /// The legacy layout: one `attn_kv_b` holding each head's key rows then value rows,
    /// instead of `attn_k_b` and `attn_v_b`.
    pub combined_kv_b: bool,
}

impl MlaConfig {
    /// Floats one token adds to one layer's cache: the latent and the RoPE key.
    pub fn cached_width(&self) -> usize {
        self.kv_lora_rank + self.n_rope
    }

    /// Query/key width of one head before absorption.
    pub fn k_head(&self) -> usize {
        self.n_nope + self.n_rope
    }
}

/// How router logits become expert scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// Most experts a token may be routed to (no released model routes to more than a few
/// dozen; the bound keeps the decode path's scratch on the stack).
pub const MAX_TOP_K: usize = 64;
/// Most routed experts a layer may have: llama.cpp's limit (LLAMA_MAX_EXPERTS); also
/// bounds the router's stack scratch.
pub const MAX_EXPERTS: usize = 512;

/// The routed experts of a mixture-of-experts model (the same in every MoE layer).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_expert: usize,
    /// Experts each token is routed to (top-k).
    pub n_expert_used: usize,
    /// Intermediate size of one expert's FFN.
    pub n_ff_exp: usize,
    /// Whether the top-k router weights are renormalised to sum to 1.
    pub norm_topk: bool,
    pub gating: Gating,
    /// Multiplier of the chosen experts' weights (DeepSeek's routed scaling factor).
    pub weights_scale: f32,
    /// Group-limited routing: experts in `n_group` equal groups, a token choosing among
    /// the `n_group_used` groups whose two best scores sum highest (DeepSeek V3).
    pub groups: Option<(usize, usize)>,
    /// Shared experts every token runs (their FFN is `n_shared x n_ff_exp` wide).
    pub n_shared: usize,
}

impl ModelConfig {
    pub fn from_gguf(f: &GgufFile) -> Result<Self, GgufError> {
        let arch_name = f.get_str("general.architecture")?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| {
            f.err(FormatError::BadValue {
                key: "general.architecture".into(),
                detail: format!(
                    "architecture '{arch_name}' is not supported (weft runs {})",
                    Arch::SUPPORTED
                ),
            })
        })?;
        let k = |s: &str| format!("{arch_name}.{s}");
        let us = |s: &str| -> Result<usize, GgufError> { Ok(f.get_u64(&k(s))? as usize) };
        let n_embd = us("embedding_length")?;
        // Multi-token-prediction blocks (GLM's deepseek2 files) follow the decoder's layers;
        // weft does not run them, as llama.cpp does not when decoding.
        let nextn = f.get_u64_or(&k("nextn_predict_layers"), 0)? as usize;
        let n_layer = us("block_count")?.checked_sub(nextn).ok_or_else(|| {
            f.err(FormatError::BadValue {
                key: k("nextn_predict_layers"),
                detail: format!("{nextn} prediction layers exceed block_count"),
            })
        })?;
        let n_head = us("attention.head_count")?;
        let n_head_kv = f.get_u64_or(&k("attention.head_count_kv"), n_head as u64)? as usize;
        let head_dim = match f.get(&k("attention.key_length")) {
            Some(_) => us("attention.key_length")?,
            None => n_embd.checked_div(n_head).unwrap_or(0),
        };
        let bad = |key: String, detail: String| f.err(FormatError::BadValue { key, detail });
        let moe = moe_config(f, arch_name)?;
        // An all-MoE model may omit the dense FFN size; its dense FFN range is then unused.
        let n_ff = match (f.get(&k("feed_forward_length")), moe) {
            (None, Some(m)) => m.n_ff_exp,
            _ => us("feed_forward_length")?,
        };
        if n_embd == 0
            || n_layer == 0
            || n_head == 0
            || n_head_kv == 0
            || head_dim == 0
            || n_ff == 0
        {
            return Err(bad(k("*"), "embedding_length, block_count, head counts, key_length and feed_forward_length must be positive".into()));
        }
        if n_head % n_head_kv != 0 {
            return Err(bad(
                k("attention.head_count_kv"),
                format!("{n_head} query heads are not a multiple of {n_head_kv} KV heads"),
            ));
        }
        let scaling = rope_scaling(f, arch, arch_name)?;
        let mla = mla_config(f, arch_name, n_head, scaling.kq_mscale)?;
        // The latent cache is one row per token for all heads (checked in mla_config).
        let n_head_kv = if mla.is_some() { 1 } else { n_head_kv };
        if mla.is_some() {
            for key in ["attention.sliding_window", "attention.temperature_scale"] {
                if f.get(&k(key)).is_some() {
                    return Err(bad(
                        k(key),
                        "not supported with deepseek2's latent attention".into(),
                    ));
                }
            }
        }
        // MLA: the generic head width is the value head's (what attn_output reads per head).
        let head_dim = mla.map_or(head_dim, |m| m.v_head);
        let v_len = f.get_u64_or(&k("attention.value_length"), head_dim as u64)? as usize;
        if v_len != head_dim && mla.is_none() {
            return Err(bad(
                k("attention.value_length"),
                format!("{v_len} differs from key_length {head_dim}; not supported"),
            ));
        }
        // Float hyper-parameters must be finite and positive: a NaN epsilon or RoPE base
        // would load fine and turn every logit into NaN at the first token.
        let positive = |key: String, v: f32| -> Result<f32, GgufError> {
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(bad(key, format!("{v} must be a finite number > 0")))
            }
        };
        let eps = positive(
            k("attention.layer_norm_rms_epsilon"),
            f.get_f32(&k("attention.layer_norm_rms_epsilon"))?,
        )?;
        let n_rot = f.get_u64_or(&k("rope.dimension_count"), head_dim as u64)? as usize;
        let rot_room = mla.map_or(head_dim, |m| m.n_rope);
        if n_rot > rot_room || !n_rot.is_multiple_of(2) || mla.is_some_and(|m| m.n_rope != n_rot) {
            return Err(bad(
                k("rope.dimension_count"),
                format!("{n_rot} must be even and at most the head's RoPE part {rot_room}"),
            ));
        }
        let default_base = if arch == Arch::Gemma3 {
            1_000_000.0
        } else {
            10_000.0
        };
        let rope_base = positive(
            k("rope.freq_base"),
            f.get_f32_or(&k("rope.freq_base"), default_base)?,
        )?;
        let rope_base_swa = positive(
            k("rope.freq_base_swa"),
            f.get_f32_or(&k("rope.freq_base_swa"), 10_000.0)?,
        )?;
        let n_ctx_train = f.get_u64_or(&k("context_length"), 4096)? as usize;
        let tok = f.get_array("tokenizer.ggml.tokens")?;
        let n_vocab = tok.len();
        let embd = f.tensor("token_embd.weight")?;
        if embd.dims.len() != 2
            || embd.dims[0] as usize != n_embd
            || embd.dims[1] as usize != n_vocab
        {
            return Err(f.err(FormatError::BadTensor {
                tensor: "token_embd.weight".into(),
                detail: format!(
                    "shape {:?} does not match embedding_length {n_embd} x vocabulary {n_vocab}",
                    embd.dims
                ),
            }));
        }
        let window = sliding_windows(f, arch, arch_name, n_layer)?;
        let gemma = arch == Arch::Gemma3;
        let final_softcap = match f.get_f32_or(&k("final_logit_softcapping"), 0.0)? {
            c if c.is_nan() || c == f32::INFINITY => {
                return Err(bad(
                    k("final_logit_softcapping"),
                    format!("{c} must be a finite number (0: off)"),
                ))
            }
            c if c > 0.0 => Some(c),
            _ => None,
        };
        let cfg = ModelConfig {
            arch,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            n_vocab,
            n_ctx_train,
            eps,
            rope_style: match arch {
                Arch::Llama | Arch::Mistral | Arch::DeepSeek2 => RopeStyle::Normal,
                Arch::Gemma3 | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => RopeStyle::Neox,
            },
            n_rot,
            rope_base,
            rope_base_swa,
            rope_freq_scale: scaling.freq_scale,
            rope_yarn: scaling.yarn,
            rope_mscale: scaling.rope_mscale,
            window,
            embed_scale: if gemma { (n_embd as f32).sqrt() } else { 1.0 },
            // Gemma 3 27B (62 layers) scales queries by n_embd/n_head; the others by head_dim.
            attn_scale: if let Some(m) = mla {
                m.kq_scale
            } else if gemma && n_layer == 62 {
                1.0 / ((n_embd / n_head) as f32).sqrt()
            } else {
                1.0 / (head_dim as f32).sqrt()
            },
            final_softcap,
            gelu: gemma,
            qk_norm: f.has_tensor("blk.0.attn_q_norm.weight"),
            post_norms: gemma,
            qkv_bias: f.has_tensor("blk.0.attn_q.bias"),
            tied_output: !f.has_tensor("output.weight"),
            moe,
            mla,
        };
        Ok(cfg)
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Floats one token adds to one layer's whole (unsharded) KV cache: MLA's latent and
    /// RoPE key, else a key and a value per KV head.
    pub fn kv_floats_per_token_layer(&self) -> usize {
        self.mla.map_or(2 * self.kv_dim(), |m| m.cached_width())
    }

    /// Bytes of weft's KV cache per token over all layers, its values stored as `ty`,
    /// and what a full-KV cache (every head's key and value) of the same type would need.
    pub fn kv_bytes_per_token(&self, ty: crate::kv::CacheType) -> (usize, usize) {
        let layers = self.n_layer * ty.bytes();
        (
            layers * self.kv_floats_per_token_layer(),
            layers * self.full_kv_floats_per_token_layer(),
        )
    }

    /// What a full-KV cache of this model would hold per token and layer: a key and a
    /// value for every head (MLA decompressed), for comparison with the latent cache.
    pub fn full_kv_floats_per_token_layer(&self) -> usize {
        match self.mla {
            Some(m) => self.n_head * (m.k_head() + m.v_head),
            None => 2 * self.kv_dim(),
        }
    }
}

/// deepseek2's latent-attention shape, or `None` for other architectures. Only files in
/// the absorbed layout (`attn_k_b`/`attn_v_b`, `key_length_mla` set) are read; a legacy
/// file with one `attn_kv_b` is refused with the reason.
fn mla_config(
    f: &GgufFile,
    arch_name: &str,
    n_head: usize,
    kq_mscale: f32,
) -> Result<Option<MlaConfig>, GgufError> {
    if arch_name != "deepseek2" {
        return Ok(None);
    }
    let k = |s: &str| format!("{arch_name}.{s}");
    let bad = |key: String, detail: String| f.err(FormatError::BadValue { key, detail });
    let us = |s: &str| -> Result<usize, GgufError> { Ok(f.get_u64(&k(s))? as usize) };
    // The current layout names the MLA head sizes apart from the absorbed MQA key (the
    // latent + RoPE key); a legacy file with one combined attn_kv_b has only the former
    // as its plain key and value lengths.
    let legacy = f.get(&k("attention.key_length_mla")).is_none();
    let (k_key, v_key) = if legacy {
        ("attention.key_length", "attention.value_length")
    } else {
        ("attention.key_length_mla", "attention.value_length_mla")
    };
    let k_head = us(k_key)?;
    let v_head = us(v_key)?;
    let kv_lora_rank = us("attention.kv_lora_rank")?;
    let q_lora_rank = f.get_u64_or(&k("attention.q_lora_rank"), 0)? as usize;
    let n_rope = us("rope.dimension_count")?;
    if kv_lora_rank == 0 || v_head == 0 || n_rope == 0 || k_head <= n_rope || n_head == 0 {
        return Err(bad(
            k("attention.*"),
            format!(
                "kv_lora_rank {kv_lora_rank}, {k_key} {k_head}, {v_key} {v_head}, \
                 rope.dimension_count {n_rope}: all must be positive and the key longer \
                 than its RoPE part"
            ),
        ));
    }
    let cached = kv_lora_rank
        .checked_add(n_rope)
        .ok_or_else(|| bad(k("attention.kv_lora_rank"), "too large".into()))?;
    let key_len = f.get_u64_or(&k("attention.key_length"), cached as u64)?;
    if !legacy && key_len as usize != cached {
        return Err(bad(
            k("attention.key_length"),
            format!(
                "{key_len}: the absorbed MLA key is kv_lora_rank + RoPE = {}",
                kv_lora_rank + n_rope
            ),
        ));
    }
    // The absorbed layout caches one KV head; a legacy file declares one per query head.
    let kv_heads = f.get_u64_or(&k("attention.head_count_kv"), n_head as u64)? as usize;
    let want = if legacy { n_head } else { 1 };
    if kv_heads != want {
        return Err(bad(
            k("attention.head_count_kv"),
            format!(
                "{kv_heads}: a{} deepseek2 file declares {want}",
                if legacy {
                    " legacy attn_kv_b"
                } else {
                    "n absorbed"
                }
            ),
        ));
    }
    if q_lora_rank == 0 && f.has_tensor("blk.0.attn_q_a.weight") {
        return Err(bad(
            k("attention.q_lora_rank"),
            "missing or 0, but the layers have a low-rank query (attn_q_a)".into(),
        ));
    }
    Ok(Some(MlaConfig {
        q_lora_rank,
        kv_lora_rank,
        n_nope: k_head - n_rope,
        n_rope,
        v_head,
        kq_scale: kq_mscale * kq_mscale / (k_head as f32).sqrt(),
        combined_kv_b: legacy,
    }))
}

/// A file's RoPE scaling, as llama.cpp applies it.
struct RopeScaling {
    freq_scale: f32,
    yarn: Option<YarnRamp>,
    /// Magnitude of RoPE's sines and cosines.
    rope_mscale: f32,
    /// deepseek2's query-key scale factor (squared into its kq_scale).
    kq_mscale: f32,
}

/// `rope.scaling.*`: none, linear, or YaRN (deepseek2 only), with llama.cpp's factors:
/// the RoPE magnitude is `yarn_attn_factor` (ggml multiplies YaRN's own `1 + 0.1 ln s` back
/// in), and deepseek2 pre-scales its kq_scale by `attn_factor·(1 + 0.1 ln s)·(1 + 0.1·
/// log_mul·ln s)`, its file's log multiplier stored divided by 0.1.
fn rope_scaling(f: &GgufFile, arch: Arch, arch_name: &str) -> Result<RopeScaling, GgufError> {
    let k = |s: &str| format!("{arch_name}.{s}");
    let bad = |key: String, detail: String| f.err(FormatError::BadValue { key, detail });
    let positive = |key: &str, default: f32| -> Result<f32, GgufError> {
        match f.get_f32_or(&k(key), default)? {
            v if v.is_finite() && v > 0.0 => Ok(v),
            v => Err(bad(k(key), format!("{v} must be a finite number > 0"))),
        }
    };
    let deepseek = arch == Arch::DeepSeek2;
    // A factor of 0 means none (llama.cpp reads it so); below 1 would shrink the context.
    let factor = || -> Result<f32, GgufError> {
        match f.get_f32_or(&k("rope.scaling.factor"), 1.0)? {
            0.0 => Ok(1.0),
            v if v.is_finite() && v >= 1.0 => Ok(v),
            v => Err(bad(
                k("rope.scaling.factor"),
                format!("{v} must be a finite number >= 1 (0: none)"),
            )),
        }
    };
    let kind = f.get(&k("rope.scaling.type")).and_then(|v| v.as_str());
    let (freq_scale, yarn) = match kind {
        Some("none") | None => (1.0, None),
        Some("linear") => (1.0 / factor()?, None),
        Some("yarn") if deepseek => {
            // A 0 or absent original context is the training context, as in llama.cpp.
            let n_ctx_train = f.get_u64_or(&k("context_length"), 4096)?;
            let orig = match f.get_u64_or(&k("rope.scaling.original_context_length"), 0)? {
                0 => n_ctx_train,
                c => c,
            };
            // llama.cpp's deepseek2 keeps YaRN's default betas whatever the file says
            // (Kimi K2's files state others); weft follows it so both rotate alike.
            let ramp = YarnRamp {
                n_ctx_orig: orig as usize,
                beta_fast: 32.0,
                beta_slow: 1.0,
            };
            (1.0 / factor()?, Some(ramp))
        }
        Some(other) => {
            return Err(bad(
                k("rope.scaling.type"),
                format!("RoPE scaling '{other}' is not supported for {arch_name}"),
            ))
        }
    };
    let log_mul = if deepseek {
        match f.get_f32_or(&k("rope.scaling.yarn_log_multiplier"), 0.0)? / 0.1 {
            v if v.is_finite() => v,
            v => return Err(bad(k("rope.scaling.yarn_log_multiplier"), format!("{v}"))),
        }
    } else {
        0.0
    };
    let attn_factor = positive("rope.scaling.attn_factor", 1.0)?;
    let s = 1.0 / freq_scale;
    let get_mscale = |m: f32| {
        if s <= 1.0 {
            1.0
        } else {
            0.1 * m * s.ln() + 1.0
        }
    };
    let yarn_attn = match yarn {
        None => 1.0,
        Some(_) => {
            let ratio = if log_mul != 0.0 {
                let m = if deepseek && log_mul != 1.0 {
                    log_mul
                } else {
                    1.0
                };
                get_mscale(m) / get_mscale(log_mul)
            } else {
                get_mscale(1.0)
            };
            ratio / (1.0 + 0.1 * s.ln())
        }
    } * attn_factor;
    let rope_mscale = match yarn {
        Some(_) => yarn_attn * (1.0 + 0.1 * s.ln()),
        None => yarn_attn,
    };
    let kq_mscale = yarn_attn * (1.0 + 0.1 * s.ln()) * (1.0 + 0.1 * log_mul * s.ln());
    Ok(RopeScaling {
        freq_scale,
        yarn,
        rope_mscale,
        kq_mscale,
    })
}

/// `{arch}.expert_count` and friends, checked: `None` when the file declares no experts.
fn moe_config(f: &GgufFile, arch_name: &str) -> Result<Option<MoeConfig>, GgufError> {
    let k = |s: &str| format!("{arch_name}.{s}");
    let bad = |key: String, detail: String| f.err(FormatError::BadValue { key, detail });
    let declared = f.get(&k("expert_count")).is_some();
    if !declared {
        if arch_name == "qwen3moe" || arch_name == "deepseek2" {
            return Err(bad(
                k("expert_count"),
                format!("missing: a {arch_name} model must declare its experts"),
            ));
        }
        return Ok(None);
    }
    let n_expert = f.get_u64(&k("expert_count"))? as usize;
    if n_expert == 0 {
        return Err(bad(
            k("expert_count"),
            "0 experts: must be at least 1".into(),
        ));
    }
    if n_expert > MAX_EXPERTS {
        return Err(bad(
            k("expert_count"),
            format!("{n_expert} experts exceed the limit of {MAX_EXPERTS}"),
        ));
    }
    let n_expert_used = f.get_u64(&k("expert_used_count"))? as usize;
    if n_expert_used == 0 || n_expert_used > n_expert.min(MAX_TOP_K) {
        return Err(bad(
            k("expert_used_count"),
            format!(
                "{n_expert_used} experts per token: must be 1..={} (expert_count {n_expert}, limit {MAX_TOP_K})",
                n_expert.min(MAX_TOP_K)
            ),
        ));
    }
    let n_ff_exp = f.get_u64(&k("expert_feed_forward_length"))? as usize;
    if n_ff_exp == 0 {
        return Err(bad(
            k("expert_feed_forward_length"),
            "0: an expert needs a positive FFN size".into(),
        ));
    }
    // qwen3moe renormalises the top-k weights (llama.cpp passes norm_w = true);
    // deepseek2 only where the file says so.
    let deepseek = arch_name == "deepseek2";
    let norm_topk = f.get_bool_or(&k("expert_weights_norm"), !deepseek)?;
    // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid (0: unset). Read for
    // deepseek2 only, as llama.cpp does; unset there, a file with a selection bias routes
    // by sigmoid (as GLM's do, where llama.cpp guesses it from the layer and vocabulary
    // counts) and one without by softmax (DeepSeek V2's).
    let gating_key = if deepseek {
        f.get_u64_or(&k("expert_gating_func"), 0)?
    } else {
        1
    };
    let gating = match gating_key {
        0 if has_selection_bias(f) => Gating::Sigmoid,
        0 | 1 => Gating::Softmax,
        2 => Gating::Sigmoid,
        other => {
            return Err(bad(
                k("expert_gating_func"),
                format!("{other}: weft routes by softmax (1) or sigmoid (2)"),
            ))
        }
    };
    let scale_key = if deepseek {
        f.get_f32_or(&k("expert_weights_scale"), 0.0)?
    } else {
        0.0
    };
    let weights_scale = match scale_key {
        0.0 => 1.0,
        s if s.is_finite() && s > 0.0 => s,
        s => {
            return Err(bad(
                k("expert_weights_scale"),
                format!("{s} must be a finite number > 0 (0: none)"),
            ))
        }
    };
    let (n_group, n_group_used) = if deepseek {
        (
            f.get_u64_or(&k("expert_group_count"), 0)? as usize,
            f.get_u64_or(&k("expert_group_used_count"), 0)? as usize,
        )
    } else {
        (0, 0)
    };
    let groups = if n_group > 1 {
        if !n_expert.is_multiple_of(n_group) || n_group_used == 0 || n_group_used >= n_group {
            return Err(bad(
                k("expert_group_count"),
                format!(
                    "{n_group} groups of {n_expert} experts, {n_group_used} used: the groups \
                     must divide the experts and 0 < used < groups"
                ),
            ));
        }
        if n_expert_used > n_group_used * (n_expert / n_group) {
            return Err(bad(
                k("expert_group_used_count"),
                format!(
                    "{n_group_used} groups of {} experts cannot hold {n_expert_used} choices",
                    n_expert / n_group
                ),
            ));
        }
        Some((n_group, n_group_used))
    } else {
        None
    };
    // llama.cpp requires the shared-expert count of deepseek2 (and reads none elsewhere).
    let n_shared = if deepseek {
        f.get_u64(&k("expert_shared_count"))? as usize
    } else {
        0
    };
    if n_shared.checked_mul(n_ff_exp).is_none() {
        return Err(bad(
            k("expert_shared_count"),
            format!("{n_shared} shared experts of {n_ff_exp} columns: too large"),
        ));
    }
    Ok(Some(MoeConfig {
        n_expert,
        n_expert_used,
        n_ff_exp,
        norm_topk,
        gating,
        weights_scale,
        groups,
        n_shared,
    }))
}

/// Whether some layer has deepseek2's expert-selection bias (`exp_probs_b`).
fn has_selection_bias(f: &GgufFile) -> bool {
    f.tensors()
        .iter()
        .any(|t| t.name.ends_with(".exp_probs_b.bias"))
}

/// Gemma 3 alternates sliding-window and global layers; llama-family models may set a
/// single window for all layers (Mistral) or none.
fn sliding_windows(
    f: &GgufFile,
    arch: Arch,
    arch_name: &str,
    n_layer: usize,
) -> Result<Vec<Option<usize>>, GgufError> {
    let key = format!("{arch_name}.attention.sliding_window");
    let swa = f.get_u64_or(&key, 0)? as usize;
    if swa == 0 {
        return Ok(vec![None; n_layer]);
    }
    let pat_key = format!("{arch_name}.attention.sliding_window_pattern");
    let is_swa: Vec<bool> = match f.get(&pat_key) {
        Some(v) if v.as_array().is_some() => {
            let a = f.get_array(&pat_key)?;
            let flags = a.as_i64s().ok_or_else(|| {
                f.err(FormatError::BadValue {
                    key: pat_key.clone(),
                    detail: "expected an array of booleans".into(),
                })
            })?;
            if flags.len() != n_layer {
                return Err(f.err(FormatError::BadValue {
                    key: pat_key,
                    detail: format!("{} entries for {n_layer} layers", flags.len()),
                }));
            }
            flags.into_iter().map(|x| x != 0).collect()
        }
        _ => {
            let default = if arch == Arch::Gemma3 { 6 } else { 0 };
            let pat = f.get_u64_or(&pat_key, default)? as usize;
            (0..n_layer)
                .map(|il| pat == 0 || il % pat < pat - 1)
                .collect()
        }
    };
    Ok(is_swa
        .into_iter()
        .map(|s| if s { Some(swa) } else { None })
        .collect())
}
