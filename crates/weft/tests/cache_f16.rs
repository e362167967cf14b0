//! The f16 KV cache (`--cache-type f16`): weft's greedy tokens against llama-server's with
//! its own f16 cache (`-ctk f16 -ctv f16`) on synthetic models with grouped-query
//! attention and with MLA's latent cache, F32 and Q8_0 weights, a prompt past 1,000
//! tokens included, and on the real Gemma 3 where present; every cluster layout equal to
//! one node with it; its memory half the f32 cache's.

mod common;

use std::time::Instant;

use common::llamacpp::{compare, llamacpp, quantize, synth, word_pairs, LlamaServer, QUANT_TOL};
use common::order_tie::{order_near_tie, Case};
use common::{
    assert_same_path, greedy, ids, ok_json, real_model, synthetic_llama_q8, weft, GEMMA3_TOL,
    LAYOUTS, SYNTHETIC_TOL,
};

/// Tokens generated per case.
const N: usize = 16;

const F16: [&str; 2] = ["--cache-type", "f16"];

fn prompts() -> [(&'static str, String); 2] {
    // 170 word pairs: past 1,000 tokens in the synthetic vocabulary.
    let long = word_pairs(
        170,
        &["the cat", "sat on", "a mat", "in Paris", "hello world"],
    );
    [
        ("france", "hello world, the capital of France is".into()),
        ("long", long),
    ]
}

#[test]
fn an_f16_cache_matches_llamacpps_f16_cache() {
    let Some(bin) = llamacpp() else { return };
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let gqa: &[&str] = &["--arch", "llama", "--layers", "3", "--seed", "5"];
    let mla: &[&str] = &[
        "--arch",
        "deepseek2",
        "--heads",
        "4",
        "--head-scale",
        "8",
        "--layers",
        "3",
        "--seed",
        "42",
    ];
    let mut models = Vec::new();
    for (name, dims) in [("gqa", gqa), ("mla", mla)] {
        let f32 = synth(dir.path(), &format!("{name}-f32"), "F32", dims);
        let q8 = quantize(&bin, &f32, dir.path(), &format!("{name}-q8_0"), "Q8_0");
        models.push((format!("{name} F32"), f32, SYNTHETIC_TOL));
        models.push((format!("{name} Q8_0"), q8, QUANT_TOL));
    }
    if let Some(m) = real_model() {
        models.push(("gemma3 Q4_K_M".into(), m, GEMMA3_TOL));
    }
    let mut table = Vec::new();
    let mut failures = Vec::new();
    for (name, model, tol) in &models {
        let server = LlamaServer::start_with_cache(&bin, model, "f16");
        let order_case = Case {
            bin: &bin,
            model,
            weft_model: None,
            f32_twin: None,
            cache: "f16",
            weft_flags: &F16,
        };
        for (label, prompt) in prompts() {
            let run = greedy(model.to_str().unwrap(), &prompt, N, &F16);
            let prompt_ids = ids(&run, "prompt_ids");
            let llama = server.greedy(&prompt_ids, N);
            let case = format!("{name} {label} ({} prompt tokens)", prompt_ids.len());
            match compare(&run, &llama, *tol) {
                Ok(a) => table.push(format!(
                    "{case:<40} {:>2}/{N}{}",
                    a.prefix,
                    a.gap
                        .map(|g| format!("  near-tie: llama.cpp's token {g:.3} behind"))
                        .unwrap_or_default()
                )),
                Err(e) => match order_near_tie(&order_case, &run, &llama) {
                    Some(why) => table.push(format!("{case:<40} order near-tie {why}")),
                    None => {
                        table.push(format!("{case:<40} PARTS"));
                        failures.push(format!("{case}: {e}\n{}", server.log_tail()));
                    }
                },
            }
        }
    }
    println!("weft --cache-type f16 against llama.cpp -ctk f16 -ctv f16, agreeing tokens:");
    for row in &table {
        println!("  {row}");
    }
    println!("({:.1} s)", t0.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn an_f16_cache_on_every_layout_matches_one_node() {
    let dir = tempfile::tempdir().unwrap();
    let m = synthetic_llama_q8(dir.path());
    let [_, (_, long)] = prompts();
    let single = greedy(&m, &long, 8, &F16);
    assert!(ids(&single, "prompt_ids").len() > 1000);
    // The f16 cache is in force: the f32 cache's path differs somewhere in its logprobs.
    let f32 = greedy(&m, &long, 8, &[]);
    assert_ne!(single["top_logprobs"], f32["top_logprobs"]);
    assert_same_path("f16 against f32 cache", &f32, &single, SYNTHETIC_TOL);
    for l in LAYOUTS {
        let args: Vec<&str> = l.iter().chain(&F16).copied().collect();
        let got = greedy(&m, &long, 8, &args);
        assert_same_path(&format!("f16 cache {l:?}"), &single, &got, SYNTHETIC_TOL);
    }
}

#[test]
fn an_f16_cache_takes_half_the_memory() {
    let dir = tempfile::tempdir().unwrap();
    let m = synthetic_llama_q8(dir.path());
    let bench = |extra: &[&str]| {
        let args = ["bench", "--model", &m, "-p", "8", "-n", "4", "-r", "1"];
        let args: Vec<&str> = args
            .iter()
            .chain(extra)
            .chain(&["--no-bandwidth", "--json"])
            .copied()
            .collect();
        ok_json(&weft(&args))
    };
    let (full, half) = (bench(&[]), bench(&F16));
    let per_token = |b: &serde_json::Value| b["kv_bytes_per_token"].as_u64().unwrap();
    assert_eq!(per_token(&full), 2 * per_token(&half), "{full}\n{half}");
    assert!(half["tg_tok_s"].as_f64().unwrap() > 0.0);
    // An unknown type is refused by name, with the known ones.
    let bad = weft(&["run", "--model", &m, "--prompt", "hi", "--cache-type", "f8"]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("f32 and f16"), "{err}");
}
