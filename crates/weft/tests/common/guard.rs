//! The guard that shows a comparison against llama.cpp can fail: weft on a model of
//! another seed must part from llama-server on the reference, and no other summation order
//! of either engine may call that part a near-tie.

use std::path::Path;

use super::ids;
use super::llamacpp::{compare, LlamaServer, QUANT_TOL};
use super::order_tie::{order_near_tie, Case};

/// weft on `other` (a model of seed 43) against llama-server on `reference` (seed 42), on
/// every prompt: a part beyond the loosest tolerance that no other order explains. Returns
/// the table rows (labels padded to `width`) and the failures.
pub fn guard_other_seed(
    bin: &Path,
    reference: &Path,
    other: &Path,
    prompts: &[(&'static str, String)],
    n: usize,
    width: usize,
) -> (Vec<String>, Vec<String>) {
    let (mut table, mut failures) = (Vec::new(), Vec::new());
    let server = LlamaServer::start(bin, reference);
    let order_case = Case {
        bin,
        model: reference,
        weft_model: Some(other),
        f32_twin: None,
        cache: "f32",
        weft_flags: &[],
    };
    for (label, prompt) in prompts {
        let run = super::greedy(other.to_str().unwrap(), prompt, n, &[]);
        let llama = server.greedy(&ids(&run, "prompt_ids"), n);
        match compare(&run, &llama, QUANT_TOL) {
            Ok(a) => failures.push(format!(
                "guard {label}: weft on seed 43 passed as llama.cpp on seed 42 ({} equal tokens)",
                a.prefix
            )),
            Err(e) => match order_near_tie(&order_case, &run, &llama) {
                Some(why) => failures.push(format!(
                    "guard {label}: weft on seed 43 against llama.cpp on seed 42 passed as an \
                     order near-tie {why}"
                )),
                None => {
                    let case = format!("guard: seed 43 vs 42, {label}");
                    let why = e.lines().next().unwrap_or_default();
                    table.push(format!("{case:<width$} fails as it must: {why}"));
                }
            },
        }
    }
    (table, failures)
}
