//! The layout flags `weft run`, `serve`, `bench` and `plan` share (`--nodes`, `--peers`,
//! `--tp`, `--pp`, `--ep`, ...), with sizes such as `--node-memory-limit 1.5G`; `--nodes N`
//! starts its local nodes through weft-cluster.

use anyhow::{Context, Result};
use clap::Args;
use weft_cluster::local::{start_local_nodes, LocalNodes, LocalOptions};

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
    /// With --peers: do not share the model; every node must hold its own copy (by
    /// default a node without one fetches its shard from this process and the others).
    #[arg(long)]
    pub no_share: bool,
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
    /// Spare experts each EP group also holds, from its neighbours' share (redundant
    /// experts): a token's expert that two groups hold runs on the less busy one, so the
    /// busiest group waits less, for that much more memory per node.
    #[arg(long, default_value_t = 0)]
    pub ep_spares: usize,
    /// How the KV cache stores keys and values: f32, or f16 (half the memory and the
    /// bytes attention reads at long context; llama.cpp's default). On every node.
    #[arg(long, default_value = "f32")]
    pub cache_type: weft_model::CacheType,
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

    /// Expert-parallel groups per stage: --ep, or as many as --ep-weights gives.
    pub fn ep_groups(&self) -> usize {
        self.ep.unwrap_or(self.ep_weights.len().max(1))
    }

    /// The nodes a full shape (--tp and --pp both given) needs; None without one.
    pub fn full_shape_nodes(&self) -> Option<usize> {
        Some(self.tp? * self.pp? * self.ep_groups())
    }

    /// Starts `n` local `weft node` processes (this binary) with `threads` each and the
    /// --pin, --node-memory-limit and --node-slowdown flags, allowed to open `model`;
    /// their control addresses.
    pub fn start_local_nodes(
        &self,
        n: usize,
        secret: &str,
        threads: usize,
        model: &std::path::Path,
    ) -> Result<(LocalNodes, Vec<String>)> {
        let exe = std::env::current_exe().context("finding the weft binary")?;
        let opts = LocalOptions {
            threads,
            pin: self.pin,
            memory_limit: self.node_memory_limit,
            slowdown: self.node_slowdown.clone(),
            model: Some(model.to_path_buf()),
        };
        Ok(start_local_nodes(&exe, n, secret, &opts)?)
    }
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
