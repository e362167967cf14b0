//! What the planner knows of a model: bytes per layer (attention, dense FFN, experts),
//! embedding and head, KV bytes per token, and the expert share a token reads. Built from
//! GGUF metadata and the tensor index alone, by the caller.

use serde::{Deserialize, Serialize};

/// Weight bytes of one layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerProfile {
    /// Attention projections and norms.
    pub attn_bytes: u64,
    /// Of `attn_bytes`, what every tensor-parallel rank reads whole: weights per token,
    /// not per head (MLA's latent down-projections and their norms).
    #[serde(default)]
    pub replicated_bytes: u64,
    /// A dense FFN (0 in a MoE layer).
    pub ffn_bytes: u64,
    /// Every routed expert of the layer, and its router (0 in a dense layer).
    pub expert_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    pub name: String,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub layers: Vec<LayerProfile>,
    /// Token embedding (read one row per token: memory, not bandwidth).
    pub embed_bytes: u64,
    /// Output head and final norm (read whole by the last stage every token).
    pub head_bytes: u64,
    /// KV cache bytes of one token in one layer, whole (f32 as weft caches them): K and V
    /// of all KV heads, or MLA's latent and RoPE key.
    pub kv_bytes_per_token: u64,
    /// Routed experts per MoE layer and how many a token uses.
    pub experts: Option<(usize, usize)>,
}

impl ModelProfile {
    /// The fraction of a MoE layer's expert bytes one token reads.
    pub fn active_expert_share(&self) -> f64 {
        match self.experts {
            Some((n, k)) if n > 0 => k as f64 / n as f64,
            _ => 1.0,
        }
    }

    /// Bytes one decoded token reads in layer `l`, split into what tensor parallelism
    /// shares (attention and dense FFN) and what expert parallelism shares (experts).
    pub fn active_bytes(&self, l: usize) -> (f64, f64) {
        let p = &self.layers[l];
        (
            (p.attn_bytes + p.ffn_bytes) as f64,
            p.expert_bytes as f64 * self.active_expert_share(),
        )
    }

    /// Bytes of layers `layers` that every tensor-parallel rank reads whole.
    pub fn replicated_bytes(&self, layers: std::ops::Range<usize>) -> f64 {
        self.layers[layers]
            .iter()
            .map(|l| l.replicated_bytes as f64)
            .sum()
    }

    pub fn total_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.attn_bytes + l.ffn_bytes + l.expert_bytes)
            .sum::<u64>()
            + self.embed_bytes
            + self.head_bytes
    }
}
