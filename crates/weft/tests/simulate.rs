//! `weft simulate` as a user runs it: built-in and file profiles, every layout kind, JSON,
//! the SVG plot, this machine measured, the published check, and the errors that name
//! what is wrong.

mod common;

use std::process::Command;

use common::{ok_json, synthetic_llama_q8, weft};
use serde_json::Value;

fn rows(v: &Value) -> &Vec<Value> {
    v["rows"].as_array().expect("rows")
}

fn fail_text(args: &[&str]) -> String {
    let out = weft(args);
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn every_kind_at_every_node_count_with_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("qwen.svg");
    let v = ok_json(&weft(&[
        "simulate",
        "--model",
        "qwen3-235b-a22b",
        "--hardware",
        "m4-max",
        "--link",
        "10gbe,tb5-rdma",
        "--nodes",
        "1..16",
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]));
    let r = rows(&v);
    // 5 node counts x 5 kinds x 2 links.
    assert_eq!(r.len(), 50);
    let get = |n: u64, kind: &str, link: &str| {
        r.iter()
            .find(|x| x["nodes"] == n && x["layout"] == kind && x["link"] == link)
            .unwrap()
    };
    // 142 GB of weights: one 128 GB machine cannot hold them, two can.
    assert_eq!(get(1, "best", "10gbe")["fits"], false);
    assert!(get(1, "best", "10gbe")["unfit"]
        .as_str()
        .unwrap()
        .contains("needs"));
    assert_eq!(get(2, "best", "10gbe")["fits"], true);
    for n in [2, 4, 8, 16] {
        let best = get(n, "best", "tb5-rdma")["decode_tok_s"].as_f64().unwrap();
        for kind in ["pp", "tp", "ep", "hybrid"] {
            let x = get(n, kind, "tb5-rdma");
            if x["fits"] == true {
                assert!(x["decode_tok_s"].as_f64().unwrap() <= best + 1e-9, "{x}");
                let parts = ["compute_ms", "network_ms", "bubble_ms"]
                    .iter()
                    .map(|k| x[k].as_f64().unwrap())
                    .sum::<f64>();
                let token = 1e3 / x["decode_tok_s"].as_f64().unwrap();
                assert!((parts / token - 1.0).abs() < 1e-6, "{x}");
            }
        }
        // A faster link never makes the same layout slower.
        for kind in ["tp", "ep"] {
            let (slow, fast) = (get(n, kind, "10gbe"), get(n, kind, "tb5-rdma"));
            if slow["fits"] == true {
                assert!(fast["decode_tok_s"].as_f64() >= slow["decode_tok_s"].as_f64());
            }
        }
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.starts_with("<svg") && text.contains("tp tb5-rdma"),
        "{}",
        &text[..200]
    );
    assert!(v["elapsed_ms"].as_f64().unwrap() >= 0.0);
}

#[test]
fn a_gguf_file_is_read_for_its_tensors_and_a_file_adds_profiles() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic_llama_q8(dir.path());
    let size = std::fs::metadata(&model).unwrap().len() as f64;
    let profiles = dir.path().join("profiles.json");
    std::fs::write(
        &profiles,
        r#"{"hardware": [{"name": "mini", "memory_bytes": 16e9,
            "bandwidth_bytes_per_s": 100e9, "compute_ops_per_s": 4e12}],
            "links": [{"name": "usb4", "latency_us": 25, "bytes_per_s": 2e9}]}"#,
    )
    .unwrap();
    let v = ok_json(&weft(&[
        "simulate",
        "--model",
        &model,
        "--hardware",
        "mini",
        "--link",
        "usb4",
        "--profiles",
        profiles.to_str().unwrap(),
        "--nodes",
        "1,2",
        "--layout",
        "tp,pp",
        "--json",
    ]));
    let r = rows(&v);
    assert_eq!(r.len(), 4);
    let one = &r[0];
    assert_eq!(one["hardware"], "mini");
    assert_eq!(one["link"], "usb4");
    // One node holds every weight, its cache and the runtime allowance.
    let mem = one["memory_per_node"].as_f64().unwrap();
    assert!(
        mem > 0.9 * size && mem < size + 200e6,
        "{mem} for a {size}-byte file"
    );
    // --bits is for profiles, not files.
    let e = fail_text(&["simulate", "--model", &model, "--bits", "8"]);
    assert!(e.contains("--bits"), "{e}");
    std::fs::write(
        &profiles,
        r#"{"links": [{"name": "x", "latency_us": -1, "bytes_per_s": 1}]}"#,
    )
    .unwrap();
    let e = fail_text(&[
        "simulate",
        "--model",
        "llama-3-8b",
        "--hardware",
        "m4-max",
        "--profiles",
        profiles.to_str().unwrap(),
    ]);
    assert!(
        e.contains("profiles.json") && e.contains("latency_us"),
        "{e}"
    );
}

#[test]
fn bad_input_names_what_is_wrong() {
    // (flags after `simulate --model llama-3-8b --hardware m4-max`, what the error names)
    let cases: &[(&[&str], &[&str])] = &[
        (&["--link", "pigeon"], &["--link", "tb5-tcp"]),
        (&["--nodes", "0"], &["--nodes"]),
        (&["--nodes", "8..2"], &["backwards"]),
        (&["--layout", "zz"], &["--layout"]),
        (&["--engine", "vllm"], &["exo"]),
        // 500 tok/s of Llama 3 8B is beyond an M4 Max's bandwidth.
        (&["--calibrate", "500"], &["--calibrate", "bandwidth"]),
    ];
    for (flags, names) in cases {
        let mut args = vec!["simulate", "--model", "llama-3-8b", "--hardware", "m4-max"];
        args.extend_from_slice(flags);
        let e = fail_text(&args);
        assert!(names.iter().all(|n| e.contains(n)), "{flags:?}: {e}");
    }
    let e = fail_text(&["simulate", "--model", "llama-5", "--hardware", "m4-max"]);
    assert!(
        e.contains("llama-3.3-70b") && e.contains("\"llama-5\""),
        "{e}"
    );
    let e = fail_text(&["simulate", "--model", "llama-3-8b", "--hardware", "cray"]);
    assert!(e.contains("--hardware") && e.contains("dgx-spark"), "{e}");
    let e = fail_text(&["simulate", "--model", "/nonexistent/m.gguf"]);
    assert!(e.contains("/nonexistent/m.gguf"), "{e}");
}

#[test]
fn calibration_sets_the_single_node_figure() {
    let v = ok_json(&weft(&[
        "simulate",
        "--model",
        "llama-3-8b",
        "--hardware",
        "dgx-spark",
        "--link",
        "10gbe",
        "--calibrate",
        "30",
        "--nodes",
        "1,2",
        "--layout",
        "tp",
        "--json",
    ]));
    let r = rows(&v);
    assert!(
        (r[0]["decode_tok_s"].as_f64().unwrap() - 30.0).abs() < 1e-6,
        "{}",
        r[0]
    );
    let e = v["hardware"]["decode_efficiency"].as_f64().unwrap();
    assert!(e > 0.0 && e < 1.0, "{e}");
}

#[test]
fn the_published_results_are_set_beside_their_predictions() {
    let v = ok_json(&weft(&["simulate", "--published", "--json"]));
    let r = rows(&v);
    assert_eq!(r.len(), 14);
    // Kimi K2 Thinking's chart has no single-node bar: DeepSeek's calibrates it.
    let kimi: Vec<_> = r
        .iter()
        .filter(|x| x["model"] == "kimi-k2-thinking")
        .collect();
    assert_eq!(kimi.len(), 2);
    for x in &kimi {
        assert_eq!(x["calibration"], false, "{x}");
        let on = x["calibrated_on"].as_str().unwrap();
        assert!(on.contains("deepseek-v3") && on.contains("4.5"), "{x}");
    }
    for x in r {
        let (p, q) = (
            x["published_tok_s"].as_f64().unwrap(),
            x["predicted_tok_s"].as_f64().unwrap(),
        );
        assert!(p > 0.0 && q > 0.0, "{x}");
        if x["calibration"] == true {
            assert_eq!(x["nodes"], 1);
            assert!((q / p - 1.0).abs() < 1e-6, "{x}");
        }
    }
}

#[test]
fn this_machine_is_measured_by_weft_itself() {
    let home = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic_llama_q8(dir.path());
    let out = Command::new(env!("CARGO_BIN_EXE_weft"))
        .env("WEFT_HOME", home.path())
        .args([
            "simulate",
            "--model",
            &model,
            "--hardware",
            "this",
            "--threads",
            "1",
            "--same-machine",
            "--link",
            "shm",
            "--nodes",
            "1,2",
            "--layout",
            "tp,pp",
            "--delay-us",
            "0,300",
            "--json",
        ])
        .output()
        .unwrap();
    let v = ok_json(&out);
    let r = rows(&v);
    assert_eq!(r.len(), 8);
    assert!(v["hardware"]["name"]
        .as_str()
        .unwrap()
        .starts_with("this ("));
    // Kernel rates were measured and cached under the weft home.
    assert!(home.path().join("calibration").read_dir().unwrap().count() >= 2);
    let at = |delay: f64, kind: &str, n: u64| {
        r.iter()
            .find(|x| x["delay_us"] == delay && x["layout"] == kind && x["nodes"] == n)
            .unwrap()["decode_tok_s"]
            .as_f64()
            .unwrap()
    };
    // 300 µs on every one of the TP pair's syncs costs more than the pipeline's two
    // hand-offs.
    assert!(at(300.0, "tp", 2) < at(0.0, "tp", 2));
    assert!(at(300.0, "tp", 2) < at(300.0, "pp", 2), "{r:?}");
}
