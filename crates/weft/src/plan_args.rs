//! `weft plan`'s flags.

use std::path::PathBuf;

use clap::Args;

use crate::layout_args::LayoutArgs;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A cluster description (JSON): nodes with memory_bytes, decode_bytes_per_s and
    /// prefill_bytes_per_s; rtt_us and bytes_per_s as one number or an N x N matrix.
    /// Without it, the nodes of --nodes or --peers are surveyed.
    #[arg(long, conflicts_with_all = ["nodes", "peers"])]
    pub cluster: Option<PathBuf>,
    #[command(flatten)]
    pub live: LayoutArgs,
    /// With live nodes: plan (and check) at each of these injected link delays, µs.
    #[arg(long, value_delimiter = ',')]
    pub delays: Vec<f64>,
    /// With live nodes: run every fitting layout and print measured beside predicted.
    #[arg(long)]
    pub check: bool,
    /// With live nodes: have them time their kernels again instead of using their cache.
    #[arg(long)]
    pub recalibrate: bool,
    /// With --check: tokens decoded per measurement, and measurements per layout.
    #[arg(short = 'n', long, default_value_t = 32)]
    pub decode: usize,
    #[arg(short = 'r', long, default_value_t = 5)]
    pub reps: usize,
    /// Context per sequence the KV caches must hold.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Sequences decoded together (the batch column).
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Show at most this many layouts.
    #[arg(long, default_value_t = 12)]
    pub top: usize,
    #[arg(long)]
    pub json: bool,
}
