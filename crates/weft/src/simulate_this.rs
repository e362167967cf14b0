//! `weft simulate --hardware this`: this machine as a simulator profile, from weft's own
//! measurements: its kernels' rates over the model's weight types (cached per CPU), the
//! rate while several node processes share it, its peak read bandwidth and integer-dot
//! rate, and the memory it offers; and, with --measure, one node running the model here.

use std::path::Path;

use std::sync::Barrier;

use anyhow::{anyhow, bail, Context, Result};
use weft_cluster::planning::{decode_rate_over, prefill_rate_over, TypeBytes};
use weft_cluster::profile::{cpu_model, kernel_rates, meminfo, select_kernels};
use weft_kernels::quant::select::Shape;
use weft_kernels::{choose, roofline, ThreadPool};
use weft_sim::Hardware;

use weft_model::Backend;

use crate::bench_cluster::time_run;
use crate::cluster_open::open;
use crate::layout_args::LayoutArgs;

/// How the simulated nodes stand on this machine.
pub struct ThisMachine<'a> {
    pub threads: usize,
    /// Nodes sharing this machine at once (1: each node a machine like this one).
    pub sharing: usize,
    pub cache: &'a Path,
    pub fresh: bool,
}

/// This machine's profile for a model of weight-type mix `mix` and mean `bits`.
pub fn this_machine(m: &ThisMachine, mix: &[TypeBytes], bits: f64) -> Result<Hardware> {
    select_kernels(Some(m.cache), false);
    let rates = kernel_rates(m.threads, Some(m.cache), m.fresh);
    let decode = decode_rate_over(&rates, mix);
    let prefill = prefill_rate_over(&rates, mix);
    if !(decode > 0.0 && prefill > 0.0) {
        bail!("measuring this machine's kernels gave no rate");
    }
    let memory = meminfo("MemAvailable").unwrap_or(0) as f64 / m.sharing.max(1) as f64;
    let pool = ThreadPool::new(m.threads);
    let peak_bw = roofline::read_bandwidth(&pool, 256 << 20, 3);
    let peak_ops = roofline::peak_int8_ops(&pool).unwrap_or(0.0);
    let plural = if m.threads == 1 { "" } else { "s" };
    let mut hw = Hardware::measured(
        &format!("this ({}, {} thread{plural})", cpu_model(), m.threads),
        memory,
        (peak_bw, peak_ops),
        (decode, prefill),
        bits,
    );
    if m.sharing > 1 {
        // Both timed here and now; decode on a buffer far larger than any cache, so that
        // the nodes' streams really meet in memory.
        hw.shared_decode_share = share_together(m, mix, Shape::Decode, DECODE_PROBE_BYTES);
        hw.shared_prefill_share = share_together(m, mix, Shape::Prefill, PREFILL_PROBE_BYTES);
    }
    Ok(hw)
}

/// Weights each node streams while the decode share is timed: past the last-level cache
/// of any CPU this runs on.
const DECODE_PROBE_BYTES: usize = 256 << 20;

/// Timed rounds of each share probe, the median kept: a shared VM's noise is of the
/// size of the contention measured.
const SHARE_ROUNDS: usize = 15;

/// Weights of the prefill probe: prefill is compute-bound, and a cache-sized tile is
/// what its kernels work on.
const PREFILL_PROBE_BYTES: usize = 6 << 20;

/// The share of its `shape` rate each of `m.sharing` nodes keeps while all of them run the
/// model's main weight type's kernel at once, on `bytes` of weights each (timed alone,
/// then together, here and now so both see the same machine).
fn share_together(m: &ThisMachine, mix: &[TypeBytes], shape: Shape, bytes: usize) -> f64 {
    let Some(main) = mix
        .iter()
        .max_by(|a, b| (a.long + a.short).total_cmp(&(b.long + b.short)))
    else {
        return 0.0;
    };
    let time = || {
        let pool = ThreadPool::new(m.threads);
        let mut buf = vec![0u8; bytes];
        choose::time_chosen(
            &pool,
            main.ty,
            shape,
            (SHARE_ROUNDS, choose::Keep::Median),
            &mut buf,
        )
        .unwrap_or(0.0)
    };
    let alone = time();
    let start = Barrier::new(m.sharing);
    let together: Vec<f64> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..m.sharing)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    time()
                })
            })
            .collect();
        runs.into_iter().filter_map(|r| r.join().ok()).collect()
    });
    let mean = together.iter().sum::<f64>() / together.len().max(1) as f64;
    if alone > 0.0 {
        (mean / alone).min(1.0)
    } else {
        0.0
    }
}

/// One node's decode and prefill tok/s of the model at `path` on `threads` threads here,
/// the medians of `reps` runs (a `prompt`-token prefill, 32 decoded tokens), measured as
/// `weft bench` measures its one-node layout: a local node process (pinned to a core
/// when `pin`) driven by this process as coordinator, so the calibration point and the
/// runs it is checked against pay the same per-token costs.
pub fn measure_one_node(
    path: &Path,
    threads: usize,
    pin: bool,
    prompt: usize,
    reps: usize,
) -> Result<(f64, f64)> {
    const DECODE: usize = 32;
    let layout = LayoutArgs {
        nodes: Some(1),
        pin,
        node_threads: Some(threads),
        transport: "auto".into(),
        ..LayoutArgs::default()
    };
    let n_ctx = (prompt + DECODE + 8).max(64);
    let mut c = open(&layout, path, n_ctx, 1, false, 1, None).context("starting one local node")?;
    let mut next = crate::bench_tokens::pseudo_random_tokens(c.n_vocab as u64);
    let tokens: Vec<u32> = (0..prompt.max(1)).map(|_| next()).collect();
    let decode: Vec<u32> = (0..DECODE).map(|_| next()).collect();
    let bos = c.tokenizer.bos_id().unwrap_or(0);
    c.cluster
        .prefill(&tokens[..tokens.len().min(8)])
        .map_err(|e| anyhow!("warm-up: {e}"))?;
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for _ in 0..reps.max(1) {
        let (p, t) = time_run(&mut c.cluster, &tokens, &decode, bos)?;
        pp.extend(p);
        tg.extend(t);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    Ok((median(&mut tg), median(&mut pp)))
}
