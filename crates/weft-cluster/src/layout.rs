//! Layouts: how N nodes split a model into pipeline stages (contiguous layer ranges) that
//! are each a tensor-parallel group, with uneven layer counts and TP weights allowed.

use std::ops::Range;

/// Stages of tensor-parallel groups; node i (0-based) is stage i / tp, TP rank i % tp.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub tp: usize,
    pub pp: usize,
    /// Layer range of each stage.
    pub layers: Vec<Range<usize>>,
    /// Relative share of heads and FFN columns of each TP rank (same for every stage).
    pub tp_weights: Vec<f64>,
}

impl Layout {
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
        if nodes == 0 {
            return Err("a cluster needs at least one node".into());
        }
        let (tp, pp) = match (tp, pp) {
            (Some(t), Some(p)) => (t, p),
            (Some(t), None) => (t, nodes / t.max(1)),
            (None, Some(p)) => (nodes / p.max(1), p),
            (None, None) => (nodes, 1),
        };
        if tp == 0 || pp == 0 || tp * pp != nodes {
            return Err(format!(
                "--tp {tp} x --pp {pp} must equal the {nodes} nodes"
            ));
        }
        if pp > n_layer {
            return Err(format!(
                "{pp} pipeline stages for a model of {n_layer} layers"
            ));
        }
        let counts: Vec<usize> = match layer_counts {
            Some(c) => {
                if c.len() != pp || c.iter().sum::<usize>() != n_layer || c.contains(&0) {
                    return Err(format!(
                        "--layers {c:?} must give {pp} positive counts summing to {n_layer}"
                    ));
                }
                c.to_vec()
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
        let tp_weights = match tp_weights {
            Some(w) if w.len() == tp && w.iter().all(|&x| x > 0.0) => w.to_vec(),
            Some(w) => {
                return Err(format!(
                    "--tp-weights {w:?} must give {tp} positive weights"
                ))
            }
            None => vec![1.0; tp],
        };
        Ok(Layout {
            tp,
            pp,
            layers,
            tp_weights,
        })
    }

    pub fn nodes(&self) -> usize {
        self.tp * self.pp
    }

    /// Data-plane ranks of each stage's members (node i is rank i + 1).
    pub fn stage_ranks(&self) -> Vec<Vec<usize>> {
        (0..self.pp)
            .map(|s| (0..self.tp).map(|t| 1 + s * self.tp + t).collect())
            .collect()
    }

    /// All-reduces, pipeline hand-offs and coordinator messages of one decode step.
    pub fn syncs_per_token(&self) -> usize {
        let layers: usize = self.layers.iter().map(|r| r.len()).sum();
        let allreduce = if self.tp > 1 { 2 * layers } else { 0 };
        allreduce + (self.pp - 1) + 2
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
        assert!(Layout::new(2, None, Some(2), 18, Some(&[10, 9]), None).is_err());
        assert_eq!(
            Layout::new(2, None, None, 18, None, None)
                .unwrap()
                .syncs_per_token(),
            38
        );
    }
}
