//! Published multi-node results the simulator is checked against, and the check: each
//! engine's single-node figure calibrates the machine's efficiency for that engine and
//! model; the other node counts are predicted and set beside what was published.

use serde::Serialize;

use crate::calibrate::{calibrate, decode_workload};
use crate::sweep::{simulate, Kind, Scenario};
use crate::{engines, hardware, links, models};

/// One published series: decode tok/s of one stream at each node count.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Series {
    pub model: &'static str,
    pub hardware: &'static str,
    pub engine: &'static str,
    pub link: &'static str,
    pub layout: Kind,
    /// (nodes, tok/s); the first is one node, the calibration point.
    pub points: &'static [(usize, f64)],
    pub source: &'static str,
}

const EXO_CHARTS: &str = "exo-explore/exo docs/benchmarks/jeffgeerling (Jeff Geerling, \
                          Mac Studio M3 Ultra cluster, 2025-12)";

/// Decode tok/s on 1 / 2 / 4 Mac Studio M3 Ultra: llama.cpp splits layers over TCP, exo
/// runs tensor parallel over Thunderbolt 5 RDMA.
pub const PUBLISHED: &[Series] = &[
    Series {
        model: "qwen3-235b-a22b",
        hardware: "m3-ultra",
        engine: "llama.cpp",
        link: "tb5-tcp",
        layout: Kind::Pp,
        points: &[(1, 20.4), (2, 17.2), (4, 15.2)],
        source: EXO_CHARTS,
    },
    Series {
        model: "qwen3-235b-a22b",
        hardware: "m3-ultra",
        engine: "exo",
        link: "tb5-rdma",
        layout: Kind::Tp,
        points: &[(1, 19.5), (2, 26.2), (4, 31.9)],
        source: EXO_CHARTS,
    },
    Series {
        model: "deepseek-v3",
        hardware: "m3-ultra",
        engine: "llama.cpp",
        link: "tb5-tcp",
        layout: Kind::Pp,
        points: &[(1, 14.8), (2, 16.0), (4, 14.6)],
        source: EXO_CHARTS,
    },
    Series {
        model: "deepseek-v3",
        hardware: "m3-ultra",
        engine: "exo",
        link: "tb5-rdma",
        layout: Kind::Tp,
        points: &[(1, 21.1), (2, 27.8), (4, 32.5)],
        source: EXO_CHARTS,
    },
];

/// One node count of a series: published and predicted.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Checked {
    pub model: &'static str,
    pub engine: &'static str,
    pub link: &'static str,
    pub layout: Kind,
    pub nodes: usize,
    pub published_tok_s: f64,
    pub predicted_tok_s: f64,
    /// predicted / published - 1.
    pub error: f64,
    /// The calibration point (one node): equal by construction.
    pub calibration: bool,
    /// The decode efficiency the single-node figure gave.
    pub decode_efficiency: f64,
}

/// The scenario of a series, before calibration.
pub fn scenario(s: &Series) -> Result<Scenario, String> {
    let arch = models::named(s.model)?;
    let engine = engines::named(s.engine)?;
    Ok(Scenario {
        model: arch.profile(None, engine.kv_bytes),
        bits: arch.bits,
        hardware: hardware::named(s.hardware)?,
        link: links::named(s.link)?,
        engine,
        delay_us: 0.0,
        workload: decode_workload(4096),
        output: 128,
    })
}

/// Every published point beside its prediction.
pub fn check() -> Result<Vec<Checked>, String> {
    let mut out = Vec::new();
    for s in PUBLISHED {
        let (one, tok_s) = s.points[0];
        if one != 1 {
            return Err(format!(
                "{} on {}: the first point must be one node",
                s.model, s.engine
            ));
        }
        let sc = calibrate(&scenario(s)?, tok_s, None)?;
        let nodes: Vec<usize> = s.points.iter().map(|p| p.0).collect();
        let rows = simulate(&sc, &nodes, &[s.layout]);
        for (r, &(n, published)) in rows.iter().zip(s.points) {
            out.push(Checked {
                model: s.model,
                engine: s.engine,
                link: s.link,
                layout: s.layout,
                nodes: n,
                published_tok_s: published,
                predicted_tok_s: r.decode_tok_s,
                error: r.decode_tok_s / published - 1.0,
                calibration: n == 1,
                decode_efficiency: sc.hardware.decode_efficiency,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibration_reproduces_each_single_node_figure() {
        let rows = check().unwrap();
        assert_eq!(rows.len(), 12);
        for r in rows.iter().filter(|r| r.calibration) {
            assert!(r.error.abs() < 1e-6, "{r:?}");
            assert!(
                r.decode_efficiency > 0.05 && r.decode_efficiency <= 1.0,
                "{r:?}"
            );
        }
        for r in &rows {
            println!(
                "{:<16} {:<10} {} nodes: published {:5.1} predicted {:5.1} ({:+.0} %)",
                r.model,
                r.engine,
                r.nodes,
                r.published_tok_s,
                r.predicted_tok_s,
                r.error * 100.0
            );
        }
    }
}
