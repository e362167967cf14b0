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
use weft_model::{granularity, KvCache, Model, ModelConfig, ShardSpec};

use crate::control::{self, FromNode, NodePlan, ToNode};
use crate::stage::StageCollective;
use crate::step::{encode_top_k, reply_bytes, StepHeader, HEADER_BYTES, KIND_STOP, STATS_BYTES};

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
    kv: KvCache,
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
    let key = format!(
        "{}|{}|{:?}|{}|{:?}|{}|{}",
        path.display(),
        plan.tp_rank,
        plan.tp_weights,
        threads,
        plan.layers,
        plan.n_ctx,
        plan.ubatch
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
    let kv = model.new_cache(plan.n_ctx);
    tracing::info!(
        "loaded {} layers {a}..{b}, TP rank {} in {:.2} s",
        path.display(),
        plan.tp_rank,
        t.elapsed().as_secs_f64()
    );
    Ok(Loaded {
        key,
        model,
        kv,
        pool: ThreadPool::new(threads),
    })
}

/// Runs steps until the coordinator sends a stop; any error ends the session.
fn run_steps(group: &mut Group, plan: &NodePlan, l: &mut Loaded) -> Result<(), String> {
    let stages = &plan.stages;
    let s = plan.stage;
    let members = &stages[s];
    let position = members
        .iter()
        .position(|&r| r == plan.rank)
        .ok_or("rank not in its stage")?;
    let is_first = s == 0;
    let is_last = s + 1 == stages.len();
    let e = l.model.cfg.n_embd;
    let vocab0 = l.model.vocab_range().start;
    let mut ids = Vec::new();
    let mut id_bytes = Vec::new();
    let mut hidden_bytes = vec![0u8; l.model.ubatch() * e * 4];
    let mut logits = Vec::new();
    let mut best = Vec::new();
    let mut reply = Vec::new();
    let (mut compute, mut comm, mut idle, mut steps, mut syncs) = (0f64, 0f64, 0f64, 0u64, 0u64);
    let err = |e: weft_comm::CommError| e.to_string();
    loop {
        let t_idle = Instant::now();
        let mut hb = [0u8; HEADER_BYTES];
        // Between requests the coordinator may be silent for long: no deadline here.
        group.recv_idle(0, &mut hb).map_err(err)?;
        idle += t_idle.elapsed().as_secs_f64();
        let h = StepHeader::decode(&hb)?;
        if h.kind == KIND_STOP {
            let mut st = Vec::with_capacity(STATS_BYTES);
            for v in [compute, comm, idle] {
                st.extend_from_slice(&v.to_le_bytes());
            }
            for v in [steps, syncs, crate::procinfo::peak_rss_bytes().unwrap_or(0)] {
                st.extend_from_slice(&v.to_le_bytes());
            }
            group.send(0, &st).map_err(err)?;
            return Ok(());
        }
        let n = h.n_tokens as usize;
        id_bytes.resize(n * 4, 0);
        group.recv(0, &mut id_bytes).map_err(err)?;
        ids.clear();
        ids.extend(
            id_bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        if h.pos0 == 0 {
            l.kv.clear();
        } else if l.kv.pos != h.pos0 as usize {
            return Err(format!(
                "step at position {} but this node's cache is at {}",
                h.pos0, l.kv.pos
            ));
        }
        if h.pos0 as usize + n > l.kv.n_ctx {
            return Err(format!(
                "{} tokens past the {}-token context",
                h.pos0 as usize + n,
                l.kv.n_ctx
            ));
        }
        let t_step = Instant::now();
        let mut comm_step = 0f64;
        let ub = l.model.ubatch();
        let n_chunks = n.div_ceil(ub);
        for (ci, chunk) in ids.chunks(ub).enumerate() {
            let m = chunk.len();
            if is_first {
                l.model.embed_tokens(chunk).map_err(|e| e.to_string())?;
            } else {
                let t = Instant::now();
                let prev_leader = stages[s - 1][0];
                group
                    .recv(prev_leader, &mut hidden_bytes[..m * e * 4])
                    .map_err(err)?;
                comm_step += t.elapsed().as_secs_f64();
                for (dst, src) in l
                    .model
                    .hidden_mut(m)
                    .iter_mut()
                    .zip(hidden_bytes.chunks_exact(4))
                {
                    *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
                }
            }
            let mut coll = StageCollective {
                group: &mut *group,
                members,
                position,
                comm_secs: 0.0,
                syncs: 0,
            };
            l.model
                .forward_hidden(m, &mut l.kv, &mut coll, &l.pool)
                .map_err(|e| e.to_string())?;
            comm_step += coll.comm_secs;
            syncs += coll.syncs;
            if !is_last && position == 0 {
                let t = Instant::now();
                for (o, v) in hidden_bytes
                    .chunks_exact_mut(4)
                    .zip(l.model.hidden_mut(m).iter())
                {
                    o.copy_from_slice(&v.to_le_bytes());
                }
                for &next in &stages[s + 1] {
                    group.send(next, &hidden_bytes[..m * e * 4]).map_err(err)?;
                }
                comm_step += t.elapsed().as_secs_f64();
            }
            if is_last && h.want_logits != 0 && ci + 1 == n_chunks {
                logits.resize(l.model.vocab_range().len(), 0.0);
                l.model
                    .logits(m - 1..m, &l.pool, &mut logits)
                    .map_err(|e| e.to_string())?;
                let k = h.top_k as usize;
                encode_top_k(&logits, vocab0, k, h.want_norm != 0, &mut best, &mut reply);
                if reply.len() != reply_bytes(k) {
                    return Err(format!(
                        "top-{k} of a {}-token vocabulary slice",
                        logits.len()
                    ));
                }
                group.send(0, &reply).map_err(err)?;
            }
        }
        steps += 1;
        comm += comm_step;
        compute += t_step.elapsed().as_secs_f64() - comm_step;
    }
}
