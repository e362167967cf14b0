//! `weft bench`'s flags, and its subcommands (`bench comm`, `bench serve`).

use std::path::PathBuf;

use clap::Args;

use crate::bench_comm::{CommBenchArgs, CommRankArgs};
use crate::bench_serve::ServeBenchArgs;
use crate::layout_args::LayoutArgs;

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// Benchmark something other than the model.
    #[command(subcommand)]
    pub what: Option<BenchWhat>,
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Prompt tokens for the prefill test.
    #[arg(short = 'p', default_value_t = 128)]
    pub prefill: usize,
    /// Tokens for the decode test.
    #[arg(short = 'n', default_value_t = 64)]
    pub decode: usize,
    #[arg(long, short = 'r', default_value_t = 5)]
    pub reps: usize,
    /// Tokens already in the cache, untimed, before each prefill and decode test (as
    /// llama-bench's -d): attention's cost at long context.
    #[arg(long, short = 'd', default_value_t = 0)]
    pub depth: usize,
    /// Also decode this many sequences together in batched steps (aggregate tok/s).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Time every kernel path per weight type and shape on this CPU against its memory
    /// bandwidth and integer peak, keep the fastest (cached) and print them; no model.
    #[arg(long)]
    pub kernels: bool,
    /// Skip the memory-bandwidth probe.
    #[arg(long)]
    pub no_bandwidth: bool,
    #[arg(long)]
    pub json: bool,
    /// Across local nodes: layouts to measure side by side, e.g. 1,tp2,pp2,tp2xpp2.
    #[arg(long, value_delimiter = ',')]
    pub compare: Vec<String>,
    /// Across local nodes: link delays (µs) to measure each layout at, e.g. 0,3,300.
    #[arg(long, value_delimiter = ',')]
    pub delays: Vec<f64>,
    #[command(flatten)]
    pub layout: LayoutArgs,
}

#[derive(clap::Subcommand, Debug)]
pub enum BenchWhat {
    /// All-reduce latency, ping-pong and bandwidth between local ranks (processes).
    Comm(CommBenchArgs),
    /// Streams against `weft serve`: aggregate and per-stream tok/s, time to first token.
    Serve(ServeBenchArgs),
    /// One rank of `bench comm` (started by it).
    #[command(hide = true)]
    CommRank(CommRankArgs),
}
