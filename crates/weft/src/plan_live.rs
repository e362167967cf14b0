//! `weft plan` on running nodes: start them (`--nodes N`) or reach them (`--peers`), survey
//! their profiles and links at each delay, and print the planner's table; with `--check`,
//! run every layout that fits and print measured decode speed beside the predicted.

use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use serde_json::json;
use weft_cluster::planning::{cluster_profile, type_mix};
use weft_cluster::survey::survey;
use weft_gguf::GgufFile;
use weft_model::{Backend, ModelConfig};
use weft_plan::{plan, Candidate, ModelProfile, Workload};

use crate::best_layout::survey_options;
use crate::cluster_open::open;
use crate::cluster_secret::secret_from;
use crate::layout_args::LayoutArgs;
use crate::plan_args::PlanArgs;
use crate::plan_table::print_plans;

pub fn run(
    a: &PlanArgs,
    path: &Path,
    file: &GgufFile,
    cfg: &ModelConfig,
    model: &ModelProfile,
) -> Result<()> {
    let l = &a.live;
    let cores = weft_kernels::pool::usable_cores();
    let (_local, peers, secret, threads) = match (l.nodes, l.peers.is_empty()) {
        (Some(n), true) if n > 0 => {
            let secret = weft_comm::secret::random_secret();
            let threads = if l.pin {
                1
            } else {
                l.node_threads.unwrap_or((cores / n).max(1))
            };
            let (nodes, addrs) = l.start_local_nodes(n, &secret, threads, path)?;
            (Some(nodes), addrs, secret, threads)
        }
        (None, false) => {
            let secret = secret_from(&l.secret)?;
            let threads = l.node_threads.unwrap_or((cores / l.peers.len()).max(1));
            (None, l.peers.clone(), secret, threads)
        }
        _ => bail!("give --cluster FILE, --nodes N (N >= 1) or --peers A,B"),
    };
    let mix = type_mix(file, cfg);
    let delays = if a.delays.is_empty() {
        vec![l.link_delay_us]
    } else {
        a.delays.clone()
    };
    let workload = Workload {
        n_ctx: a.ctx,
        parallel: a.parallel.max(1),
        ..Workload::default()
    };
    let mut rows = Vec::new();
    for &delay in &delays {
        let mut opts = survey_options(&secret, l, delay, threads);
        opts.fresh = a.recalibrate;
        let s = survey(&peers, &opts).map_err(|e| anyhow!("surveying the nodes: {e}"))?;
        let cluster = cluster_profile(&s, &mix);
        if !a.check {
            if delays.len() > 1 {
                outln!("== injected link delay {delay} µs")?;
            }
            print_plans(a, path, model, &cluster)?;
            continue;
        }
        let plans = plan(model, &cluster, &workload).map_err(|e| anyhow!(e))?;
        let fitting: Vec<&Candidate> = plans.iter().filter(|p| p.unfit.is_none()).collect();
        // Round robin over the layouts, so that drift on a shared machine hits all alike;
        // each node keeps its loaded shard between sessions of the same layout.
        let mut samples = vec![Vec::new(); fitting.len()];
        for _ in 0..a.reps.max(1) {
            for (c, s) in fitting.iter().zip(&mut samples) {
                s.push(measure(c, &peers, &secret, l, delay, path, a)?);
            }
        }
        let measured: Vec<f64> = samples
            .iter_mut()
            .map(|s| {
                s.sort_by(f64::total_cmp);
                s[s.len() / 2]
            })
            .collect();
        let fastest = measured.iter().copied().fold(0.0, f64::max);
        for (rank, (c, &m)) in fitting.iter().zip(&measured).enumerate() {
            let p = c.prediction.decode_tok_s;
            rows.push(json!({
                "delay_us": delay, "layout": c.name, "rank": rank + 1,
                "predicted_tok_s": p, "measured_tok_s": m,
                "error": p / m - 1.0,
                "first_is_fastest": rank == 0 && m >= 0.95 * fastest,
            }));
        }
    }
    if !a.check {
        return Ok(());
    }
    let within = rows
        .iter()
        .filter(|r| r["error"].as_f64().is_some_and(|e| e.abs() <= 0.2))
        .count();
    let firsts: Vec<&serde_json::Value> = rows.iter().filter(|r| r["rank"] == 1).collect();
    let right = firsts
        .iter()
        .filter(|r| r["first_is_fastest"] == true)
        .count();
    if a.json {
        outln!(
            "{}",
            json!({"model": path.display().to_string(), "rows": rows,
                   "within_20pct": within, "cases": rows.len(),
                   "first_ranked_fastest": right, "delays": firsts.len()})
        )?;
        return Ok(());
    }
    outln!(
        "{:>9} {:<28} {:>5} {:>12} {:>12} {:>8}",
        "delay µs",
        "layout",
        "rank",
        "predicted",
        "measured",
        "error"
    )?;
    for r in &rows {
        outln!(
            "{:>9} {:<28} {:>5} {:>12.1} {:>12.1} {:>7.0}%",
            r["delay_us"],
            r["layout"].as_str().unwrap_or(""),
            r["rank"],
            r["predicted_tok_s"].as_f64().unwrap_or(0.0),
            r["measured_tok_s"].as_f64().unwrap_or(0.0),
            100.0 * r["error"].as_f64().unwrap_or(0.0)
        )?;
    }
    outln!(
        "{within} of {} predictions within ±20 %; the first-ranked layout was the fastest \
         (or within 5 %) at {right} of {} delays",
        rows.len(),
        firsts.len()
    )?;
    Ok(())
}

/// Decode tok/s of candidate `c` on its nodes, at `delay`: one session, one run.
fn measure(
    c: &Candidate,
    peers: &[String],
    secret: &str,
    l: &LayoutArgs,
    delay: f64,
    path: &Path,
    a: &PlanArgs,
) -> Result<f64> {
    let spec = &c.layout;
    let la = LayoutArgs {
        nodes: None,
        peers: spec.order.iter().map(|&i| peers[i].clone()).collect(),
        secret: Some(secret.to_string()),
        tp: Some(spec.tp),
        pp: Some(c.pp),
        ep: Some(spec.ep),
        layers: spec.layers.clone(),
        tp_weights: spec.tp_weights.clone(),
        ep_weights: spec.ep_weights.clone(),
        ep_spares: spec.ep_spares,
        link_delay_us: delay,
        ..l.clone()
    };
    let n_ctx = a.decode + 16;
    let mut o = open(&la, path, n_ctx, 1, false, 1, None)
        .map_err(|e| anyhow!("starting {} at {delay} µs: {e:#}", c.name))?;
    let n_vocab = o.n_vocab as u64;
    let mut next = crate::bench_tokens::pseudo_random_tokens(n_vocab);
    let bos = o.tokenizer.bos_id().unwrap_or(0);
    let cl = &mut o.cluster;
    let fail = |e| anyhow!("{} at {delay} µs: {e}", c.name);
    cl.prefill(&[bos, next(), next()]).map_err(fail)?;
    for _ in 0..4 {
        cl.decode(next()).map_err(fail)?;
    }
    cl.prefill(&[bos]).map_err(fail)?;
    let t = Instant::now();
    for _ in 0..a.decode.max(1) {
        cl.decode(next()).map_err(fail)?;
    }
    let rate = a.decode.max(1) as f64 / t.elapsed().as_secs_f64();
    cl.stop().map_err(|e| anyhow!(e))?;
    Ok(rate)
}
