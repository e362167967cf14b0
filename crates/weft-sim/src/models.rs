//! The models people cluster for, as architecture figures (layers, widths, heads, experts,
//! vocabulary) turned into the planner's `ModelProfile` at a chosen number of bits per
//! weight. Figures from each model's published config.json (docs/simulate.md names them).

use serde::Serialize;
use weft_plan::{LayerProfile, ModelProfile};

/// Multi-head latent attention (DeepSeek V3, Kimi K2): low-rank query and key-value
/// projections; the cache holds the compressed latent and the rotary key.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Mla {
    pub q_lora: usize,
    pub kv_lora: usize,
    pub rope_dim: usize,
    pub nope_dim: usize,
    pub v_dim: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Experts {
    /// Routed experts per MoE layer, and how many a token uses.
    pub count: usize,
    pub used: usize,
    /// Width of one expert's FFN.
    pub ffn: usize,
    /// Experts every token uses (DeepSeek's shared expert), of the same width.
    pub shared: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Architecture {
    pub name: &'static str,
    pub title: &'static str,
    pub layers: usize,
    pub embd: usize,
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub mla: Option<Mla>,
    /// Dense FFN width (the leading dense layers' in a MoE model).
    pub ffn: usize,
    pub experts: Option<Experts>,
    /// Leading layers with a dense FFN in a MoE model.
    pub dense_layers: usize,
    pub vocab: usize,
    pub tied: bool,
    /// Bits per weight as people run it (Q4_K_M is about 4.85).
    pub bits: f64,
    /// Bits of the attention, dense FFN and head where they differ (gpt-oss keeps them in
    /// BF16 beside MXFP4 experts).
    pub dense_bits: Option<f64>,
}

const MLA_V3: Mla = Mla {
    q_lora: 1536,
    kv_lora: 512,
    rope_dim: 64,
    nope_dim: 128,
    v_dim: 128,
};

/// Kimi K2, also the base of Kimi K2 Thinking's profile (the same architecture).
const KIMI_K2: Architecture = Architecture {
    name: "kimi-k2",
    title: "Kimi K2 1T",
    layers: 61,
    embd: 7168,
    heads: 64,
    heads_kv: 64,
    head_dim: 128,
    mla: Some(MLA_V3),
    ffn: 18432,
    experts: Some(Experts {
        count: 384,
        used: 8,
        ffn: 2048,
        shared: 1,
    }),
    dense_layers: 1,
    vocab: 163840,
    tied: false,
    bits: 4.5,
    dense_bits: None,
};

pub const CATALOG: &[Architecture] = &[
    Architecture {
        name: "llama-3.3-70b",
        title: "Llama 3.3 70B",
        layers: 80,
        embd: 8192,
        heads: 64,
        heads_kv: 8,
        head_dim: 128,
        mla: None,
        ffn: 28672,
        experts: None,
        dense_layers: 80,
        vocab: 128256,
        tied: false,
        bits: 4.85,
        dense_bits: None,
    },
    Architecture {
        name: "llama-3-8b",
        title: "Llama 3 8B",
        layers: 32,
        embd: 4096,
        heads: 32,
        heads_kv: 8,
        head_dim: 128,
        mla: None,
        ffn: 14336,
        experts: None,
        dense_layers: 32,
        vocab: 128256,
        tied: false,
        bits: 4.85,
        dense_bits: None,
    },
    Architecture {
        name: "qwen3-235b-a22b",
        title: "Qwen3-235B-A22B",
        layers: 94,
        embd: 4096,
        heads: 64,
        heads_kv: 4,
        head_dim: 128,
        mla: None,
        ffn: 12288,
        experts: Some(Experts {
            count: 128,
            used: 8,
            ffn: 1536,
            shared: 0,
        }),
        dense_layers: 0,
        vocab: 151936,
        tied: false,
        bits: 4.85,
        dense_bits: None,
    },
    Architecture {
        name: "deepseek-v3",
        title: "DeepSeek V3 671B",
        layers: 61,
        embd: 7168,
        heads: 128,
        heads_kv: 128,
        head_dim: 128,
        mla: Some(MLA_V3),
        ffn: 18432,
        experts: Some(Experts {
            count: 256,
            used: 8,
            ffn: 2048,
            shared: 1,
        }),
        dense_layers: 3,
        vocab: 129280,
        tied: false,
        bits: 4.85,
        dense_bits: None,
    },
    KIMI_K2,
    Architecture {
        name: "kimi-k2-thinking",
        title: "Kimi K2 Thinking 1T",
        // Routed experts in INT4 as shipped, in MLX's affine form (groups of 32 with a
        // bf16 scale and bias: 5 bits a weight, 658 GB in exo's model card); attention,
        // shared experts, the dense layer and the head in BF16.
        bits: 5.0,
        dense_bits: Some(16.0),
        ..KIMI_K2
    },
    Architecture {
        name: "gpt-oss-120b",
        title: "gpt-oss-120b",
        layers: 36,
        embd: 2880,
        heads: 64,
        heads_kv: 8,
        head_dim: 64,
        mla: None,
        ffn: 2880,
        experts: Some(Experts {
            count: 128,
            used: 4,
            ffn: 2880,
            shared: 0,
        }),
        dense_layers: 0,
        vocab: 201088,
        tied: false,
        bits: 4.25,
        dense_bits: Some(16.0),
    },
    Architecture {
        name: "gemma3-270m",
        title: "Gemma 3 270M",
        layers: 18,
        embd: 640,
        heads: 4,
        heads_kv: 1,
        head_dim: 256,
        mla: None,
        ffn: 2048,
        experts: None,
        dense_layers: 18,
        vocab: 262144,
        tied: true,
        bits: 4.85,
        dense_bits: None,
    },
];

/// The catalog's model of this name.
pub fn named(name: &str) -> Result<&'static Architecture, String> {
    CATALOG
        .iter()
        .find(|a| a.name.eq_ignore_ascii_case(name))
        .ok_or_else(|| {
            let names: Vec<&str> = CATALOG.iter().map(|a| a.name).collect();
            format!(
                "no model profile named {name:?}: the built-in ones are {}, or give a GGUF file",
                names.join(", ")
            )
        })
}

impl Architecture {
    /// Weights of one layer's attention.
    fn attn_params(&self) -> f64 {
        let (d, h) = (self.embd as f64, self.heads as f64);
        match self.mla {
            Some(m) => {
                let qk = (m.nope_dim + m.rope_dim) as f64;
                let q = if m.q_lora > 0 {
                    d * m.q_lora as f64 + m.q_lora as f64 * h * qk
                } else {
                    d * h * qk
                };
                let kv_a = d * (m.kv_lora + m.rope_dim) as f64;
                let kv_b = m.kv_lora as f64 * h * (m.nope_dim + m.v_dim) as f64;
                q + kv_a + kv_b + h * m.v_dim as f64 * d
            }
            None => {
                let hd = self.head_dim as f64;
                d * hd * (2.0 * h + 2.0 * self.heads_kv as f64)
            }
        }
    }

    /// Of one layer's attention, the weights applied per token rather than per head (MLA's
    /// latent down-projections): every tensor-parallel rank reads them whole.
    fn replicated_attn_params(&self) -> f64 {
        let d = self.embd as f64;
        match self.mla {
            Some(m) => d * (m.q_lora + m.kv_lora + m.rope_dim) as f64,
            None => 0.0,
        }
    }

    /// Values one token keeps in one layer's cache.
    fn kv_values(&self) -> usize {
        match self.mla {
            Some(m) => m.kv_lora + m.rope_dim,
            None => 2 * self.heads_kv * self.head_dim,
        }
    }

    /// All weights, and those one token reads.
    pub fn params(&self) -> (f64, f64) {
        let p = self.profile(Some(16.0), 2);
        let active: f64 = (0..p.layers.len())
            .map(|l| {
                let (d, e) = p.active_bytes(l);
                d + e
            })
            .sum::<f64>()
            + p.head_bytes as f64;
        // At 16 bits, bytes / 2 are weights.
        (p.total_bytes() as f64 / 2.0, active / 2.0)
    }

    /// The planner's profile at `bits` per weight (None: as people run it), the cache
    /// holding `kv_bytes` bytes per value.
    pub fn profile(&self, bits: Option<f64>, kv_bytes: usize) -> ModelProfile {
        let expert_bits = bits.unwrap_or(self.bits);
        let dense_bits = bits.or(self.dense_bits).unwrap_or(self.bits);
        let bytes = |params: f64, b: f64| (params * b / 8.0).round() as u64;
        let d = self.embd as f64;
        let layers = (0..self.layers)
            .map(|l| {
                let mut p = LayerProfile {
                    attn_bytes: bytes(self.attn_params(), dense_bits),
                    replicated_bytes: bytes(self.replicated_attn_params(), dense_bits),
                    ..LayerProfile::default()
                };
                match self.experts {
                    Some(e) if l >= self.dense_layers => {
                        let one = 3.0 * d * e.ffn as f64;
                        // The router stays in full precision.
                        p.expert_bytes = bytes(e.count as f64 * one, expert_bits)
                            + bytes(d * e.count as f64, 32.0);
                        p.ffn_bytes = bytes(e.shared as f64 * one, dense_bits);
                    }
                    _ => p.ffn_bytes = bytes(3.0 * d * self.ffn as f64, dense_bits),
                }
                p
            })
            .collect();
        let table = bytes(self.vocab as f64 * d, dense_bits);
        ModelProfile {
            name: self.title.to_string(),
            n_embd: self.embd,
            n_head: self.heads,
            n_head_kv: if self.mla.is_some() { 1 } else { self.heads_kv },
            layers,
            embed_bytes: if self.tied { 0 } else { table },
            head_bytes: table,
            kv_bytes_per_token: (self.kv_values() * kv_bytes) as u64,
            experts: self.experts.map(|e| (e.count, e.used)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameter counts as each model's makers state them (total, active), billions.
    #[test]
    fn parameter_counts_match_the_published_ones() {
        for (name, total, active) in [
            ("llama-3.3-70b", 70.6, 70.6),
            ("llama-3-8b", 8.03, 8.03),
            ("qwen3-235b-a22b", 235.0, 22.0),
            // 671 B without the multi-token-prediction layer; 37 B active.
            ("deepseek-v3", 671.0, 37.0),
            ("kimi-k2", 1026.0, 32.5),
            ("kimi-k2-thinking", 1026.0, 32.5),
            ("gpt-oss-120b", 116.8, 5.13),
            ("gemma3-270m", 0.268, 0.268),
        ] {
            let (t, a) = named(name).unwrap().params();
            let (t, a) = (t / 1e9, a / 1e9);
            assert!((t / total - 1.0).abs() < 0.03, "{name}: {t:.2} B in all");
            assert!((a / active - 1.0).abs() < 0.08, "{name}: {a:.2} B active");
        }
    }

    #[test]
    fn the_bits_give_the_sizes_of_the_files_exo_ran() {
        // exo's model cards (December 2025) give mlx-community/DeepSeek-V3.1-4bit as 378
        // and mlx-community/Kimi-K2-Thinking as 658: the repositories' sizes in GB.
        for (name, bits, gb) in [
            ("deepseek-v3", Some(4.5), 378.0),
            ("kimi-k2-thinking", None, 658.0),
        ] {
            let p = named(name).unwrap().profile(bits, 2);
            let got = p.total_bytes() as f64 / 1e9;
            assert!((got / gb - 1.0).abs() < 0.02, "{name}: {got:.0} GB");
        }
    }

    #[test]
    fn a_mla_cache_holds_the_latent_only_and_unknown_names_list_the_known() {
        let v3 = named("DeepSeek-V3").unwrap().profile(None, 2);
        assert_eq!(v3.kv_bytes_per_token, 576 * 2);
        assert_eq!(v3.experts, Some((256, 8)));
        assert_eq!(
            v3.layers[0].expert_bytes, 0,
            "the first three layers are dense"
        );
        assert!(v3.layers[3].expert_bytes > 0);
        let e = named("llama-4").unwrap_err();
        assert!(e.contains("kimi-k2") && e.contains("llama-4"), "{e}");
    }
}
