//! `weft bench` across local node processes: layouts (one node, TP, PP, hybrid) and link
//! delays measured side by side in one run, round-robin so drift hits all alike, with
//! syncs per token, the share of time nodes spend waiting on the network, per-node memory,
//! and a prediction from the seed's arithmetic (syncs × one-way latency).

use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use weft_model::Backend;

use crate::bench_args::BenchArgs;
use crate::cluster_open::{open, Opened};
use crate::layout_args::LayoutArgs;
use crate::paths::resolve_model;

/// One configuration: "1", "tp2", "pp3", "tp2xpp2" at a given link delay.
struct Config {
    name: String,
    shape: Shape,
    delay_us: f64,
}

/// A layout to compare: sizes and spare experts per expert group.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Shape {
    tp: usize,
    pp: usize,
    ep: usize,
    spares: usize,
}

/// "1", "tp2", "pp2", "ep2", "ep2s4" (EP=2, each group holding 4 spare experts), or a
/// product such as "ep2xtp2xpp2".
fn parse_layout(s: &str) -> Result<Shape> {
    let s = s.trim().to_ascii_lowercase();
    let mut shape = Shape {
        tp: 1,
        pp: 1,
        ep: 1,
        spares: 0,
    };
    if s == "1" {
        return Ok(shape);
    }
    let size = |v: &str, part: &str| -> Result<usize> {
        v.parse()
            .with_context(|| format!("layout {s:?}: bad size {part:?}"))
    };
    for part in s.split('x') {
        if let Some(v) = part.strip_prefix("tp") {
            shape.tp = size(v, part)?;
        } else if let Some(v) = part.strip_prefix("pp") {
            shape.pp = size(v, part)?;
        } else if let Some(v) = part.strip_prefix("ep") {
            let (groups, spares) = v.split_once('s').unwrap_or((v, "0"));
            shape.ep = size(groups, part)?;
            shape.spares = size(spares, part)?;
        } else {
            bail!("layout {s:?}: expected 1, tpN, ppN, epN[sM] or a product such as ep2xtp2");
        }
    }
    if shape.tp == 0 || shape.pp == 0 || shape.ep == 0 {
        bail!("layout {s:?}: sizes must be positive");
    }
    if shape.spares > 0 && shape.ep == 1 {
        bail!("layout {s:?}: spare experts need EP of 2 or more");
    }
    Ok(shape)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        0.0
    } else {
        s[s.len() / 2]
    }
}

/// One timed run on `cl`, as `weft bench` times every layout: a prefill of `prompt`, then
/// (after a BOS) a decode of `decode`'s tokens one at a time; tok/s of each (None for an
/// empty part).
pub fn time_run(
    cl: &mut impl Backend,
    prompt: &[u32],
    decode: &[u32],
    bos: u32,
) -> Result<(Option<f64>, Option<f64>)> {
    let mut pp = None;
    if !prompt.is_empty() {
        let t = Instant::now();
        cl.prefill(prompt).map_err(|e| anyhow!("prefill: {e}"))?;
        pp = Some(prompt.len() as f64 / t.elapsed().as_secs_f64());
    }
    let mut tg = None;
    if !decode.is_empty() {
        cl.prefill(&[bos])
            .map_err(|e| anyhow!("decode start: {e}"))?;
        let t = Instant::now();
        let mut tok = bos;
        for &next in decode {
            cl.decode(tok).map_err(|e| anyhow!("decode: {e}"))?;
            tok = next;
        }
        tg = Some(decode.len() as f64 / t.elapsed().as_secs_f64());
    }
    Ok((pp, tg))
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let path = resolve_model(a.model.clone())?;
    let delays: Vec<f64> = if a.delays.is_empty() {
        vec![a.layout.link_delay_us]
    } else {
        a.delays.clone()
    };
    let layouts: Vec<Shape> = if a.compare.is_empty() {
        let n = a.layout.nodes.unwrap_or(a.layout.peers.len()).max(1);
        let ep = a.layout.ep_groups();
        let pp = a.layout.pp.unwrap_or(1).max(1);
        let tp = a.layout.tp.unwrap_or(n / (pp * ep).max(1)).max(1);
        vec![Shape {
            tp,
            pp: a.layout.pp.unwrap_or(n / (tp * ep).max(1)).max(1),
            ep,
            spares: a.layout.ep_spares,
        }]
    } else {
        a.compare
            .iter()
            .map(|s| parse_layout(s))
            .collect::<Result<_>>()?
    };
    let mut configs = Vec::new();
    for &d in &delays {
        for &shape in &layouts {
            let Shape { tp, pp, ep, spares } = shape;
            let mut parts = Vec::new();
            for (what, n) in [("EP", ep), ("TP", tp), ("PP", pp)] {
                if n > 1 {
                    parts.push(format!("{what}={n}"));
                }
            }
            let mut name = if parts.is_empty() {
                "1 node".to_string()
            } else {
                parts.join(" x ")
            };
            if spares > 0 {
                name += &format!(" +{spares}");
            }
            configs.push(Config {
                name,
                shape,
                delay_us: d,
            });
        }
    }
    let n_ctx = (a.prefill + a.decode + 8).max(64);
    let mut clusters: Vec<Opened> = Vec::new();
    for c in &configs {
        let l = LayoutArgs {
            nodes: if a.layout.peers.is_empty() {
                Some(c.shape.tp * c.shape.pp * c.shape.ep)
            } else {
                None
            },
            tp: Some(c.shape.tp),
            pp: Some(c.shape.pp),
            ep: Some(c.shape.ep),
            ep_spares: c.shape.spares,
            ep_weights: if c.shape.ep == a.layout.ep_weights.len() {
                a.layout.ep_weights.clone()
            } else {
                Vec::new()
            },
            link_delay_us: c.delay_us,
            ..a.layout.clone()
        };
        clusters.push(
            open(&l, &path, n_ctx, 1, false, 1, None)
                .with_context(|| format!("starting {}", c.name))?,
        );
    }
    let n_vocab = clusters[0].n_vocab as u64;
    let mut next = crate::bench_tokens::pseudo_random_tokens(n_vocab);
    let prompt: Vec<u32> = (0..a.prefill.max(1)).map(|_| next()).collect();
    // Decode feeds the same pseudo-random tokens to every layout, as llama-bench does.
    let decode_tokens: Vec<u32> = (0..a.decode).map(|_| next()).collect();
    let bos = clusters[0].tokenizer.bos_id().unwrap_or(0);
    for c in clusters.iter_mut() {
        c.cluster
            .prefill(&prompt[..prompt.len().min(8)])
            .map_err(|e| anyhow!("warm-up: {e}"))?;
    }
    let mut pp = vec![Vec::new(); configs.len()];
    let mut tg = vec![Vec::new(); configs.len()];
    for _ in 0..a.reps.max(1) {
        for (i, c) in clusters.iter_mut().enumerate() {
            let (p, t) = time_run(&mut c.cluster, &prompt[..a.prefill], &decode_tokens, bos)
                .with_context(|| configs[i].name.clone())?;
            pp[i].extend(p);
            tg[i].extend(t);
        }
    }
    // One-node decode time per token, for the predictions.
    let t1 = configs
        .iter()
        .zip(&tg)
        .find(|(c, _)| (c.shape.tp, c.shape.pp, c.shape.ep) == (1, 1, 1) && c.delay_us == 0.0)
        .map(|(_, v)| 1.0 / median(v));
    let mut runs = Vec::new();
    for (i, c) in clusters.iter_mut().enumerate() {
        let layout = c.cluster.layout().clone();
        let stats = c
            .cluster
            .stop()
            .map_err(|e| anyhow!("{}: stop: {e}", configs[i].name))?;
        let comm: f64 = stats.iter().map(|s| s.comm_secs).sum();
        let busy: f64 = stats.iter().map(|s| s.comm_secs + s.compute_secs).sum();
        let layers: usize = layout.layers.iter().map(|r| r.len()).sum();
        let allreduces = if layout.width() > 1 { 2 * layers } else { 0 };
        let syncs = layout.syncs_per_token();
        let d = configs[i].delay_us * 1e-6;
        let predicted = t1.map(|t| 1.0 / (t / layout.width() as f64 + syncs as f64 * d));
        runs.push(json!({
            "layout": configs[i].name,
            "tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "ep_spares": layout.ep_spares,
            "link_delay_us": configs[i].delay_us,
            "pp_tok_s": median(&pp[i]), "pp_samples": pp[i],
            "tg_tok_s": median(&tg[i]), "tg_samples": tg[i],
            "allreduces_per_token": allreduces,
            "syncs_per_token": syncs,
            "seed_wait_ms_per_token": allreduces as f64 * d * 1e3,
            "network_share": if busy > 0.0 { comm / busy } else { 0.0 },
            "predicted_tg_tok_s": predicted,
            "nodes": stats,
        }));
    }
    let base = runs[0]["tg_tok_s"].as_f64().unwrap_or(0.0);
    if a.json {
        let mut v = json!({"model": path.display().to_string(), "pin": a.layout.pin, "runs": runs});
        if runs.len() == 1 {
            v["pp_tok_s"] = runs[0]["pp_tok_s"].clone();
            v["tg_tok_s"] = runs[0]["tg_tok_s"].clone();
        }
        outln!("{v}")?;
        return Ok(());
    }
    outln!(
        "{:<14} {:>8} {:>9} {:>9} {:>7} {:>6} {:>9} {:>10} {:>12}",
        "layout",
        "delay µs",
        "pp tok/s",
        "tg tok/s",
        "tg x",
        "syncs",
        "net wait",
        "seed ms/t",
        "predicted"
    )?;
    for r in &runs {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        let pred = r["predicted_tg_tok_s"]
            .as_f64()
            .map(|p| format!("{p:.1}"))
            .unwrap_or("-".into());
        outln!(
            "{:<14} {:>8} {:>9.1} {:>9.1} {:>7.2} {:>6} {:>8.0}% {:>10.2} {:>12}",
            r["layout"].as_str().unwrap_or("?"),
            f("link_delay_us"),
            f("pp_tok_s"),
            f("tg_tok_s"),
            f("tg_tok_s") / base.max(1e-9),
            r["syncs_per_token"],
            100.0 * f("network_share"),
            f("seed_wait_ms_per_token"),
            pred
        )?;
    }
    outln!("per-node peak RSS / shard weight bytes (MB):")?;
    for r in &runs {
        let nodes: Vec<String> = r["nodes"]
            .as_array()
            .map(|v| v.as_slice())
            .unwrap_or(&[])
            .iter()
            .map(|n: &Value| {
                format!(
                    "{:.0}/{:.0}",
                    n["peak_rss_bytes"].as_f64().unwrap_or(0.0) / 1e6,
                    n["shard_bytes"].as_f64().unwrap_or(0.0) / 1e6
                )
            })
            .collect();
        outln!(
            "  {:<14} delay {:>5}: {}",
            r["layout"].as_str().unwrap_or("?"),
            r["link_delay_us"],
            nodes.join("  ")
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_to_compare_parse_with_their_spares() {
        let shape = |tp, pp, ep, spares| Shape { tp, pp, ep, spares };
        assert_eq!(parse_layout("1").unwrap(), shape(1, 1, 1, 0));
        assert_eq!(parse_layout("ep2xtp2").unwrap(), shape(2, 1, 2, 0));
        assert_eq!(parse_layout("EP2s4").unwrap(), shape(1, 1, 2, 4));
        assert_eq!(parse_layout("ep3s2xpp2").unwrap(), shape(1, 2, 3, 2));
        for bad in ["tp2s4", "ep1s2", "ep2sx", "ep0", "dp2"] {
            assert!(parse_layout(bad).is_err(), "{bad}");
        }
    }
}
