//! What the planner knows of the machines: each node's memory and measured speeds, and the
//! links between them (round-trip time and bandwidth), as measured by the nodes or written
//! by hand in a cluster file for hardware one does not own yet.

use serde::{Deserialize, Serialize};

use crate::engine::EngineCosts;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeProfile {
    pub name: String,
    /// Bytes this node offers for weights and KV caches (after `--memory-limit`).
    #[serde(deserialize_with = "whole_bytes")]
    pub memory_bytes: u64,
    /// Weight bytes per second its decode kernels stream (quantized matvec, all its cores).
    pub decode_bytes_per_s: f64,
    /// Weight bytes × tokens per second of its prefill kernels (quantized matmul).
    pub prefill_bytes_per_s: f64,
    /// Decode speed while the other nodes compute too (0: as alone). Nodes that share a
    /// machine share its memory bandwidth: a tensor-parallel group's members compute at
    /// once and get this; pipeline stages take turns and get the speed alone.
    #[serde(default)]
    pub loaded_decode_bytes_per_s: f64,
    /// Prefill speed while the other nodes compute too (0: as alone); nodes sharing a
    /// machine share its cores' execution units as well (two vCPUs may be one core's
    /// hyperthreads).
    #[serde(default)]
    pub loaded_prefill_bytes_per_s: f64,
}

impl NodeProfile {
    /// Decode speed when `together` nodes compute at the same time.
    pub fn decode_rate(&self, together: usize) -> f64 {
        if together > 1 && self.loaded_decode_bytes_per_s > 0.0 {
            self.loaded_decode_bytes_per_s
        } else {
            self.decode_bytes_per_s
        }
    }

    /// Prefill speed when `together` nodes compute at the same time.
    pub fn prefill_rate(&self, together: usize) -> f64 {
        if together > 1 && self.loaded_prefill_bytes_per_s > 0.0 {
            self.loaded_prefill_bytes_per_s
        } else {
            self.prefill_bytes_per_s
        }
    }
}

/// A byte count written as any JSON number (`8e9` or `8000000000`).
fn whole_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let v = f64::deserialize(d)?;
    if v.is_finite() && v >= 0.0 && v < u64::MAX as f64 {
        Ok(v as u64)
    } else {
        Err(serde::de::Error::custom(format!(
            "memory_bytes {v} is not a byte count"
        )))
    }
}

/// Nodes and the links between them. `rtt_us[i][j]` and `bytes_per_s[i][j]` describe the
/// link from node i to node j; `coordinator_rtt_us[i]` the coordinator's link to node i.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterProfile {
    pub nodes: Vec<NodeProfile>,
    pub rtt_us: Vec<Vec<f64>>,
    pub bytes_per_s: Vec<Vec<f64>>,
    pub coordinator_rtt_us: Vec<f64>,
    /// What the engine's protocol adds to the links (weft's: nothing).
    #[serde(default)]
    pub engine: EngineCosts,
}

/// A link figure in a cluster file: one number for every pair, or a full matrix.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum PerPair {
    All(f64),
    Matrix(Vec<Vec<f64>>),
}

/// A cluster file: the nodes, and the links as numbers or matrices.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    nodes: Vec<NodeProfile>,
    rtt_us: PerPair,
    bytes_per_s: PerPair,
    #[serde(default)]
    coordinator_rtt_us: Option<Vec<f64>>,
    #[serde(default)]
    engine: EngineCosts,
}

impl ClusterProfile {
    /// Reads a cluster description: `{"nodes": [{"name", "memory_bytes",
    /// "decode_bytes_per_s", "prefill_bytes_per_s"}, ..], "rtt_us": 300 or [[..]],
    /// "bytes_per_s": 1.25e9 or [[..]], "coordinator_rtt_us": [..] (default: node 0's
    /// row)}`. Errors name the field.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let f: ClusterFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let n = f.nodes.len();
        let matrix = |p: PerPair| match p {
            PerPair::All(v) => (0..n)
                .map(|i| (0..n).map(|j| if i == j { 0.0 } else { v }).collect())
                .collect(),
            PerPair::Matrix(m) => m,
        };
        let rtt_us = matrix(f.rtt_us);
        let coordinator_rtt_us = match f.coordinator_rtt_us {
            Some(v) => v,
            None => rtt_us.first().cloned().unwrap_or_default(),
        };
        let c = ClusterProfile {
            nodes: f.nodes,
            rtt_us,
            bytes_per_s: matrix(f.bytes_per_s),
            coordinator_rtt_us,
            engine: f.engine,
        };
        c.validate()?;
        Ok(c)
    }

    /// Every pair linked alike: `rtt_us` round trip and `bytes_per_s` bandwidth.
    pub fn uniform(nodes: Vec<NodeProfile>, rtt_us: f64, bytes_per_s: f64) -> Self {
        let n = nodes.len();
        ClusterProfile {
            nodes,
            rtt_us: vec![vec![rtt_us; n]; n],
            bytes_per_s: vec![vec![bytes_per_s; n]; n],
            coordinator_rtt_us: vec![rtt_us; n],
            engine: EngineCosts::default(),
        }
    }

    /// Checks the matrices' shapes and values; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        let n = self.nodes.len();
        if n == 0 {
            return Err("nodes: the cluster has no nodes".into());
        }
        for (what, m) in [("rtt_us", &self.rtt_us), ("bytes_per_s", &self.bytes_per_s)] {
            if m.len() != n || m.iter().any(|row| row.len() != n) {
                return Err(format!("{what}: expected a {n} x {n} matrix"));
            }
            if m.iter().flatten().any(|v| !v.is_finite() || *v < 0.0) {
                return Err(format!("{what}: values must be finite and >= 0"));
            }
        }
        let e = &self.engine;
        let figures = [
            ("per_message_us", e.per_message_us),
            ("sync_overhead_us", e.sync_overhead_us),
            ("remote_layer_us", e.remote_layer_us),
            ("layer_overhead_us", e.layer_overhead_us),
            ("wire_bytes", e.wire_bytes),
            ("segment_bytes", e.segment_bytes),
            ("ring_from_bytes", e.ring_from_bytes),
        ];
        if let Some((what, v)) = figures.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
            return Err(format!("engine.{what}: {v} must be finite and >= 0"));
        }
        if let crate::engine::Handoff::Star { round_trips } = e.handoff {
            if !(round_trips.is_finite() && round_trips >= 0.0) {
                return Err(format!(
                    "engine.handoff.round_trips: {round_trips} must be finite and >= 0"
                ));
            }
        }
        if self.coordinator_rtt_us.len() != n {
            return Err(format!("coordinator_rtt_us: expected {n} values"));
        }
        for (i, node) in self.nodes.iter().enumerate() {
            if !(node.decode_bytes_per_s > 0.0 && node.prefill_bytes_per_s > 0.0) {
                return Err(format!(
                    "nodes[{i}] ({}): decode_bytes_per_s and prefill_bytes_per_s must be > 0",
                    node.name
                ));
            }
        }
        Ok(())
    }

    /// Islands of nodes joined by fast links: i and j share one when their round trip is
    /// within `factor` of the fastest link either has (transitively). TP groups stay inside
    /// islands; pipeline hand-offs cross between them.
    pub fn islands(&self, factor: f64) -> Vec<Vec<usize>> {
        let n = self.nodes.len();
        let best: Vec<f64> = (0..n)
            .map(|i| {
                (0..n)
                    .filter(|&j| j != i)
                    .map(|j| self.rtt_us[i][j])
                    .fold(f64::INFINITY, f64::min)
            })
            .collect();
        let mut island = vec![usize::MAX; n];
        let mut out: Vec<Vec<usize>> = Vec::new();
        for start in 0..n {
            if island[start] != usize::MAX {
                continue;
            }
            let id = out.len();
            let mut members = vec![start];
            island[start] = id;
            let mut at = 0;
            while at < members.len() {
                let i = members[at];
                for j in 0..n {
                    let near = self.rtt_us[i][j] <= factor * best[i].min(best[j]).max(1.0);
                    if island[j] == usize::MAX && near {
                        island[j] = id;
                        members.push(j);
                    }
                }
                at += 1;
            }
            members.sort_unstable();
            out.push(members);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_files_take_numbers_or_matrices() {
        let c = ClusterProfile::from_json(
            r#"{"nodes": [
                {"name": "a", "memory_bytes": 8e9, "decode_bytes_per_s": 2e10, "prefill_bytes_per_s": 4e11},
                {"name": "b", "memory_bytes": 16e9, "decode_bytes_per_s": 1e10, "prefill_bytes_per_s": 2e11}],
                "rtt_us": 300, "bytes_per_s": [[0, 1e9], [1e9, 0]]}"#,
        );
        let c = c.unwrap();
        assert_eq!(c.nodes[1].memory_bytes, 16_000_000_000);
        assert_eq!(c.rtt_us, vec![vec![0.0, 300.0], vec![300.0, 0.0]]);
        assert_eq!(c.coordinator_rtt_us, vec![0.0, 300.0]);
        let e = ClusterProfile::from_json(r#"{"nodes": [], "rtt_us": 1, "bytes_per_s": 1}"#)
            .unwrap_err();
        assert!(e.starts_with("nodes:"), "{e}");
        let e = ClusterProfile::from_json(
            r#"{"nodes": [{"name": "a", "memory_bytes": 1, "decode_bytes_per_s": 1, "prefill_bytes_per_s": 1}], "rtt_us": [[0, 1]], "bytes_per_s": 1}"#,
        )
        .unwrap_err();
        assert!(e.starts_with("rtt_us"), "{e}");
        let e = ClusterProfile::from_json(
            r#"{"nodes": [{"name": "a", "memory_bytes": -1, "decode_bytes_per_s": 1, "prefill_bytes_per_s": 1}], "rtt_us": 1, "bytes_per_s": 1}"#,
        )
        .unwrap_err();
        assert!(e.contains("memory_bytes -1"), "{e}");
        // An engine's costs come in the file too, and are checked.
        let node = r#"{"name": "a", "memory_bytes": 1, "decode_bytes_per_s": 1, "prefill_bytes_per_s": 1}"#;
        let ok = format!(
            r#"{{"nodes": [{node}], "rtt_us": 1, "bytes_per_s": 1, "engine": {{"sync_overhead_us": 40, "handoff": {{"star": {{"round_trips": 3}}}}}}}}"#
        );
        let c = ClusterProfile::from_json(&ok).unwrap();
        assert_eq!(c.engine.sync_overhead_us, 40.0);
        assert_eq!(c.engine.segment_bytes, 65536.0, "unnamed costs stay weft's");
        let bad = format!(
            r#"{{"nodes": [{node}], "rtt_us": 1, "bytes_per_s": 1, "engine": {{"per_message_us": -3}}}}"#
        );
        let e = ClusterProfile::from_json(&bad).unwrap_err();
        assert!(e.starts_with("engine.per_message_us"), "{e}");
    }

    #[test]
    fn islands_join_fast_links_transitively() {
        let node = |n: &str| NodeProfile {
            name: n.into(),
            memory_bytes: 1,
            decode_bytes_per_s: 1.0,
            prefill_bytes_per_s: 1.0,
            loaded_decode_bytes_per_s: 0.0,
            loaded_prefill_bytes_per_s: 0.0,
        };
        let mut c = ClusterProfile::uniform(
            vec![node("a"), node("b"), node("c"), node("d")],
            1000.0,
            1.0,
        );
        for (a, b) in [(0, 1), (1, 2)] {
            c.rtt_us[a][b] = 5.0;
            c.rtt_us[b][a] = 5.0;
        }
        assert_eq!(c.islands(4.0), vec![vec![0, 1, 2], vec![3]]);
    }
}
