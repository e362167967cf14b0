//! weft's qwen3moe against llama.cpp, the reference: on synthetic MoE models of two sizes,
//! in F32, F16, Q8_0, Q4_K_M, Q5_K_M, Q5_1 and Q4_1, weft's greedy tokens must be
//! llama-server's, up to a part at a near-tie (within the tolerance, or one that another
//! summation order of either engine flips: `common::order_tie`); a model of another seed
//! must fail the same comparison; the Q4_K_M file cut into parts by llama-gguf-split must
//! give exactly the uncut file's output.

mod common;

use std::time::Instant;

use common::guard::guard_other_seed;
use common::llamacpp::{compare, llamacpp, quant_types, split, synth, word_pairs, LlamaServer};
use common::order_tie::{order_near_tie, Case};
use common::{greedy, ids};

/// Tokens generated per case.
const N: usize = 16;

/// The two models: the synth defaults (8 experts, top-2, 3 layers, 256 wide) and a larger
/// one (16 experts, top-4, 4 layers, 512 wide). Every matrix row (256 or 512 wide: embd,
/// heads x head_dim = 8 x 64, expert FFN) is a multiple of 256, as K-quants need.
const MODELS: [(&str, &[&str]); 2] = [
    ("small", &["--seed", "42"]),
    (
        "large",
        &[
            "--experts",
            "16",
            "--experts-used",
            "4",
            "--layers",
            "4",
            "--embd",
            "512",
            "--expert-ff",
            "512",
            "--seed",
            "7",
        ],
    ),
];

fn prompts() -> [(&'static str, String); 3] {
    // 21 word pairs: about 150 tokens in the synthetic vocabulary.
    let long = word_pairs(21, &["the cat", "sat on", "a mat", "in Paris"]);
    [
        ("cat", "the cat sat on the mat".to_string()),
        (
            "france",
            "hello world, the capital of France is".to_string(),
        ),
        ("long", long),
    ]
}

#[test]
fn qwen3moe_matches_llamacpp() {
    let Some(bin) = llamacpp() else { return };
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let prompts = prompts();
    let mut table = Vec::new();
    let mut failures = Vec::new();
    for (name, dims) in MODELS {
        let files = quant_types(&bin, dir.path(), name, dims, &["Q5_K_M", "Q5_1", "Q4_1"]);
        // The Q4_K_M file cut by llama.cpp into parts of 10 tensors: weft opens it from
        // its first part and must give exactly the uncut file's output.
        let parts = split(&bin, &files[3].1, dir.path(), &format!("{name}-split"), 10);
        let f32_file = files[0].1.clone();
        for (ty, model, tol) in files {
            let server = LlamaServer::start(&bin, &model);
            let order_case = Case::of_type(&bin, &model, ty, &f32_file);
            for (label, prompt) in &prompts {
                let run = greedy(model.to_str().unwrap(), prompt, N, &[]);
                if ty == "Q4_K_M" {
                    let cut = greedy(parts.to_str().unwrap(), prompt, N, &[]);
                    assert_eq!(
                        (&cut["token_ids"], &cut["top_logprobs"]),
                        (&run["token_ids"], &run["top_logprobs"]),
                        "{name} {label}: the llama-gguf-split parts differ from the uncut file"
                    );
                }
                let prompt_ids = ids(&run, "prompt_ids");
                if *label == "long" {
                    assert!(
                        (120..=200).contains(&prompt_ids.len()),
                        "the long prompt is {} tokens",
                        prompt_ids.len()
                    );
                }
                let llama = server.greedy(&prompt_ids, N);
                let case = format!("{name} {ty} {label} ({} prompt tokens)", prompt_ids.len());
                match compare(&run, &llama, tol) {
                    Ok(a) => table.push(format!(
                        "{case:<42} {:>2}/{N}{}",
                        a.prefix,
                        a.gap
                            .map(|g| format!("  near-tie: llama.cpp's token {g:.3} behind"))
                            .unwrap_or_default()
                    )),
                    Err(e) => match order_near_tie(&order_case, &run, &llama) {
                        Some(why) => table.push(format!("{case:<42} order near-tie {why}")),
                        None => {
                            table.push(format!("{case:<42} PARTS"));
                            failures.push(format!("{case}: {e}"));
                        }
                    },
                }
            }
        }
    }

    // The comparison can fail: weft on a model of another seed is not llama.cpp on the
    // small F32 model, on any prompt, even at the loosest tolerance.
    let small = dir.path().join("small-f32.gguf");
    let other = synth(dir.path(), "other-f32", "F32", &["--seed", "43"]);
    let (rows, failed) = guard_other_seed(&bin, &small, &other, &prompts, N, 42);
    table.extend(rows);
    failures.extend(failed);

    println!("weft against llama.cpp, agreeing greedy tokens:");
    for row in &table {
        println!("  {row}");
    }
    println!("({:.1} s)", t0.elapsed().as_secs_f64());
    assert!(
        failures.is_empty(),
        "weft against llama.cpp:\n{}",
        failures.join("\n\n")
    );
}
