//! Routed experts (qwen3moe's and deepseek2's sparse FFN, deepseek2's shared experts too):
//! a pure router that every rank runs alike, the
//! experts of this rank's tile, and a forward that reads only the experts tokens are
//! routed to: decode reads the k chosen experts, prefill groups the step's tokens by
//! expert so each expert's weights are read once per step. Where expert groups hold
//! spares (the same expert on several groups), each step gives every routed expert to
//! one holder, the least busy, so the stage waits less for its busiest group.

use std::sync::Arc;

use weft_gguf::GgufFile;
use weft_kernels::{ops, quant, ThreadPool};

use crate::config::{Arch, Gating, ModelConfig, MoeConfig, MAX_EXPERTS, MAX_TOP_K};
use crate::error::ModelError;
use crate::rows::{for_each_chunk, for_each_row, linear, linears_of_one_input, SendPtr};
use crate::shard::ShardSpec;
use crate::weights::{load_matrix_f32, load_vector, Linear};

/// Top-k routing: softmax or sigmoid scores, an optional selection bias (DeepSeek V3's
/// score correction), optional group-limited choice, renormalised and scaled weights.
/// Pure: no pool, no allocation; llama.cpp's `build_moe_ffn` in one function.
pub(crate) struct Router {
    /// `n_expert` rows of `n_embd` f32 weights.
    w: Vec<f32>,
    n_embd: usize,
    pub n_expert: usize,
    pub top_k: usize,
    pub norm: bool,
    gating: Gating,
    /// Added to the scores for choosing only; the weights come from the plain scores.
    bias: Option<Vec<f32>>,
    groups: Option<(usize, usize)>,
    scale: f32,
}

impl Router {
    pub fn new(w: Vec<f32>, n_embd: usize, moe: MoeConfig, bias: Option<Vec<f32>>) -> Self {
        Router {
            w,
            n_embd,
            n_expert: moe.n_expert,
            top_k: moe.n_expert_used,
            norm: moe.norm_topk,
            gating: moe.gating,
            bias,
            groups: moe.groups,
            scale: moe.weights_scale,
        }
    }

    /// Router logits of one hidden row. One fixed-order f32 path whatever the CPU, so
    /// that ranks on different hosts (AVX2 or not) pick the same experts bit for bit.
    pub fn logits(&self, x: &[f32], out: &mut [f32]) {
        for (o, row) in out[..self.n_expert]
            .iter_mut()
            .zip(self.w.chunks_exact(self.n_embd))
        {
            *o = dot_fixed_order(row, &x[..self.n_embd]);
        }
    }

    /// The `top_k` experts of `logits` and their weights, best first; ties go to the
    /// lower id, NaN ranks below every number. Scores are the softmax over all experts or
    /// each logit's sigmoid; the choice ranks score + bias, within the best groups when
    /// routing is group-limited (a group ranked by the sum of its two best); the weights
    /// are the chosen plain scores, renormalised when `norm`, then scaled.
    pub fn select(&self, logits: &[f32], ids: &mut [u32], weights: &mut [f32]) {
        let n = self.n_expert;
        let logits = &logits[..n];
        let mut probs = [0f32; MAX_EXPERTS];
        let mut keys = [0f32; MAX_EXPERTS];
        let (probs, keys) = (&mut probs[..n], &mut keys[..n]);
        match self.gating {
            Gating::Softmax => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut total = 0f32;
                for &l in logits {
                    total += (l - max).exp();
                }
                for (p, &l) in probs.iter_mut().zip(logits) {
                    *p = (l - max).exp() / total;
                }
            }
            Gating::Sigmoid => {
                for (p, &l) in probs.iter_mut().zip(logits) {
                    *p = 1.0 / (1.0 + (-l).exp());
                }
            }
        }
        // The softmax is monotone: ranking the logits ranks it without rounding ties,
        // unless groups are ranked by sums of scores (sums of logits rank otherwise).
        let by_logits =
            self.bias.is_none() && self.gating == Gating::Softmax && self.groups.is_none();
        for x in 0..n {
            let key = match &self.bias {
                Some(b) => probs[x] + b[x],
                None if by_logits => logits[x],
                None => probs[x],
            };
            keys[x] = if key.is_nan() { f32::NEG_INFINITY } else { key };
        }
        if let Some((n_group, n_used)) = self.groups {
            keep_best_groups(keys, n_group, n_used);
        }
        let k = self.top_k;
        // Insertion into a sorted top-k (one pass; `weights` holds the keys meanwhile).
        // Only a strictly greater key moves up, so ties keep the lower expert id first.
        let mut filled = 0;
        for (x, &key) in keys.iter().enumerate() {
            if filled == k {
                if key <= weights[k - 1] {
                    continue;
                }
                filled -= 1;
            }
            let mut i = filled;
            while i > 0 && key > weights[i - 1] {
                weights[i] = weights[i - 1];
                ids[i] = ids[i - 1];
                i -= 1;
            }
            weights[i] = key;
            ids[i] = x as u32;
            filled += 1;
        }
        for j in 0..k {
            weights[j] = probs[ids[j] as usize];
        }
        if self.norm {
            // llama.cpp clamps the sum at F16's smallest normal so it never divides by 0.
            let sum = weights[..k].iter().sum::<f32>().max(6.103_515_6e-5);
            weights[..k].iter_mut().for_each(|w| *w /= sum);
        }
        if self.scale != 1.0 {
            weights[..k].iter_mut().for_each(|w| *w *= self.scale);
        }
    }
}

/// Group-limited routing: ranks the `n_group` equal groups of `keys` by the sum of each
/// one's two best keys (its one key where a group has one) and sets every key outside
/// the best `n_used` groups to -inf. Ties go to the lower group.
fn keep_best_groups(keys: &mut [f32], n_group: usize, n_used: usize) {
    let per = keys.len() / n_group;
    let mut score = [0f32; MAX_EXPERTS];
    for (g, s) in score[..n_group].iter_mut().enumerate() {
        let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for &k in &keys[g * per..(g + 1) * per] {
            if k > a {
                b = a;
                a = k;
            } else if k > b {
                b = k;
            }
        }
        *s = if per == 1 { a } else { a + b };
    }
    let mut keep = [false; MAX_EXPERTS];
    for _ in 0..n_used {
        let best = (0..n_group)
            .filter(|&g| !keep[g])
            .fold(None, |b: Option<usize>, g| match b {
                Some(b) if score[b] >= score[g] || score[g].is_nan() => Some(b),
                _ => Some(g),
            });
        if let Some(g) = best {
            keep[g] = true;
        }
    }
    for g in 0..n_group {
        if !keep[g] {
            keys[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
        }
    }
}

/// Dot product with eight lanes summed in a fixed tree: vectorisable, and the same
/// result on every x86-64 CPU (no FMA contraction, no runtime dispatch).
fn dot_fixed_order(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ta.iter().zip(tb) {
        tail += x * y;
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// One expert's SwiGLU FFN, or this rank's column slice of it.
pub(crate) struct Expert {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Expert {
    fn n_bytes(&self) -> usize {
        self.gate.n_bytes() + self.up.n_bytes() + self.down.n_bytes()
    }
}

/// A MoE layer's FFN as this rank holds it: the whole router, its experts' tiles.
pub(crate) struct MoeFfn {
    pub router: Router,
    /// Global id of `experts[0]`.
    first: usize,
    experts: Vec<Expert>,
    /// This rank's expert group; per expert, the groups of the stage holding it,
    /// ascending; `shared` when some expert has several (spares), so that experts must be
    /// given out each step.
    group: usize,
    holders: Vec<Vec<usize>>,
    shared: bool,
    /// Columns of each held expert's FFN.
    pub n_ff_local: usize,
    /// This rank's columns of the shared experts (deepseek2), which every token runs;
    /// `None` where the model has none or this rank's slice is empty.
    shared_expert: Option<Expert>,
    gelu: bool,
}

impl MoeFfn {
    /// Loads layer `il`'s router and the experts `shard.experts`, columns `shard.expert_ffn`.
    pub fn load(
        f: &Arc<GgufFile>,
        il: usize,
        cfg: &ModelConfig,
        moe: MoeConfig,
        shard: &ShardSpec,
    ) -> Result<Self, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}");
        let e = cfg.n_embd;
        let (ne, ff) = (moe.n_expert, moe.n_ff_exp);
        // The selection bias is deepseek2's (llama.cpp reads it for no other family here).
        let bias = match cfg.arch == Arch::DeepSeek2 && f.has_tensor(&n("exp_probs_b.bias")) {
            true => Some(load_vector(f, &n("exp_probs_b.bias"), ne)?),
            false => None,
        };
        let router = Router::new(
            load_matrix_f32(f, &n("ffn_gate_inp.weight"), e, ne)?,
            e,
            moe,
            bias,
        );
        let shared_expert = load_shared_expert(f, il, cfg, moe, shard)?;
        let cols = shard.expert_ffn.clone();
        // Experts are interleaved as dense layers are (prefill's expert matmuls run the
        // packed tiles) where decode's row space, every chosen expert's rows end to end,
        // then stays cut at groups: both widths whole groups.
        let group = quant::pack::GROUP_ROWS;
        let pack = cols.len().is_multiple_of(group) && e.is_multiple_of(group);
        let laid = |l: Linear| if pack { l.settled(f) } else { l };
        let experts = load_experts(shard.experts.clone(), &|x| {
            Ok(Expert {
                gate: laid(Linear::load_expert_rows(
                    f,
                    &n("ffn_gate_exps.weight"),
                    x,
                    [e, ff, ne],
                    cols.clone(),
                )?),
                up: laid(Linear::load_expert_rows(
                    f,
                    &n("ffn_up_exps.weight"),
                    x,
                    [e, ff, ne],
                    cols.clone(),
                )?),
                down: laid(Linear::load_expert_cols(
                    f,
                    &n("ffn_down_exps.weight"),
                    x,
                    [ff, e, ne],
                    cols.clone(),
                )?),
            })
        })?;
        let groups = &shard.expert_groups;
        let holders: Vec<Vec<usize>> = (0..ne)
            .map(|x| {
                (0..groups.len())
                    .filter(|&g| groups[g].contains(&x))
                    .collect()
            })
            .collect();
        let shared = holders.iter().any(|h| h.len() > 1);
        Ok(MoeFfn {
            router,
            first: shard.experts.start,
            experts,
            group: shard.expert_group,
            holders,
            shared,
            n_ff_local: cols.len(),
            shared_expert,
            gelu: cfg.gelu,
        })
    }

    pub fn linears(&self) -> impl Iterator<Item = &Linear> {
        self.experts
            .iter()
            .chain(self.shared_expert.iter())
            .flat_map(|x| [&x.gate, &x.up, &x.down])
    }

    /// Columns of the shared experts this rank computes (0 without them).
    pub fn n_ff_shared_local(&self) -> usize {
        self.shared_expert.as_ref().map_or(0, |x| x.gate.n_out)
    }

    fn shared_bytes(&self) -> usize {
        self.shared_expert.as_ref().map_or(0, Expert::n_bytes)
    }

    /// Bytes of every held expert plus the router and the shared experts' slice.
    pub fn total_bytes(&self) -> usize {
        self.router_bytes() + self.expert_bytes() + self.shared_bytes()
    }

    /// Bytes of the held experts' weights.
    pub fn expert_bytes(&self) -> usize {
        self.experts.iter().map(Expert::n_bytes).sum()
    }

    /// Expected expert bytes read per decoded token: the held experts' share of the k a
    /// token is routed to (uniform routing), a spare counted as its holders' share.
    pub fn expected_expert_bytes(&self) -> usize {
        let held = self.first..self.first + self.experts.len();
        let share: f64 = held
            .map(|x| 1.0 / self.holders[x].len().max(1) as f64)
            .sum();
        let per_expert = self.expert_bytes() as f64 / self.experts.len().max(1) as f64;
        (per_expert * share * self.router.top_k as f64 / self.router.n_expert as f64) as usize
    }

    /// Expected bytes read per decoded token: the router, the expected experts and the
    /// shared experts' slice.
    pub fn active_bytes(&self) -> usize {
        self.router_bytes() + self.expected_expert_bytes() + self.shared_bytes()
    }

    fn router_bytes(&self) -> usize {
        self.router.w.len() * 4
    }
}

/// Loads experts `xs` with `one`, in order, spread over the machine's cores: where
/// experts are interleaved, each is copied and reordered byte by byte, and a large MoE
/// model holds tens of thousands of them (too small each for the packer's own threads).
fn load_experts(
    xs: std::ops::Range<usize>,
    one: &(dyn Fn(usize) -> Result<Expert, ModelError> + Sync),
) -> Result<Vec<Expert>, ModelError> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(xs.len())
        .max(1);
    let per = xs.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let r = xs.start + t * per..(xs.start + (t + 1) * per).min(xs.end);
                s.spawn(move || r.map(one).collect::<Result<Vec<_>, _>>())
            })
            .collect();
        // Every thread joined before any error returns: the scope would otherwise
        // re-raise a later thread's panic in place of the error.
        let parts: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        let mut out = Vec::with_capacity(xs.len());
        for part in parts {
            let part = part.map_err(|p| {
                let why = p
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| p.downcast_ref::<&str>().copied())
                    .unwrap_or("no message");
                ModelError::Invalid(format!("a thread loading experts panicked: {why}"))
            })?;
            out.extend(part?);
        }
        Ok(out)
    })
}

/// Layer `il`'s shared experts (`ffn_*_shexp`, `n_shared x n_ff_exp` columns), this
/// rank's slice: the stage splits them like a dense FFN, each rank taking the share of
/// the columns its dense FFN range has of `n_ff`, cut on ffn_down_shexp's blocks, so the
/// slices of a stage's ranks tile the columns exactly once. `None` without shared experts
/// or where this rank's slice is empty.
fn load_shared_expert(
    f: &Arc<GgufFile>,
    il: usize,
    cfg: &ModelConfig,
    moe: MoeConfig,
    shard: &ShardSpec,
) -> Result<Option<Expert>, ModelError> {
    let n = |s: &str| format!("blk.{il}.{s}");
    if moe.n_shared == 0 {
        return Ok(None);
    }
    // The product was checked against overflow with the metadata (config.rs).
    let (e, width) = (cfg.n_embd, moe.n_shared * moe.n_ff_exp);
    let block = f.tensor(&n("ffn_down_shexp.weight"))?.ty.block_size();
    let edge = |col: usize| {
        if col >= cfg.n_ff {
            width
        } else {
            col * width / cfg.n_ff / block * block
        }
    };
    let cols = edge(shard.ffn.start)..edge(shard.ffn.end);
    if cols.is_empty() {
        return Ok(None);
    }
    Ok(Some(Expert {
        gate: Linear::load_rows(f, &n("ffn_gate_shexp.weight"), e, width, cols.clone())?,
        up: Linear::load_rows(f, &n("ffn_up_shexp.weight"), e, width, cols.clone())?,
        down: Linear::load_cols(
            f,
            &n("ffn_down_shexp.weight"),
            width,
            e,
            cols,
            shard.tp_rank == 0,
        )?,
    }))
}

/// Scratch for routing and expert outputs, sized at load for a whole micro-batch.
pub(crate) struct MoeScratch {
    logits: Vec<f32>,
    ids: Vec<u32>,
    weights: Vec<f32>,
    /// Per held expert: where its (row, weight) entries start in `order`.
    starts: Vec<usize>,
    /// Choices given to each expert group so far in this step (spares).
    loads: Vec<u32>,
    /// Per expert: rows routed to it in this step, and the group computing them.
    rows_of: Vec<u32>,
    group_of: Vec<usize>,
    order: Vec<(u32, f32)>,
    /// Inputs gathered for one expert, and its gate, up and down outputs.
    xe: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    eo: Vec<f32>,
    /// Bytes of expert weights read since the counter was last taken.
    pub bytes_read: u64,
}

impl MoeScratch {
    /// Room for `ubatch` rows through layers shaped like `moe` (and `held` experts of
    /// `n_ff_local` columns each, in a stage of `groups` expert groups; `n_ff_local` also
    /// covers this rank's slice of the shared experts).
    pub fn new(
        ubatch: usize,
        n_embd: usize,
        moe: MoeConfig,
        (held, groups): (usize, usize),
        n_ff_local: usize,
    ) -> Self {
        let k = moe.n_expert_used;
        // Decode lays the k chosen experts side by side; prefill gathers up to ubatch rows.
        let rows = ubatch.max(k);
        MoeScratch {
            logits: vec![0.0; ubatch * moe.n_expert],
            ids: vec![0; ubatch * k],
            weights: vec![0.0; ubatch * k],
            starts: vec![0; held + 1],
            loads: vec![0; groups],
            rows_of: vec![0; moe.n_expert],
            group_of: vec![0; moe.n_expert],
            order: vec![(0, 0.0); ubatch * k],
            xe: vec![0.0; rows * n_embd],
            g: vec![0.0; rows * n_ff_local],
            u: vec![0.0; rows * n_ff_local],
            eo: vec![0.0; rows * n_embd],
            bytes_read: 0,
        }
    }
}

/// Buffers of the model's workspace that the expert FFN reads and writes.
pub(crate) struct MoeIo<'a> {
    /// Normed input rows (`m x n_embd`).
    pub xn: &'a [f32],
    /// Partial outputs (`m x n_embd`), summed across the stage by the caller.
    pub o: &'a mut [f32],
    pub acts: &'a mut [u8],
    pub tile: &'a mut [f32],
    pub s: &'a mut MoeScratch,
}

impl MoeFfn {
    /// Routes the `m` rows of `io.xn` and writes this rank's share of the expert mix
    /// into `io.o` (zeros for rows routed to no held expert).
    pub fn forward(&self, pool: &ThreadPool, io: MoeIo, n_embd: usize, m: usize) {
        let e = n_embd;
        let (ne, k) = (self.router.n_expert, self.router.top_k);
        let MoeIo {
            xn,
            o,
            acts,
            tile,
            s,
        } = io;
        let router = &self.router;
        for_each_row(pool, &mut s.logits, ne, ne, m, &|t, l| {
            router.logits(&xn[t * e..(t + 1) * e], l)
        });
        for t in 0..m {
            router.select(
                &s.logits[t * ne..(t + 1) * ne],
                &mut s.ids[t * k..(t + 1) * k],
                &mut s.weights[t * k..(t + 1) * k],
            );
        }
        if self.shared {
            self.keep_assigned(s, m);
        }
        self.group_by_expert(s, m);
        o[..m * e].fill(0.0);
        if m == 1 {
            self.decode(pool, &xn[..e], &mut o[..e], acts, s);
        } else {
            self.prefill(pool, xn, o, acts, tile, s, e, m);
        }
        if let Some(x) = &self.shared_expert {
            self.run_expert(pool, x, xn, m, acts, tile, s);
            for_each_chunk(pool, &mut o[..m * e], 64, &|r, d| {
                d.iter_mut().zip(&s.eo[r]).for_each(|(d, v)| *d += v)
            });
        }
    }

    /// `x`'s SwiGLU FFN on the `m` rows of `rows` into `s.eo` (through `s.g` and `s.u`).
    #[allow(clippy::too_many_arguments)]
    fn run_expert(
        &self,
        pool: &ThreadPool,
        x: &Expert,
        rows: &[f32],
        m: usize,
        acts: &mut [u8],
        tile: &mut [f32],
        s: &mut MoeScratch,
    ) {
        let (e, ff) = (x.gate.n_in, x.gate.n_out);
        linears_of_one_input(
            pool,
            rows,
            e,
            m,
            &mut [(&x.gate, &mut s.g[..]), (&x.up, &mut s.u[..])],
            acts,
            tile,
        );
        let (up, gelu) = (&s.u, self.gelu);
        for_each_chunk(pool, &mut s.g[..m * ff], 64, &|r, g| {
            ops::gated_activation(g, &up[r], gelu)
        });
        linear(pool, &x.down, &s.g, ff, m, &mut s.eo, e, acts, tile);
    }

    /// Several rows: each held expert runs once on the rows routed to it, gathered.
    #[allow(clippy::too_many_arguments)]
    fn prefill(
        &self,
        pool: &ThreadPool,
        xn: &[f32],
        o: &mut [f32],
        acts: &mut [u8],
        tile: &mut [f32],
        s: &mut MoeScratch,
        e: usize,
        m: usize,
    ) {
        debug_assert!(m > 1);
        for j in 0..self.experts.len() {
            let (a, b) = (s.starts[j], s.starts[j + 1]);
            if a == b {
                continue;
            }
            let x = &self.experts[j];
            let cnt = b - a;
            for (i, &(row, _)) in s.order[a..b].iter().enumerate() {
                let row = row as usize;
                s.xe[i * e..(i + 1) * e].copy_from_slice(&xn[row * e..(row + 1) * e]);
            }
            let xe = std::mem::take(&mut s.xe);
            self.run_expert(pool, x, &xe, cnt, acts, tile, s);
            s.xe = xe;
            for (i, &(row, w)) in s.order[a..b].iter().enumerate() {
                let row = row as usize;
                let (dst, src) = (&mut o[row * e..(row + 1) * e], &s.eo[i * e..(i + 1) * e]);
                dst.iter_mut().zip(src).for_each(|(d, v)| *d += w * v);
            }
            s.bytes_read += x.n_bytes() as u64;
        }
    }

    /// Gives each expert the step routes to to one group holding it, and drops from
    /// `s.ids` the choices other groups compute. An expert one group holds goes to it;
    /// then each spare (ascending id) goes with all its rows to its least loaded holder
    /// (ties: the lower group), loads counted in rows, so each expert's weights are read
    /// once per step and at decode the busiest group computes as few experts as the
    /// spares allow. Every rank routes alike, so every rank gives out alike and each
    /// choice runs exactly once across the stage.
    fn keep_assigned(&self, s: &mut MoeScratch, m: usize) {
        const DROPPED: u32 = u32::MAX;
        let ids = &mut s.ids[..m * self.router.top_k];
        give_out(
            &self.holders,
            ids,
            &mut s.rows_of,
            &mut s.loads,
            &mut s.group_of,
        );
        for id in ids {
            if s.group_of[*id as usize] != self.group {
                *id = DROPPED;
            }
        }
    }

    /// Counting sort of the step's (row, expert) choices by held expert, rows ascending.
    fn group_by_expert(&self, s: &mut MoeScratch, m: usize) {
        let k = self.router.top_k;
        let held = self.first..self.first + self.experts.len();
        s.starts.fill(0);
        for &id in &s.ids[..m * k] {
            if held.contains(&(id as usize)) {
                s.starts[id as usize - self.first + 1] += 1;
            }
        }
        for j in 0..self.experts.len() {
            s.starts[j + 1] += s.starts[j];
        }
        // `starts[j]` advances as entries land; it ends at the old `starts[j + 1]`, and
        // the shift below restores the starts.
        for t in 0..m {
            for i in 0..k {
                let id = s.ids[t * k + i] as usize;
                if held.contains(&id) {
                    let j = id - self.first;
                    s.order[s.starts[j]] = (t as u32, s.weights[t * k + i]);
                    s.starts[j] += 1;
                }
            }
        }
        for j in (1..=self.experts.len()).rev() {
            s.starts[j] = s.starts[j - 1];
        }
        s.starts[0] = 0;
    }

    /// One token: the chosen held experts' gate and up rows in one parallel pass, their
    /// down rows in a second, then the weighted sum. Only their bytes are read.
    fn decode(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        o: &mut [f32],
        acts: &mut [u8],
        s: &mut MoeScratch,
    ) {
        let e = x.len();
        let ff = self.n_ff_local;
        // The held experts this token chose, ascending; one row routes to each at most once.
        let mut slots = [0usize; MAX_TOP_K];
        let mut n = 0;
        for j in 0..self.experts.len() {
            if s.starts[j + 1] > s.starts[j] {
                slots[n] = j;
                n += 1;
            }
        }
        if n == 0 || ff == 0 {
            return;
        }
        let slots = &slots[..n];
        let first = &self.experts[slots[0]];
        let (gt, ut) = (first.gate.ty, first.up.ty);
        let ab_g = quant::act_bytes(gt, e);
        let ab_u = quant::act_bytes(ut, e);
        let shared = quant::vec_dot_type(gt) == quant::vec_dot_type(ut);
        quant::quantize_act(gt, x, &mut acts[..ab_g]);
        if !shared {
            quant::quantize_act(ut, x, &mut acts[ab_g..ab_g + ab_u]);
        }
        let (act_g, act_u) = acts.split_at(ab_g);
        let act_u = if shared {
            &act_g[..ab_u]
        } else {
            &act_u[..ab_u]
        };
        let act_g = &act_g[..ab_g];
        let (gp, up) = (
            SendPtr::new(s.g.as_mut_ptr()),
            SendPtr::new(s.u.as_mut_ptr()),
        );
        let experts = &self.experts;
        // Ranges start at a group of rows, as interleaved experts need (ff and e are
        // whole groups where experts are interleaved: `load`).
        let align = quant::pack::GROUP_ROWS;
        pool.for_ranges(n * 2 * ff, align, &|r| {
            for_segments(r, ff, |seg, i0, i1| {
                let (slot, half) = (seg / 2, seg % 2);
                let x = &experts[slots[slot]];
                let (w, act, p) = if half == 0 {
                    (&x.gate, act_g, gp)
                } else {
                    (&x.up, act_u, up)
                };
                // SAFETY: segment `seg` rows i0..i1 map to this task's own slots of g or u.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(p.get().add(slot * ff + i0), i1 - i0) };
                w.rows_into(i0..i1, act, out);
            })
        });
        for i in 0..n {
            ops::gated_activation(
                &mut s.g[i * ff..(i + 1) * ff],
                &s.u[i * ff..(i + 1) * ff],
                self.gelu,
            );
        }
        let dt = first.down.ty;
        let ab_d = quant::act_bytes(dt, ff);
        for i in 0..n {
            quant::quantize_act(
                dt,
                &s.g[i * ff..(i + 1) * ff],
                &mut acts[i * ab_d..(i + 1) * ab_d],
            );
        }
        let acts = &*acts;
        let ep = SendPtr::new(s.eo.as_mut_ptr());
        pool.for_ranges(n * e, align, &|r| {
            for_segments(r, e, |slot, i0, i1| {
                let w = &experts[slots[slot]].down;
                // SAFETY: rows i0..i1 of expert slot `slot` are this task's alone.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(ep.get().add(slot * e + i0), i1 - i0) };
                w.rows_into(i0..i1, &acts[slot * ab_d..(slot + 1) * ab_d], out);
            })
        });
        for (i, &j) in slots.iter().enumerate() {
            let w = s.order[s.starts[j]].1;
            let src = &s.eo[i * e..(i + 1) * e];
            o.iter_mut().zip(src).for_each(|(d, v)| *d += w * v);
            s.bytes_read += self.experts[j].n_bytes() as u64;
        }
    }
}

/// Fills `group_of[x]` with the group computing expert `x` in a step whose choices are
/// `ids`: its only holder, or for an expert several groups hold (ascending id, after the
/// single holders' rows are counted) the holder with the fewest rows so far, the lower
/// on a tie. Experts no choice names are left `usize::MAX`.
fn give_out(
    holders: &[Vec<usize>],
    ids: &[u32],
    rows_of: &mut [u32],
    loads: &mut [u32],
    group_of: &mut [usize],
) {
    rows_of.fill(0);
    group_of.fill(usize::MAX);
    for &id in ids {
        rows_of[id as usize] += 1;
    }
    loads.fill(0);
    for (x, h) in holders.iter().enumerate() {
        if let ([g], true) = (&h[..], rows_of[x] > 0) {
            loads[*g] += rows_of[x];
            group_of[x] = *g;
        }
    }
    for (x, h) in holders.iter().enumerate() {
        if let ([first, rest @ ..], true) = (&h[..], rows_of[x] > 0) {
            if !rest.is_empty() {
                let g = rest
                    .iter()
                    .fold(*first, |b, &g| if loads[g] < loads[b] { g } else { b });
                loads[g] += rows_of[x];
                group_of[x] = g;
            }
        }
    }
}

/// Splits a flat range over consecutive blocks of `len` into per-block pieces:
/// `f(block, start_in_block, end_in_block)`.
fn for_segments(r: std::ops::Range<usize>, len: usize, mut f: impl FnMut(usize, usize, usize)) {
    let mut at = r.start;
    while at < r.end {
        let block = at / len;
        let end = r.end.min((block + 1) * len);
        f(block, at - block * len, end - block * len);
        at = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(n_expert: usize, top_k: usize, norm: bool) -> MoeConfig {
        MoeConfig {
            n_expert,
            n_expert_used: top_k,
            n_ff_exp: 4,
            norm_topk: norm,
            gating: Gating::Softmax,
            weights_scale: 1.0,
            groups: None,
            n_shared: 0,
        }
    }

    fn router(n_expert: usize, top_k: usize, norm: bool) -> Router {
        Router::new(
            vec![0.0; n_expert * 8],
            8,
            config(n_expert, top_k, norm),
            None,
        )
    }

    fn sigmoid(x: f32) -> f32 {
        1.0 / (1.0 + (-x).exp())
    }

    #[test]
    fn sigmoid_scores_with_a_selection_bias_weigh_by_the_plain_scores() {
        let cfg = MoeConfig {
            gating: Gating::Sigmoid,
            weights_scale: 2.5,
            ..config(4, 2, true)
        };
        // The bias lifts expert 0 (score 0.5) over experts 1 and 2 for the choice only.
        let r = Router::new(vec![0.0; 32], 8, cfg, Some(vec![0.5, 0.0, 0.0, 0.0]));
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let (mut ids, mut w) = ([0u32; 2], [0f32; 2]);
        r.select(&logits, &mut ids, &mut w);
        assert_eq!(ids, [0, 1]);
        let (p0, p1) = (sigmoid(0.0), sigmoid(2.0));
        assert!((w[0] - 2.5 * p0 / (p1 + p0)).abs() < 1e-6, "{w:?}");
        assert!((w[1] - 2.5 * p1 / (p1 + p0)).abs() < 1e-6, "{w:?}");
        // Without renormalisation the weights are the sigmoids, scaled.
        let r = Router::new(
            vec![0.0; 32],
            8,
            MoeConfig {
                norm_topk: false,
                ..cfg
            },
            Some(vec![0.5, 0.0, 0.0, 0.0]),
        );
        r.select(&logits, &mut ids, &mut w);
        assert!((w[0] - 2.5 * p0).abs() < 1e-6 && (w[1] - 2.5 * p1).abs() < 1e-6);
    }

    #[test]
    fn group_limited_routing_chooses_inside_the_best_groups() {
        // Eight experts in four groups of two; the best two groups by their two-best sum
        // are group 1 (0.9 + 0.1 = 1.0) and group 3 (0.5 + 0.48): group 0 holds the best
        // single expert (0.95) but sums lower (0.95 + 0.0).
        let cfg = MoeConfig {
            gating: Gating::Sigmoid,
            groups: Some((4, 2)),
            ..config(8, 3, false)
        };
        let r = Router::new(vec![0.0; 64], 8, cfg, None);
        let p = [0.95f32, 0.0, 0.9, 0.1, 0.3, 0.3, 0.5, 0.48];
        let logits: Vec<f32> = p.iter().map(|&p| (p / (1.0 - p)).ln()).collect();
        let (mut ids, mut w) = ([0u32; 3], [0f32; 3]);
        r.select(&logits, &mut ids, &mut w);
        assert_eq!(ids, [2, 6, 7]);
        // Without groups the best expert overall is chosen.
        let r = Router::new(
            vec![0.0; 64],
            8,
            MoeConfig {
                groups: None,
                ..cfg
            },
            None,
        );
        r.select(&logits, &mut ids, &mut w);
        assert_eq!(ids, [0, 2, 6]);
        // Softmax scores: groups rank by the sum of probabilities, not of logits (group
        // 0's logits sum to -7 against group 1's 4, but its probabilities sum higher).
        let cfg = MoeConfig {
            groups: Some((2, 1)),
            ..config(4, 1, false)
        };
        let r = Router::new(vec![0.0; 32], 8, cfg, None);
        let (mut ids, mut w) = ([0u32; 1], [0f32; 1]);
        r.select(&[3.0, -10.0, 2.0, 2.0], &mut ids, &mut w);
        assert_eq!(ids, [0]);
        let mut keys = [1.0f32, 1.0, 1.0, 1.0];
        keep_best_groups(&mut keys, 4, 2);
        assert_eq!(
            keys,
            [1.0, 1.0, f32::NEG_INFINITY, f32::NEG_INFINITY],
            "ties: lower group"
        );
    }

    #[test]
    fn top_k_softmax_renormalised() {
        let r = router(4, 2, true);
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let (mut ids, mut w) = ([0u32; 2], [0f32; 2]);
        r.select(&logits, &mut ids, &mut w);
        assert_eq!(ids, [1, 2]);
        // exp(3) / (exp(3) + exp(2)) = 1 / (1 + e^-1)
        let want = 1.0 / (1.0 + (-1.0f32).exp());
        assert!((w[0] - want).abs() < 1e-6, "{w:?}");
        assert!((w[0] + w[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn without_renormalisation_weights_are_softmax_probabilities() {
        let r = router(3, 1, false);
        let (mut ids, mut w) = ([0u32; 1], [0f32; 1]);
        r.select(&[0.0, 0.0, 2f32.ln()], &mut ids, &mut w);
        assert_eq!(ids, [2]);
        assert!((w[0] - 0.5).abs() < 1e-6, "{w:?}");
    }

    #[test]
    fn ties_go_to_the_lower_expert_id() {
        let r = router(5, 3, true);
        let (mut ids, mut w) = ([0u32; 3], [0f32; 3]);
        r.select(&[0.5, 1.0, 0.5, 1.0, 0.5], &mut ids, &mut w);
        assert_eq!(ids, [1, 3, 0]);
        let r = router(3, 2, true);
        r.select(&[f32::NAN, 1.0, f32::NAN], &mut ids[..2], &mut w[..2]);
        assert_eq!(&ids[..2], &[1, 0]);
    }

    #[test]
    fn top_k_equals_a_stable_sort() {
        // Logits drawn from a few values so ties are common.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for n_expert in [1usize, 3, 8, 64, 128] {
            for k in [1usize, 2, 8] {
                if k > n_expert {
                    continue;
                }
                let r = router(n_expert, k, true);
                for _ in 0..20 {
                    let logits: Vec<f32> = (0..n_expert)
                        .map(|_| {
                            state ^= state << 13;
                            state ^= state >> 7;
                            state ^= state << 17;
                            (state % 7) as f32 * 0.5
                        })
                        .collect();
                    let mut order: Vec<usize> = (0..n_expert).collect();
                    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
                    let (mut ids, mut w) = (vec![0u32; k], vec![0f32; k]);
                    r.select(&logits, &mut ids, &mut w);
                    let want: Vec<u32> = order[..k].iter().map(|&e| e as u32).collect();
                    assert_eq!(ids, want, "{logits:?}");
                    assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-5);
                }
            }
        }
    }

    #[test]
    fn fixed_order_dot_matches_the_plain_sum() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let plain: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (*x as f64) * (*y as f64))
            .sum();
        assert!((dot_fixed_order(&a, &b) as f64 - plain).abs() < 1e-4);
    }

    #[test]
    fn spares_go_to_the_less_loaded_holder_with_all_their_rows() {
        // Eight experts, two groups: 0..5 and 3..8 (experts 3 and 4 held by both).
        let holders: Vec<Vec<usize>> = (0..8)
            .map(|x| (0..2).filter(|&g| [0..5, 3..8][g].contains(&x)).collect())
            .collect();
        let (mut rows, mut loads, mut to) = ([0u32; 8], [0u32; 2], [0usize; 8]);
        // Decode: 0, 1, 2 load group 0; both spares then go to group 1.
        give_out(&holders, &[0, 1, 2, 3, 4], &mut rows, &mut loads, &mut to);
        assert_eq!(&to[..5], &[0, 0, 0, 1, 1]);
        assert_eq!(loads, [3, 2]);
        assert_eq!(to[5], usize::MAX, "an expert no one chose has no group");
        // Even singles: the spares alternate, lower group first.
        give_out(&holders, &[0, 7, 3, 4], &mut rows, &mut loads, &mut to);
        assert_eq!((to[3], to[4]), (0, 1));
        assert_eq!(loads, [2, 2]);
        // A step of several rows: a spare goes whole (all its rows) to one holder, so its
        // weights are read once; loads count rows (3 : 1, then expert 3's three rows to
        // group 1, then expert 4's one to group 0).
        give_out(
            &holders,
            &[3, 0, 3, 1, 3, 2, 4, 7],
            &mut rows,
            &mut loads,
            &mut to,
        );
        assert_eq!((to[3], to[4]), (1, 0));
        assert_eq!(loads, [4, 4]);
        // Every chosen expert lands on a group that holds it.
        for (x, &g) in to.iter().enumerate() {
            assert!(g == usize::MAX || holders[x].contains(&g));
        }
    }

    #[test]
    fn segments_split_at_block_edges() {
        let mut got = Vec::new();
        for_segments(6..17, 5, |b, i, j| got.push((b, i, j)));
        assert_eq!(got, vec![(1, 1, 5), (2, 0, 5), (3, 0, 2)]);
    }
}
