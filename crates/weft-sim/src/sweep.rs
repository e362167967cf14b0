//! One simulation: a model, a machine, a link and an engine, over node counts and layouts.
//! Each node count gets a cluster of identical machines joined alike, and each layout
//! kind its layouts of exactly that many nodes (the fastest that fits where a kind has
//! several), predicted by weft-plan's cost model: the one `weft plan` places real runs by.

use serde::Serialize;
use weft_plan::{even_layout, Candidate, ClusterProfile, ModelProfile, Workload};

use crate::engines::Engine;
use crate::hardware::Hardware;
use crate::links::Link;

/// Which layouts a row stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Pipeline stages only.
    Pp,
    /// Tensor parallel only.
    Tp,
    /// Expert parallel only (attention tensor-parallel over the same nodes).
    Ep,
    /// The fastest mix of at least two of TP, EP and PP.
    Hybrid,
    /// The fastest layout of any kind.
    Best,
}

impl Kind {
    pub const ALL: [Kind; 5] = [Kind::Pp, Kind::Tp, Kind::Ep, Kind::Hybrid, Kind::Best];

    pub fn parse(s: &str) -> Result<Kind, String> {
        match s.to_ascii_lowercase().as_str() {
            "pp" => Ok(Kind::Pp),
            "tp" => Ok(Kind::Tp),
            "ep" => Ok(Kind::Ep),
            "hybrid" => Ok(Kind::Hybrid),
            "best" => Ok(Kind::Best),
            _ => Err(format!(
                "unknown layout {s:?}: give tp, pp, ep, hybrid or best"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Pp => "pp",
            Kind::Tp => "tp",
            Kind::Ep => "ep",
            Kind::Hybrid => "hybrid",
            Kind::Best => "best",
        }
    }

    /// Whether a (tp, ep, pp) factorisation is of this kind.
    fn admits(self, (tp, ep, pp): (usize, usize, usize)) -> bool {
        let split = [tp, ep, pp].iter().filter(|&&k| k > 1).count();
        match self {
            Kind::Pp => tp == 1 && ep == 1,
            Kind::Tp => ep == 1 && pp == 1,
            Kind::Ep => tp == 1 && pp == 1,
            Kind::Hybrid => split >= 2,
            Kind::Best => true,
        }
    }
}

/// What is simulated.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub model: ModelProfile,
    /// Mean bits per weight of the model (prefill's operations per byte).
    pub bits: f64,
    pub hardware: Hardware,
    pub link: Link,
    pub engine: Engine,
    /// Injected one-way delay on every link, µs (as weft's transport injects it).
    pub delay_us: f64,
    pub workload: Workload,
    /// Tokens each request generates.
    pub output: usize,
}

/// One node count and layout kind.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    pub nodes: usize,
    pub layout: Kind,
    /// The layout chosen: "TP=4", "EP=8 x PP=2"; "-" where the kind has none here.
    pub name: String,
    pub tp: usize,
    pub ep: usize,
    pub pp: usize,
    pub hardware: String,
    pub link: String,
    pub engine: String,
    pub delay_us: f64,
    pub decode_tok_s: f64,
    /// Aggregate tok/s of the workload's `parallel` streams.
    pub batch_tok_s: f64,
    pub prefill_tok_s: f64,
    pub ttft_ms: f64,
    /// One request of the workload's prompt and output, first token to last, ms.
    pub request_ms: f64,
    pub fits: bool,
    pub unfit: Option<String>,
    /// The most any node needs, bytes.
    pub memory_per_node: u64,
    /// One decoded token, ms: computing, waiting on links, waiting for the slowest rank.
    pub compute_ms: f64,
    pub network_ms: f64,
    pub bubble_ms: f64,
    /// Share of node-time idle while one stream decodes (a pipeline's stages take turns).
    pub idle_share: f64,
}

/// The cluster of `n` machines of `s`.
pub fn cluster(s: &Scenario, n: usize) -> ClusterProfile {
    let nodes = (0..n).map(|i| s.hardware.node(s.bits, i)).collect();
    let rtt = 2.0 * (s.link.latency_us + s.delay_us);
    let mut c = ClusterProfile::uniform(nodes, rtt, s.link.bytes_per_s);
    c.engine = weft_plan::EngineCosts {
        per_message_us: s.link.per_message_us,
        ..s.engine.costs
    };
    if !s.engine.coordinator_apart {
        c.coordinator_rtt_us[0] = 0.0;
    }
    c
}

/// Every (tp, ep, pp) with tp × ep × pp = n.
fn factorisations(n: usize) -> Vec<(usize, usize, usize)> {
    let divisors = |k: usize| (1..=k).filter(move |d| k.is_multiple_of(*d));
    let mut out = Vec::new();
    for pp in divisors(n) {
        for ep in divisors(n / pp) {
            out.push((n / pp / ep, ep, pp));
        }
    }
    out
}

/// Rows for every node count in `nodes` and kind in `kinds`.
pub fn simulate(s: &Scenario, nodes: &[usize], kinds: &[Kind]) -> Vec<Row> {
    let mut rows = Vec::new();
    for &n in nodes {
        let c = cluster(s, n);
        let order: Vec<usize> = (0..n).collect();
        // Each factorisation once, shared by the kinds that admit it.
        let candidates: Vec<((usize, usize, usize), Candidate)> = factorisations(n)
            .into_iter()
            .filter_map(|f| even_layout(&s.model, &c, &s.workload, &order, f).map(|c| (f, c)))
            .collect();
        for &kind in kinds {
            let best = candidates
                .iter()
                .filter(|(f, _)| kind.admits(*f) && (n == 1 || *f != (1, 1, 1)))
                .min_by(|(_, a), (_, b)| {
                    (a.unfit.is_some()).cmp(&b.unfit.is_some()).then(
                        b.prediction
                            .decode_tok_s
                            .total_cmp(&a.prediction.decode_tok_s),
                    )
                });
            rows.push(row(s, n, kind, best.map(|(_, c)| c)));
        }
    }
    rows
}

fn row(s: &Scenario, n: usize, kind: Kind, c: Option<&Candidate>) -> Row {
    let mut r = Row {
        nodes: n,
        layout: kind,
        name: "-".into(),
        tp: 0,
        ep: 0,
        pp: 0,
        hardware: s.hardware.name.clone(),
        link: s.link.name.clone(),
        engine: s.engine.name.into(),
        delay_us: s.delay_us,
        decode_tok_s: 0.0,
        batch_tok_s: 0.0,
        prefill_tok_s: 0.0,
        ttft_ms: 0.0,
        request_ms: 0.0,
        fits: false,
        unfit: Some(format!(
            "no {} layout of {n} nodes: the model has {} layers, {} heads{}",
            kind.name(),
            s.model.layers.len(),
            s.model.n_head,
            s.model
                .experts
                .map_or(String::new(), |(e, _)| format!(", {e} experts"))
        )),
        memory_per_node: 0,
        compute_ms: 0.0,
        network_ms: 0.0,
        bubble_ms: 0.0,
        idle_share: 0.0,
    };
    let Some(c) = c else {
        return r;
    };
    let p = &c.prediction;
    let busy = p.compute_s + p.bubble_s;
    r.name = c.name.clone();
    r.tp = c.layout.tp;
    r.ep = c.layout.ep;
    r.pp = c.pp;
    r.decode_tok_s = p.decode_tok_s;
    r.batch_tok_s = p.batch_tok_s;
    r.prefill_tok_s = p.prefill_tok_s;
    r.ttft_ms = p.ttft_s * 1e3;
    r.request_ms = r.ttft_ms + s.output.saturating_sub(1) as f64 / p.decode_tok_s * 1e3;
    r.fits = c.unfit.is_none();
    r.unfit = c.unfit.clone();
    r.memory_per_node = c.memory.iter().copied().max().unwrap_or(0);
    r.compute_ms = p.compute_s * 1e3;
    r.network_ms = p.network_s * 1e3;
    r.bubble_ms = p.bubble_s * 1e3;
    // Of the token's time, each stage computes during its own share only.
    let token = 1.0 / p.decode_tok_s.max(1e-12);
    r.idle_share = 1.0 - busy / (c.pp as f64 * token).max(1e-12);
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{engines, hardware, links, models};

    fn scenario(model: &str, hw: &str, link: Link, engine: &str) -> Scenario {
        let engine = engines::named(engine).unwrap();
        let arch = models::named(model).unwrap();
        Scenario {
            model: arch.profile(None, engine.kv_bytes),
            bits: arch.bits,
            hardware: hardware::named(hw).unwrap(),
            link,
            engine,
            delay_us: 0.0,
            workload: Workload {
                n_ctx: 4096,
                ..Workload::default()
            },
            output: 128,
        }
    }

    /// A link of latency only: the seed's arithmetic counts nothing else.
    fn latency_only(us: f64) -> Link {
        Link {
            name: format!("{us} µs"),
            latency_us: us,
            bytes_per_s: 1e15,
            per_message_us: 0.0,
        }
    }

    #[test]
    fn the_seed_arithmetic_comes_out_of_the_model() {
        // 80 layers x 2 syncs x 300 µs = 48 ms a token; x 3 µs = 0.48 ms (and the
        // coordinator's token in and out, one latency each).
        for (us, want_ms) in [(300.0, 48.0 + 0.6), (3.0, 0.48 + 0.006)] {
            let s = scenario("llama-3.3-70b", "m3-ultra", latency_only(us), "weft");
            let r = &simulate(&s, &[2], &[Kind::Tp])[0];
            assert_eq!(r.name, "TP=2");
            assert!(
                (r.network_ms / want_ms - 1.0).abs() < 1e-4,
                "{us} µs: {} ms",
                r.network_ms
            );
            // The parts add up to the token.
            let token = r.compute_ms + r.network_ms + r.bubble_ms;
            assert!((token * r.decode_tok_s / 1e3 - 1.0).abs() < 1e-9);
        }
    }

    #[test]
    fn tensor_parallel_needs_fast_links_and_pipelines_give_capacity_not_speed() {
        let at = |link: &str, kind: Kind| {
            let s = scenario(
                "llama-3.3-70b",
                "m3-ultra",
                links::named(link).unwrap(),
                "exo",
            );
            simulate(&s, &[4], &[kind])[0].decode_tok_s
        };
        let (pp_tcp, tp_tcp) = (at("tb5-tcp", Kind::Pp), at("tb5-tcp", Kind::Tp));
        let (pp_rdma, tp_rdma) = (at("tb5-rdma", Kind::Pp), at("tb5-rdma", Kind::Tp));
        let one = {
            let s = scenario(
                "llama-3.3-70b",
                "m3-ultra",
                links::named("tb5-tcp").unwrap(),
                "exo",
            );
            simulate(&s, &[1], &[Kind::Best])[0].decode_tok_s
        };
        // Four pipeline stages are no faster than one node.
        assert!(
            pp_tcp <= one && pp_rdma <= one * 1.001,
            "{one} {pp_tcp} {pp_rdma}"
        );
        // Over TCP, TP gains little (its syncs take longer than its compute); over RDMA
        // it is more than twice as fast as the pipeline.
        assert!(tp_tcp < 1.2 * pp_tcp, "{tp_tcp} against {pp_tcp}");
        assert!(tp_rdma > 2.0 * pp_rdma, "{tp_rdma} against {pp_rdma}");
    }

    #[test]
    fn every_kind_answers_at_1024_nodes_and_says_why_it_cannot() {
        let s = scenario(
            "deepseek-v3",
            "m4-max",
            links::named("100gbe-rdma").unwrap(),
            "weft",
        );
        let nodes: Vec<usize> = (0..=10).map(|i| 1 << i).collect();
        let rows = simulate(&s, &nodes, &Kind::ALL);
        assert_eq!(rows.len(), nodes.len() * Kind::ALL.len());
        let at = |n: usize, k: Kind| rows.iter().find(|r| r.nodes == n && r.layout == k).unwrap();
        // 671 B at 4.85 bits needs four 128 GB machines at least.
        assert!(!at(2, Kind::Best).fits);
        assert!(at(8, Kind::Best).fits, "{:?}", at(8, Kind::Best));
        // 61 layers: no pipeline of 64 stages; 128 heads: no TP of 256.
        assert!(at(64, Kind::Pp)
            .unfit
            .as_deref()
            .unwrap()
            .contains("61 layers"));
        assert_eq!(at(256, Kind::Tp).name, "-");
        // EP of 128 nodes: every node holds two experts of each layer.
        assert_eq!(at(128, Kind::Ep).name, "EP=128");
        let best = at(1024, Kind::Best);
        assert!(best.fits && best.tp * best.ep * best.pp == 1024, "{best:?}");
        // The best layout is at least as fast as every kind.
        for k in Kind::ALL {
            let r = at(1024, k);
            assert!(
                !r.fits || r.decode_tok_s <= best.decode_tok_s + 1e-9,
                "{r:?}"
            );
        }
    }

    #[test]
    fn expert_parallelism_reads_only_the_active_share() {
        let s = scenario(
            "qwen3-235b-a22b",
            "m3-ultra",
            links::named("tb5-rdma").unwrap(),
            "weft",
        );
        let rows = simulate(&s, &[1, 4], &[Kind::Ep, Kind::Tp]);
        let one = rows[0].decode_tok_s;
        let ep4 = rows
            .iter()
            .find(|r| r.nodes == 4 && r.layout == Kind::Ep)
            .unwrap();
        // Four groups: each reads about a quarter of the routed bytes, but waits for the
        // busiest group, which the bubble column shows.
        assert!(
            ep4.decode_tok_s > 2.0 * one,
            "{} against {one}",
            ep4.decode_tok_s
        );
        assert!(ep4.bubble_ms > 0.0, "{ep4:?}");
    }
}
