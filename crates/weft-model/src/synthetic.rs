//! Tiny synthetic GGUF models of every supported architecture and weight type, with a
//! SentencePiece vocabulary, written by tests (no model download needed).

use weft_gguf::{Array, GgmlType, GgufWriter, Value};
use weft_kernels::quant;

use crate::config::Arch;

/// Shape and weight type of a synthetic model.
#[derive(Clone, Debug)]
pub struct SyntheticSpec {
    pub arch: Arch,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    /// Extra vocabulary entries beyond the 4 specials and 256 byte tokens.
    pub n_extra_vocab: usize,
    /// Type of every 2-D weight (embedding included).
    pub weight_type: GgmlType,
    pub seed: u64,
    /// Token ids whose embedding rows are NaN, so a prompt holding one yields NaN logits
    /// (tests of non-finite handling; use a type that keeps NaN, such as F16 or F32,
    /// and an architecture with its own output matrix so other prompts stay finite).
    pub nan_tokens: Vec<u32>,
    /// Names of F32 vectors (norm weights, biases) written as all NaN.
    pub nan_tensors: Vec<String>,
    /// Routed experts (qwen3moe, deepseek2): every layer's FFN (deepseek2: after the
    /// leading dense ones) is a router and these experts.
    pub moe: Option<SyntheticMoe>,
    /// Latent attention (deepseek2).
    pub mla: Option<SyntheticMla>,
    /// Multiplier of the output head's weights: larger gives more peaked logits, so
    /// greedy paths of two engines rarely part at a near-tie.
    pub head_scale: f32,
}

/// Experts of a synthetic MoE model.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticMoe {
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    /// deepseek2's extras (ignored for qwen3moe): shared experts, dense layers first,
    /// sigmoid gating with a selection bias (else softmax), group-limited routing
    /// (groups, groups used; 0: off), the routed weights' scale (0: none) and whether
    /// they are renormalised.
    pub n_shared: usize,
    pub leading_dense: usize,
    pub sigmoid: bool,
    pub groups: (usize, usize),
    pub weights_scale: f32,
    pub norm: bool,
}

impl SyntheticMoe {
    /// `n_expert` routed experts of `n_ff_exp` columns, `n_expert_used` a token; with
    /// deepseek2, one shared expert, one dense layer first and sigmoid gating.
    pub fn routed(n_expert: usize, n_expert_used: usize, n_ff_exp: usize) -> Self {
        SyntheticMoe {
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_shared: 1,
            leading_dense: 1,
            sigmoid: true,
            groups: (0, 0),
            weights_scale: 0.0,
            norm: true,
        }
    }
}

/// deepseek2's latent attention shape.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticMla {
    /// 0: a plain `attn_q`.
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub n_nope: usize,
    pub n_rope: usize,
    pub v_head: usize,
    /// YaRN scaling written as DeepSeek V3's converter writes it: (factor, original
    /// context), with its log multiplier 0.1.
    pub yarn: Option<(f32, u32)>,
    /// The legacy layout: one `attn_kv_b` and plain key/value lengths, as older
    /// converters wrote DeepSeek files.
    pub combined_kv_b: bool,
}

impl SyntheticSpec {
    /// A small model whose dimensions suit `ty`'s block size.
    pub fn small(arch: Arch, ty: GgmlType) -> Self {
        let k = ty.block_size() == 256;
        SyntheticSpec {
            arch,
            n_embd: 256,
            n_layer: 3,
            n_head: if arch == Arch::Qwen3Moe { 8 } else { 4 },
            n_head_kv: if arch == Arch::Gemma3 { 1 } else { 2 },
            head_dim: if k { 128 } else { 64 },
            n_ff: 512,
            n_extra_vocab: 252,
            weight_type: ty,
            seed: 42,
            nan_tokens: Vec::new(),
            nan_tensors: Vec::new(),
            moe: matches!(arch, Arch::Qwen3Moe | Arch::DeepSeek2).then_some(SyntheticMoe::routed(
                8,
                2,
                if k { 512 } else { 128 },
            )),
            mla: (arch == Arch::DeepSeek2).then_some(SyntheticMla {
                q_lora_rank: if k { 256 } else { 128 },
                kv_lora_rank: if k { 256 } else { 128 },
                n_nope: if k { 256 } else { 64 },
                n_rope: 32,
                v_head: 64,
                yarn: None,
                combined_kv_b: false,
            }),
            head_scale: 1.0,
        }
    }

    pub fn n_vocab(&self) -> usize {
        4 + 256 + self.n_extra_vocab
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Builds the GGUF image of `spec`.
pub fn synthetic_model(spec: &SyntheticSpec) -> GgufWriter {
    let mut rng = Rng(spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let a = spec.arch.name();
    let mut w = GgufWriter::new();
    let (e, hd, ff) = (spec.n_embd, spec.head_dim, spec.n_ff);
    w.set_str("general.architecture", a)
        .set_str(
            "general.name",
            &format!("synthetic-{a}-{}", spec.weight_type),
        )
        .set_u32(&format!("{a}.context_length"), 2048)
        .set_u32(&format!("{a}.embedding_length"), e as u32)
        .set_u32(&format!("{a}.block_count"), spec.n_layer as u32)
        .set_u32(&format!("{a}.feed_forward_length"), ff as u32)
        .set_u32(&format!("{a}.attention.head_count"), spec.n_head as u32)
        .set_u32(
            &format!("{a}.attention.head_count_kv"),
            spec.n_head_kv as u32,
        )
        .set_u32(&format!("{a}.attention.key_length"), hd as u32)
        .set_u32(&format!("{a}.attention.value_length"), hd as u32)
        .set_f32(&format!("{a}.attention.layer_norm_rms_epsilon"), 1e-6)
        .set_f32(&format!("{a}.rope.freq_base"), 10000.0);
    if spec.arch == Arch::Gemma3 {
        // Short window so tests cross it; layer 2 of 3 is global with pattern 3.
        w.set_u32(&format!("{a}.attention.sliding_window"), 8)
            .set_u32(&format!("{a}.attention.sliding_window_pattern"), 3);
    }
    if let Some(m) = spec.mla {
        w.set_u32(&format!("{a}.attention.q_lora_rank"), m.q_lora_rank as u32)
            .set_u32(
                &format!("{a}.attention.kv_lora_rank"),
                m.kv_lora_rank as u32,
            )
            .set_u32(&format!("{a}.rope.dimension_count"), m.n_rope as u32);
        let (kv_heads, key, value) = if m.combined_kv_b {
            (spec.n_head, m.n_nope + m.n_rope, m.v_head)
        } else {
            (1, m.kv_lora_rank + m.n_rope, m.kv_lora_rank)
        };
        w.set_u32(&format!("{a}.attention.head_count_kv"), kv_heads as u32)
            .set_u32(&format!("{a}.attention.key_length"), key as u32)
            .set_u32(&format!("{a}.attention.value_length"), value as u32);
        if !m.combined_kv_b {
            w.set_u32(
                &format!("{a}.attention.key_length_mla"),
                (m.n_nope + m.n_rope) as u32,
            )
            .set_u32(&format!("{a}.attention.value_length_mla"), m.v_head as u32);
        }
        if let Some((factor, orig)) = m.yarn {
            w.set_str(&format!("{a}.rope.scaling.type"), "yarn")
                .set_f32(&format!("{a}.rope.scaling.factor"), factor)
                .set_u32(&format!("{a}.rope.scaling.original_context_length"), orig)
                .set_f32(&format!("{a}.rope.scaling.yarn_log_multiplier"), 0.1);
        }
    }
    if let (Some(m), Arch::DeepSeek2) = (spec.moe, spec.arch) {
        w.set_u32(
            &format!("{a}.leading_dense_block_count"),
            m.leading_dense as u32,
        )
        .set_u32(&format!("{a}.expert_shared_count"), m.n_shared as u32)
        .set_bool(&format!("{a}.expert_weights_norm"), m.norm)
        .set_f32(&format!("{a}.expert_weights_scale"), m.weights_scale)
        .set_u32(
            &format!("{a}.expert_gating_func"),
            if m.sigmoid { 2 } else { 1 },
        );
        if m.groups.0 > 1 {
            w.set_u32(&format!("{a}.expert_group_count"), m.groups.0 as u32)
                .set_u32(&format!("{a}.expert_group_used_count"), m.groups.1 as u32);
        }
    }
    if let Some(m) = spec.moe {
        w.set_u32(&format!("{a}.expert_count"), m.n_expert as u32)
            .set_u32(&format!("{a}.expert_used_count"), m.n_expert_used as u32)
            .set_u32(
                &format!("{a}.expert_feed_forward_length"),
                m.n_ff_exp as u32,
            );
    }
    add_vocab(&mut w, spec);
    let values = |name: &str, n_in: usize, n: usize, rng: &mut Rng| -> Vec<f32> {
        let scale = 1.0 / (n_in as f32).sqrt();
        let boost = match name {
            "output.weight" => spec.head_scale,
            // Well-separated router logits: routing rarely hangs on a near-tie.
            _ if name.ends_with("ffn_gate_inp.weight") => 4.0,
            _ => 1.0,
        };
        (0..n)
            .map(|_| {
                let v = rng.next() * scale * 1.5;
                if boost == 1.0 {
                    v
                } else {
                    v * boost
                }
            })
            .collect()
    };
    let experts = |w: &mut GgufWriter, name: &str, dims: [usize; 3], rng: &mut Rng| {
        let vals = values(name, dims[0], dims.iter().product(), rng);
        w.add_tensor(
            name,
            &dims.map(|d| d as u64),
            spec.weight_type,
            quant::quantize_row(spec.weight_type, &vals),
        );
    };
    let weight = |w: &mut GgufWriter, name: &str, n_in: usize, n_out: usize, rng: &mut Rng| {
        let mut vals = values(name, n_in, n_in * n_out, rng);
        if name == "token_embd.weight" {
            for &t in &spec.nan_tokens {
                let row = t as usize * n_in;
                vals[row..row + n_in].fill(f32::NAN);
            }
        }
        w.add_tensor(
            name,
            &[n_in as u64, n_out as u64],
            spec.weight_type,
            quant::quantize_row(spec.weight_type, &vals),
        );
    };
    let vector = |w: &mut GgufWriter, name: &str, n: usize, rng: &mut Rng, around: f32| {
        let mut vals: Vec<f32> = (0..n).map(|_| around + 0.2 * rng.next()).collect();
        if spec.nan_tensors.iter().any(|t| t == name) {
            vals.fill(f32::NAN);
        }
        w.add_tensor(
            name,
            &[n as u64],
            GgmlType::F32,
            quant::quantize_row(GgmlType::F32, &vals),
        );
    };
    let nv = spec.n_vocab();
    weight(&mut w, "token_embd.weight", e, nv, &mut rng);
    vector(&mut w, "output_norm.weight", e, &mut rng, 1.0);
    if spec.arch != Arch::Gemma3 {
        weight(&mut w, "output.weight", e, nv, &mut rng);
    }
    for il in 0..spec.n_layer {
        let n = |s: &str| format!("blk.{il}.{s}");
        vector(&mut w, &n("attn_norm.weight"), e, &mut rng, 1.0);
        if let Some(m) = spec.mla {
            let (nh, kh, kvr) = (spec.n_head, m.n_nope + m.n_rope, m.kv_lora_rank);
            if m.q_lora_rank == 0 {
                weight(&mut w, &n("attn_q.weight"), e, nh * kh, &mut rng);
            } else {
                let r = m.q_lora_rank;
                weight(&mut w, &n("attn_q_a.weight"), e, r, &mut rng);
                vector(&mut w, &n("attn_q_a_norm.weight"), r, &mut rng, 1.0);
                weight(&mut w, &n("attn_q_b.weight"), r, nh * kh, &mut rng);
            }
            weight(
                &mut w,
                &n("attn_kv_a_mqa.weight"),
                e,
                kvr + m.n_rope,
                &mut rng,
            );
            vector(&mut w, &n("attn_kv_a_norm.weight"), kvr, &mut rng, 1.0);
            if m.combined_kv_b {
                let rows = nh * (m.n_nope + m.v_head);
                weight(&mut w, &n("attn_kv_b.weight"), kvr, rows, &mut rng);
            } else {
                experts(&mut w, &n("attn_k_b.weight"), [m.n_nope, kvr, nh], &mut rng);
                experts(&mut w, &n("attn_v_b.weight"), [kvr, m.v_head, nh], &mut rng);
            }
        } else {
            weight(&mut w, &n("attn_q.weight"), e, spec.n_head * hd, &mut rng);
            weight(
                &mut w,
                &n("attn_k.weight"),
                e,
                spec.n_head_kv * hd,
                &mut rng,
            );
            weight(
                &mut w,
                &n("attn_v.weight"),
                e,
                spec.n_head_kv * hd,
                &mut rng,
            );
        }
        if spec.arch == Arch::Qwen2 {
            vector(&mut w, &n("attn_q.bias"), spec.n_head * hd, &mut rng, 0.0);
            vector(
                &mut w,
                &n("attn_k.bias"),
                spec.n_head_kv * hd,
                &mut rng,
                0.0,
            );
            vector(
                &mut w,
                &n("attn_v.bias"),
                spec.n_head_kv * hd,
                &mut rng,
                0.0,
            );
        }
        if matches!(spec.arch, Arch::Gemma3 | Arch::Qwen3 | Arch::Qwen3Moe) {
            vector(&mut w, &n("attn_q_norm.weight"), hd, &mut rng, 1.0);
            vector(&mut w, &n("attn_k_norm.weight"), hd, &mut rng, 1.0);
        }
        let v_width = spec.n_head * spec.mla.map_or(hd, |m| m.v_head);
        weight(&mut w, &n("attn_output.weight"), v_width, e, &mut rng);
        vector(&mut w, &n("ffn_norm.weight"), e, &mut rng, 1.0);
        let dense_first =
            spec.arch == Arch::DeepSeek2 && spec.moe.is_some_and(|m| il < m.leading_dense);
        if let (Some(m), false) = (spec.moe, dense_first) {
            // The router stays F32, as llama-quantize leaves it.
            let vals = values("ffn_gate_inp.weight", e, e * m.n_expert, &mut rng);
            w.add_tensor(
                &n("ffn_gate_inp.weight"),
                &[e as u64, m.n_expert as u64],
                GgmlType::F32,
                quant::quantize_row(GgmlType::F32, &vals),
            );
            let (fe, ne) = (m.n_ff_exp, m.n_expert);
            experts(&mut w, &n("ffn_gate_exps.weight"), [e, fe, ne], &mut rng);
            experts(&mut w, &n("ffn_up_exps.weight"), [e, fe, ne], &mut rng);
            experts(&mut w, &n("ffn_down_exps.weight"), [fe, e, ne], &mut rng);
            if spec.arch == Arch::DeepSeek2 {
                if m.sigmoid {
                    vector(&mut w, &n("exp_probs_b.bias"), ne, &mut rng, 0.0);
                }
                let sh = fe * m.n_shared;
                if sh > 0 {
                    weight(&mut w, &n("ffn_gate_shexp.weight"), e, sh, &mut rng);
                    weight(&mut w, &n("ffn_up_shexp.weight"), e, sh, &mut rng);
                    weight(&mut w, &n("ffn_down_shexp.weight"), sh, e, &mut rng);
                }
            }
        } else {
            weight(&mut w, &n("ffn_gate.weight"), e, ff, &mut rng);
            weight(&mut w, &n("ffn_up.weight"), e, ff, &mut rng);
            weight(&mut w, &n("ffn_down.weight"), ff, e, &mut rng);
        }
        if spec.arch == Arch::Gemma3 {
            vector(&mut w, &n("post_attention_norm.weight"), e, &mut rng, 1.0);
            vector(&mut w, &n("post_ffw_norm.weight"), e, &mut rng, 1.0);
        }
    }
    w
}

/// Specials, byte tokens, then pieces of a tiny English vocabulary.
fn add_vocab(w: &mut GgufWriter, spec: &SyntheticSpec) {
    let mut tokens = vec![
        "<pad>".to_string(),
        "<eos>".into(),
        "<bos>".into(),
        "<unk>".into(),
    ];
    let mut types = vec![3i32, 3, 3, 2];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let words = [
        "▁the",
        "▁a",
        "▁of",
        "▁and",
        "▁to",
        "▁in",
        "▁is",
        "▁it",
        "▁that",
        "▁cat",
        "▁dog",
        "▁sat",
        "▁on",
        "▁mat",
        "▁capital",
        "▁France",
        "▁Paris",
        "▁city",
        "▁hello",
        "▁world",
        "▁The",
        "▁weft",
        "▁model",
        "ing",
        "ed",
        "er",
        "▁",
        "e",
        "t",
        "a",
        "o",
        "i",
        "n",
        "s",
        "h",
        "r",
        "d",
        "l",
        "c",
        "u",
        "m",
        "w",
        "f",
        "g",
        "y",
        "p",
        "b",
        "v",
        "k",
        ".",
        ",",
        "!",
        "?",
        "\n",
        "T",
        "F",
        "P",
        "H",
        "W",
    ];
    let mut scores = vec![0f32; tokens.len()];
    let mut i = 0usize;
    while tokens.len() < spec.n_vocab() {
        let t = if i < words.len() {
            words[i].to_string()
        } else {
            format!("▁w{i}")
        };
        tokens.push(t);
        types.push(1);
        scores.push(-(i as f32));
        i += 1;
    }
    tokens.truncate(spec.n_vocab());
    types.truncate(spec.n_vocab());
    scores.truncate(spec.n_vocab());
    w.set_str("tokenizer.ggml.model", "llama")
        .set("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))
        .set("tokenizer.ggml.scores", Value::Array(Array::F32(scores)))
        .set("tokenizer.ggml.token_type", Value::Array(Array::I32(types)))
        .set_u32("tokenizer.ggml.bos_token_id", 2)
        .set_u32("tokenizer.ggml.eos_token_id", 1)
        .set_u32("tokenizer.ggml.unknown_token_id", 3)
        .set_u32("tokenizer.ggml.padding_token_id", 0)
        .set_bool("tokenizer.ggml.add_bos_token", true)
        .set_bool("tokenizer.ggml.add_space_prefix", true);
}
