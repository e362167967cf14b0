//! `weft node`: a long-running worker. It takes one coordinator at a time on its control
//! port, loads the shard its plan names (only those bytes of its own model file), joins the
//! data-plane group and runs its part of every step until the coordinator stops or a peer
//! is lost; then it waits for the next coordinator. A failed request never ends the node.

use std::collections::VecDeque;
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use weft_comm::{Group, GroupOptions, Liveness, TransportKind};
use weft_gguf::GgufFile;
use weft_kernels::ThreadPool;
use weft_model::memory::human_bytes;
use weft_model::{granularity, KvCache, Model, ModelConfig, SeqSpan, ShardSpec, StageSplit};

use crate::activity::WorkCounters;
use crate::control::{self, FromNode, NodePlan, ShareSpec, SurveyRequest, ToNode};
use crate::heartbeat::{ControlLink, Hooks};
use crate::share::NodeShards;
use crate::stage::StageCollective;
use crate::step::{
    encode_top_k, reply_bytes, StepHeader, HEADER_BYTES, KIND_BATCH, KIND_STOP, SPAN_BYTES,
    SPAN_LOGITS, SPAN_RESET, STATS_BYTES,
};

/// How long an unauthenticated connection may take to prove itself.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
/// Handshakes in flight at once; a new connection past this closes the oldest pending
/// one, so silent connections cannot keep a real coordinator out.
const MAX_PENDING: usize = 32;
/// How long an authenticated coordinator waits for the session before it is told the
/// node is busy with another.
const BUSY_WAIT: Duration = Duration::from_secs(10);
/// How long a coordinator may be silent (no message, no heartbeat) on the control channel.
pub const CONTROL_SILENCE: Duration = Duration::from_secs(10);
/// The environment variable of the test aid in `load`: milliseconds added to each
/// layer's load.
pub const LOAD_DELAY_ENV: &str = "WEFT_TEST_LOAD_DELAY_MS";
/// Ranks a node's liveness table can hold before the plan says how many there are.
const MAX_RANKS: usize = 4096;

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
    /// Bytes this node may use for its shard's weights and KV caches; a plan that needs
    /// more is refused before the weights are read or the caches allocated.
    pub memory_limit: Option<u64>,
    /// The node's weft home (models/ it holds, calibration/ for its cached kernel speeds).
    pub home: Option<PathBuf>,
    /// Directories a model file a coordinator names must lie in (empty: `home`/models).
    /// A node opens no other path a coordinator sends: only these and its own `model`.
    pub model_dirs: Vec<PathBuf>,
    /// Test aid: every stretch of compute takes this many times as long (spinning), to
    /// emulate a slower machine beside faster ones. 1: off.
    pub slowdown: f64,
    /// The member list this node keeps and answers membership requests from (`discovery`).
    pub membership: Option<Arc<crate::discovery::Membership>>,
    /// Bytes the shard cache (`home`/shards) may take; least recently used models are
    /// evicted past it. None: no limit.
    pub cache_limit: Option<u64>,
}

impl NodeOptions {
    /// Where this node caches fetched shards.
    pub fn shards_dir(&self) -> Option<PathBuf> {
        self.home.as_ref().map(|h| h.join("shards"))
    }
}

/// The file a coordinator named, if it lies in one of the node's model directories (after
/// following links and `..`); otherwise an error naming the path and the directories.
fn allowed_model(opts: &NodeOptions, asked: &str) -> Result<PathBuf, String> {
    let dirs: Vec<PathBuf> = if opts.model_dirs.is_empty() {
        opts.home.iter().map(|h| h.join("models")).collect()
    } else {
        opts.model_dirs.clone()
    };
    let real = std::fs::canonicalize(asked)
        .map_err(|e| format!("the coordinator's model {asked}: {e}"))?;
    let inside = dirs.iter().any(|d| {
        std::fs::canonicalize(d)
            .map(|d| real.starts_with(d))
            .unwrap_or(false)
    });
    if inside {
        return Ok(real);
    }
    let names: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    Err(format!(
        "the coordinator asked for {asked}, which is outside this node's model directories \
         ({}): start the node with --model FILE or --models-dir DIR, or put the file there",
        if names.is_empty() {
            "none".into()
        } else {
            names.join(", ")
        }
    ))
}

/// An authenticated coordinator's control link and the liveness its heartbeats feed.
struct Accepted {
    link: ControlLink<ToNode, FromNode>,
    liveness: Arc<Liveness>,
    from: String,
    /// The coordinator's first message, read before the session (see `accept_loop`).
    first: std::cell::Cell<Option<ToNode>>,
}

/// One session at a time: `busy` while a coordinator is being served.
#[derive(Default)]
struct Gate {
    busy: Mutex<bool>,
    freed: Condvar,
}

impl Gate {
    /// Takes the session, waiting up to `wait` for the current one to end.
    fn acquire(&self, wait: Duration) -> bool {
        let Ok(g) = self.busy.lock() else {
            return false;
        };
        let Ok((mut g, _)) = self.freed.wait_timeout_while(g, wait, |busy| *busy) else {
            return false;
        };
        if *g {
            return false;
        }
        *g = true;
        true
    }

    fn release(&self) {
        if let Ok(mut g) = self.busy.lock() {
            *g = false;
        }
        self.freed.notify_one();
    }
}

/// Serves coordinators on `listener` forever (until the process is killed).
pub fn serve(listener: TcpListener, opts: NodeOptions) -> ! {
    let ip = listener
        .local_addr()
        .map(|a| a.ip())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]));
    let (tx, rx) = mpsc::channel::<Accepted>();
    let gate = Arc::new(Gate::default());
    // What this node's beats report: one session at a time, so one set for the process.
    let work = Arc::new(WorkCounters::default());
    let shards = opts.shards_dir().map(|d| Arc::new(NodeShards::new(d)));
    if let Some(home) = opts.home.clone() {
        // The model files' content hashes, for surveys; a failure only leaves them out.
        let _ = std::thread::Builder::new()
            .name("weft-hash-models".into())
            .spawn(move || crate::profile::hash_models(&home));
    }
    {
        let (secret, gate, work) = (opts.secret.clone(), gate.clone(), work.clone());
        let members = opts.membership.clone();
        let shards = shards.clone();
        if let Err(e) = std::thread::Builder::new()
            .name("weft-accept".into())
            .spawn(move || accept_loop(listener, secret, tx, gate, members, work, shards))
        {
            tracing::error!("cannot start the accept thread: {e}");
            std::process::exit(1);
        }
    }
    let mut cache: Option<Loaded> = None;
    loop {
        let Ok(acc) = rx.recv() else {
            tracing::error!("the accept thread has stopped");
            std::process::exit(1);
        };
        tracing::info!("coordinator {} connected", acc.from);
        match session(&acc, &opts, ip, &mut cache, &work, shards.as_deref()) {
            Ok(()) => tracing::info!("coordinator {} finished", acc.from),
            Err(e) => {
                tracing::warn!("request from {} failed: {e}", acc.from);
                let _ = acc.link.send(&FromNode::Failed { error: e });
            }
        }
        drop(acc);
        gate.release();
    }
}

/// Accepts connections and runs each handshake on its own thread with a short deadline,
/// so that silent or slow connections cannot delay a real coordinator; authenticated
/// coordinators wait for the session in turn.
fn accept_loop(
    listener: TcpListener,
    secret: Vec<u8>,
    tx: mpsc::Sender<Accepted>,
    gate: Arc<Gate>,
    members: Option<Arc<crate::discovery::Membership>>,
    work: Arc<WorkCounters>,
    shards: Option<Arc<NodeShards>>,
) {
    let pending: Arc<Mutex<VecDeque<(u64, TcpStream)>>> = Arc::default();
    let next_id = AtomicU64::new(0);
    for conn in listener.incoming() {
        let mut stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let from = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "(unknown)".into());
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        if let (Ok(mut p), Ok(dup)) = (pending.lock(), stream.try_clone()) {
            if p.len() >= MAX_PENDING {
                if let Some((_, oldest)) = p.pop_front() {
                    tracing::debug!("too many pending handshakes: closing the oldest");
                    let _ = oldest.shutdown(Shutdown::Both);
                }
            }
            p.push_back((id, dup));
        }
        let (secret, tx, gate, pending) =
            (secret.clone(), tx.clone(), gate.clone(), pending.clone());
        let (members, work, shards) = (members.clone(), work.clone(), shards.clone());
        let spawned = std::thread::Builder::new()
            .name("weft-handshake".into())
            .spawn(move || {
                let proved = control::accept(&mut stream, &secret, HANDSHAKE_TIMEOUT);
                // Leave the pending list; if we are no longer on it, the accept loop
                // evicted (shut down) this connection, whatever the handshake said.
                let evicted = match pending.lock() {
                    Ok(mut p) => {
                        let before = p.len();
                        p.retain(|(i, _)| *i != id);
                        p.len() == before
                    }
                    Err(_) => true,
                };
                if evicted {
                    tracing::debug!("connection from {from} was evicted during its handshake");
                    return;
                }
                match proved {
                    Err(e) => {
                        if e.contains("secret") {
                            tracing::warn!("refused coordinator {from}: {e}");
                        } else {
                            tracing::debug!("dropped connection from {from}: {e}");
                        }
                        return;
                    }
                    // Another node fetching pieces of a shard this node holds.
                    Ok(control::Channel::Share) => {
                        match &shards {
                            Some(sh) => crate::share::serve_share(stream, &**sh, &from),
                            None => {
                                tracing::debug!("{from} asked for shards; this node keeps none")
                            }
                        }
                        return;
                    }
                    Ok(control::Channel::Control) => {}
                }
                let liveness = Arc::new(Liveness::new(MAX_RANKS, Some(0)));
                let link = match ControlLink::start(stream, &from, node_hooks(&liveness, work)) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::warn!("coordinator {from}: {e}");
                        return;
                    }
                };
                // A membership request is answered here, beside any session, for as long
                // as its link lasts; anything else is a coordinator's first message.
                let first = match link.recv(CONTROL_SILENCE) {
                    Ok(ToNode::Members(g)) => {
                        match &members {
                            Some(m) => m.serve_link(&link, *g, &from),
                            None => {
                                let _ = link.send(&FromNode::Failed {
                                    error: "this node keeps no member list".into(),
                                });
                            }
                        }
                        return;
                    }
                    Ok(m) => m,
                    Err(e) => {
                        tracing::debug!("connection from {from} sent nothing: {e}");
                        return;
                    }
                };
                if !gate.acquire(BUSY_WAIT) {
                    let _ = link.send(&FromNode::Failed {
                        error: format!(
                            "busy: serving another coordinator for over {} s",
                            BUSY_WAIT.as_secs()
                        ),
                    });
                    return;
                }
                if let Err(mpsc::SendError(acc)) = tx.send(Accepted {
                    link,
                    liveness,
                    from,
                    first: std::cell::Cell::new(Some(first)),
                }) {
                    drop(acc);
                    gate.release();
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start a handshake thread: {e}");
        }
    }
}

/// The coordinator's beats carry every rank's silence: rank 0 (it) is heard now, the
/// others as it last heard them, and a closed control connection means rank 0 is lost.
/// This node's beats carry its work.
fn node_hooks(liveness: &Arc<Liveness>, work: Arc<WorkCounters>) -> Hooks {
    let (on_beat, on_end) = (liveness.clone(), liveness.clone());
    Hooks {
        on_beat: Box::new(move |ages, _| {
            on_beat.heard(0);
            for (r, &a) in ages.iter().enumerate().skip(1) {
                if a == u32::MAX {
                    on_beat.mark_dead(r);
                } else {
                    on_beat.heard_ago(r, Duration::from_millis(a as u64));
                }
            }
        }),
        on_end: Box::new(move || on_end.mark_dead(0)),
        ages: Box::new(Vec::new),
        work: Box::new(move || Some(work.snapshot())),
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
    acc: &Accepted,
    opts: &NodeOptions,
    ip: IpAddr,
    cache: &mut Option<Loaded>,
    work: &WorkCounters,
    shards: Option<&NodeShards>,
) -> Result<(), String> {
    let ctl = &acc.link;
    let plan = match acc
        .first
        .take()
        .map_or_else(|| ctl.recv(CONTROL_SILENCE), Ok)?
    {
        ToNode::Plan(p) => *p,
        ToNode::Survey(r) => return survey_session(acc, opts, ip, &r),
        other => return Err(format!("expected a plan, got {other:?}")),
    };
    if plan.group_size < 2 || plan.group_size > MAX_RANKS || plan.rank >= plan.group_size {
        return Err(format!(
            "the plan puts rank {} in a group of {} (2..={MAX_RANKS})",
            plan.rank, plan.group_size
        ));
    }
    acc.liveness.limit_to(plan.group_size);
    // The node's own copy if it has one; otherwise the shard is fetched from the holders
    // the plan names (or the error says why neither works).
    let source = match &opts.model {
        Some(own) => ModelSource::Own(own.clone()),
        None => match (allowed_model(opts, &plan.model), &plan.share) {
            (Ok(p), _) => ModelSource::Own(p),
            (Err(_), Some(share)) => {
                let mut share = share.clone();
                let alive = || ctl.silent_for() < CONTROL_SILENCE;
                let known = crate::node_fetch::resolve_root(&mut share, &opts.secret, &alive)?;
                ModelSource::Shared(share, known)
            }
            (Err(e), None) => return Err(e),
        },
    };
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
        source.key(),
        plan.tp_rank,
        (&plan.tp_weights, &plan.ep_weights, plan.ep_spares),
        threads,
        plan.layers,
        plan.n_ctx,
        plan.ubatch,
        plan.slots
    );
    let mut fetched = None;
    if cache.as_ref().map(|c| c.key != key).unwrap_or(true) {
        *cache = None; // free the old shard before loading the new one
        let file = match &source {
            ModelSource::Own(path) => GgufFile::open(path)
                .map(Arc::new)
                .map_err(|e| e.to_string()),
            ModelSource::Shared(share, known) => {
                fetch_for(share, known.clone(), opts, shards, &plan, work).map(|f| {
                    let file = f.file.clone();
                    fetched = Some(f.report);
                    file
                })
            }
        };
        let loaded = file.and_then(|f| load(f, &plan, threads, opts.memory_limit, key, work));
        work.load_ended();
        *cache = Some(loaded?);
    }
    let loaded = cache.as_mut().ok_or("no shard loaded")?;
    // A fresh data listener on the control address's IP: the group's mesh forms on it.
    let data = weft_comm::bind(&format!("{ip}:0")).map_err(|e| e.to_string())?;
    let data_addr = data.local_addr().map_err(|e| e.to_string())?.to_string();
    ctl.send(&FromNode::Ready {
        data_addr,
        shard_bytes: loaded.model.total_weight_bytes() as u64,
        // Resident now, not the peak: a survey before (timing kernels over buffers since
        // freed) would swell the peak; the peak is reported when the session stops.
        rss_bytes: crate::procinfo::rss_bytes().unwrap_or(0),
        fetched,
    })?;
    let addrs = match ctl.recv(CONTROL_SILENCE)? {
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
    gopts.liveness = Some(acc.liveness.clone());
    if let Some(spin) = opts.spin {
        gopts.spin = spin;
    }
    let mut group =
        Group::with_listener(plan.rank, &addrs, data, gopts).map_err(|e| e.to_string())?;
    run_steps(&mut group, &plan, loaded, opts.slowdown, work)
}

/// Reports this node's profile, then measures links in a group with the coordinator and
/// the other nodes of the survey.
fn survey_session(
    acc: &Accepted,
    opts: &NodeOptions,
    ip: IpAddr,
    r: &SurveyRequest,
) -> Result<(), String> {
    if r.group_size < 2 || r.group_size > MAX_RANKS || r.rank == 0 || r.rank >= r.group_size {
        return Err(format!(
            "the survey puts rank {} in a group of {} (2..={MAX_RANKS})",
            r.rank, r.group_size
        ));
    }
    if r.pings == 0 || r.pings > 100_000 || r.bulk > 256 << 20 {
        return Err(format!(
            "a survey of {} pings and {} bulk bytes (1..=100000, at most 256 MiB)",
            r.pings, r.bulk
        ));
    }
    acc.liveness.limit_to(r.group_size);
    let own = weft_kernels::pool::usable_cores();
    let threads = opts
        .threads
        .unwrap_or(if r.threads == 0 { own } else { r.threads })
        .max(1);
    let info = crate::profile::local_info(
        opts.home.as_deref(),
        r.fresh,
        threads,
        opts.memory_limit,
        opts.slowdown,
    );
    let data = weft_comm::bind(&format!("{ip}:0")).map_err(|e| e.to_string())?;
    let data_addr = data.local_addr().map_err(|e| e.to_string())?.to_string();
    acc.link.send(&FromNode::Profile {
        info: Box::new(info),
        data_addr,
    })?;
    let addrs = loop {
        match acc.link.recv(CONTROL_SILENCE)? {
            ToNode::Go { addrs } => break addrs,
            ToNode::Calibrate => acc.link.send(&FromNode::Rates {
                rates: crate::profile::loaded_rates(threads, opts.slowdown),
            })?,
            other => return Err(format!("expected go, got {other:?}")),
        }
    };
    let mut gopts = group_options(
        r.rank,
        &r.transport,
        r.link_delay_us,
        r.timeout_ms,
        opts.secret.clone(),
    )?;
    gopts.liveness = Some(acc.liveness.clone());
    let mut group = Group::with_listener(r.rank, &addrs, data, gopts).map_err(|e| e.to_string())?;
    group
        .probe_links(r.pings, r.bulk)
        .map_err(|e| format!("measuring links: {e}"))?;
    Ok(())
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
        timeout: Duration::from_millis(timeout_ms.max(1)),
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

/// Where a node's model comes from.
enum ModelSource {
    /// A file it holds.
    Own(PathBuf),
    /// Fetched from the holders into its shard cache (with the manifest, when the node
    /// had to ask for the root).
    Shared(ShareSpec, Option<weft_share::Manifest>),
}

impl ModelSource {
    fn key(&self) -> String {
        match self {
            ModelSource::Own(p) => p.display().to_string(),
            ModelSource::Shared(s, _) => format!("shared:{}", s.root),
        }
    }
}

/// The shard a plan gives this node.
fn plan_shard(file: &GgufFile, plan: &NodePlan) -> Result<ShardSpec, String> {
    let cfg = ModelConfig::from_gguf(file).map_err(|e| e.to_string())?;
    let gran = granularity(file, &cfg).map_err(|e| e.to_string())?;
    let (a, b) = plan.layers;
    let split = StageSplit {
        tp_weights: plan.tp_weights.clone(),
        ep_weights: plan.ep_weights.clone(),
        ep_spares: plan.ep_spares,
    };
    Ok(ShardSpec::stage(&cfg, gran, plan.tp_rank, &split)
        .map_err(|e| e.to_string())?
        .with_layers(a..b))
}

/// Fetches the plan's shard into this node's cache, then keeps the cache under its limit.
fn fetch_for(
    share: &ShareSpec,
    known: Option<weft_share::Manifest>,
    opts: &NodeOptions,
    shards: Option<&NodeShards>,
    plan: &NodePlan,
    work: &WorkCounters,
) -> Result<crate::node_fetch::Fetched, String> {
    let shards = shards
        .ok_or("this node has no copy of the model and no weft home to fetch its shard into")?;
    // The dry run also refuses, before anything is fetched, a shard over --memory-limit.
    let dry = |file: Arc<GgufFile>| {
        let shard = plan_shard(&file, plan)?;
        let mut model = Model::load(file, shard, plan.ubatch).map_err(|e| e.to_string())?;
        model.set_cache_type(plan.cache_type);
        check_memory(&model, plan, opts.memory_limit)
    };
    let f = crate::node_fetch::fetch_shard(share, known, &opts.secret, shards, work, &dry);
    work.fetch_ended();
    let f = f?;
    if let Some(limit) = opts.cache_limit {
        shards.close_except(&f.root);
        for gone in weft_share::cache::evict(&shards.dir, limit, &f.root) {
            shards.forget(&gone.root);
        }
    }
    Ok(f)
}

/// Refuses a shard whose weights and KV caches need more than `--memory-limit`.
fn check_memory(model: &Model, plan: &NodePlan, memory_limit: Option<u64>) -> Result<(), String> {
    let (a, b) = plan.layers;
    if let Some(limit) = memory_limit {
        let weights = model.total_weight_bytes() as u64;
        let kv = (model.cache_bytes(plan.n_ctx) * plan.slots.max(1)) as u64;
        if weights + kv > limit {
            return Err(format!(
                "this node's shard needs {} ({} of weights for layers {a}..{b}, experts {:?}{}, \
                 and {} of KV cache), over its --memory-limit of {}",
                human_bytes((weights + kv) as u128),
                human_bytes(weights as u128),
                model.shard.experts,
                if plan.ep_spares > 0 {
                    format!(
                        " with {} spares (fewer --ep-spares need less)",
                        plan.ep_spares
                    )
                } else {
                    String::new()
                },
                human_bytes(kv as u128),
                human_bytes(limit as u128)
            ));
        }
    }
    Ok(())
}

fn load(
    file: Arc<GgufFile>,
    plan: &NodePlan,
    threads: usize,
    memory_limit: Option<u64>,
    key: String,
    work: &WorkCounters,
) -> Result<Loaded, String> {
    let t = Instant::now();
    let path = file.path().to_path_buf();
    let (a, b) = plan.layers;
    let shard = plan_shard(&file, plan)?;
    // Loading maps the file and copies only column-split blocks; no weight is read yet.
    // Test aid: each layer's load takes this much longer, so tests can watch a shard
    // load (a large model's takes minutes). Unset in normal use.
    let pause = std::env::var(LOAD_DELAY_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis);
    let mut model = Model::load_with_progress(file, shard, plan.ubatch, &mut |done, total| {
        work.load_progress(done, total);
        if let Some(p) = pause {
            std::thread::sleep(p);
        }
    })
    .map_err(|e| e.to_string())?;
    model.set_cache_type(plan.cache_type);
    check_memory(&model, plan, memory_limit)?;
    let caches = (0..plan.slots.max(1))
        .map(|_| model.new_cache(plan.n_ctx))
        .collect();
    tracing::info!(
        "loaded {} layers {a}..{b}, stage position {} (experts {:?}) in {:.2} s",
        path.display(),
        plan.tp_rank,
        model.shard.experts,
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
fn run_steps(
    group: &mut Group,
    plan: &NodePlan,
    l: &mut Loaded,
    slowdown: f64,
    work: &WorkCounters,
) -> Result<(), String> {
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
        slowdown,
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
        let busy = t_step.elapsed().as_secs_f64() - st.comm;
        comm += st.comm;
        compute += busy;
        work.step(busy, st.comm);
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
    /// `NodeOptions::slowdown`.
    slowdown: f64,
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
            slowdown: self.slowdown,
            since: Instant::now(),
        };
        l.model
            .forward_hidden_batch(&self.spans, &mut l.caches, &mut coll, &l.pool)
            .map_err(|e| e.to_string())?;
        coll.stretch();
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
            let t = Instant::now();
            l.model
                .logits(0..rows, &l.pool, &mut self.logits)
                .map_err(|e| e.to_string())?;
            crate::stage::stretch_by(self.slowdown, t.elapsed());
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
