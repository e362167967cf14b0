//! Layout flags shared by `weft run` and `weft bench`, `weft node`, and the local cluster
//! that `--nodes N` starts: N `weft node` processes on this machine, stopped at the end.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use weft_cluster::{Cluster, ClusterOptions, Layout, LayoutRequest, NodeOptions};
use weft_gguf::GgufFile;
use weft_model::{ModelConfig, DEFAULT_UBATCH};
use weft_tokenizer::Tokenizer;

#[derive(Args, Debug, Clone, Default)]
pub struct LayoutArgs {
    /// Start this many local node processes and run across them.
    #[arg(long)]
    pub nodes: Option<usize>,
    /// Use nodes already running (`weft node`), comma-separated control addresses.
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Cluster secret for --peers (or WEFT_SECRET); --nodes makes its own.
    #[arg(long)]
    pub secret: Option<String>,
    /// Tensor-parallel size of each pipeline stage.
    #[arg(long)]
    pub tp: Option<usize>,
    /// Pipeline stages.
    #[arg(long)]
    pub pp: Option<usize>,
    /// Layers per stage, comma-separated (default: even).
    #[arg(long, value_delimiter = ',')]
    pub layers: Vec<usize>,
    /// Relative share of each TP rank, comma-separated (default: equal).
    #[arg(long, value_delimiter = ',')]
    pub tp_weights: Vec<f64>,
    /// Expert-parallel groups per stage (MoE models): each holds a share of the experts.
    /// A stage then has TP x EP nodes; attention stays tensor-parallel over all of them.
    #[arg(long)]
    pub ep: Option<usize>,
    /// Relative share of the experts of each EP group, comma-separated (e.g. by memory).
    #[arg(long, value_delimiter = ',')]
    pub ep_weights: Vec<f64>,
    /// Data-plane transport: auto (shared memory on one host), tcp or shm.
    #[arg(long, default_value = "auto")]
    pub transport: String,
    /// Injected one-way delay on every data-plane link, µs.
    #[arg(long, default_value_t = 0.0)]
    pub link_delay_us: f64,
    /// With --nodes: pin each node to its own core, one thread each.
    #[arg(long)]
    pub pin: bool,
    /// Threads per node (default: cores / nodes).
    #[arg(long)]
    pub node_threads: Option<usize>,
    /// With --nodes: each local node's --memory-limit (see `weft node --help`).
    #[arg(long, value_parser = parse_size)]
    pub node_memory_limit: Option<u64>,
    /// With --nodes, a test aid: each local node's --slowdown, comma-separated (e.g. 1,2
    /// makes the second node compute at half speed).
    #[arg(long, value_delimiter = ',')]
    pub node_slowdown: Vec<f64>,
}

impl LayoutArgs {
    pub fn is_cluster(&self) -> bool {
        self.nodes.is_some() || !self.peers.is_empty()
    }
}

/// `weft node` arguments.
#[derive(Args, Debug)]
pub struct NodeArgs {
    /// Control address to listen on (port 0 picks one; the address is printed).
    #[arg(long, default_value = "0.0.0.0:7411")]
    pub listen: String,
    /// Cluster secret (or WEFT_SECRET).
    #[arg(long)]
    pub secret: Option<String>,
    /// This node's copy of the model (default: the path the coordinator sends).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long)]
    pub threads: Option<usize>,
    /// Pin the process to this core.
    #[arg(long)]
    pub pin_core: Option<usize>,
    /// Busy-poll budget of data-plane waits, µs (default 200; 20000 with --pin-core, since
    /// a pinned node's spinning takes no core from anyone).
    #[arg(long)]
    pub spin_us: Option<u64>,
    /// Refuse any plan whose shard (weights and KV caches) needs more than this: bytes,
    /// or with a unit (500M, 1.5G, 2GiB).
    #[arg(long, value_parser = parse_size)]
    pub memory_limit: Option<u64>,
    /// Test aid: make every stretch of compute take F times as long (by spinning), to
    /// emulate a slower machine beside faster ones; the node's measured speeds say so.
    #[arg(long, default_value_t = 1.0)]
    pub slowdown: f64,
    /// This node's name in member lists and its mDNS announcement (default: the host name).
    #[arg(long)]
    pub name: Option<String>,
    /// Another node's control address (comma-separated for several): tell it about this
    /// node and swap member lists with it; for networks where mDNS does not reach.
    #[arg(long, value_delimiter = ',')]
    pub join: Vec<String>,
    /// Neither announce this node over mDNS nor browse for others (--join still works).
    #[arg(long)]
    pub no_mdns: bool,
}

/// "1.5G", "500MB", "2GiB" or plain bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a size such as 512M, 1.5G or 2GiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (use k, M, G, T or KiB..TiB)"
            ))
        }
    };
    let bytes = v * mult;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("{s:?}: out of range"));
    }
    Ok(bytes as u64)
}

/// The secret from the flag or WEFT_SECRET, refused when too weak to resist online guessing.
pub(crate) fn secret_from(flag: &Option<String>) -> Result<String> {
    let s = flag
        .clone()
        .or_else(|| std::env::var("WEFT_SECRET").ok())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| {
            anyhow!(
                "a cluster secret is needed: --secret S or WEFT_SECRET (`weft secret` makes one)"
            )
        })?;
    weft_comm::secret::check_secret(&s).map_err(|e| anyhow!(e))?;
    Ok(s)
}

/// `weft secret`: one fresh secret on stdout (so it can be captured), the hint on stderr.
pub fn print_secret() -> Result<()> {
    outln!("{}", weft_comm::secret::random_secret())?;
    eprintln!(
        "give every node and coordinator of one cluster this secret: \
         --secret SECRET, or WEFT_SECRET=SECRET in the environment"
    );
    Ok(())
}

pub fn node(a: NodeArgs) -> Result<()> {
    let secret = secret_from(&a.secret)?;
    if !(a.slowdown.is_finite() && (1.0..=1000.0).contains(&a.slowdown)) {
        bail!(
            "--slowdown {}: must be between 1 (off) and 1000",
            a.slowdown
        );
    }
    if let Some(c) = a.pin_core {
        pin_to_core(c)?;
    }
    let listener = weft_comm::bind(&a.listen).map_err(|e| anyhow!("{e}"))?;
    let addr = listener.local_addr()?;
    let membership = crate::cluster_status::node_membership(
        &secret,
        addr,
        a.name.as_deref(),
        &a.join,
        a.no_mdns,
    )?;
    outln!("listening on {addr}")?;
    use std::io::Write;
    std::io::stdout().flush()?;
    weft_cluster::serve(
        listener,
        NodeOptions {
            secret: secret.into_bytes(),
            model: a.model,
            threads: a.threads,
            spin: a
                .spin_us
                .or(a.pin_core.map(|_| 20_000))
                .map(Duration::from_micros),
            memory_limit: a.memory_limit,
            home: Some(crate::paths::weft_home()),
            slowdown: a.slowdown,
            membership: Some(membership),
        },
    )
}

fn pin_to_core(core: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_setaffinity reads it for this process.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!(
                "pinning to core {core}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// Local node processes, killed when dropped.
pub struct LocalNodes {
    children: Vec<Child>,
}

impl Drop for LocalNodes {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(crate) fn start_local_nodes(
    n: usize,
    secret: &str,
    threads: usize,
    pin: bool,
    memory_limit: Option<u64>,
    slowdown: &[f64],
) -> Result<(LocalNodes, Vec<String>)> {
    let exe = std::env::current_exe().context("finding the weft binary")?;
    let cores = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(1);
    let mut nodes = LocalNodes {
        children: Vec::new(),
    };
    let mut addrs = Vec::new();
    for i in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args([
            "node",
            "--listen",
            "127.0.0.1:0",
            "--threads",
            &threads.to_string(),
        ])
        .env("WEFT_SECRET", secret)
        // Local nodes share the user's terminal: only their warnings, unless asked.
        .env(
            "WEFT_LOG",
            std::env::var("WEFT_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        if pin {
            cmd.args(["--pin-core", &(i % cores).to_string()]);
        }
        if let Some(m) = memory_limit {
            cmd.args(["--memory-limit", &m.to_string()]);
        }
        if let Some(f) = slowdown.get(i) {
            cmd.args(["--slowdown", &f.to_string()]);
        }
        // Local nodes belong to this process: if it dies without cleaning up (SIGKILL),
        // the kernel stops them too.
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe and touches only the child being made.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().with_context(|| format!("starting node {i}"))?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| anyhow!("node {i} has no stdout"))?;
        nodes.children.push(child);
        let mut line = String::new();
        BufReader::new(out)
            .read_line(&mut line)
            .with_context(|| format!("reading node {i}'s address"))?;
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .ok_or_else(|| anyhow!("node {i} printed {line:?} instead of its address"))?;
        addrs.push(addr.to_string());
    }
    Ok((nodes, addrs))
}

/// A running cluster and what a coordinator needs beside it.
pub struct Opened {
    pub cluster: Cluster,
    pub tokenizer: Tokenizer,
    pub n_vocab: usize,
    pub peers: Vec<String>,
    /// Local nodes (with --nodes); dropped after the cluster.
    pub _local: Option<LocalNodes>,
}

pub fn open(
    l: &LayoutArgs,
    model: &Path,
    n_ctx: usize,
    top_k: usize,
    logprobs: bool,
    slots: usize,
) -> Result<Opened> {
    if l.nodes.is_some() && !l.peers.is_empty() {
        bail!("give either --nodes (local) or --peers (running nodes), not both");
    }
    // A weak --peers secret is refused before the model is read or anything started.
    let given = if l.peers.is_empty() {
        None
    } else {
        Some(secret_from(&l.secret)?)
    };
    let file =
        Arc::new(GgufFile::open(model).with_context(|| format!("opening {}", model.display()))?);
    let cfg = ModelConfig::from_gguf(&file)?;
    let tokenizer = weft_model::vocab::tokenizer_from_gguf(&file)?;
    let cores = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(1);
    let (local, peers, secret) = match (l.nodes, given) {
        (Some(n), _) => {
            if n == 0 {
                bail!("--nodes must be at least 1");
            }
            let secret = weft_comm::secret::random_secret();
            let threads = if l.pin {
                1
            } else {
                l.node_threads.unwrap_or((cores / n).max(1))
            };
            let (nodes, addrs) = start_local_nodes(
                n,
                &secret,
                threads,
                l.pin,
                l.node_memory_limit,
                &l.node_slowdown,
            )?;
            (Some(nodes), addrs, secret)
        }
        (None, Some(secret)) => (None, l.peers.clone(), secret),
        (None, None) => bail!("no nodes: give --nodes N or --peers A,B"),
    };
    let threads = if l.pin {
        1
    } else {
        l.node_threads.unwrap_or((cores / peers.len()).max(1))
    };
    let no_layout_flags = l.tp.is_none()
        && l.pp.is_none()
        && l.ep.is_none()
        && l.layers.is_empty()
        && l.tp_weights.is_empty()
        && l.ep_weights.is_empty();
    let (peers, request) = if no_layout_flags && peers.len() > 1 {
        // No layout given: survey the nodes and run the planner's best layout.
        let workload = weft_plan::Workload {
            n_ctx: n_ctx.min(cfg.n_ctx_train).max(1),
            parallel: slots.max(1),
            ..weft_plan::Workload::default()
        };
        let (best, order) =
            crate::plan_live::best_layout(&file, &cfg, &peers, &secret, l, threads, &workload)?;
        let f = &best.prediction;
        eprintln!(
            "plan: {} on {} of {} nodes (layers {:?}): predicted {:.1} tok/s decode, {:.0} tok/s prefill; `weft plan` shows every layout, --tp/--pp/--ep override",
            best.name,
            order.len(),
            peers.len(),
            best.layout.layers,
            f.decode_tok_s,
            f.prefill_tok_s
        );
        let request = LayoutRequest {
            nodes: order.len(),
            tp: Some(best.layout.tp),
            pp: Some(best.pp),
            ep: Some(best.layout.ep),
            n_layer: cfg.n_layer,
            layer_counts: Some(best.layout.layers.clone()),
            tp_weights: Some(best.layout.tp_weights.clone()),
            ep_weights: Some(best.layout.ep_weights.clone()),
        };
        (order, request)
    } else {
        let request = LayoutRequest {
            nodes: peers.len(),
            tp: l.tp,
            pp: l.pp,
            ep: l.ep,
            n_layer: cfg.n_layer,
            layer_counts: (!l.layers.is_empty()).then(|| l.layers.clone()),
            tp_weights: (!l.tp_weights.is_empty()).then(|| l.tp_weights.clone()),
            ep_weights: (!l.ep_weights.is_empty()).then(|| l.ep_weights.clone()),
        };
        (peers, request)
    };
    let layout = Layout::plan(&request).map_err(|e| anyhow!(e))?;
    if layout.ep > 1 && cfg.moe.is_none() {
        bail!(
            "--ep {}: {} has no routed experts to split",
            layout.ep,
            model.display()
        );
    }
    let opts = ClusterOptions {
        secret: secret.into_bytes(),
        model: model.to_string_lossy().into_owned(),
        n_vocab: cfg.n_vocab,
        n_ctx: n_ctx.min(cfg.n_ctx_train).max(1),
        ubatch: DEFAULT_UBATCH,
        slots: slots.max(1),
        threads_per_node: threads,
        transport: l.transport.clone(),
        link_delay_us: l.link_delay_us,
        timeout: Duration::from_secs(2),
        top_k,
        logprobs,
    };
    let cluster = Cluster::connect(&peers, layout, opts).map_err(|e| anyhow!(e))?;
    Ok(Opened {
        cluster,
        tokenizer,
        n_vocab: cfg.n_vocab,
        peers,
        _local: local,
    })
}
