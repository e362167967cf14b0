//! Which part of the model one node holds: its tensor-parallel slice (query heads, FFN
//! columns, vocabulary rows), its tile of the routed experts (which experts, which of
//! each expert's FFN columns) and its pipeline layer range.

use std::ops::Range;

use crate::config::ModelConfig;
use crate::error::ModelError;

/// The part of a model held by one rank. The unsharded model is `ShardSpec::full`.
///
/// A stage's ranks all sum their partial outputs in one all-reduce after attention and
/// one after the FFN, so the invariant is: every head, FFN column, vocabulary row and
/// (expert, expert column) cell belongs to exactly one rank of the stage (or, for a spare
/// expert held by several groups, is computed by exactly one of them at each step).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    /// This rank's position in its stage, and the stage's size (attention and dense FFNs
    /// are tensor-parallel over the whole stage).
    pub tp_rank: usize,
    pub tp_size: usize,
    /// Layers of this pipeline stage.
    pub layers: Range<usize>,
    /// Query heads of this rank (contiguous).
    pub heads: Range<usize>,
    /// FFN intermediate columns of this rank (contiguous, on the down projection's block boundary).
    pub ffn: Range<usize>,
    /// Output-head (vocabulary) rows of this rank.
    pub vocab: Range<usize>,
    /// Routed experts whose weights this rank holds (expert parallelism; MoE models):
    /// its group's own share, widened by any spares (`StageSplit::ep_spares`).
    pub experts: Range<usize>,
    /// The experts each expert group of the stage holds, this rank's group at
    /// `expert_group`. Ranges overlap where groups hold spares; a routed expert several
    /// groups hold is computed by one of them, chosen alike on every rank (moe.rs).
    pub expert_groups: Vec<Range<usize>>,
    pub expert_group: usize,
    /// Columns of each held expert's FFN (tensor parallelism inside the experts).
    pub expert_ffn: Range<usize>,
}

/// How a stage of `ep × tp` ranks splits a model: position p is expert group `p / tp`
/// and expert-column slice `p % tp`; attention and dense FFNs split over all positions.
#[derive(Clone, Debug, PartialEq)]
pub struct StageSplit {
    /// Relative share of each expert-column slice, and of heads within an expert group.
    pub tp_weights: Vec<f64>,
    /// Relative share of the experts held by each expert group (e.g. by memory).
    pub ep_weights: Vec<f64>,
    /// Experts each group holds beyond its share, taken from its neighbours' ranges
    /// (redundant experts, as DeepSeek's EPLB keeps): a token's routed experts that two
    /// groups hold go to the less busy one, so the busiest group waits less.
    pub ep_spares: usize,
}

impl StageSplit {
    /// A plain tensor-parallel stage with these weights.
    pub fn tensor_parallel(tp_weights: &[f64]) -> Self {
        StageSplit {
            tp_weights: tp_weights.to_vec(),
            ep_weights: vec![1.0],
            ep_spares: 0,
        }
    }

    pub fn size(&self) -> usize {
        self.tp_weights.len() * self.ep_weights.len()
    }

    /// Share of heads, dense FFN columns and vocabulary rows of each position.
    fn position_weights(&self) -> Vec<f64> {
        let tp = self.tp_weights.len();
        (0..self.size())
            .map(|p| self.ep_weights[p / tp] * self.tp_weights[p % tp])
            .collect()
    }
}

/// Split granularities imposed by the weights' quant blocks.
#[derive(Clone, Copy, Debug)]
pub struct Granularity {
    /// Heads must be split in multiples of this (attn_output's input columns are split on blocks).
    pub heads: usize,
    /// FFN columns must be split in multiples of this (ffn_down's block size).
    pub ffn: usize,
    /// Expert FFN columns must be split in multiples of this (ffn_down_exps's block size).
    pub expert_ffn: usize,
}

impl ShardSpec {
    /// Everything: one node, all layers.
    pub fn full(cfg: &ModelConfig) -> Self {
        ShardSpec {
            tp_rank: 0,
            tp_size: 1,
            layers: 0..cfg.n_layer,
            heads: 0..cfg.n_head,
            ffn: 0..cfg.n_ff,
            vocab: 0..cfg.n_vocab,
            experts: 0..cfg.moe.map_or(0, |m| m.n_expert),
            expert_groups: std::iter::once(0..cfg.moe.map_or(0, |m| m.n_expert)).collect(),
            expert_group: 0,
            expert_ffn: 0..cfg.moe.map_or(0, |m| m.n_ff_exp),
        }
    }

    /// Rank `rank` of a tensor-parallel group whose members get shares proportional to
    /// `weights` (e.g. measured speeds; all equal for an even split).
    pub fn tensor_parallel(
        cfg: &ModelConfig,
        gran: Granularity,
        rank: usize,
        weights: &[f64],
    ) -> Result<Self, ModelError> {
        Self::stage(cfg, gran, rank, &StageSplit::tensor_parallel(weights))
    }

    /// Position `pos` of a stage split as `split` (tensor and expert parallel).
    pub fn stage(
        cfg: &ModelConfig,
        gran: Granularity,
        pos: usize,
        split: &StageSplit,
    ) -> Result<Self, ModelError> {
        let size = split.size();
        if pos >= size || size == 0 {
            return Err(ModelError::Shard(format!(
                "rank {pos} outside a group of {size}"
            )));
        }
        let weights = split.position_weights();
        let heads = split_proportional(cfg.n_head, gran.heads, &weights).map_err(|e| {
            ModelError::Shard(format!(
                "query heads ({} in steps of {}): {e}",
                cfg.n_head, gran.heads
            ))
        })?;
        let ffn = split_proportional(cfg.n_ff, gran.ffn, &weights).map_err(|e| {
            ModelError::Shard(format!(
                "FFN columns ({} in steps of {}): {e}",
                cfg.n_ff, gran.ffn
            ))
        })?;
        let vocab = split_proportional(cfg.n_vocab, 1, &weights)
            .map_err(|e| ModelError::Shard(format!("vocabulary rows: {e}")))?;
        let tp = split.tp_weights.len();
        let (expert_groups, expert_ffn) = match cfg.moe {
            None if split.ep_weights.len() > 1 => {
                return Err(ModelError::Shard(
                    "expert parallelism needs a model with experts".into(),
                ))
            }
            None => (std::iter::once(0..0).collect(), 0..0),
            Some(m) => {
                let own = split_proportional(m.n_expert, 1, &split.ep_weights)
                    .map_err(|e| ModelError::Shard(format!("experts ({}): {e}", m.n_expert)))?;
                let groups = if own.len() > 1 {
                    widen(&own, split.ep_spares, m.n_expert)
                } else {
                    own
                };
                let cols = split_proportional(m.n_ff_exp, gran.expert_ffn, &split.tp_weights)
                    .map_err(|e| {
                        ModelError::Shard(format!(
                            "expert FFN columns ({} in steps of {}): {e}",
                            m.n_ff_exp, gran.expert_ffn
                        ))
                    })?;
                (groups, cols[pos % tp].clone())
            }
        };
        Ok(ShardSpec {
            tp_rank: pos,
            tp_size: size,
            layers: 0..cfg.n_layer,
            heads: heads[pos].clone(),
            ffn: ffn[pos].clone(),
            vocab: vocab[pos].clone(),
            experts: expert_groups[pos / tp].clone(),
            expert_group: pos / tp,
            expert_groups,
            expert_ffn,
        })
    }

    /// The same shard restricted to a pipeline stage's layers.
    pub fn with_layers(mut self, layers: Range<usize>) -> Self {
        self.layers = layers;
        self
    }

    /// KV heads this rank needs: those its query heads attend with. When the group is
    /// larger than the KV head count, KV heads are replicated across ranks, not split.
    pub fn kv_heads(&self, cfg: &ModelConfig) -> Range<usize> {
        let g = cfg.n_head / cfg.n_head_kv;
        self.heads.start / g..self.heads.end.div_ceil(g)
    }

    pub fn is_first_stage(&self) -> bool {
        self.layers.start == 0
    }

    pub fn is_last_stage(&self, cfg: &ModelConfig) -> bool {
        self.layers.end == cfg.n_layer
    }
}

/// Each group's own experts widened by `spares` of its neighbours', half on each side where
/// there is room (all on one side at the ends), within `0..n`: ranges stay contiguous and
/// each still contains its own share.
fn widen(own: &[Range<usize>], spares: usize, n: usize) -> Vec<Range<usize>> {
    own.iter()
        .map(|r| {
            let len = (r.len() + spares).min(n);
            let start = r.start.saturating_sub(spares / 2).min(n - len);
            start..start + len
        })
        .collect()
}

/// Splits `0..n` into `weights.len()` contiguous ranges whose sizes are multiples of
/// `step` and roughly proportional to the weights; every range gets at least one step.
pub fn split_proportional(
    n: usize,
    step: usize,
    weights: &[f64],
) -> Result<Vec<Range<usize>>, String> {
    let parts = weights.len();
    if parts == 0 {
        return Err("no ranks".into());
    }
    if step == 0 || !n.is_multiple_of(step) {
        return Err(format!("{n} is not a multiple of {step}"));
    }
    let units = n / step;
    if units < parts {
        return Err(format!(
            "{units} units cannot be split across {parts} ranks"
        ));
    }
    if weights.iter().any(|w| !w.is_finite() || *w <= 0.0) {
        return Err("weights must be positive".into());
    }
    let total: f64 = weights.iter().sum();
    // Largest-remainder rounding, with a floor of one unit each.
    let mut counts: Vec<usize> = weights
        .iter()
        .map(|w| ((w / total * units as f64).floor() as usize).max(1))
        .collect();
    while counts.iter().sum::<usize>() > units {
        let i = (0..parts).filter(|&i| counts[i] > 1).max_by(|&a, &b| {
            let ea = counts[a] as f64 - weights[a] / total * units as f64;
            let eb = counts[b] as f64 - weights[b] / total * units as f64;
            ea.total_cmp(&eb)
        });
        match i {
            Some(i) => counts[i] -= 1,
            None => break,
        }
    }
    while counts.iter().sum::<usize>() < units {
        let i = (0..parts)
            .max_by(|&a, &b| {
                let ea = weights[a] / total * units as f64 - counts[a] as f64;
                let eb = weights[b] / total * units as f64 - counts[b] as f64;
                ea.total_cmp(&eb)
            })
            .unwrap_or(0);
        counts[i] += 1;
    }
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|c| {
            let r = start..start + c * step;
            start = r.end;
            r
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_and_uneven_splits() {
        assert_eq!(
            split_proportional(4, 1, &[1.0, 1.0]).unwrap(),
            vec![0..2, 2..4]
        );
        assert_eq!(
            split_proportional(4, 1, &[3.0, 1.0]).unwrap(),
            vec![0..3, 3..4]
        );
        assert_eq!(
            split_proportional(2048, 256, &[1.0; 4]).unwrap(),
            vec![0..512, 512..1024, 1024..1536, 1536..2048]
        );
        let r = split_proportional(100, 1, &[1.0, 2.0, 7.0]).unwrap();
        assert_eq!(
            r.iter().map(|r| r.len()).collect::<Vec<_>>(),
            vec![10, 20, 70]
        );
        assert!(split_proportional(4, 1, &[1.0; 5]).is_err());
        assert!(split_proportional(10, 4, &[1.0]).is_err());
        let r = split_proportional(8, 1, &[100.0, 1.0]).unwrap();
        assert_eq!(r, vec![0..7, 7..8]);
    }

    #[test]
    fn spares_widen_each_group_into_its_neighbours() {
        let own = split_proportional(64, 1, &[1.0, 1.0]).unwrap();
        assert_eq!(widen(&own, 4, 64), vec![0..36, 28..64]);
        assert_eq!(widen(&own, 0, 64), own);
        // Uneven, three groups: the middle one takes half from each side.
        let own = split_proportional(64, 1, &[2.0, 1.0, 1.0]).unwrap();
        assert_eq!(own, vec![0..32, 32..48, 48..64]);
        assert_eq!(widen(&own, 6, 64), vec![0..38, 29..51, 42..64]);
        // More spares than experts: every group holds everything.
        assert_eq!(widen(&own, 100, 64), vec![0..64; 3]);
        for spares in 0..70 {
            for (o, w) in own.iter().zip(widen(&own, spares, 64)) {
                assert!(w.start <= o.start && o.end <= w.end && w.end <= 64);
                assert_eq!(w.len(), (o.len() + spares).min(64));
            }
        }
    }
}
