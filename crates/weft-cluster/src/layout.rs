//! Layouts: how N nodes split a model into pipeline stages (contiguous layer ranges) that
//! are each a group of `tp × ep` ranks: attention and dense FFNs tensor-parallel over the
//! whole stage, routed experts split `ep` ways (expert parallelism) and each expert's
//! columns `tp` ways. Uneven layer counts, TP weights and EP weights are allowed.

use std::ops::Range;

/// What the user asked for; any size left out is derived from the node count.
#[derive(Clone, Debug, Default)]
pub struct LayoutRequest {
    pub nodes: usize,
    pub tp: Option<usize>,
    pub pp: Option<usize>,
    pub ep: Option<usize>,
    pub n_layer: usize,
    /// Layers of each stage (default: even).
    pub layer_counts: Option<Vec<usize>>,
    pub tp_weights: Option<Vec<f64>>,
    pub ep_weights: Option<Vec<f64>>,
    /// Spare experts each expert group also holds (`--ep-spares`; 0: none).
    pub ep_spares: usize,
}

/// Stages of `tp × ep` ranks; node i (0-based) is stage i / (tp·ep), position i % (tp·ep)
/// in it: expert group position / tp, expert-column slice position % tp.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub tp: usize,
    pub pp: usize,
    /// Expert-parallel groups per stage (1: every rank holds every expert's slice).
    pub ep: usize,
    /// Layer range of each stage.
    pub layers: Vec<Range<usize>>,
    /// Relative share of heads and FFN columns of each TP rank (same for every stage).
    pub tp_weights: Vec<f64>,
    /// Relative share of the experts of each expert group (same for every stage).
    pub ep_weights: Vec<f64>,
    /// Experts each group holds beyond its share, from its neighbours (redundant
    /// experts: a choice two groups can compute goes to the less busy one).
    pub ep_spares: usize,
}

impl Layout {
    /// Every node's shard of `file` (node order): what each loads, as the node computes
    /// it from its plan.
    pub fn node_shards(
        &self,
        file: &weft_gguf::GgufFile,
        cfg: &weft_model::ModelConfig,
    ) -> Result<Vec<weft_model::ShardSpec>, weft_model::ModelError> {
        let gran = weft_model::granularity(file, cfg)?;
        let split = weft_model::StageSplit {
            tp_weights: self.tp_weights.clone(),
            ep_weights: self.ep_weights.clone(),
            ep_spares: self.ep_spares,
        };
        (0..self.nodes())
            .map(|i| {
                let stage = i / self.width();
                Ok(
                    weft_model::ShardSpec::stage(cfg, gran, i % self.width(), &split)?
                        .with_layers(self.layers[stage].clone()),
                )
            })
            .collect()
    }

    /// `nodes` nodes with the given TP/PP sizes (either may be left out and is derived);
    /// `layer_counts` optionally fixes each stage's number of layers.
    pub fn new(
        nodes: usize,
        tp: Option<usize>,
        pp: Option<usize>,
        n_layer: usize,
        layer_counts: Option<&[usize]>,
        tp_weights: Option<&[f64]>,
    ) -> Result<Layout, String> {
        Self::plan(&LayoutRequest {
            nodes,
            tp,
            pp,
            ep: None,
            n_layer,
            layer_counts: layer_counts.map(<[usize]>::to_vec),
            tp_weights: tp_weights.map(<[f64]>::to_vec),
            ep_weights: None,
            ep_spares: 0,
        })
    }

    /// The layout `r` asks for, checked.
    pub fn plan(r: &LayoutRequest) -> Result<Layout, String> {
        let nodes = r.nodes;
        if nodes == 0 {
            return Err("a cluster needs at least one node".into());
        }
        let ep = match (r.ep, &r.ep_weights) {
            (Some(e), _) => e,
            (None, Some(w)) => w.len(),
            (None, None) => 1,
        };
        if ep == 0 {
            return Err("--ep must be at least 1".into());
        }
        if r.ep_spares > 0 && ep == 1 {
            return Err(format!(
                "--ep-spares {} needs expert parallelism (--ep 2 or more)",
                r.ep_spares
            ));
        }
        let (tp, pp) = match (r.tp, r.pp) {
            (Some(t), Some(p)) => (t, p),
            (Some(t), None) => (t, nodes / (t * ep).max(1)),
            (None, Some(p)) => (nodes / (p * ep).max(1), p),
            (None, None) => (nodes / ep, 1),
        };
        if tp == 0 || pp == 0 || tp * ep * pp != nodes {
            let ep_part = if ep > 1 {
                format!(" x --ep {ep}")
            } else {
                String::new()
            };
            return Err(format!(
                "--tp {tp}{ep_part} x --pp {pp} must equal the {nodes} nodes"
            ));
        }
        let n_layer = r.n_layer;
        if pp > n_layer {
            return Err(format!(
                "{pp} pipeline stages for a model of {n_layer} layers"
            ));
        }
        let counts: Vec<usize> = match &r.layer_counts {
            Some(c) => {
                if c.len() != pp || c.iter().sum::<usize>() != n_layer || c.contains(&0) {
                    return Err(format!(
                        "--layers {c:?} must give {pp} positive counts summing to {n_layer}"
                    ));
                }
                c.clone()
            }
            None => (0..pp)
                .map(|s| n_layer / pp + usize::from(s < n_layer % pp))
                .collect(),
        };
        let mut layers = Vec::new();
        let mut at = 0;
        for c in counts {
            layers.push(at..at + c);
            at += c;
        }
        let weights = |flag: &str, w: &Option<Vec<f64>>, n: usize| match w {
            Some(w) if w.len() == n && w.iter().all(|&x| x.is_finite() && x > 0.0) => Ok(w.clone()),
            Some(w) => Err(format!("{flag} {w:?} must give {n} positive weights")),
            None => Ok(vec![1.0; n]),
        };
        Ok(Layout {
            tp,
            pp,
            ep,
            layers,
            tp_weights: weights("--tp-weights", &r.tp_weights, tp)?,
            ep_weights: weights("--ep-weights", &r.ep_weights, ep)?,
            ep_spares: r.ep_spares,
        })
    }

    /// Ranks in each stage.
    pub fn width(&self) -> usize {
        self.tp * self.ep
    }

    pub fn nodes(&self) -> usize {
        self.width() * self.pp
    }

    /// Data-plane ranks of each stage's members (node i is rank i + 1).
    pub fn stage_ranks(&self) -> Vec<Vec<usize>> {
        let w = self.width();
        (0..self.pp)
            .map(|s| (0..w).map(|t| 1 + s * w + t).collect())
            .collect()
    }

    /// All-reduces, pipeline hand-offs and coordinator messages of one decode step.
    pub fn syncs_per_token(&self) -> usize {
        let layers: usize = self.layers.iter().map(|r| r.len()).sum();
        let allreduce = if self.width() > 1 { 2 * layers } else { 0 };
        allreduce + (self.pp - 1) + 2
    }

    /// A short name: "TP=2", "EP=2 x TP=2 x PP=2", "1 node".
    pub fn name(&self) -> String {
        let mut parts = Vec::new();
        if self.ep > 1 {
            parts.push(format!("EP={}", self.ep));
        }
        if self.tp > 1 {
            parts.push(format!("TP={}", self.tp));
        }
        if self.pp > 1 {
            parts.push(format!("PP={}", self.pp));
        }
        if parts.is_empty() {
            "1 node".into()
        } else if self.ep > 1 && self.ep_spares > 0 {
            format!("{} +{} spare experts", parts.join(" x "), self.ep_spares)
        } else {
            parts.join(" x ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_derive_and_validate() {
        let l = Layout::new(4, Some(2), None, 18, None, None).unwrap();
        assert_eq!((l.tp, l.pp), (2, 2));
        assert_eq!(l.layers, vec![0..9, 9..18]);
        assert_eq!(l.stage_ranks(), vec![vec![1, 2], vec![3, 4]]);
        let l = Layout::new(3, None, Some(3), 18, Some(&[8, 6, 4]), None).unwrap();
        assert_eq!(l.layers, vec![0..8, 8..14, 14..18]);
        assert!(Layout::new(3, Some(2), None, 18, None, None).is_err());
        assert!(Layout::new(2, None, Some(2), 18, None, Some(&[10.0, 9.0])).is_err());
        assert!(Layout::new(2, None, Some(2), 18, Some(&[10, 9]), None).is_err());
        assert_eq!(
            Layout::new(2, None, None, 18, None, None)
                .unwrap()
                .syncs_per_token(),
            38
        );
    }

    #[test]
    fn expert_parallel_stages() {
        let req = |nodes, tp, pp, ep, ep_weights: Option<Vec<f64>>| LayoutRequest {
            nodes,
            tp,
            pp,
            ep,
            n_layer: 6,
            ep_weights,
            ..LayoutRequest::default()
        };
        // --ep 2 alone: one stage of two expert groups.
        let l = Layout::plan(&req(2, None, None, Some(2), None)).unwrap();
        assert_eq!((l.tp, l.ep, l.pp), (1, 2, 1));
        assert_eq!(l.stage_ranks(), vec![vec![1, 2]]);
        assert_eq!(l.name(), "EP=2");
        // EP=2 x TP=2 x PP=2: eight nodes, stages of four.
        let l = Layout::plan(&req(8, Some(2), Some(2), Some(2), None)).unwrap();
        assert_eq!(l.stage_ranks(), vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8]]);
        assert_eq!(l.syncs_per_token(), 2 * 6 + 1 + 2);
        // Uneven weights give the group count when --ep is left out.
        let l = Layout::plan(&req(3, None, None, None, Some(vec![2.0, 1.0, 1.0]))).unwrap();
        assert_eq!((l.ep, l.ep_weights.len()), (3, 3));
        let e = Layout::plan(&req(3, Some(2), None, Some(2), None)).unwrap_err();
        assert!(e.contains("--tp 2 x --ep 2 x --pp"), "{e}");
        let e = Layout::plan(&req(2, None, None, Some(2), Some(vec![1.0]))).unwrap_err();
        assert!(e.contains("--ep-weights"), "{e}");
        // Spares ride along with expert groups, and are refused without them.
        let spared = |nodes, ep| LayoutRequest {
            ep_spares: 4,
            ..req(nodes, None, None, ep, None)
        };
        let l = Layout::plan(&spared(2, Some(2))).unwrap();
        assert_eq!((l.ep, l.ep_spares), (2, 4));
        assert_eq!(l.name(), "EP=2 +4 spare experts");
        let e = Layout::plan(&spared(2, None)).unwrap_err();
        assert!(e.contains("--ep-spares 4 needs expert parallelism"), "{e}");
    }
}
