//! The planner's choices on described clusters.

use super::*;
use crate::cluster::NodeProfile;
use crate::model::LayerProfile;

const GB: u64 = 1_000_000_000;

/// A dense model of `layers` layers of `layer_mb` MB each (half attention, half FFN).
fn dense(layers: usize, layer_mb: u64) -> ModelProfile {
    let half = layer_mb * 500_000;
    ModelProfile {
        name: "dense".into(),
        n_embd: 4096,
        n_head: 32,
        n_head_kv: 8,
        layers: vec![
            LayerProfile {
                attn_bytes: half,
                ffn_bytes: half,
                ..LayerProfile::default()
            };
            layers
        ],
        embed_bytes: 500_000_000,
        head_bytes: 500_000_000,
        kv_bytes_per_token: 2 * 1024 * 4,
        experts: None,
    }
}

fn node(name: &str, mem_gb: u64, gb_s: f64) -> NodeProfile {
    NodeProfile {
        name: name.into(),
        memory_bytes: mem_gb * GB,
        decode_bytes_per_s: gb_s * 1e9,
        prefill_bytes_per_s: gb_s * 1e9 * 20.0,
        loaded_decode_bytes_per_s: 0.0,
        loaded_prefill_bytes_per_s: 0.0,
    }
}

fn small_workload() -> Workload {
    Workload {
        n_ctx: 2048,
        ..Workload::default()
    }
}

#[test]
fn two_fast_islands_get_tp_inside_and_pp_across() {
    // Nodes 0 and 2 share a Thunderbolt-class link (3 µs), 1 and 3 another; the islands
    // are joined by 1 ms. 2 GB each: the model needs all four. The best plan must keep
    // TP inside each island.
    let nodes = (0..4).map(|i| node(&format!("n{i}"), 2, 50.0)).collect();
    let mut c = ClusterProfile::uniform(nodes, 1000.0, 1e9);
    for (a, b) in [(0, 2), (1, 3)] {
        c.rtt_us[a][b] = 3.0;
        c.rtt_us[b][a] = 3.0;
        c.bytes_per_s[a][b] = 5e9;
        c.bytes_per_s[b][a] = 5e9;
    }
    for i in 0..4 {
        c.rtt_us[i][i] = 0.0;
    }
    // 4 GB of weights: at 1 ms a sync, 160 syncs a token cost more than TP=4 saves.
    let plans = plan(&dense(80, 50), &c, &small_workload()).unwrap();
    let best = &plans[0];
    assert_eq!(
        best.name,
        "TP=2 x PP=2",
        "{:#?}",
        plans
            .iter()
            .map(|p| (&p.name, p.prediction.decode_tok_s))
            .collect::<Vec<_>>()
    );
    let stage = |s: usize| {
        let mut v = best.layout.order[s * 2..s * 2 + 2].to_vec();
        v.sort_unstable();
        v
    };
    assert_eq!((stage(0), stage(1)), (vec![0, 2], vec![1, 3]));
    // TP=4 across the slow link is predicted slower than TP inside islands.
    let tp4 = plans.iter().find(|p| p.name == "TP=4").unwrap();
    // Two nodes alone cannot hold it, and say so.
    let two = plans
        .iter()
        .find(|p| p.name == "TP=2 (2 of 4 nodes)")
        .unwrap();
    assert!(
        two.unfit.as_deref().unwrap().contains("offers 2.0 GB"),
        "{two:?}"
    );
    assert!(tp4.prediction.decode_tok_s < best.prediction.decode_tok_s);
}

#[test]
fn a_slow_node_gets_fewer_layers_and_a_smaller_share() {
    let nodes = vec![node("fast", 64, 60.0), node("slow", 64, 20.0)];
    let c = ClusterProfile::uniform(nodes, 300.0, 1e9);
    let plans = plan(&dense(40, 200), &c, &small_workload()).unwrap();
    let pp = plans
        .iter()
        .find(|p| p.pp == 2 && p.unfit.is_none())
        .unwrap();
    let slow_stage = pp.layout.order.iter().position(|&n| n == 1).unwrap();
    let (slow, fast) = (
        pp.layout.layers[slow_stage],
        pp.layout.layers[1 - slow_stage],
    );
    assert!(slow * 2 < fast, "slow node got {slow} layers, fast {fast}");
    let weighted = plans
        .iter()
        .find(|p| p.layout.tp == 2 && p.name.contains(":"))
        .unwrap();
    let even = plans
        .iter()
        .find(|p| p.layout.tp == 2 && !p.name.contains(":"))
        .unwrap();
    // The fast node (first in order) carries the larger share, and that is predicted faster.
    assert!(weighted.layout.tp_weights[0] > weighted.layout.tp_weights[1]);
    assert!(weighted.prediction.decode_tok_s > even.prediction.decode_tok_s);
}

#[test]
fn a_model_too_big_for_one_node_is_planned_across_and_refused_when_it_fits_nowhere() {
    // 40 layers of 250 MB = 10 GB; each node offers 8 GB.
    let nodes = vec![node("a", 8, 50.0), node("b", 8, 50.0)];
    let c = ClusterProfile::uniform(nodes.clone(), 50.0, 1e9);
    let m = dense(40, 250);
    let plans = plan(&m, &c, &small_workload()).unwrap();
    assert!(plans[0].unfit.is_none(), "{:?}", plans[0]);
    for (need, &n) in plans[0].memory.iter().zip(&plans[0].layout.order) {
        assert!(*need <= c.nodes[n].memory_bytes);
    }
    let one = ClusterProfile::uniform(vec![nodes[0].clone()], 50.0, 1e9);
    let plans = plan(&m, &one, &small_workload()).unwrap();
    let why = plans[0].unfit.as_deref().unwrap();
    assert!(why.starts_with("node a needs 1"), "{why}");
    assert!(why.contains("offers 8.0 GB"), "{why}");
}

/// Eight layers of 64 experts (2 GB a layer), 8 routed per token.
fn moe_8_of_64() -> ModelProfile {
    let mut m = dense(8, 100);
    for l in &mut m.layers {
        l.ffn_bytes = 0;
        l.expert_bytes = 2 * GB;
    }
    m.experts = Some((64, 8));
    m
}

#[test]
fn moe_models_get_expert_parallel_candidates() {
    let m = moe_8_of_64();
    let nodes = vec![node("a", 12, 50.0), node("b", 12, 50.0)];
    let c = ClusterProfile::uniform(nodes, 5.0, 5e9);
    let plans = plan(&m, &c, &small_workload()).unwrap();
    let ep = plans.iter().find(|p| p.name == "EP=2").unwrap();
    assert!(ep.unfit.is_none(), "{ep:?}");
    // Experts are the bulk: with them split, each node holds about half.
    assert!(ep.memory.iter().all(|&b| b < 9 * GB), "{:?}", ep.memory);
    // A token reads 8 of 64 experts: active bytes, not total, decide decode speed.
    let one_node = 8.0 * (50e6 + 2e9 * 8.0 / 64.0) + 5e8;
    let single = ClusterProfile::uniform(vec![node("big", 64, 50.0)], 5.0, 5e9);
    let p = &plan(&m, &single, &small_workload()).unwrap()[0];
    let expect = 50e9 / one_node;
    assert!(
        (p.prediction.decode_tok_s / expect - 1.0).abs() < 0.05,
        "{p:?}"
    );
}

#[test]
fn spare_experts_are_ranked_when_they_fit() {
    let m = moe_8_of_64();
    let plan_with = |memory_gb: u64| {
        let nodes = vec![node("a", memory_gb, 50.0), node("b", memory_gb, 50.0)];
        plan(
            &m,
            &ClusterProfile::uniform(nodes, 5.0, 5e9),
            &small_workload(),
        )
        .unwrap()
    };
    // Room for a quarter more experts each: 8 spares a group, faster than plain EP=2 (the
    // busiest group waits less) and holding 8 of 64 more experts' bytes per node.
    let plans = plan_with(12);
    let plain = plans.iter().find(|p| p.name == "EP=2").unwrap();
    let spared = plans
        .iter()
        .find(|p| p.name == "EP=2 +8 spare experts")
        .unwrap();
    assert!(spared.unfit.is_none(), "{spared:?}");
    assert!(spared.prediction.decode_tok_s > plain.prediction.decode_tok_s * 1.03);
    assert!(spared.prediction.bubble_s < plain.prediction.bubble_s);
    let extra = spared.memory[0] - plain.memory[0];
    assert!(
        (extra as f64 / (8.0 * 2e9 * 8.0 / 64.0) - 1.0).abs() < 0.01,
        "{extra}"
    );
    // 9 GB a node: plain EP=2 fits (8 GB of experts each), the spares do not.
    let plans = plan_with(9);
    let spared = plans
        .iter()
        .find(|p| p.name == "EP=2 +8 spare experts")
        .unwrap();
    assert!(spared.unfit.is_some(), "{spared:?}");
    let plain = plans.iter().find(|p| p.name == "EP=2").unwrap();
    assert!(plain.unfit.is_none(), "{plain:?}");
}

#[test]
fn many_nodes_are_planned() {
    // 256 described nodes in 16 islands of 16: runs through every factorisation.
    let nodes: Vec<_> = (0..256)
        .map(|i| {
            node(
                &format!("n{i}"),
                32 + (i % 3) as u64 * 16,
                40.0 + (i % 5) as f64,
            )
        })
        .collect();
    let mut c = ClusterProfile::uniform(nodes, 500.0, 1e9);
    for a in 0..256 {
        for b in 0..256 {
            if a / 16 == b / 16 {
                c.rtt_us[a][b] = if a == b { 0.0 } else { 4.0 };
            }
        }
    }
    let plans = plan(&dense(126, 800), &c, &small_workload()).unwrap();
    assert!(plans.len() > 5);
    assert!(plans[0].unfit.is_none());
    // Stages of the best plan never span two islands.
    let w = plans[0].layout.width();
    for stage in plans[0].layout.order.chunks(w) {
        assert!(stage.iter().all(|&n| n / 16 == stage[0] / 16), "{stage:?}");
    }
}

#[test]
fn bad_cluster_descriptions_name_the_field() {
    let mut c = ClusterProfile::uniform(vec![node("a", 8, 1.0)], 1.0, 1.0);
    c.rtt_us = vec![vec![1.0, 2.0]];
    let e = plan(&dense(2, 1), &c, &small_workload()).unwrap_err();
    assert!(e.starts_with("rtt_us"), "{e}");
    let mut c = ClusterProfile::uniform(vec![node("a", 8, 1.0)], 1.0, 1.0);
    c.nodes[0].decode_bytes_per_s = 0.0;
    let e = plan(&dense(2, 1), &c, &small_workload()).unwrap_err();
    assert!(e.contains("nodes[0] (a)"), "{e}");
}
