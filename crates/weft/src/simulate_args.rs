//! `weft simulate`'s flags.

use std::path::PathBuf;

use clap::Args;

#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// A model profile (llama-3.3-70b, llama-3-8b, qwen3-235b-a22b, deepseek-v3, kimi-k2,
    /// kimi-k2-thinking, gpt-oss-120b, gemma3-270m) or a GGUF file, read for its metadata
    /// and tensor index only.
    #[arg(long, required_unless_present = "published")]
    pub model: Option<String>,
    /// Machine profile of every node: m3-ultra, m4-max, dgx-spark, ryzen-ai-max-395,
    /// raspberry-pi-5, or "this" (measured by weft here), or a name from --profiles.
    #[arg(long, default_value = "this")]
    pub hardware: String,
    /// Link profiles joining the nodes, comma-separated: tb5-tcp, tb5-rdma, 1gbe, 10gbe,
    /// 100gbe-rdma, wifi, shm, or names from --profiles.
    #[arg(long, value_delimiter = ',', default_value = "10gbe")]
    pub link: Vec<String>,
    /// Engine whose protocol runs the cluster: weft, llama.cpp (RPC) or exo (MLX).
    #[arg(long, default_value = "weft")]
    pub engine: String,
    /// Node counts, comma-separated (1,2,4), or a range of powers of two (1..1024).
    #[arg(long, default_value = "1,2,4")]
    pub nodes: String,
    /// Layout kinds, comma-separated: tp, pp, ep, hybrid, best (default: all).
    #[arg(long, value_delimiter = ',')]
    pub layout: Vec<String>,
    /// Injected one-way delay added to every link, µs, comma-separated (as weft's
    /// transport injects it with --link-delay-us).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub delay_us: Vec<f64>,
    /// Bits per weight of a model profile (default: as people run it, Q4_K_M 4.85).
    #[arg(long)]
    pub bits: Option<f64>,
    /// Streams decoded together (the batch column).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Prompt tokens of the time-to-first-token figure.
    #[arg(long, default_value_t = 512)]
    pub prompt: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 128)]
    pub output: usize,
    /// Context each stream's cache holds (default: prompt + output).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// A single-node decode tok/s measured for this model, machine and engine: sets the
    /// machine's decode efficiency (docs/simulate.md).
    #[arg(long)]
    pub calibrate: Option<f64>,
    /// A single-node prefill tok/s: sets the machine's prefill efficiency.
    #[arg(long, requires = "calibrate")]
    pub calibrate_prefill: Option<f64>,
    /// With --hardware this: threads of each simulated node.
    #[arg(long)]
    pub threads: Option<usize>,
    /// With --hardware this: the nodes are processes sharing this one machine (its
    /// memory bandwidth and memory), as `weft bench --nodes N` runs them.
    #[arg(long)]
    pub same_machine: bool,
    /// With --hardware this and a GGUF file: run the model on one node here first (its
    /// decode and a --prompt-token prefill, as `weft bench` does) and calibrate from that,
    /// as --calibrate and --calibrate-prefill would.
    #[arg(long, conflicts_with = "calibrate")]
    pub measure: bool,
    /// With --hardware this: time the kernels again instead of using the cache.
    #[arg(long)]
    pub recalibrate: bool,
    /// More profiles (JSON): {"hardware": [...], "links": [...]}, fields as in
    /// docs/simulate.md.
    #[arg(long)]
    pub profiles: Option<PathBuf>,
    /// Write a plot of decode tok/s against node count (SVG).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Set the published multi-node results beside their predictions instead.
    #[arg(long)]
    pub published: bool,
    #[arg(long)]
    pub json: bool,
}
