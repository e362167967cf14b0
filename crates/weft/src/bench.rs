//! `weft bench`: prefill and decode speed measured like llama-bench (median and spread
//! over repetitions), bytes read per token, the memory-bandwidth roofline, load time and RSS.

use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;

use crate::bench_args::{BenchArgs, BenchWhat};
use crate::paths::resolve_model;
use crate::progress::{load_engine, resolve_threads};

pub fn run(a: BenchArgs) -> Result<()> {
    match a.what {
        Some(BenchWhat::Comm(c)) => return crate::bench_comm::run(c),
        Some(BenchWhat::Serve(c)) => return crate::bench_serve::run(c),
        Some(BenchWhat::CommRank(c)) => return crate::bench_comm::run_rank(c),
        None => {}
    }
    if a.kernels {
        return crate::bench_kernels::run(a.json);
    }
    if a.layout.is_cluster() || !a.compare.is_empty() {
        if a.depth > 0 {
            anyhow::bail!("--depth is measured on one node; drop it or the cluster flags");
        }
        return crate::bench_cluster::run(&a);
    }
    let path = resolve_model(a.model.clone())?;
    let threads = resolve_threads(a.threads)?;
    let n_ctx = (a.depth + a.prefill + a.decode + 8).max(64);
    let (mut engine, load_s) = load_engine(&path, threads, n_ctx, a.layout.cache_type)?;
    let n_vocab = engine.model.cfg.n_vocab as u32;
    // Pseudo-random prompt tokens, as llama-bench uses.
    let mut next = crate::bench_tokens::pseudo_random_tokens(n_vocab as u64);
    let prompt: Vec<u32> = (0..a.prefill).map(|_| next()).collect();
    let bos = engine.tokenizer.bos_id().unwrap_or(0);
    // The context each test starts after: BOS alone, or BOS and `depth - 1` more tokens.
    let context: Vec<u32> = std::iter::once(bos)
        .chain((1..a.depth.max(1)).map(|_| next()))
        .collect();
    // Warm-up: touch every weight page once.
    engine
        .prefill(&prompt[..prompt.len().min(8)])
        .context("warm-up")?;
    let mut pp = Vec::new();
    for _ in 0..a.reps.max(1) {
        if a.prefill > 0 {
            if a.depth > 0 {
                engine.prefill(&context).context("prefill depth")?;
            }
            let t = Instant::now();
            if a.depth > 0 {
                engine.extend(&prompt).context("prefill")?;
            } else {
                engine.prefill(&prompt).context("prefill")?;
            }
            pp.push(a.prefill as f64 / t.elapsed().as_secs_f64());
        }
    }
    let batched = (a.batch > 1)
        .then(|| batched_decode(&mut engine, a.batch, a.decode.max(1), a.reps.max(1), bos))
        .transpose()?;
    // Decode allocates nothing more, so the peak is reached; read before the bandwidth
    // probe's buffer exists.
    let rss = weft_cluster::procinfo::peak_rss_bytes();
    let probe = (!a.no_bandwidth).then(|| weft_kernels::roofline::ReadProbe::new(512 << 20));
    let bytes_per_token = engine.model.weight_bytes_per_token();
    // Each decode repetition right after a probe of the bandwidth: the roofline of that
    // moment, as a shared machine's bandwidth drifts from one second to the next.
    let (mut tg, mut bw, mut fractions) = (Vec::new(), Vec::new(), Vec::new());
    let mut expert_read = 0u64;
    for _ in 0..a.reps.max(1) {
        if a.decode == 0 {
            break;
        }
        let now_bw = probe.as_ref().map(|p| p.measure(&engine.pool, 3));
        engine.prefill(&context).context("decode start")?;
        engine.model.take_expert_bytes_read();
        let t = Instant::now();
        let mut tok = bos;
        for _ in 0..a.decode {
            engine.decode(tok).context("decode")?;
            // Random next tokens, as llama-bench feeds: on a MoE model a repeated
            // token would route to the same, cache-warm experts every step.
            tok = next();
        }
        let rate = a.decode as f64 / t.elapsed().as_secs_f64();
        tg.push(rate);
        expert_read += engine.model.take_expert_bytes_read();
        if let Some(b) = now_bw {
            bw.push(b);
            fractions.push(rate * bytes_per_token as f64 / b);
        }
    }
    let moe = moe_report(&engine.model, expert_read, a.decode * a.reps.max(1));
    let bandwidth = match (&probe, bw.is_empty()) {
        (None, _) => None,
        (Some(_), false) => Some(median_sd(&bw).0),
        (Some(p), true) => Some(p.measure(&engine.pool, 3)),
    };
    let fraction = (!fractions.is_empty()).then(|| median_sd(&fractions).0);
    let (pp_med, pp_sd) = median_sd(&pp);
    let (tg_med, tg_sd) = median_sd(&tg);
    let roofline = bandwidth.map(|bw| bw / bytes_per_token as f64);
    drop(probe);
    let file_bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let kv_bytes = engine.kv.bytes();
    let kv_per_token = engine
        .model
        .cfg
        .kv_bytes_per_token(engine.model.cache_type());
    if a.json {
        outln!(
            "{}",
            json!({
                "model": path.display().to_string(),
                "threads": threads,
                "pp": a.prefill, "tg": a.decode, "reps": a.reps, "depth": a.depth,
                "pp_tok_s": pp_med, "pp_tok_s_sd": pp_sd, "pp_samples": pp,
                "tg_tok_s": tg_med, "tg_tok_s_sd": tg_sd, "tg_samples": tg,
                "bytes_per_token": bytes_per_token,
                "memory_bandwidth_gb_s": bandwidth.map(|b| b / 1e9),
                "roofline_tok_s": roofline,
                "memory_bandwidth_samples_gb_s": bw.iter().map(|b| b / 1e9).collect::<Vec<_>>(),
                "roofline_fraction": fraction,
                "load_s": load_s,
                "peak_rss_bytes": rss,
                "file_bytes": file_bytes,
                "kv_bytes": kv_bytes,
                "kv_bytes_per_token": kv_per_token.0,
                "kv_bytes_per_token_full": kv_per_token.1,
                "batch": a.batch,
                "batch_tg_tok_s": batched,
                "moe": moe,
            })
        )?;
    } else {
        outln!(
            "model {} | {threads} threads | load {load_s:.2}s",
            path.display()
        )?;
        // As llama-bench names its tests: "pp512", or "pp512 @ d4096" after a context.
        let at = if a.depth > 0 {
            format!(" @ d{}", a.depth)
        } else {
            String::new()
        };
        outln!(
            "{:<12} {pp_med:8.1} tok/s  ± {pp_sd:.1}",
            format!("pp{}{at}", a.prefill)
        )?;
        outln!(
            "{:<12} {tg_med:8.1} tok/s  ± {tg_sd:.1}",
            format!("tg{}{at}", a.decode)
        )?;
        if let Some(b) = batched {
            outln!(
                "tg{:<5} {b:8.1} tok/s  aggregate of {} sequences in batched steps ({:.2}x)",
                a.decode,
                a.batch,
                b / tg_med.max(1e-9)
            )?;
        }
        outln!(
            "bytes read per decoded token: {:.1} MB",
            bytes_per_token as f64 / 1e6
        )?;
        if !moe.is_null() {
            let f = |k: &str| moe[k].as_f64().unwrap_or(0.0);
            outln!(
                "MoE: {:.2} B of {:.2} B parameters active per token ({} of {} experts); \
                 weights read per decoded token {:.1} MB measured, {:.1} MB active, {:.1} MB total",
                f("active_params") / 1e9,
                f("total_params") / 1e9,
                moe["experts_used"],
                moe["experts"],
                f("measured_bytes_per_token") / 1e6,
                f("active_bytes_per_token") / 1e6,
                f("total_bytes") / 1e6
            )?;
        }
        if let (Some(bw), Some(r)) = (bandwidth, roofline) {
            let reach = match fraction {
                Some(f) => format!(
                    "; decode reaches {:.0}% of it (median of each repetition against the \
                     probe just before it)",
                    100.0 * f
                ),
                None => String::new(),
            };
            outln!(
                "memory bandwidth {:.1} GB/s -> roofline {r:.1} tok/s{reach}",
                bw / 1e9
            )?;
        }
        outln!(
            "{}",
            crate::inspect::kv_per_token_line(&engine.model.cfg, engine.model.cache_type())
        )?;
        if let Some(rss) = rss {
            outln!(
                "peak RSS {:.1} MB (file {:.1} MB, KV cache {:.1} MB)",
                rss as f64 / 1e6,
                file_bytes as f64 / 1e6,
                kv_bytes as f64 / 1e6
            )?;
        }
    }
    Ok(())
}

/// For a MoE model: parameters and weight bytes, active per token against the total, and
/// the bytes the decode loop really read per token (`expert_read` over `tokens`).
/// Parameters are counted as llama.cpp counts them (every tensor, the embedding too);
/// an expert tensor's share is experts used / experts.
fn moe_report(model: &weft_model::Model, expert_read: u64, tokens: usize) -> serde_json::Value {
    let Some(m) = model.cfg.moe else {
        return serde_json::Value::Null;
    };
    let (mut total, mut active) = (0f64, 0f64);
    for t in model.file().tensors() {
        let n = t.n_elements() as f64;
        total += n;
        active += if t.name.contains("_exps.") {
            n * m.n_expert_used as f64 / m.n_expert as f64
        } else {
            n
        };
    }
    let (_, expected_experts) = model.expert_bytes();
    let active_bytes = model.weight_bytes_per_token();
    let dense_bytes = active_bytes - expected_experts;
    let measured = dense_bytes as f64 + expert_read as f64 / tokens.max(1) as f64;
    json!({
        "experts": m.n_expert,
        "experts_used": m.n_expert_used,
        "total_params": total,
        "active_params": active,
        "total_bytes": model.total_weight_bytes(),
        "active_bytes_per_token": active_bytes,
        "measured_bytes_per_token": measured,
        "measured_over_active": measured / active_bytes.max(1) as f64,
    })
}

/// Median aggregate tok/s of `b` sequences decoding `n` tokens each, one batched step
/// per token for all of them.
fn batched_decode(
    engine: &mut weft_model::Engine,
    b: usize,
    n: usize,
    reps: usize,
    bos: u32,
) -> Result<f64> {
    use weft_model::{Identity, SeqSpan};
    let model = &mut engine.model;
    let mut caches: Vec<_> = (0..b).map(|_| model.new_cache(n + 8)).collect();
    let spans: Vec<SeqSpan> = (0..b)
        .map(|i| SeqSpan {
            cache: i,
            n_tokens: 1,
            logits: true,
        })
        .collect();
    let n_v = model.vocab_range().len();
    let mut logits = Vec::new();
    let mut rates = Vec::new();
    for _ in 0..reps {
        caches.iter_mut().for_each(|c| c.clear());
        let mut toks = vec![bos; b];
        let t = Instant::now();
        for _ in 0..n {
            model
                .forward_batch(
                    &toks,
                    &spans,
                    &mut caches,
                    &mut Identity,
                    &engine.pool,
                    &mut logits,
                )
                .context("batched decode")?;
            for (i, tok) in toks.iter_mut().enumerate() {
                *tok = weft_model::sampler::argmax(&logits[i * n_v..(i + 1) * n_v]);
            }
        }
        rates.push((b * n) as f64 / t.elapsed().as_secs_f64());
    }
    Ok(median_sd(&rates).0)
}

fn median_sd(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let med = if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    let mean = s.iter().sum::<f64>() / s.len() as f64;
    let var = s.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / s.len() as f64;
    (med, var.sqrt())
}
