//! Mixture-of-experts across real node processes: expert parallelism (even, uneven, with
//! TP inside the experts, inside a pipeline stage, with spare experts) gives the single node's greedy path on
//! synthetic qwen3moe and deepseek2 models (latent attention, shared experts, sigmoid and
//! softmax routing), short and long prompts; a per-node memory cap that one node cannot
//! meet is met by splitting the experts; bad expert metadata is a clear error.

mod common;

use std::path::Path;

use serde_json::Value;
use weft_gguf::{GgmlType, GgufWriter, Value as GgufValue};
use weft_model::synthetic::{synthetic_model, SyntheticMla, SyntheticMoe, SyntheticSpec};
use weft_model::Arch;

use common::{assert_same_path, greedy, ok_json, weft, SYNTHETIC_TOL};

fn moe_spec(ty: GgmlType, seed: u64) -> SyntheticSpec {
    let mut s = SyntheticSpec::small(Arch::Qwen3Moe, ty);
    s.n_layer = 4;
    s.seed = seed;
    s.head_scale = 8.0;
    s.moe = Some(SyntheticMoe::routed(
        16,
        4,
        if ty.block_size() == 256 { 256 } else { 128 },
    ));
    s
}

fn write(dir: &Path, name: &str, w: &GgufWriter) -> String {
    let p = dir.join(name);
    w.write_file(&p).unwrap();
    p.to_str().unwrap().to_string()
}

const EP_LAYOUTS: [&[&str]; 7] = [
    &["--nodes", "2", "--ep", "2"],
    &["--nodes", "3", "--ep", "3", "--ep-weights", "2,1,1"],
    &["--nodes", "4", "--ep", "2", "--tp", "2"],
    &["--nodes", "4", "--pp", "2", "--ep", "2"],
    &["--nodes", "2", "--tp", "2"],
    // Spare experts: a choice two groups hold is computed by one of them only.
    &["--nodes", "2", "--ep", "2", "--ep-spares", "4"],
    &[
        "--nodes",
        "3",
        "--ep",
        "3",
        "--ep-weights",
        "2,1,1",
        "--ep-spares",
        "3",
    ],
];

#[test]
fn expert_parallel_layouts_match_one_node() {
    let dir = tempfile::tempdir().unwrap();
    let long: String = (0..60)
        .map(|i| ["the cat", "sat on", "a mat", "in Paris"][i % 4])
        .collect::<Vec<_>>()
        .join(" ");
    for (ty, seed) in [(GgmlType::Q8_0, 7), (GgmlType::F16, 11)] {
        let m = write(
            dir.path(),
            &format!("moe-{ty}.gguf"),
            &synthetic_model(&moe_spec(ty, seed)),
        );
        for prompt in ["the cat sat on the mat", long.as_str()] {
            let single = greedy(&m, prompt, 12, &[]);
            for l in EP_LAYOUTS {
                let got = greedy(&m, prompt, 12, l);
                let what = format!("qwen3moe {ty} {l:?}, {}-char prompt", prompt.len());
                assert_eq!(got["prompt_ids"], single["prompt_ids"], "{what}");
                assert_same_path(&what, &single, &got, SYNTHETIC_TOL);
            }
        }
    }
}

/// deepseek2 in two variants: Q8_0 with a low-rank query, sigmoid routing with its bias
/// and one dense layer first; F16 in the legacy attn_kv_b layout with a plain query,
/// softmax routing limited to 2 of 4 groups, scaled weights and two dense layers first.
/// Both with a shared expert.
fn deepseek2_spec(ty: GgmlType, seed: u64) -> SyntheticSpec {
    let mut s = SyntheticSpec::small(Arch::DeepSeek2, ty);
    s.n_layer = 4;
    s.seed = seed;
    s.head_scale = 8.0;
    let routed = SyntheticMoe::routed(16, 4, 128);
    if ty == GgmlType::F16 {
        s.moe = Some(SyntheticMoe {
            leading_dense: 2,
            sigmoid: false,
            groups: (4, 2),
            weights_scale: 2.5,
            ..routed
        });
        s.mla = Some(SyntheticMla {
            q_lora_rank: 0,
            combined_kv_b: true,
            ..s.mla.expect("deepseek2 has MLA")
        });
    } else {
        s.moe = Some(routed);
    }
    s
}

#[test]
fn deepseek2_layouts_match_one_node() {
    let dir = tempfile::tempdir().unwrap();
    let long: String = (0..60)
        .map(|i| ["the cat", "sat on", "a mat", "in Paris"][i % 4])
        .collect::<Vec<_>>()
        .join(" ");
    let layouts: [&[&str]; 6] = [
        &["--nodes", "2", "--tp", "2"],
        &["--nodes", "2", "--ep", "2"],
        &["--nodes", "4", "--ep", "2", "--tp", "2"],
        &["--nodes", "2", "--pp", "2"],
        &["--nodes", "4", "--pp", "2", "--ep", "2"],
        &["--nodes", "3", "--ep", "3", "--ep-weights", "2,1,1"],
    ];
    for (ty, seed) in [(GgmlType::Q8_0, 5), (GgmlType::F16, 9)] {
        let m = write(
            dir.path(),
            &format!("deepseek2-{ty}.gguf"),
            &synthetic_model(&deepseek2_spec(ty, seed)),
        );
        for prompt in ["the cat sat on the mat", long.as_str()] {
            let single = greedy(&m, prompt, 12, &[]);
            for l in layouts {
                let got = greedy(&m, prompt, 12, l);
                let what = format!("deepseek2 {ty} {l:?}, {}-char prompt", prompt.len());
                assert_eq!(got["prompt_ids"], single["prompt_ids"], "{what}");
                assert_same_path(&what, &single, &got, SYNTHETIC_TOL);
            }
        }
    }
}

fn node_stats(v: &Value) -> Vec<(u64, u64)> {
    v["node_stats"]
        .as_array()
        .expect("node_stats")
        .iter()
        .map(|n| {
            (
                n["shard_bytes"].as_u64().unwrap(),
                n["peak_rss_bytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_memory_cap_one_node_cannot_meet_is_met_by_expert_parallelism() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = moe_spec(GgmlType::Q8_0, 3);
    // Experts dominate: 64 experts of 3 x 256 x 512 Q8_0 values per layer, ~100 MB in all.
    spec.moe = Some(SyntheticMoe::routed(64, 4, 512));
    let m = write(dir.path(), "big-moe.gguf", &synthetic_model(&spec));
    let one = greedy(&m, "hello world", 6, &["--nodes", "1"]);
    let (whole, _) = node_stats(&one)[0];
    let cap = whole * 3 / 4;
    let cap_s = cap.to_string();
    // One node with the cap: refused, naming what the shard needs and the cap.
    let out = weft(&[
        "run",
        "--model",
        &m,
        "--prompt",
        "hello world",
        "-n",
        "4",
        "--nodes",
        "1",
        "--node-memory-limit",
        &cap_s,
    ]);
    assert!(!out.status.success(), "one node must refuse the cap");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("over its --memory-limit of") && err.contains("of weights"),
        "{err}"
    );
    // Two nodes, experts split: each shard under the cap, same output as one node.
    let two = greedy(
        &m,
        "hello world",
        6,
        &["--nodes", "2", "--ep", "2", "--node-memory-limit", &cap_s],
    );
    assert_same_path("EP=2 under a cap", &one, &two, SYNTHETIC_TOL);
    for (shard, rss) in node_stats(&two) {
        assert!(shard < cap, "shard {shard} over the cap {cap}");
        assert!(
            shard * 10 < whole * 6,
            "shard {shard} is not about half of {whole}"
        );
        eprintln!(
            "EP=2 node: shard {:.1} MB, peak RSS {:.1} MB (one node's shard: {:.1} MB)",
            shard as f64 / 1e6,
            rss as f64 / 1e6,
            whole as f64 / 1e6
        );
    }
}

/// The synthetic model with one metadata key or tensor replaced.
fn broken(dir: &Path, name: &str, edit: impl FnOnce(&mut GgufWriter)) -> String {
    broken_spec(dir, name, &moe_spec(GgmlType::F32, 5), edit)
}

fn broken_spec(
    dir: &Path,
    name: &str,
    spec: &SyntheticSpec,
    edit: impl FnOnce(&mut GgufWriter),
) -> String {
    let mut w = synthetic_model(spec);
    edit(&mut w);
    write(dir, name, &w)
}

#[test]
fn bad_deepseek2_metadata_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    // Q8_0: the absorbed layout; F16: the legacy attn_kv_b layout.
    let (absorbed, legacy) = (
        deepseek2_spec(GgmlType::Q8_0, 5),
        deepseek2_spec(GgmlType::F16, 5),
    );
    let spec_case = |spec: &SyntheticSpec, name: &str, key: &'static str, v: GgufValue| {
        let p = broken_spec(dir.path(), name, spec, |w| {
            w.set(key, v);
        });
        (p, key)
    };
    let case = |name: &str, key: &'static str, v: GgufValue| spec_case(&absorbed, name, key, v);
    let cases = [
        case(
            "kv.gguf",
            "deepseek2.attention.head_count_kv",
            GgufValue::U32(2),
        ),
        spec_case(
            &legacy,
            "legacy-kv.gguf",
            "deepseek2.attention.head_count_kv",
            GgufValue::U32(1),
        ),
        case(
            "gating.gguf",
            "deepseek2.expert_gating_func",
            GgufValue::U32(4),
        ),
        case(
            "groups.gguf",
            "deepseek2.expert_group_count",
            GgufValue::U32(3),
        ),
        case(
            "nextn.gguf",
            "deepseek2.nextn_predict_layers",
            GgufValue::U32(9),
        ),
        case(
            "swa.gguf",
            "deepseek2.attention.sliding_window",
            GgufValue::U32(64),
        ),
        case(
            "klen.gguf",
            "deepseek2.attention.key_length",
            GgufValue::U32(100),
        ),
        case(
            "scaling.gguf",
            "deepseek2.rope.scaling.type",
            GgufValue::String("longrope".into()),
        ),
    ];
    for (m, key) in cases {
        let out = weft(&["run", "--model", &m, "--prompt", "hi", "-n", "2"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{key}: {err}");
        assert!(
            err.contains(key) && !err.contains("panicked"),
            "{key}: {err}"
        );
    }
}

#[test]
fn bad_expert_metadata_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(String, &str)> = vec![
        (
            broken(dir.path(), "zero.gguf", |w| {
                w.set("qwen3moe.expert_count", GgufValue::U32(0));
            }),
            "qwen3moe.expert_count",
        ),
        (
            broken(dir.path(), "used.gguf", |w| {
                w.set("qwen3moe.expert_used_count", GgufValue::U32(17));
            }),
            "qwen3moe.expert_used_count",
        ),
        (
            broken(dir.path(), "shape.gguf", |w| {
                // 15 experts' worth of gate weights under a 16-expert header.
                w.replace_tensor(
                    "blk.1.ffn_gate_exps.weight",
                    &[256, 128, 15],
                    GgmlType::F32,
                    vec![0u8; 256 * 128 * 15 * 4],
                );
            }),
            "blk.1.ffn_gate_exps.weight",
        ),
    ];
    for (m, field) in cases {
        for layout in [&[][..], &["--nodes", "2", "--ep", "2"][..]] {
            let mut args = vec!["run", "--model", &m, "--prompt", "hi", "-n", "2"];
            args.extend_from_slice(layout);
            let out = weft(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{m} {layout:?}: {err}");
            assert!(err.contains(field), "{m} {layout:?}: {err}");
            assert!(!err.contains("panicked"), "{m} {layout:?}: {err}");
        }
    }
    // --ep on a dense model is refused up front.
    let dense = write(
        dir.path(),
        "dense.gguf",
        &synthetic_model(&SyntheticSpec::small(Arch::Llama, GgmlType::Q8_0)),
    );
    let out = weft(&[
        "run", "--model", &dense, "--prompt", "hi", "-n", "2", "--nodes", "2", "--ep", "2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no routed experts"), "{err}");
    // Spares without expert groups are refused, naming the flag.
    let moe = write(
        dir.path(),
        "moe-spares.gguf",
        &synthetic_model(&moe_spec(GgmlType::Q8_0, 3)),
    );
    let out = weft(&[
        "run",
        "--model",
        &moe,
        "--prompt",
        "hi",
        "-n",
        "2",
        "--nodes",
        "2",
        "--tp",
        "2",
        "--ep-spares",
        "2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--ep-spares 2 needs expert parallelism"),
        "{err}"
    );
    let _ = ok_json; // shared helper, used by other files
}
