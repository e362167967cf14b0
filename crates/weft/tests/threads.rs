//! Thread counts as a user sets them: more threads than usable cores is warned about and
//! still decodes, an absurd count is refused naming both numbers, and a busy neighbour on
//! the other core costs a share of speed (the figures are printed, not asserted: timings
//! are noisy and tests never judge wall-clock speed).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::{ids, ok_json, real_model, synthetic_llama_q8, weft};

fn cores() -> usize {
    weft_kernels::pool::usable_cores()
}

#[test]
fn threads_above_the_cores_are_warned_and_still_decode() {
    let dir = tempfile::tempdir().unwrap();
    let m = synthetic_llama_q8(dir.path());
    let n = (cores() + 1).to_string();
    let out = weft(&[
        "run",
        "--model",
        &m,
        "--prompt",
        "the cat",
        "-n",
        "16",
        "--temperature",
        "0",
        "--json",
        "--threads",
        &n,
    ]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let v = ok_json(&out);
    assert_eq!(ids(&v, "token_ids").len(), 16);
    assert!(
        err.contains(&format!("--threads {n} is more than the {} cores", cores())),
        "{err}"
    );
    // The same output as with the default threads: only the speed may differ.
    let base = ok_json(&weft(&[
        "run",
        "--model",
        &m,
        "--prompt",
        "the cat",
        "-n",
        "16",
        "--temperature",
        "0",
        "--json",
    ]));
    assert_eq!(v["token_ids"], base["token_ids"]);
}

#[test]
fn an_absurd_thread_count_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = synthetic_llama_q8(dir.path());
    let out = weft(&[
        "run",
        "--model",
        &m,
        "--prompt",
        "hi",
        "--threads",
        "100000",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--threads 100000") && err.contains(&format!("{} cores", cores())),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let zero = weft(&["run", "--model", &m, "--prompt", "hi", "--threads", "0"]);
    assert!(!zero.status.success());
}

/// Decode tok/s of the real model with `threads` (None: the default).
fn decode_rate(model: &str, threads: Option<&str>) -> f64 {
    let mut args = vec![
        "run",
        "--model",
        model,
        "--prompt",
        "The capital of France is",
        "-n",
        "48",
        "--temperature",
        "0",
        "--json",
    ];
    if let Some(t) = threads {
        args.extend(["--threads", t]);
    }
    let v = ok_json(&weft(&args));
    assert_eq!(ids(&v, "token_ids").len(), 48);
    v["decode_tok_s"].as_f64().unwrap()
}

#[test]
fn a_busy_neighbour_costs_a_share_of_speed() {
    let Some(m) = real_model() else { return };
    let m = m.to_str().unwrap();
    let quiet_default = decode_rate(m, None);
    let quiet_one = decode_rate(m, Some("1"));
    // A neighbour that keeps one core busy for as long as it runs.
    let stop = Arc::new(AtomicBool::new(false));
    let spinner = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut x = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        })
    };
    let busy_default = decode_rate(m, None);
    let busy_one = decode_rate(m, Some("1"));
    stop.store(true, Ordering::Relaxed);
    spinner.join().unwrap();
    eprintln!(
        "decode tok/s on {} cores: quiet: default threads {quiet_default:.1}, 1 thread \
         {quiet_one:.1}; with a busy neighbour: default threads {busy_default:.1}, 1 thread \
         {busy_one:.1}",
        cores()
    );
    assert!(busy_default > 0.0 && busy_one > 0.0);
}
