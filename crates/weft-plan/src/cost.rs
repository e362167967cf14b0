//! The cost model: predicted decode, batched decode and prefill speed, time to first token
//! and memory per node of one layout. Every term is a measurement times a count:
//! weight bytes read / the node's measured streaming rate, syncs × the measured link
//! latency, bytes sent / the measured link bandwidth (ARCHITECTURE.md lists them).

use serde::{Deserialize, Serialize};

use crate::cluster::ClusterProfile;
use crate::engine::Handoff;
use crate::model::ModelProfile;

/// What the cluster will be asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// Context per sequence (KV cache).
    pub n_ctx: usize,
    /// Sequences decoded together in batched steps.
    pub parallel: usize,
    /// Prompt length of the time-to-first-token figure.
    pub prompt: usize,
    /// Tokens per prefill step.
    pub ubatch: usize,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            n_ctx: 4096,
            parallel: 1,
            prompt: 512,
            ubatch: 128,
        }
    }
}

/// A layout to evaluate: stage s holds `order[s*w..(s+1)*w]` (w = tp·ep); position p of a
/// stage is expert group p / tp and expert-column slice p % tp, as weft-cluster lays it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayoutSpec {
    pub tp: usize,
    pub ep: usize,
    pub order: Vec<usize>,
    pub layers: Vec<usize>,
    pub tp_weights: Vec<f64>,
    pub ep_weights: Vec<f64>,
    /// Spare experts each expert group holds beyond its share (redundant experts).
    #[serde(default)]
    pub ep_spares: usize,
}

impl LayoutSpec {
    pub fn width(&self) -> usize {
        self.tp * self.ep
    }

    /// Share of attention, dense FFN, head and KV heads of position p.
    pub fn dense_share(&self, p: usize) -> f64 {
        let w = |q: usize| self.ep_weights[q / self.tp] * self.tp_weights[q % self.tp];
        w(p) / (0..self.width()).map(w).sum::<f64>()
    }

    /// Share of the expert (expert, column) grid of position p.
    pub fn expert_share(&self, p: usize) -> f64 {
        let ep: f64 = self.ep_weights.iter().sum();
        let tp: f64 = self.tp_weights.iter().sum();
        self.ep_weights[p / self.tp] / ep * self.tp_weights[p % self.tp] / tp
    }

    /// Share of the expert grid position p holds, spares included, of `ne` experts.
    pub fn held_expert_share(&self, p: usize, ne: usize) -> f64 {
        let ep: f64 = self.ep_weights.iter().sum();
        let tp: f64 = self.tp_weights.iter().sum();
        let spares = if self.ep > 1 { self.ep_spares } else { 0 };
        let groups =
            (self.ep_weights[p / self.tp] / ep + spares as f64 / ne.max(1) as f64).min(1.0);
        groups * self.tp_weights[p % self.tp] / tp
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// One stream's decode speed.
    pub decode_tok_s: f64,
    /// Aggregate decode speed of `parallel` streams in batched steps.
    pub batch_tok_s: f64,
    pub prefill_tok_s: f64,
    /// Time to the first token of a `prompt`-token prompt.
    pub ttft_s: f64,
    /// Of one decode step, along its critical path: seconds computing (each stage's mean
    /// rank), waiting for a stage's slowest rank beyond the mean (uneven shares, the
    /// busiest expert group), and in syncs and hand-offs. They sum to 1 / decode_tok_s.
    pub compute_s: f64,
    #[serde(default)]
    pub bubble_s: f64,
    pub network_s: f64,
}

/// Expected busiest expert group's load over the mean, for `k` experts a token routes to
/// spread over `ep` groups (mean + c·sd of the multinomial; c fitted to the exact E[max]
/// of two groups, which is what decode waits for).
fn expert_imbalance(k: usize, ep: usize) -> f64 {
    if ep <= 1 || k == 0 {
        return 1.0;
    }
    let (k, e) = (k as f64, ep as f64);
    let mean = k / e;
    let sd = (k * (1.0 / e) * (1.0 - 1.0 / e)).sqrt();
    ((mean + 0.68 * (2.0 * e.ln()).sqrt() * sd) / mean).min(e)
}

/// The busiest group's expected load over the mean when each of `ep` even groups of `ne`
/// experts also holds `spares` of its neighbours' and each expert two groups hold goes
/// to the less loaded (as weft-model's moe.rs gives experts out: single holders first,
/// then spares by ascending id). No closed form: the mean over a fixed sequence of 4096
/// pseudo-random routings, the same at every call.
fn expert_imbalance_with_spares(k: usize, ne: usize, ep: usize, spares: usize) -> f64 {
    if spares == 0 || ep <= 1 || k == 0 || ne < k {
        return expert_imbalance(k, ep);
    }
    const DRAWS: usize = 4096;
    let held: Vec<(usize, usize)> = (0..ep)
        .map(|g| {
            let (a, b) = (g * ne / ep, (g + 1) * ne / ep);
            let len = (b - a + spares).min(ne);
            let start = a.saturating_sub(spares / 2).min(ne - len);
            (start, start + len)
        })
        .collect();
    let holders: Vec<Vec<usize>> = (0..ne)
        .map(|x| {
            (0..ep)
                .filter(|&g| held[g].0 <= x && x < held[g].1)
                .collect()
        })
        .collect();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut chosen, mut loads) = (vec![0usize; k], vec![0usize; ep]);
    let mut total = 0usize;
    for _ in 0..DRAWS {
        // k distinct experts, uniformly.
        let mut n = 0;
        while n < k {
            let x = (next() % ne as u64) as usize;
            if !chosen[..n].contains(&x) {
                chosen[n] = x;
                n += 1;
            }
        }
        chosen.sort_unstable();
        loads.fill(0);
        for &x in &chosen {
            if let [g] = holders[x][..] {
                loads[g] += 1;
            }
        }
        for &x in &chosen {
            if let [first, ref rest @ ..] = holders[x][..] {
                if !rest.is_empty() {
                    // The least loaded holder, the lower on a tie.
                    let g = rest
                        .iter()
                        .fold(first, |b, &g| if loads[g] < loads[b] { g } else { b });
                    loads[g] += 1;
                }
            }
        }
        total += loads.iter().copied().max().unwrap_or(0);
    }
    (total as f64 / DRAWS as f64) / (k as f64 / ep as f64)
}

/// Seconds of one step of `tokens` rows, along its critical path.
#[derive(Clone, Copy, Debug, Default)]
struct StepTime {
    /// Each stage's mean rank computing.
    compute: f64,
    /// Each stage's slowest rank beyond the mean: what the others wait for.
    bubble: f64,
    /// Syncs and hand-offs.
    network: f64,
}

impl StepTime {
    fn total(&self) -> f64 {
        self.compute + self.bubble + self.network
    }
}

/// One step of `tokens` rows.
fn step(
    m: &ModelProfile,
    c: &ClusterProfile,
    l: &LayoutSpec,
    tokens: usize,
    decode: bool,
) -> StepTime {
    let w = l.width();
    let (ne, k) = m.experts.unwrap_or((1, 1));
    // Distinct experts a step touches (uniform routing): all of them soon in prefill.
    let touched = 1.0 - (1.0 - k as f64 / ne as f64).powi(tokens as i32);
    let imbalance = if tokens == 1 {
        expert_imbalance_with_spares(k, ne, l.ep, l.ep_spares)
    } else {
        1.0
    };
    let proto = &c.engine;
    let mut t = StepTime::default();
    let mut first = 0;
    let stages = l.layers.len();
    for (s, &count) in l.layers.iter().enumerate() {
        let members = &l.order[s * w..(s + 1) * w];
        let range = first..first + count;
        first += count;
        let dense: f64 = range.clone().map(|i| m.active_bytes(i).0).sum();
        // Read whole by every rank of the stage, whatever its share.
        let replicated = m.replicated_bytes(range.clone());
        let dense = dense - replicated;
        // The head: every row of a decode step, only the last row of a prompt chunk.
        let (head, head_rows) = match (s + 1 == stages, decode) {
            (false, _) => (0.0, 0.0),
            (true, true) => (m.head_bytes as f64, tokens as f64),
            (true, false) => (m.head_bytes as f64, 1.0),
        };
        let experts: f64 = range.map(|i| m.layers[i].expert_bytes as f64).sum();
        let floor = count as f64 * proto.layer_overhead_us * 1e-6;
        // `busiest`: the rank's expert group is the step's busiest (EP decode).
        let rank_time = |p: usize, n: usize, busiest: bool| {
            let node = &c.nodes[n];
            let h = if proto.head_split {
                head * l.dense_share(p)
            } else {
                head
            };
            let d = dense * l.dense_share(p) + replicated;
            let e = experts * l.expert_share(p);
            if decode && tokens == 1 {
                let load = if busiest { imbalance } else { 1.0 };
                return floor + (d + h + e * touched * load) / node.decode_rate(w);
            }
            // Weights stream once per step; compute grows with the rows.
            let read = (d + h + e * touched) / node.decode_rate(w);
            let work = (tokens as f64 * (d + e * k as f64 / ne as f64) + head_rows * h)
                / node.prefill_rate(w);
            floor + read.max(work)
        };
        let (mut slowest, mut sum) = (0f64, 0f64);
        // The mean rank carries the mean expert load; the stage waits for its slowest
        // rank with the busiest group's load.
        for (p, &n) in members.iter().enumerate() {
            slowest = slowest.max(rank_time(p, n, true));
            sum += rank_time(p, n, false);
        }
        let mean = sum / w as f64;
        t.compute += mean;
        t.bubble += (slowest - mean).max(0.0);
        let hidden = tokens as f64 * m.n_embd as f64 * proto.wire_bytes;
        if w > 1 {
            let bytes = hidden;
            let mut worst = 0f64;
            for &a in members {
                for &b in members {
                    if a != b {
                        let one = proto.allreduce_s(w, bytes, c.rtt_us[a][b], c.bytes_per_s[a][b]);
                        worst = worst.max(one);
                    }
                }
            }
            t.network += 2.0 * count as f64 * worst;
        }
        if s > 0 {
            // Into this stage: from the previous one, or from the host that drives it.
            let from = match proto.handoff {
                Handoff::Chain => l.order[(s - 1) * w],
                Handoff::Star { .. } => l.order[0],
            };
            let to = members[0];
            let bytes = hidden;
            t.network += proto.handoff_s(bytes, c.rtt_us[from][to], c.bytes_per_s[from][to], count);
        }
    }
    // The token in, the top logits out.
    let (head, tail) = (l.order[0], l.order[l.order.len() - 1]);
    let tail = match proto.handoff {
        // The host fetched the last stage's output itself.
        Handoff::Star { .. } => head,
        Handoff::Chain => tail,
    };
    t.network += (c.coordinator_rtt_us[head] + c.coordinator_rtt_us[tail]) * 0.5e-6;
    t
}

/// Predicted speeds of layout `l`.
pub fn predict(m: &ModelProfile, c: &ClusterProfile, l: &LayoutSpec, w: &Workload) -> Prediction {
    let one = step(m, c, l, 1, true);
    let b = w.parallel.max(1);
    let batch = if b == 1 {
        one.total()
    } else {
        step(m, c, l, b, true).total()
    };
    let u = w.ubatch.max(1).min(w.prompt.max(1));
    let prefill_tok_s = u as f64 / step(m, c, l, u, false).total();
    Prediction {
        decode_tok_s: 1.0 / one.total(),
        batch_tok_s: b as f64 / batch,
        prefill_tok_s,
        ttft_s: w.prompt as f64 / prefill_tok_s + one.total(),
        compute_s: one.compute,
        bubble_s: one.bubble,
        network_s: one.network,
    }
}

/// Bytes each node of `l` (in `l.order`) needs: its weights and its KV caches, plus a
/// fixed allowance for the runtime and scratch buffers.
pub fn memory(m: &ModelProfile, l: &LayoutSpec, w: &Workload) -> Vec<u64> {
    const RUNTIME: f64 = 64e6;
    let width = l.width();
    let stages = l.layers.len();
    let mut out = vec![0u64; l.order.len()];
    let mut first = 0;
    for (s, &count) in l.layers.iter().enumerate() {
        let range = first..first + count;
        first += count;
        let dense: f64 = range
            .clone()
            .map(|i| (m.layers[i].attn_bytes + m.layers[i].ffn_bytes) as f64)
            .sum::<f64>()
            + if s + 1 == stages {
                m.head_bytes as f64
            } else {
                0.0
            };
        let replicated = m.replicated_bytes(range.clone());
        let experts: f64 = range.map(|i| m.layers[i].expert_bytes as f64).sum();
        let ne = m.experts.map_or(1, |(ne, _)| ne);
        let kv = (w.n_ctx * w.parallel.max(1) * count) as f64 * m.kv_bytes_per_token as f64;
        for p in 0..width {
            let a = l.dense_share(p);
            // KV heads are whole: a rank holds at least one.
            let kv_share = a.max(1.0 / m.n_head_kv.max(1) as f64);
            let bytes = (dense - replicated) * a
                + replicated
                + experts * l.held_expert_share(p, ne)
                + kv * kv_share
                + RUNTIME;
            out[s * width + p] = bytes as u64;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::NodeProfile;
    use crate::model::LayerProfile;

    /// Compute seconds of one decode step of a 1-layer model over TP=`tp` ranks that
    /// stream 1 byte/s, no links cost, with `replicated` of the 100 attention bytes read
    /// whole and a 60-byte head split or not.
    fn compute_of(tp: usize, replicated: u64, head_split: bool) -> f64 {
        let node = |i: usize| NodeProfile {
            name: format!("n{i}"),
            memory_bytes: 1 << 30,
            decode_bytes_per_s: 1.0,
            prefill_bytes_per_s: 1.0,
            loaded_decode_bytes_per_s: 0.0,
            loaded_prefill_bytes_per_s: 0.0,
        };
        let mut c = ClusterProfile::uniform((0..tp).map(node).collect(), 0.0, 1e12);
        c.engine.head_split = head_split;
        let m = ModelProfile {
            name: "m".into(),
            n_embd: 8,
            n_head: 4,
            n_head_kv: 4,
            layers: vec![LayerProfile {
                attn_bytes: 100,
                replicated_bytes: replicated,
                ..LayerProfile::default()
            }],
            embed_bytes: 0,
            head_bytes: 60,
            kv_bytes_per_token: 0,
            experts: None,
        };
        let l = LayoutSpec {
            tp,
            ep: 1,
            order: (0..tp).collect(),
            layers: vec![1],
            tp_weights: vec![1.0; tp],
            ep_weights: vec![1.0],
            ep_spares: 0,
        };
        predict(&m, &c, &l, &Workload::default()).compute_s
    }

    #[test]
    fn replicated_weights_and_an_unsplit_head_are_read_whole_by_every_rank() {
        assert!((compute_of(1, 40, true) - 160.0).abs() < 1e-9);
        // TP=2: (100 - 40) / 2 + 40 of the layer, and half the head.
        assert!((compute_of(2, 40, true) - 100.0).abs() < 1e-9);
        assert!((compute_of(2, 0, true) - 80.0).abs() < 1e-9);
        // A head left whole: 60 on each rank.
        assert!((compute_of(2, 40, false) - 130.0).abs() < 1e-9);
    }

    #[test]
    fn imbalance_of_two_groups_is_near_the_exact_expectation() {
        // E[max(X, 8 - X)] with X ~ Bin(8, 1/2) is 4 + E|X - 4| = 5.09: 1.27 of the mean.
        let f = expert_imbalance(8, 2);
        assert!((f - 1.27).abs() < 0.03, "{f}");
        assert_eq!(expert_imbalance(8, 1), 1.0);
        assert!(expert_imbalance(8, 64) <= 64.0);
    }

    #[test]
    fn spares_lower_the_busiest_groups_load() {
        // No spares: the simulation agrees with the closed form's 1.27.
        let none = expert_imbalance_with_spares(8, 64, 2, 0);
        assert_eq!(none, expert_imbalance(8, 2));
        // 4 spares a group (8 of 64 experts on both): E[max] falls from 5.02 to about 4.6.
        let four = expert_imbalance_with_spares(8, 64, 2, 4);
        assert!((four - 4.6 / 4.0).abs() < 0.03, "{four}");
        let eight = expert_imbalance_with_spares(8, 64, 2, 8);
        assert!(eight < four && eight > 1.0, "{eight} {four}");
        // Every group holding every expert balances to the ceiling of k / ep.
        assert!((expert_imbalance_with_spares(8, 64, 2, 64) - 1.0).abs() < 1e-9);
        assert!((expert_imbalance_with_spares(7, 64, 2, 64) - 4.0 / 3.5).abs() < 1e-9);
    }
}
