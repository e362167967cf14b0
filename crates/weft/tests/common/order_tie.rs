//! A part between weft's and llama.cpp's greedy paths told apart as a summation-order
//! near-tie: on the context both paths shared up to the part, one engine run in another
//! order (or rounding) takes the other engine's token there.
//!
//! Why a tolerance alone cannot judge every part: a routed layer's expert choice, or on
//! the head-scale-8 synthetic models an attention peak, can hang on a near-tie, and a
//! flipped choice moves the logits by whole nats. Measured on a Zen 3 host (AVX2, no VNNI)
//! on deepseek2 Q4_K_M with group-limited softmax routing, the long prompt: llama.cpp with
//! and without its repacked Q4_K layout parts from itself at the third token, its own
//! logprobs there moving by 2.2 nats; weft's AVX2 path follows the repacked one for nine
//! tokens and weft's scalar path the other for ten. Such a part says nothing about
//! correctness; a wrong kernel or layer parts on every order.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use super::ids;
use super::llamacpp::LlamaServer;

/// The model and settings both engines ran, to run again in another order.
pub struct Case<'a> {
    /// llama.cpp's tools.
    pub bin: &'a Path,
    pub model: &'a Path,
    /// The model weft ran where it is not `model`: the other-seed guard, which shows that
    /// no other order makes a wrong model's path llama.cpp's.
    pub weft_model: Option<&'a Path>,
    /// The same model in F32 where `model` is its F16 rounding: llama.cpp rounds
    /// activations to F16 before an F16 matmul (weft keeps them in F32), and on the F32
    /// file neither side rounds.
    pub f32_twin: Option<&'a Path>,
    /// llama-server's KV cache type ("f32" or "f16").
    pub cache: &'a str,
    /// weft's flags beside the model (`--cache-type f16`).
    pub weft_flags: &'a [&'a str],
}

impl<'a> Case<'a> {
    /// A model of `quant_types`' type `ty` run as the comparisons run it (weft's defaults,
    /// an f32 cache on both sides), `f32` its F32 file (the twin where `ty` is F16).
    pub fn of_type(bin: &'a Path, model: &'a Path, ty: &str, f32: &'a Path) -> Self {
        Case {
            bin,
            model,
            weft_model: None,
            f32_twin: (ty == "F16").then_some(f32),
            cache: "f32",
            weft_flags: &[],
        }
    }
}

/// weft's other summation orders: ggml's row layout where the CPU has an interleaved
/// one, and the scalar kernels.
const WEFT_ORDERS: [(&str, &str); 2] = [
    ("WEFT_KERNELS_NO_PACK", "in ggml's row layout"),
    ("WEFT_KERNELS_SCALAR", "on its scalar kernels"),
];

/// Where `run` (weft) and `llama` part, the first other order of either engine that takes
/// the other engine's token on the shared context, described for a test's table; None
/// where none does (or where one path stopped early: no token to compare).
pub fn order_near_tie(case: &Case, run: &Value, llama: &[u64]) -> Option<String> {
    let weft_path = ids(run, "token_ids");
    let at = weft_path
        .iter()
        .zip(llama)
        .take_while(|(a, b)| a == b)
        .count();
    let (&weft_token, &llama_token) = (weft_path.get(at)?, llama.get(at)?);
    let context: Vec<u64> = ids(run, "prompt_ids")
        .into_iter()
        .chain(llama[..at].iter().copied())
        .collect();
    for (var, what) in WEFT_ORDERS {
        if weft_next(case, &context, var) == Some(llama_token) {
            return Some(format!(
                "at {at}: weft {what} takes llama.cpp's token {llama_token}"
            ));
        }
    }
    let mut llama_orders = vec![(case.model, "--no-repack", "without its repacked layout")];
    if let Some(f32) = case.f32_twin {
        llama_orders.push((f32, "", "on the F32 file (no F16 rounding)"));
    }
    for (model, flag, what) in llama_orders {
        let flags: Vec<&str> = Some(flag).filter(|f| !f.is_empty()).into_iter().collect();
        let server = LlamaServer::start_with(case.bin, model, case.cache, &flags);
        if server.greedy(&context, 1).first() == Some(&weft_token) {
            return Some(format!(
                "at {at}: llama.cpp {what} takes weft's token {weft_token}"
            ));
        }
    }
    None
}

/// weft's greedy token after exactly `context`, with `var`=1 set; None where that run
/// fails (its stderr printed: the caller then reports the part itself).
fn weft_next(case: &Case, context: &[u64], var: &str) -> Option<u64> {
    let context = context
        .iter()
        .map(|id| id.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = Command::new(env!("CARGO_BIN_EXE_weft"))
        .env(var, "1")
        .arg("run")
        .arg("--model")
        .arg(case.weft_model.unwrap_or(case.model))
        .args([
            "--prompt-ids",
            &context,
            "-n",
            "1",
            "--temperature",
            "0",
            "--json",
        ])
        .args(case.weft_flags)
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "weft with {var}=1 after the shared context: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    ids(&v, "token_ids").first().copied()
}
