//! The planner as users meet it: `weft plan` on a described cluster (ranked layouts, the
//! reasons a layout does not fit, bad files named), on live local nodes it surveys (a
//! slowed node gets the smaller share), and `weft run` without layout flags running the
//! planner's best layout under per-node memory caps, or refusing with the reason.

mod common;

use serde_json::Value;
use weft_gguf::GgmlType;
use weft_model::synthetic::{synthetic_model, SyntheticMoe, SyntheticSpec};
use weft_model::Arch;

use common::{greedy, ok_json, weft, SYNTHETIC_TOL};

/// A MoE model of about 109 MB, most of it experts.
fn moe_model(dir: &std::path::Path) -> String {
    let mut spec = SyntheticSpec::small(Arch::Qwen3Moe, GgmlType::Q8_0);
    spec.n_layer = 4;
    spec.seed = 3;
    spec.head_scale = 8.0;
    spec.moe = Some(SyntheticMoe::routed(64, 4, 512));
    let p = dir.join("moe.gguf");
    synthetic_model(&spec).write_file(&p).unwrap();
    p.to_str().unwrap().to_string()
}

fn cluster_file(dir: &std::path::Path, text: &str) -> String {
    let p = dir.join("cluster.json");
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn a_described_cluster_is_planned_and_ranked() {
    let dir = tempfile::tempdir().unwrap();
    let m = moe_model(dir.path());
    // Two fast machines with little memory, one slow one with a lot, 300 µs apart.
    let c = cluster_file(
        dir.path(),
        r#"{"nodes": [
            {"name": "fast-a", "memory_bytes": 80e6, "decode_bytes_per_s": 4e10, "prefill_bytes_per_s": 8e11},
            {"name": "fast-b", "memory_bytes": 80e6, "decode_bytes_per_s": 4e10, "prefill_bytes_per_s": 8e11},
            {"name": "big-slow", "memory_bytes": 1e9, "decode_bytes_per_s": 5e9, "prefill_bytes_per_s": 1e11}],
            "rtt_us": 300, "bytes_per_s": 1.2e9}"#,
    );
    let v = ok_json(&weft(&[
        "plan",
        "--model",
        &m,
        "--cluster",
        &c,
        "--ctx",
        "256",
        "--json",
        "--top",
        "50",
    ]));
    let plans = v["plans"].as_array().unwrap();
    assert!(plans.len() >= 4, "{v}");
    let best = &plans[0];
    assert_eq!(best["fits"], true, "{best}");
    // The fast pair alone cannot hold the model; so it is not ranked first as fitting.
    for p in plans {
        let nodes: usize = p["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_array().unwrap().len())
            .sum();
        let fast_only = p["stages"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s.as_array().unwrap())
            .all(|n| n.as_str().unwrap().starts_with("fast"));
        if fast_only && nodes == 1 {
            assert_eq!(p["fits"], false, "{p}");
            let why = p["unfit"].as_str().unwrap();
            assert!(
                why.contains("needs") && why.contains("offers 80.0 MB"),
                "{why}"
            );
        }
    }
    // Predictions are ordered among the fitting layouts.
    let speeds: Vec<f64> = plans
        .iter()
        .filter(|p| p["fits"] == true)
        .map(|p| p["prediction"]["decode_tok_s"].as_f64().unwrap())
        .collect();
    assert!(speeds.windows(2).all(|w| w[0] >= w[1]), "{speeds:?}");
    // The text table says the same.
    let out = weft(&["plan", "--model", &m, "--cluster", &c, "--ctx", "256"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("rank layout") && text.contains("does not fit: node"),
        "{text}"
    );
}

#[test]
fn bad_cluster_files_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let m = moe_model(dir.path());
    for (text, field) in [
        (r#"{"nodes": []"#, "EOF"),
        (r#"{"nodes": [], "rtt_us": 1, "bytes_per_s": 1}"#, "nodes:"),
        (
            r#"{"nodes": [{"name": "a", "memory_bytes": 1e9, "decode_bytes_per_s": 1e9, "prefill_bytes_per_s": 1e9}], "rtt_us": [[0, 1]], "bytes_per_s": 1}"#,
            "rtt_us",
        ),
        (
            r#"{"nodes": [{"name": "a", "memory_bytes": 1e9, "decode_bytes_per_s": 0, "prefill_bytes_per_s": 1e9}], "rtt_us": 1, "bytes_per_s": 1}"#,
            "nodes[0] (a)",
        ),
    ] {
        let c = cluster_file(dir.path(), text);
        let out = weft(&["plan", "--model", &m, "--cluster", &c]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("cluster.json") && err.contains(field),
            "{field}: {err}"
        );
    }
}

#[test]
fn live_nodes_are_surveyed_and_a_slowed_node_gets_less() {
    let dir = tempfile::tempdir().unwrap();
    let m = moe_model(dir.path());
    let home = dir.path().join("home");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
        .args([
            "plan",
            "--model",
            &m,
            "--nodes",
            "2",
            "--node-slowdown",
            "1,3",
        ])
        .args(["--ctx", "256", "--json", "--top", "50"])
        .env("WEFT_HOME", &home)
        .output()
        .unwrap();
    let v: Value = ok_json(&out);
    let plans = v["plans"].as_array().unwrap();
    // A TP=2 layout weighted by measured speed gives the unslowed node the larger share.
    let weighted = plans
        .iter()
        .find(|p| {
            p["tp"] == 2 && {
                let w = p["tp_weights"].as_array().unwrap();
                w[0].as_f64().unwrap() > 1.2 * w[1].as_f64().unwrap()
            }
        })
        .unwrap_or_else(|| panic!("no speed-weighted TP=2 layout: {v}"));
    assert_eq!(weighted["fits"], true);
    // The node's kernel speeds were measured once and cached under its home.
    assert!(home.join("calibration").read_dir().unwrap().count() >= 1);
}

#[test]
fn run_without_layout_flags_plans_under_memory_caps() {
    let dir = tempfile::tempdir().unwrap();
    let m = moe_model(dir.path());
    let single = greedy(&m, "the cat sat on the mat", 8, &[]);
    // 120 MB a node: one node cannot hold the model and its runtime; two can.
    let got = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
        .args([
            "run",
            "--model",
            &m,
            "--prompt",
            "the cat sat on the mat",
            "-n",
            "8",
        ])
        .args([
            "--temperature",
            "0",
            "--json",
            "--logprobs",
            "5",
            "--ctx",
            "256",
        ])
        .args(["--nodes", "2", "--node-memory-limit", "120M"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&got.stderr).to_string();
    assert!(
        err.contains("plan: ") && err.contains("on 2 of 2 nodes"),
        "{err}"
    );
    let got = ok_json(&got);
    common::assert_same_path("planned under a cap", &single, &got, SYNTHETIC_TOL);
    // 40 MB a node: nothing fits; refused before any shard is sent, with the reason.
    let out = weft(&[
        "run",
        "--model",
        &m,
        "--prompt",
        "hi",
        "-n",
        "2",
        "--ctx",
        "256",
        "--nodes",
        "2",
        "--node-memory-limit",
        "40M",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("fits no layout of these 2 nodes") && err.contains("offers 40.0 MB"),
        "{err}"
    );
}

/// Kills a child process when dropped (a failed assertion too).
struct Reap(std::process::Child);
impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_planned_layout_and_its_measurements_are_shown() {
    let dir = tempfile::tempdir().unwrap();
    let m = moe_model(dir.path());
    // `weft serve` without layout flags: /v1/cluster shows the plan and the survey.
    let mut serve = Reap(
        std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
            .args([
                "serve", "--port", "0", "--model", &m, "--nodes", "2", "--ctx", "256",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = common::listening_on(&mut serve.0, "weft serve");
    let out = std::process::Command::new("curl")
        .args(["-sS", &format!("{url}/v1/cluster")])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let plan = &v["plan"];
    assert!(plan["layout"].is_string(), "{v}");
    assert_eq!(plan["chosen"], true, "the planner chose it: {v}");
    assert!(
        plan["prediction"]["decode_tok_s"].as_f64().unwrap() > 0.0,
        "{v}"
    );
    assert_eq!(plan["profiles"].as_array().unwrap().len(), 2, "{v}");
    let rtt = plan["links"]["rtt_us"].as_array().unwrap();
    assert_eq!(rtt.len(), 3, "coordinator and two nodes: {v}");
    assert!(rtt[1][2].as_f64().unwrap() > 0.0, "{v}");
    drop(serve);
    // `weft cluster status --measure`: profiles and the link matrix of running nodes.
    let secret = "weft-planning-test-secret-0123456789-abcdefghij";
    let (a, addr_a) = common::start_node("127.0.0.1:0", secret);
    let (b, _) = common::start_node("127.0.0.1:0", secret);
    let _nodes = common::Kill(vec![a, b]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
        .args([
            "cluster",
            "status",
            "--no-mdns",
            "--peers",
            &addr_a,
            "--measure",
            "--json",
        ])
        .env("WEFT_SECRET", secret)
        .output()
        .unwrap();
    let v = ok_json(&out);
    // Only node a was named: b is not a member unless it joined, so one node is measured.
    let s = &v["survey"];
    assert_eq!(s["nodes"].as_array().unwrap().len(), 1, "{v}");
    let n = &s["nodes"][0];
    assert!(n["memory_total"].as_u64().unwrap() > 0, "{n}");
    assert!(n["rates"].as_array().unwrap().len() >= 9, "{n}");
    assert_eq!(s["links"]["rtt_us"].as_array().unwrap().len(), 2, "{v}");
}
