//! `weft node`: its flags, and the node started with them (core pinning, membership,
//! then weft-cluster's serve loop).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use clap::Args;
use weft_cluster::local::pin_to_core;
use weft_cluster::NodeOptions;

use crate::cluster_secret::secret_from;
use crate::layout_args::parse_size;

/// `weft node` arguments.
#[derive(Args, Debug)]
pub struct NodeArgs {
    /// Control address to listen on, every interface by default, for coordinators on other
    /// machines (port 0 picks one; the address is printed). Data-plane listeners open on
    /// the same IP, on ports the system picks.
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
    /// Bytes the shard cache (the weft home's shards/: pieces of models this node fetched
    /// from other machines) may take; least recently used models are evicted past it.
    #[arg(long, value_parser = parse_size)]
    pub cache_limit: Option<u64>,
    /// Test aid: make every stretch of compute take F times as long (by spinning), to
    /// emulate a slower machine beside faster ones; the node's measured speeds say so.
    #[arg(long, default_value_t = 1.0)]
    pub slowdown: f64,
    /// Directories whose model files a coordinator may ask this node to open,
    /// comma-separated (default: the weft home's models/); no other path is opened unless
    /// given with --model.
    #[arg(long, value_delimiter = ',')]
    pub models_dir: Vec<PathBuf>,
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
            model_dirs: a.models_dir,
            slowdown: a.slowdown,
            membership: Some(membership),
            cache_limit: a.cache_limit,
        },
    )
}
