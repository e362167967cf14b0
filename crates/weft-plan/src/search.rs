//! The search: every (TP, EP, PP) factorisation of the node count that the model's heads
//! and experts allow, nodes ordered so stages fall inside fast islands, TP/EP shares even
//! or by speed or memory, layers balanced by each stage's predicted time within its
//! memory; each candidate predicted, checked for fit, and ranked.

use serde::{Deserialize, Serialize};

use crate::cluster::ClusterProfile;
use crate::cost::{memory, predict, LayoutSpec, Prediction, Workload};
use crate::model::ModelProfile;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub layout: LayoutSpec,
    pub pp: usize,
    /// "EP=2 x TP=2 x PP=2", "1 node".
    pub name: String,
    pub prediction: Prediction,
    /// Bytes each node needs, in `layout.order`.
    pub memory: Vec<u64>,
    /// Why the layout cannot run, if it cannot ("node b needs 12.1 GB, offers 8.0 GB").
    pub unfit: Option<String>,
}

/// Bytes in decimal units with one decimal: "3.1 GB", "118.9 MB".
fn gb(b: f64) -> String {
    let (v, unit) = [(1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")]
        .into_iter()
        .find(|(u, _)| b >= *u)
        .unwrap_or((1.0, "B"));
    format!("{:.1} {unit}", b / v)
}

/// Every layout of the cluster's nodes (all of them) for `m` under `w`: the ones that fit
/// first, fastest one-stream decode first; then the others, each with its reason.
pub fn plan(m: &ModelProfile, c: &ClusterProfile, w: &Workload) -> Result<Vec<Candidate>, String> {
    c.validate()?;
    let n = c.nodes.len();
    let n_layer = m.layers.len();
    if n_layer == 0 {
        return Err("the model has no layers".into());
    }
    let all = node_order(c);
    let mut out = Vec::new();
    // All the nodes, and every shorter prefix of the order (the fastest island first):
    // adding a slow node or a slow link can cost more than it gives.
    for used in (1..=n).rev() {
        let order = &all[..used];
        for pp in (1..=used.min(n_layer)).filter(|p| used.is_multiple_of(*p)) {
            let width = used / pp;
            for ep in (1..=width).filter(|e| width.is_multiple_of(*e)) {
                let tp = width / ep;
                if ep > 1 && m.experts.is_none_or(|(ne, _)| ep > ne) {
                    continue;
                }
                if width > m.n_head {
                    continue;
                }
                // With experts split, also each group holding a quarter of its share again
                // as spares from its neighbours: less waiting on the busiest group at
                // decode, for that much more memory (ranked if it fits).
                // Even groups only: the nodes give experts out by count, not by speed.
                let spares = match m.experts {
                    Some((ne, _)) if ep > 1 && ne / (4 * ep) > 0 => ne / (4 * ep),
                    _ => 0,
                };
                for (tp_weights, ep_weights) in share_variants(c, order, tp, ep) {
                    let even = ep_weights.windows(2).all(|p| p[0] == p[1]);
                    let offered = if even && spares > 0 {
                        &[0, spares][..]
                    } else {
                        &[0][..]
                    };
                    for &ep_spares in offered {
                        let mut spec = LayoutSpec {
                            tp,
                            ep,
                            order: order.to_vec(),
                            layers: vec![0; pp],
                            tp_weights: tp_weights.clone(),
                            ep_weights: ep_weights.clone(),
                            ep_spares,
                        };
                        balance_layers(m, c, w, &mut spec);
                        out.push(evaluate(m, c, w, spec, n));
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| {
        (a.unfit.is_some()).cmp(&b.unfit.is_some()).then(
            b.prediction
                .decode_tok_s
                .total_cmp(&a.prediction.decode_tok_s),
        )
    });
    out.dedup_by(|a, b| a.layout == b.layout);
    Ok(out)
}

/// One layout with even shares over `order`'s nodes (TP x EP ranks a stage, `pp` stages),
/// its layers balanced by predicted stage time within memory; None when the nodes do not
/// divide into it, or the model has too few layers, heads or experts for it.
pub fn even_layout(
    m: &ModelProfile,
    c: &ClusterProfile,
    w: &Workload,
    order: &[usize],
    (tp, ep, pp): (usize, usize, usize),
) -> Option<Candidate> {
    let width = tp * ep;
    let allowed = width > 0
        && pp > 0
        && width * pp == order.len()
        && pp <= m.layers.len()
        && width <= m.n_head
        && (ep == 1 || m.experts.is_some_and(|(ne, _)| ep <= ne));
    if !allowed {
        return None;
    }
    let mut spec = LayoutSpec {
        tp,
        ep,
        order: order.to_vec(),
        layers: vec![0; pp],
        tp_weights: vec![1.0; tp],
        ep_weights: vec![1.0; ep],
        ep_spares: 0,
    };
    balance_layers(m, c, w, &mut spec);
    Some(evaluate(m, c, w, spec, c.nodes.len()))
}

/// Predicts and checks one layout (of `spec.order`'s nodes out of `nodes`).
pub fn evaluate(
    m: &ModelProfile,
    c: &ClusterProfile,
    w: &Workload,
    spec: LayoutSpec,
    nodes: usize,
) -> Candidate {
    let pp = spec.layers.len();
    let mem = memory(m, &spec, w);
    let unfit = spec
        .order
        .iter()
        .zip(&mem)
        .find(|(&node, &need)| need > c.nodes[node].memory_bytes)
        .map(|(&node, &need)| {
            format!(
                "node {} needs {}, offers {} (the model is {} in all)",
                c.nodes[node].name,
                gb(need as f64),
                gb(c.nodes[node].memory_bytes as f64),
                gb(m.total_bytes() as f64)
            )
        });
    let mut parts = Vec::new();
    for (what, k) in [("EP", spec.ep), ("TP", spec.tp), ("PP", pp)] {
        if k > 1 {
            parts.push(format!("{what}={k}"));
        }
    }
    let uneven = |v: &[f64]| v.windows(2).any(|p| (p[0] - p[1]).abs() > 1e-9);
    let mut name = if parts.is_empty() {
        "1 node".to_string()
    } else {
        parts.join(" x ")
    };
    if uneven(&spec.tp_weights) || uneven(&spec.ep_weights) {
        let w: Vec<String> = spec
            .tp_weights
            .iter()
            .chain(if spec.ep > 1 {
                &spec.ep_weights[..]
            } else {
                &[]
            })
            .map(|x| format!("{x}"))
            .collect();
        name += &format!(" {}", w.join(":"));
    }
    if spec.ep > 1 && spec.ep_spares > 0 {
        name += &format!(" +{} spare experts", spec.ep_spares);
    }
    if spec.order.len() < nodes {
        name += &format!(" ({} of {nodes} nodes)", spec.order.len());
    }
    Candidate {
        name,
        prediction: predict(m, c, &spec, w),
        memory: mem,
        pp,
        layout: spec,
        unfit,
    }
}

/// Islands largest first (so equal-width stages fall inside them), fastest node first
/// within each.
fn node_order(c: &ClusterProfile) -> Vec<usize> {
    let mut islands = c.islands(4.0);
    islands.sort_by_key(|i| std::cmp::Reverse(i.len()));
    islands
        .into_iter()
        .flat_map(|mut i| {
            i.sort_by(|&a, &b| {
                c.nodes[b]
                    .decode_bytes_per_s
                    .total_cmp(&c.nodes[a].decode_bytes_per_s)
            });
            i
        })
        .collect()
}

/// Even shares, and shares by speed and by memory where nodes differ (position p's
/// figure is the mean over stages of the node at p).
fn share_variants(
    c: &ClusterProfile,
    order: &[usize],
    tp: usize,
    ep: usize,
) -> Vec<(Vec<f64>, Vec<f64>)> {
    let width = tp * ep;
    let stages = order.len() / width;
    let mean_at = |p: usize, f: &dyn Fn(usize) -> f64| {
        (0..stages).map(|s| f(order[s * width + p])).sum::<f64>() / stages as f64
    };
    let mut out = vec![(vec![1.0; tp], vec![1.0; ep])];
    let speed = |n: usize| c.nodes[n].decode_bytes_per_s;
    let mem = |n: usize| c.nodes[n].memory_bytes as f64;
    for f in [&speed as &dyn Fn(usize) -> f64, &mem] {
        let pos: Vec<f64> = (0..width).map(|p| mean_at(p, f)).collect();
        // TP weights: the mean over expert groups; EP weights: the sum over a group.
        let tpw: Vec<f64> = (0..tp)
            .map(|t| (0..ep).map(|e| pos[e * tp + t]).sum::<f64>() / ep as f64)
            .collect();
        let epw: Vec<f64> = (0..ep)
            .map(|e| (0..tp).map(|t| pos[e * tp + t]).sum::<f64>())
            .collect();
        let norm = |v: Vec<f64>| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min).max(1e-12);
            v.into_iter()
                .map(|x| (x / lo * 100.0).round() / 100.0)
                .collect::<Vec<_>>()
        };
        let v = (norm(tpw), norm(epw));
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// Gives each stage its layer count: one layer at a time to the stage whose predicted
/// time grows least, among stages with memory for one more (a mean layer's weights and
/// KV share); when memory runs out everywhere the rest go by time alone, and the fit
/// check then names the node.
fn balance_layers(m: &ModelProfile, c: &ClusterProfile, w: &Workload, spec: &mut LayoutSpec) {
    let pp = spec.layers.len();
    let n_layer = m.layers.len();
    let width = spec.width();
    let mean = |f: &dyn Fn(usize) -> f64| (0..n_layer).map(f).sum::<f64>() / n_layer as f64;
    let active = mean(&|i| {
        let (d, e) = m.active_bytes(i);
        d + e
    });
    let dense_mem = mean(&|i| (m.layers[i].attn_bytes + m.layers[i].ffn_bytes) as f64);
    let expert_mem = mean(&|i| m.layers[i].expert_bytes as f64);
    let kv = (w.n_ctx * w.parallel.max(1)) as f64 * m.kv_bytes_per_token as f64;
    let node = |s: usize, p: usize| &c.nodes[spec.order[s * width + p]];
    let last = |s: usize| s + 1 == pp;
    // Per stage: seconds per layer and for the head (slowest position), and the most
    // layers its members' memory holds.
    let mut per_layer = vec![0f64; pp];
    let mut head = vec![0f64; pp];
    let mut cap = vec![usize::MAX; pp];
    for s in 0..pp {
        for p in 0..width {
            let ne = m.experts.map_or(1, |(ne, _)| ne);
            let (a, e) = (spec.dense_share(p), spec.held_expert_share(p, ne));
            let bw = node(s, p).decode_rate(width);
            per_layer[s] = per_layer[s].max(a * active / bw);
            let head_bytes = if last(s) {
                m.head_bytes as f64 * a
            } else {
                0.0
            };
            head[s] = head[s].max(head_bytes / bw);
            let kv_share = a.max(1.0 / m.n_head_kv.max(1) as f64);
            let per = dense_mem * a + expert_mem * e + kv * kv_share;
            let room = node(s, p).memory_bytes as f64 - head_bytes - 64e6;
            let fit = if room <= 0.0 {
                0
            } else {
                (room / per.max(1.0)).floor() as usize
            };
            cap[s] = cap[s].min(fit);
        }
    }
    spec.layers = vec![1; pp];
    for _ in pp..n_layer {
        let time = |s: usize, layers: &[usize]| (layers[s] + 1) as f64 * per_layer[s] + head[s];
        let layers = spec.layers.clone();
        let pick = (0..pp)
            .filter(|&s| layers[s] < cap[s])
            .min_by(|&a, &b| time(a, &layers).total_cmp(&time(b, &layers)))
            .or_else(|| (0..pp).min_by(|&a, &b| time(a, &layers).total_cmp(&time(b, &layers))));
        if let Some(s) = pick {
            spec.layers[s] += 1;
        }
    }
}

#[cfg(test)]
mod tests;
