//! `weft synth`: writes a synthetic GGUF model (random weights, a small SentencePiece
//! vocabulary) of any supported architecture, for tests, benchmarks and comparisons
//! with llama.cpp on architectures with no small real model (MoE).

use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use weft_gguf::GgmlType;
use weft_model::synthetic::{synthetic_model, SyntheticMla, SyntheticMoe, SyntheticSpec};
use weft_model::Arch;

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Where to write the GGUF file.
    pub out: PathBuf,
    /// Architecture (gemma3, llama, mistral, qwen2, qwen3, qwen3moe, deepseek2).
    #[arg(long, default_value = "qwen3moe")]
    pub arch: String,
    /// Weight type of every matrix (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
    /// Q6_K).
    #[arg(long = "type", default_value = "F16")]
    pub weight_type: String,
    #[arg(long, default_value_t = 256)]
    pub embd: usize,
    #[arg(long, default_value_t = 3)]
    pub layers: usize,
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    #[arg(long, default_value_t = 2)]
    pub heads_kv: usize,
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// Dense FFN size (also written for MoE models, as converters do).
    #[arg(long, default_value_t = 512)]
    pub ff: usize,
    /// Routed experts per MoE layer (qwen3moe, deepseek2).
    #[arg(long, default_value_t = 8)]
    pub experts: usize,
    /// Experts each token is routed to.
    #[arg(long, default_value_t = 2)]
    pub experts_used: usize,
    /// FFN size of one expert.
    #[arg(long, default_value_t = 256)]
    pub expert_ff: usize,
    /// deepseek2: rank of the query's low-rank projection (0: a plain attn_q).
    #[arg(long, default_value_t = 128)]
    pub q_lora_rank: usize,
    /// deepseek2: width of the cached latent vector.
    #[arg(long, default_value_t = 128)]
    pub kv_lora_rank: usize,
    /// deepseek2: per head, the query/key part without RoPE.
    #[arg(long, default_value_t = 64)]
    pub qk_nope: usize,
    /// deepseek2: per head, the RoPE part (the key's is shared by all heads).
    #[arg(long, default_value_t = 32)]
    pub qk_rope: usize,
    /// deepseek2: per head, the value width.
    #[arg(long, default_value_t = 64)]
    pub v_head: usize,
    /// deepseek2: shared experts every token runs.
    #[arg(long, default_value_t = 1)]
    pub shared_experts: usize,
    /// deepseek2: dense layers before the MoE layers.
    #[arg(long, default_value_t = 1)]
    pub leading_dense: usize,
    /// deepseek2: expert scores by `sigmoid` (with a selection bias) or `softmax`.
    #[arg(long, default_value = "sigmoid")]
    pub gating: String,
    /// deepseek2: group-limited routing, GROUPS,USED (0,0: off).
    #[arg(long, default_value = "0,0")]
    pub expert_groups: String,
    /// deepseek2: multiplier of the routed weights (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub expert_weights_scale: f32,
    /// deepseek2: YaRN RoPE scaling, FACTOR,ORIGINAL_CONTEXT (as DeepSeek V3's files state it).
    #[arg(long)]
    pub yarn: Option<String>,
    /// deepseek2: the legacy layout, one attn_kv_b instead of attn_k_b and attn_v_b.
    #[arg(long)]
    pub combined_kv_b: bool,
    /// deepseek2: do not renormalise the chosen experts' weights.
    #[arg(long)]
    pub no_expert_weights_norm: bool,
    /// Vocabulary entries beyond the 4 specials and 256 byte tokens.
    #[arg(long, default_value_t = 252)]
    pub extra_vocab: usize,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Output-head weight multiplier: larger makes logits more peaked.
    #[arg(long, default_value_t = 4.0)]
    pub head_scale: f32,
}

pub fn run(a: SynthArgs) -> Result<()> {
    let arch = Arch::from_name(&a.arch)
        .ok_or_else(|| anyhow!("--arch {}: weft runs {}", a.arch, Arch::SUPPORTED))?;
    let ty = GgmlType::WEIGHT_TYPES
        .into_iter()
        .find(|t| t.name().eq_ignore_ascii_case(&a.weight_type))
        .ok_or_else(|| anyhow!("--type {}: not a weight type weft writes", a.weight_type))?;
    let bs = ty.block_size();
    let whole_blocks = |dims: &[(&str, usize)]| -> Result<()> {
        match dims.iter().find(|(_, n)| *n == 0 || !n.is_multiple_of(bs)) {
            Some((flag, n)) => Err(anyhow!(
                "{flag} {n} must be a positive multiple of {ty}'s block of {bs}"
            )),
            None => Ok(()),
        }
    };
    whole_blocks(&[
        ("--embd", a.embd),
        ("--ff", a.ff),
        ("--expert-ff", a.expert_ff),
        ("--heads x --head-dim", a.heads * a.head_dim),
    ])?;
    let mut spec = SyntheticSpec::small(arch, ty);
    spec.n_embd = a.embd;
    spec.n_layer = a.layers;
    spec.n_head = a.heads;
    spec.n_head_kv = a.heads_kv;
    spec.head_dim = a.head_dim;
    spec.n_ff = a.ff;
    spec.n_extra_vocab = a.extra_vocab;
    spec.seed = a.seed;
    spec.head_scale = a.head_scale;
    if matches!(arch, Arch::Qwen3Moe | Arch::DeepSeek2) {
        let groups = a
            .expert_groups
            .split_once(',')
            .and_then(|(g, u)| Some((g.trim().parse().ok()?, u.trim().parse().ok()?)))
            .ok_or_else(|| anyhow!("--expert-groups {}: want GROUPS,USED", a.expert_groups))?;
        let sigmoid = match a.gating.as_str() {
            "sigmoid" => true,
            "softmax" => false,
            g => return Err(anyhow!("--gating {g}: sigmoid or softmax")),
        };
        spec.moe = Some(SyntheticMoe {
            n_shared: a.shared_experts,
            leading_dense: a.leading_dense,
            sigmoid,
            groups,
            weights_scale: a.expert_weights_scale,
            norm: !a.no_expert_weights_norm,
            ..SyntheticMoe::routed(a.experts, a.experts_used, a.expert_ff)
        });
    }
    if arch == Arch::DeepSeek2 {
        whole_blocks(&[
            ("--kv-lora-rank", a.kv_lora_rank),
            ("--qk-nope", a.qk_nope),
            ("--heads x --v-head", a.heads * a.v_head),
        ])?;
        if !a.q_lora_rank.is_multiple_of(bs) || a.qk_rope == 0 || !a.qk_rope.is_multiple_of(2) {
            return Err(anyhow!(
                "--q-lora-rank {} must be a multiple of {bs} (0: plain attn_q); --qk-rope {} \
                 a positive even number",
                a.q_lora_rank,
                a.qk_rope
            ));
        }
        let yarn = match &a.yarn {
            None => None,
            Some(y) => Some(
                y.split_once(',')
                    .and_then(|(f, c)| Some((f.trim().parse().ok()?, c.trim().parse().ok()?)))
                    .filter(|&(f, c): &(f32, u32)| f >= 1.0 && c > 0)
                    .ok_or_else(|| anyhow!("--yarn {y}: want FACTOR,ORIGINAL_CONTEXT"))?,
            ),
        };
        spec.mla = Some(SyntheticMla {
            yarn,
            combined_kv_b: a.combined_kv_b,
            q_lora_rank: a.q_lora_rank,
            kv_lora_rank: a.kv_lora_rank,
            n_nope: a.qk_nope,
            n_rope: a.qk_rope,
            v_head: a.v_head,
        });
    }
    synthetic_model(&spec)
        .write_file(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    outln!("wrote {} ({arch:?}, {ty})", a.out.display())?;
    Ok(())
}
