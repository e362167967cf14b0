//! `weft synth`: writes a synthetic GGUF model (random weights, a small SentencePiece
//! vocabulary) of any supported architecture, for tests, benchmarks and comparisons
//! with llama.cpp on architectures with no small real model (MoE).

use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use weft_gguf::GgmlType;
use weft_model::synthetic::{synthetic_model, SyntheticMoe, SyntheticSpec};
use weft_model::Arch;

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Where to write the GGUF file.
    pub out: PathBuf,
    /// Architecture (gemma3, llama, mistral, qwen2, qwen3, qwen3moe).
    #[arg(long, default_value = "qwen3moe")]
    pub arch: String,
    /// Weight type of every matrix (F32, F16, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K).
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
    /// Routed experts per MoE layer (qwen3moe).
    #[arg(long, default_value_t = 8)]
    pub experts: usize,
    /// Experts each token is routed to.
    #[arg(long, default_value_t = 2)]
    pub experts_used: usize,
    /// FFN size of one expert.
    #[arg(long, default_value_t = 256)]
    pub expert_ff: usize,
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
    for (flag, n) in [
        ("--embd", a.embd),
        ("--ff", a.ff),
        ("--expert-ff", a.expert_ff),
        ("--heads x --head-dim", a.heads * a.head_dim),
    ] {
        if n == 0 || !n.is_multiple_of(bs) {
            return Err(anyhow!(
                "{flag} {n} must be a positive multiple of {ty}'s block of {bs}"
            ));
        }
    }
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
    if arch == Arch::Qwen3Moe {
        spec.moe = Some(SyntheticMoe {
            n_expert: a.experts,
            n_expert_used: a.experts_used,
            n_ff_exp: a.expert_ff,
        });
    }
    synthetic_model(&spec)
        .write_file(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    outln!("wrote {} ({arch:?}, {ty})", a.out.display())?;
    Ok(())
}
