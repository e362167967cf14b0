//! What the planner is given: a model's profile, read from its GGUF metadata and tensor
//! index alone (bytes per layer as attention, dense FFN or experts, the embedding, the
//! head, KV bytes per token, bytes per weight type), and a cluster's, from a survey.

use weft_gguf::{GgmlType, GgufFile};
use weft_kernels::calibrate::TypeRate;
use weft_kernels::quant::select::Shape;
use weft_model::{CacheType, ModelConfig};
use weft_plan::{ClusterProfile, LayerProfile, ModelProfile, NodeProfile};

use crate::survey::Survey;

/// `file`'s profile for `weft_plan::plan`.
pub fn model_profile(file: &GgufFile, cfg: &ModelConfig, cache: CacheType) -> ModelProfile {
    let mut layers = vec![LayerProfile::default(); cfg.n_layer];
    let (mut embed, mut head) = (0u64, 0u64);
    for t in file.tensors() {
        let bytes = t.ty.bytes_for(t.n_elements()).unwrap_or(0);
        let name = t.name.as_str();
        if let Some(rest) = name.strip_prefix("blk.") {
            let (il, what) = rest.split_once('.').unwrap_or((rest, ""));
            let Some(l) = il.parse::<usize>().ok().and_then(|i| layers.get_mut(i)) else {
                continue;
            };
            if what.contains("_exps") || what.starts_with("ffn_gate_inp") {
                l.expert_bytes += bytes;
            } else if what.starts_with("ffn_") && !what.starts_with("ffn_norm") {
                l.ffn_bytes += bytes;
            } else {
                l.attn_bytes += bytes;
                // MLA's latent down-projections apply per token: no head split shares them.
                if what.starts_with("attn_q_a") || what.starts_with("attn_kv_a") {
                    l.replicated_bytes += bytes;
                }
            }
        } else if name.starts_with("token_embd") {
            embed += bytes;
        } else {
            head += bytes;
        }
    }
    if cfg.tied_output {
        // The head is the embedding matrix, read whole by the last stage every token (the
        // first stage reads one row per token of it: no memory of its own).
        head += std::mem::take(&mut embed);
    }
    ModelProfile {
        name: file
            .get("general.name")
            .and_then(|v| v.as_str())
            .unwrap_or("model")
            .to_string(),
        n_embd: cfg.n_embd,
        n_head: cfg.n_head,
        n_head_kv: cfg.n_head_kv,
        layers,
        embed_bytes: embed,
        head_bytes: head,
        kv_bytes_per_token: (cfg.kv_floats_per_token_layer() * cache.bytes()) as u64,
        experts: cfg.moe.map(|m| (m.n_expert, m.n_expert_used)),
    }
}

/// Bytes of each weight type a decoded token reads: the layers' tensors (a MoE layer's
/// experts at the share a token uses) and the head.
pub fn type_mix(file: &GgufFile, cfg: &ModelConfig) -> Vec<TypeBytes> {
    let share = cfg
        .moe
        .map_or(1.0, |m| m.n_expert_used as f64 / m.n_expert as f64);
    let mut mix: Vec<TypeBytes> = Vec::new();
    let head = if cfg.tied_output {
        "token_embd.weight"
    } else {
        "output.weight"
    };
    for t in file.tensors() {
        if !(t.name.starts_with("blk.") || t.name == head) || t.dims.len() < 2 {
            continue;
        }
        let mut bytes = t.ty.bytes_for(t.n_elements()).unwrap_or(0) as f64;
        if t.name.contains("_exps.") {
            bytes *= share;
        }
        let i = match mix.iter().position(|e| e.ty == t.ty) {
            Some(i) => i,
            None => {
                mix.push(TypeBytes {
                    ty: t.ty,
                    long: 0.0,
                    short: 0.0,
                });
                mix.len() - 1
            }
        };
        if t.dims[0] as usize <= Shape::SHORT_ROW {
            mix[i].short += bytes;
        } else {
            mix[i].long += bytes;
        }
    }
    mix
}

/// Bytes of one weight type a decode step reads, in rows of a common width and in short
/// rows (at most `Shape::SHORT_ROW` values, which stream at their own rate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TypeBytes {
    pub ty: GgmlType,
    pub long: f64,
    pub short: f64,
}

/// Which of a type's rates applies.
#[derive(Clone, Copy, PartialEq)]
enum Rate {
    Decode,
    Prefill,
}

/// A node's streaming rate over a type mix: total bytes over the sum of each type's
/// bytes / its rate (types it did not measure count at its slowest measured rate).
fn mixed_rate(rates: &[TypeRate], mix: &[TypeBytes], which: Rate) -> f64 {
    let pick = |r: &TypeRate, short: bool| match which {
        Rate::Decode => r.decode_rate(short),
        Rate::Prefill => r.prefill_bytes_per_s,
    };
    let slowest = |short: bool| {
        rates
            .iter()
            .map(|r| pick(r, short))
            .fold(f64::INFINITY, f64::min)
    };
    let (mut bytes, mut secs) = (0.0, 0.0);
    for e in mix {
        let r = weft_kernels::calibrate::rate_of(rates, e.ty);
        for (b, short) in [(e.long, false), (e.short, true)] {
            let rate = r.map_or(slowest(short), |r| pick(r, short));
            bytes += b;
            secs += b / rate.max(1.0);
        }
    }
    if secs > 0.0 {
        bytes / secs
    } else {
        slowest(false)
    }
}

/// A node's decode rate over a model's type mix, bytes/s.
pub fn decode_rate_over(rates: &[TypeRate], mix: &[TypeBytes]) -> f64 {
    mixed_rate(rates, mix, Rate::Decode)
}

/// A node's prefill rate over a model's type mix, weight bytes x tokens/s.
pub fn prefill_rate_over(rates: &[TypeRate], mix: &[TypeBytes]) -> f64 {
    mixed_rate(rates, mix, Rate::Prefill)
}

/// A node's decode rate over the mix while the others compute too (`loaded`, timed at
/// once on every node; empty: not measured, 0). Sharing memory only slows a node: a
/// loaded figure above the solo one is a window that ran partly alone.
pub fn loaded_rate_over(rates: &[TypeRate], loaded: &[TypeRate], mix: &[TypeBytes]) -> f64 {
    if loaded.is_empty() {
        return 0.0;
    }
    // The loaded round times common rows only (and no short ones): the solo rate over
    // the mix, slowed as much as sharing slowed those.
    let solo = mixed_rate(rates, mix, Rate::Decode);
    let solo_common: Vec<TypeRate> = rates
        .iter()
        .map(|r| TypeRate {
            decode_short_bytes_per_s: 0.0,
            ..r.clone()
        })
        .collect();
    let shared = mixed_rate(loaded, mix, Rate::Decode);
    let alone = mixed_rate(&solo_common, mix, Rate::Decode);
    (solo * shared / alone.max(1.0)).min(solo)
}

/// The planner's cluster from a survey: memory each node offers, its kernel speed over
/// the model's type mix, the measured links (round trips in µs, bandwidth in bytes/s).
pub fn cluster_profile(s: &Survey, mix: &[TypeBytes]) -> ClusterProfile {
    let n = s.nodes.len();
    let nodes = s
        .nodes
        .iter()
        .zip(&s.peers)
        .map(|(info, addr)| NodeProfile {
            name: format!("{} ({addr})", info.name),
            memory_bytes: info.offered_memory(),
            decode_bytes_per_s: decode_rate_over(&info.rates, mix),
            prefill_bytes_per_s: prefill_rate_over(&info.rates, mix),
            loaded_decode_bytes_per_s: loaded_rate_over(&info.rates, &info.rates_loaded, mix),
            loaded_prefill_bytes_per_s: 0.0,
        })
        .collect();
    let sub = |m: &Vec<Vec<f64>>, scale: f64| -> Vec<Vec<f64>> {
        (1..=n)
            .map(|i| (1..=n).map(|j| m[i][j] * scale).collect())
            .collect()
    };
    ClusterProfile {
        nodes,
        rtt_us: sub(&s.links.rtt_us, 1.0),
        bytes_per_s: sub(&s.links.bandwidth_gb_s, 1e9),
        coordinator_rtt_us: (1..=n).map(|j| s.links.rtt_us[0][j]).collect(),
        engine: weft_plan::EngineCosts::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_gguf::GgmlType;
    use weft_model::synthetic::{synthetic_model, SyntheticSpec};
    use weft_model::Arch;

    #[test]
    fn bytes_are_sorted_by_what_reads_them() {
        let spec = SyntheticSpec::small(Arch::Qwen3Moe, GgmlType::Q8_0);
        let f = GgufFile::from_bytes("moe.gguf", synthetic_model(&spec).to_bytes()).unwrap();
        let cfg = ModelConfig::from_gguf(&f).unwrap();
        let p = model_profile(&f, &cfg, CacheType::F32);
        let total: u64 = f
            .tensors()
            .iter()
            .map(|t| t.ty.bytes_for(t.n_elements()).unwrap())
            .sum();
        assert_eq!(p.total_bytes(), total, "every tensor counted once");
        assert_eq!(p.layers.len(), 3);
        let l = p.layers[0];
        assert_eq!(l.ffn_bytes, 0, "qwen3moe layers have no dense FFN");
        // 8 experts x 3 matrices of 256 x 128 Q8_0 (34 bytes a 32-block), plus the F32 router.
        assert_eq!(l.expert_bytes, 8 * 3 * 256 * 128 / 32 * 34 + 256 * 8 * 4);
        assert!(l.attn_bytes > 0);
        assert_eq!(p.experts, Some((8, 2)));
        assert_eq!(p.kv_bytes_per_token, (2 * 64 * 2 * 4) as u64);
        let half = model_profile(&f, &cfg, CacheType::F16);
        assert_eq!(half.kv_bytes_per_token, (2 * 64 * 2 * 2) as u64);
    }
}
