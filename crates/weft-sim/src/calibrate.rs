//! The efficiency factors from one single-node measurement: the decode tok/s an engine
//! reached with a model on one machine fixes the share of the machine's bandwidth it
//! streams at (and a prefill tok/s the share of its compute). Never from multi-node
//! results: those are what the simulator is checked against.

use weft_plan::Workload;

use crate::sweep::{simulate, Kind, Scenario};

/// One node's predicted (decode, prefill) tok/s at decode and prefill efficiencies `e`.
fn one_node(s: &Scenario, decode_e: f64, prefill_e: f64) -> (f64, f64) {
    let mut s = s.clone();
    s.hardware.decode_efficiency = decode_e;
    s.hardware.prefill_efficiency = prefill_e;
    s.hardware.shared_decode_share = 0.0;
    s.hardware.shared_prefill_share = 0.0;
    let r = &simulate(&s, &[1], &[Kind::Best])[0];
    (r.decode_tok_s, r.prefill_tok_s)
}

/// `s` with its machine's decode efficiency set so one node decodes at `decode_tok_s`
/// (and prefill efficiency so it prefills at `prefill_tok_s`, if given). A token's time
/// is bytes / (bandwidth × e) plus what no bandwidth shortens (links, per-layer floors),
/// so two predictions fix both parts and e follows.
pub fn calibrate(
    s: &Scenario,
    decode_tok_s: f64,
    prefill_tok_s: Option<f64>,
) -> Result<Scenario, String> {
    if !(decode_tok_s.is_finite() && decode_tok_s > 0.0) {
        return Err(format!(
            "calibration: decode tok/s {decode_tok_s} must be > 0"
        ));
    }
    let pe = s.hardware.prefill_efficiency;
    let t = |e: f64| 1.0 / one_node(s, e, pe).0;
    // t(e) = a / e + b.
    let (t1, t_half) = (t(1.0), t(0.5));
    let a = t_half - t1;
    let b = t1 - a;
    let want = 1.0 / decode_tok_s;
    if want <= b {
        return Err(format!(
            "calibration: {decode_tok_s} tok/s is faster than {} allows at any bandwidth \
             ({:.1} ms a token are fixed costs)",
            s.engine.name,
            b * 1e3
        ));
    }
    let e = a / (want - b);
    if e > 1.0 {
        return Err(format!(
            "calibration: {decode_tok_s} tok/s needs {:.0} % of {}'s bandwidth; check the \
             model's bits or the machine",
            e * 100.0,
            s.hardware.name
        ));
    }
    let mut out = s.clone();
    out.hardware.decode_efficiency = e;
    if let Some(p) = prefill_tok_s {
        if !(p.is_finite() && p > 0.0) {
            return Err(format!("calibration: prefill tok/s {p} must be > 0"));
        }
        // Prefill is compute-bound at any real prompt: its time scales as 1 / e.
        let at_one = one_node(&out, e, 1.0).1;
        let pe = p / at_one;
        if pe > 1.0 {
            return Err(format!(
                "calibration: {p} prefill tok/s needs {:.0} % of {}'s compute",
                pe * 100.0,
                s.hardware.name
            ));
        }
        out.hardware.prefill_efficiency = pe;
    }
    Ok(out)
}

/// A workload for calibrating and checking decode figures: one stream, a short prompt.
pub fn decode_workload(n_ctx: usize) -> Workload {
    Workload {
        n_ctx,
        parallel: 1,
        prompt: 512,
        ubatch: 512,
    }
}
