//! Helpers the weft binary's integration tests share.
// Each test file compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Output;

use serde_json::Value;

/// How far one token's logprob moves on Gemma 3 270M when only the summation order
/// changes: its activations have large outliers, so another order flips a few 8-bit
/// activation roundings per layer. Measured, the first greedy token's logprob for "The
/// capital of France is" moves by up to 0.12 between one node, TP=4, and the AVX2 and VNNI
/// kernels; a part in a greedy path within this of the best is a near-tie, not a bug.
pub const GEMMA3_TOL: f64 = 0.25;

/// The JSON a successful weft command printed on stdout.
pub fn ok_json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "weft failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// The real model where `weft pull` puts it, or None (and a skip message) when absent.
pub fn real_model() -> Option<PathBuf> {
    let home = std::env::var_os("WEFT_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/weft")
        });
    let p = home.join("models/gemma-3-270m-q4_k_m.gguf");
    if p.exists() {
        return Some(p);
    }
    eprintln!("skipping: {} is not present (run `weft pull`)", p.display());
    None
}
