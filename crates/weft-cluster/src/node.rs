//! `weft node`: a long-running worker. It takes one coordinator at a time on its control
//! port, loads the shard its plan names (only those bytes of its own model file), joins the
//! data-plane group and runs its part of every step until the coordinator stops or a peer
//! is lost; then it waits for the next coordinator. A failed request never ends the node.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft_comm::{Group, GroupOptions, TransportKind};
use weft_gguf::GgufFile;
use weft_kernels::ThreadPool;
use weft_model::{granularity, KvCache, Model, ModelConfig, SeqSpan, ShardSpec};

use crate::control::{self, FromNode, NodePlan, ToNode};
use crate::stage::StageCollective;
use crate::step::{
    encode_top_k, reply_bytes, StepHeader, HEADER_BYTES, KIND_BATCH, KIND_STOP, SPAN_BYTES,
    SPAN_LOGITS, SPAN_RESET, STATS_BYTES,
};

#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub secret: Vec<u8>,
    /// This node's own copy of the model (overrides the path in plans).
    pub model: Option<PathBuf>,
    /// Threads for compute; None takes the plan's.
    pub threads: Option<usize>,
    /// How long a waiting data-plane receive may busy-poll (None: weft-comm's default).
    /// A node with a core to itself spins through a whole pipeline stage's wait: waking a
    /// halted vCPU costs far more than the spinning, which takes nothing from anyone.
    pub spin: Option<Duration>,
}

/// Serves coordinators on `listener` forever (until the process is killed).
pub fn serve(listener: TcpListener, opts: NodeOptions) -> ! {
    let mut cache: Option<Loaded> = None;
    loop {
        let (mut stream, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if let Err(e) = control::accept(&mut stream, &opts.secret, Duration::from_secs(5)) {
            tracing::warn!("refused coordinator {from}: {e}");
            continue;
        }
        tracing::info!("coordinator {from} connected");
        match session(&mut stream, &opts, &listener, &mut cache) {
            Ok(()) => tracing::info!("coordinator {from} finished"),
            Err(e) => {
                tracing::warn!("request from {from} failed: {e}");
                let _ = control::send(&mut stream, &FromNode::Failed { error: e });
            }
        }
    }
}

/// A loaded shard, kept for the next coordinator with the same plan.
struct Loaded {
    key: String,
    model: Model,
    /// One KV cache per sequence slot of the plan.
    caches: Vec<KvCache>,
    pool: ThreadPool,
}

fn session(
    ctl: &mut TcpStream,
    opts: &NodeOptions,
    listener: &TcpListener,
    cache: &mut Option<Loaded>,
) -> Result<(), String> {
    let plan = match control::recv::<ToNode>(ctl, Duration::from_secs(30))? {
        ToNode::Plan(p) => *p,
        other => return Err(format!("expected a plan, got {other:?}")),
    };
    let path = opts
        .model
        .clone()
        .unwrap_or_else(|| PathBuf::from(&plan.model));
    let threads = opts.threads.unwrap_or(plan.threads).max(1);
    if plan.slots == 0 || plan.slots > control::MAX_SLOTS {
        return Err(format!(
            "the plan asks for {} sequence slots (1..={})",
            plan.slots,
            control::MAX_SLOTS
        ));
    }
    let key = format!(
        "{}|{}|{:?}|{}|{:?}|{}|{}|{}",
        path.display(),
        plan.tp_rank,
        plan.tp_weights,
        threads,
        plan.layers,
        plan.n_ctx,
        plan.ubatch,
        plan.slots
    );
    if cache.as_ref().map(|c| c.key != key).unwrap_or(true) {
        *cache = None; // free the old shard before loading the new one
        *cache = Some(load(&path, &plan, threads, key)?);
    }
    let loaded = cache.as_mut().ok_or("no shard loaded")?;
    // A fresh data listener on the control address's IP: the group's mesh forms on it.
    let ip = listener.local_addr().map_err(|e| e.to_string())?.ip();
    let data = weft_comm::bind(&format!("{ip}:0")).map_err(|e| e.to_string())?;
    let data_addr = data.local_addr().map_err(|e| e.to_string())?.to_string();
    control::send(
        ctl,
        &FromNode::Ready {
            data_addr,
            shard_bytes: loaded.model.weight_bytes_per_token() as u64,
            rss_bytes: crate::procinfo::peak_rss_bytes().unwrap_or(0),
        },
    )?;
    let addrs = match control::recv::<ToNode>(ctl, Duration::from_secs(30))? {
        ToNode::Go { addrs } => addrs,
        other => return Err(format!("expected go, got {other:?}")),
    };
    let mut gopts = group_options(
        plan.rank,
        &plan.transport,
        plan.link_delay_us,
        plan.timeout_ms,
        opts.secret.clone(),
    )?;
    if let Some(spin) = opts.spin {
        gopts.spin = spin;
    }
    let mut group =
        Group::with_listener(plan.rank, &addrs, data, gopts).map_err(|e| e.to_string())?;
    run_steps(&mut group, &plan, loaded)
}

/// The data-plane options every member of a cluster group uses; `rank` 0 is the coordinator.
pub(crate) fn group_options(
    rank: usize,
    transport: &str,
    link_delay_us: f64,
    timeout_ms: u64,
    secret: Vec<u8>,
) -> Result<GroupOptions, String> {
    Ok(GroupOptions {
        secret,
        transport: transport.parse::<TransportKind>()?,
        timeout: Duration::from_millis(timeout_ms),
        connect_timeout: Duration::from_secs(20),
        delay: Duration::from_nanos((link_delay_us * 1e3) as u64),
        max_frame: 1 << 20,
        // The coordinator (rank 0) samples between steps and otherwise waits: it blocks.
        passive: vec![0],
        spin: if rank == 0 {
            Duration::ZERO
        } else {
            GroupOptions::default().spin
        },
        ..GroupOptions::default()
    })
}

fn load(path: &PathBuf, plan: &NodePlan, threads: usize, key: String) -> Result<Loaded, String> {
    let t = Instant::now();
    let file = Arc::new(GgufFile::open(path).map_err(|e| e.to_string())?);
    let cfg = ModelConfig::from_gguf(&file).map_err(|e| e.to_string())?;
    let gran = granularity(&file, &cfg).map_err(|e| e.to_string())?;
    let (a, b) = plan.layers;
    let shard = ShardSpec::tensor_parallel(&cfg, gran, plan.tp_rank, &plan.tp_weights)
        .map_err(|e| e.to_string())?
        .with_layers(a..b);
    let model = Model::load(file, shard, plan.ubatch).map_err(|e| e.to_string())?;
    let caches = (0..plan.slots.max(1))
        .map(|_| model.new_cache(plan.n_ctx))
        .collect();
    tracing::info!(
        "loaded {} layers {a}..{b}, TP rank {} in {:.2} s",
        path.display(),
        plan.tp_rank,
        t.elapsed().as_secs_f64()
    );
    Ok(Loaded {
        key,
        model,
        caches,
        pool: ThreadPool::new(threads),
    })
}

/// Runs steps until the coordinator sends a stop; any error ends the session.
fn run_steps(group: &mut Group, plan: &NodePlan, l: &mut Loaded) -> Result<(), String> {
    let members = &plan.stages[plan.stage];
    let position = members
        .iter()
        .position(|&r| r == plan.rank)
        .ok_or("rank not in its stage")?;
    let mut st = Stepper {
        plan,
        position,
        ids: Vec::new(),
        id_bytes: Vec::new(),
        hidden_bytes: vec![0u8; l.model.ubatch() * l.model.cfg.n_embd * 4],
        logits: Vec::new(),
        best: Vec::new(),
        row_reply: Vec::new(),
        reply: Vec::new(),
        spans: Vec::new(),
        span_bytes: Vec::new(),
        comm: 0.0,
        syncs: 0,
    };
    let (mut compute, mut comm, mut idle, mut steps) = (0f64, 0f64, 0f64, 0u64);
    let err = |e: weft_comm::CommError| e.to_string();
    loop {
        let t_idle = Instant::now();
        let mut hb = [0u8; HEADER_BYTES];
        // Between requests the coordinator may be silent for long: no deadline here.
        group.recv_idle(0, &mut hb).map_err(err)?;
        idle += t_idle.elapsed().as_secs_f64();
        let h = StepHeader::decode(&hb)?;
        if h.kind == KIND_STOP {
            let mut out = Vec::with_capacity(STATS_BYTES);
            for v in [compute, comm, idle] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            let peak = crate::procinfo::peak_rss_bytes().unwrap_or(0);
            for v in [steps, st.syncs, peak] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            group.send(0, &out).map_err(err)?;
            return Ok(());
        }
        let t_step = Instant::now();
        st.comm = 0.0;
        if h.kind == KIND_BATCH {
            st.batch_step(group, l, &h)?;
        } else {
            st.run_step(group, l, &h)?;
        }
        steps += 1;
        comm += st.comm;
        compute += t_step.elapsed().as_secs_f64() - st.comm;
    }
}

/// A node's step buffers (reused, so steps allocate nothing) and its place in the plan.
struct Stepper<'p> {
    plan: &'p NodePlan,
    position: usize,
    ids: Vec<u32>,
    id_bytes: Vec<u8>,
    hidden_bytes: Vec<u8>,
    logits: Vec<f32>,
    best: Vec<(f32, u32)>,
    row_reply: Vec<u8>,
    reply: Vec<u8>,
    spans: Vec<SeqSpan>,
    span_bytes: Vec<u8>,
    /// Seconds of this step spent on the network, and all-reduces so far.
    comm: f64,
    syncs: u64,
}

fn words(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

impl Stepper<'_> {
    fn recv_ids(&mut self, group: &mut Group, n: usize) -> Result<(), String> {
        self.id_bytes.resize(n * 4, 0);
        group
            .recv(0, &mut self.id_bytes)
            .map_err(|e| e.to_string())?;
        self.ids.clear();
        self.ids.extend(words(&self.id_bytes));
        Ok(())
    }

    /// One sequence in slot 0 (`weft run`): a prompt of any length or one token.
    fn run_step(
        &mut self,
        group: &mut Group,
        l: &mut Loaded,
        h: &StepHeader,
    ) -> Result<(), String> {
        let n = h.n_tokens as usize;
        self.recv_ids(group, n)?;
        let kv = &mut l.caches[0];
        if h.pos0 == 0 {
            kv.clear();
        } else if kv.pos != h.pos0 as usize {
            return Err(format!(
                "step at position {} but this node's cache is at {}",
                h.pos0, kv.pos
            ));
        }
        if h.pos0 as usize + n > kv.n_ctx {
            return Err(format!(
                "{} tokens past the {}-token context",
                h.pos0 as usize + n,
                kv.n_ctx
            ));
        }
        let ub = l.model.ubatch();
        let ids = std::mem::take(&mut self.ids);
        let n_chunks = n.div_ceil(ub);
        let mut result = Ok(());
        for (ci, chunk) in ids.chunks(ub).enumerate() {
            self.spans.clear();
            self.spans.push(SeqSpan {
                cache: 0,
                n_tokens: chunk.len(),
                logits: h.want_logits != 0 && ci + 1 == n_chunks,
            });
            result = self.pass(group, l, chunk, h);
            if result.is_err() {
                break;
            }
        }
        self.ids = ids;
        result
    }

    /// Several sequences in their slots, as the spans after the header describe.
    fn batch_step(
        &mut self,
        group: &mut Group,
        l: &mut Loaded,
        h: &StepHeader,
    ) -> Result<(), String> {
        let n_spans = h.pos0 as usize;
        let n = h.n_tokens as usize;
        if n_spans == 0 || n_spans > l.caches.len() || n > l.model.ubatch() {
            return Err(format!(
                "a batched step of {n_spans} spans and {n} tokens (at most {} slots, {} tokens)",
                l.caches.len(),
                l.model.ubatch()
            ));
        }
        self.span_bytes.resize(n_spans * SPAN_BYTES, 0);
        group
            .recv(0, &mut self.span_bytes)
            .map_err(|e| e.to_string())?;
        self.spans.clear();
        let held = l.caches.len();
        for c in self.span_bytes.chunks_exact(SPAN_BYTES) {
            let w = |i: usize| u32::from_le_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]);
            let (slot, count, flags) = (w(0) as usize, w(4) as usize, w(8));
            let cache = l
                .caches
                .get_mut(slot)
                .ok_or_else(|| format!("span names slot {slot}; this node holds {held}"))?;
            if flags & SPAN_RESET != 0 {
                cache.clear();
            }
            self.spans.push(SeqSpan {
                cache: slot,
                n_tokens: count,
                logits: flags & SPAN_LOGITS != 0,
            });
        }
        self.recv_ids(group, n)?;
        let ids = std::mem::take(&mut self.ids);
        let result = self.pass(group, l, &ids, h);
        self.ids = ids;
        result
    }

    /// Runs `ids`, laid out as `self.spans`, through this node's layers: receive or embed,
    /// all-reduce inside the stage, hand on the hidden state, or reply with top-k.
    fn pass(
        &mut self,
        group: &mut Group,
        l: &mut Loaded,
        ids: &[u32],
        h: &StepHeader,
    ) -> Result<(), String> {
        let plan = self.plan;
        let stages = &plan.stages;
        let s = plan.stage;
        let (is_first, is_last) = (s == 0, s + 1 == stages.len());
        let e = l.model.cfg.n_embd;
        let m = ids.len();
        let err = |e: weft_comm::CommError| e.to_string();
        if is_first {
            l.model.embed_tokens(ids).map_err(|e| e.to_string())?;
        } else {
            let t = Instant::now();
            group
                .recv(stages[s - 1][0], &mut self.hidden_bytes[..m * e * 4])
                .map_err(err)?;
            self.comm += t.elapsed().as_secs_f64();
            for (dst, src) in l
                .model
                .hidden_mut(m)
                .iter_mut()
                .zip(self.hidden_bytes.chunks_exact(4))
            {
                *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
            }
        }
        let mut coll = StageCollective {
            group: &mut *group,
            members: &stages[s],
            position: self.position,
            comm_secs: 0.0,
            syncs: 0,
        };
        l.model
            .forward_hidden_batch(&self.spans, &mut l.caches, &mut coll, &l.pool)
            .map_err(|e| e.to_string())?;
        self.comm += coll.comm_secs;
        self.syncs += coll.syncs;
        if !is_last && self.position == 0 {
            let t = Instant::now();
            for (o, v) in self
                .hidden_bytes
                .chunks_exact_mut(4)
                .zip(l.model.hidden_mut(m).iter())
            {
                o.copy_from_slice(&v.to_le_bytes());
            }
            for &next in &stages[s + 1] {
                group
                    .send(next, &self.hidden_bytes[..m * e * 4])
                    .map_err(err)?;
            }
            self.comm += t.elapsed().as_secs_f64();
        }
        let rows = if is_last {
            l.model.gather_logit_rows(&self.spans)
        } else {
            0
        };
        if rows > 0 {
            let n_v = l.model.vocab_range().len();
            self.logits.resize(rows * n_v, 0.0);
            l.model
                .logits(0..rows, &l.pool, &mut self.logits)
                .map_err(|e| e.to_string())?;
            let k = h.top_k as usize;
            let vocab0 = l.model.vocab_range().start;
            self.reply.clear();
            for row in self.logits.chunks_exact(n_v) {
                encode_top_k(
                    row,
                    vocab0,
                    k,
                    h.want_norm != 0,
                    &mut self.best,
                    &mut self.row_reply,
                );
                if self.row_reply.len() != reply_bytes(k) {
                    return Err(format!("top-{k} of a {n_v}-token vocabulary slice"));
                }
                self.reply.extend_from_slice(&self.row_reply);
            }
            group.send(0, &self.reply).map_err(err)?;
        }
        Ok(())
    }
}
