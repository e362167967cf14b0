//! The planner's view of a model, read from its GGUF metadata and tensor index alone (no
//! weight is read): bytes per layer as attention, dense FFN or experts, the embedding, the
//! head, and KV bytes per token.

use weft_gguf::GgufFile;
use weft_model::ModelConfig;
use weft_plan::{LayerProfile, ModelProfile};

/// `file`'s profile for `weft_plan::plan`.
pub fn model_profile(file: &GgufFile, cfg: &ModelConfig) -> ModelProfile {
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
        kv_bytes_per_token: (cfg.kv_dim() * 2 * 4) as u64,
        experts: cfg.moe.map(|m| (m.n_expert, m.n_expert_used)),
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
        let p = model_profile(&f, &cfg);
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
    }
}
