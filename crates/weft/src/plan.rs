//! `weft plan`: the planner's ranked layouts for a model, with predicted speed and memory
//! per node and why each layout that does not fit does not, on a cluster described in a
//! file (nodes with memory and speeds, links with round trip and bandwidth) or on running
//! nodes it surveys (`--nodes N` local ones, or `--peers`); `--check` then runs each
//! layout and prints the measured speed beside the predicted one.

use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use serde_json::json;
use weft_gguf::GgufFile;
use weft_model::memory::human_bytes;
use weft_model::ModelConfig;
use weft_plan::{plan, ClusterProfile, Workload};

use crate::cluster_cli::LayoutArgs;
use crate::paths::resolve_model;

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
    /// With --check: tokens decoded per measurement, and measurements per layout.
    #[arg(short = 'n', long, default_value_t = 32)]
    pub decode: usize,
    #[arg(short = 'r', long, default_value_t = 3)]
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

pub fn run(a: PlanArgs) -> Result<()> {
    let path = resolve_model(a.model.clone())?;
    let file = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let cfg = ModelConfig::from_gguf(&file)?;
    let model = weft_cluster::model_profile(&file, &cfg);
    let Some(cluster_file) = &a.cluster else {
        return crate::plan_live::run(&a, &path, &file, &cfg, &model);
    };
    let text = std::fs::read_to_string(cluster_file)
        .with_context(|| format!("reading {}", cluster_file.display()))?;
    let cluster =
        ClusterProfile::from_json(&text).map_err(|e| anyhow!("{}: {e}", cluster_file.display()))?;
    print_plans(&a, &path, &model, &cluster)
}

/// The ranked table (or JSON) of `cluster`'s layouts for `model`.
pub fn print_plans(
    a: &PlanArgs,
    path: &std::path::Path,
    model: &weft_plan::ModelProfile,
    cluster: &ClusterProfile,
) -> Result<()> {
    let workload = Workload {
        n_ctx: a.ctx,
        parallel: a.parallel.max(1),
        ..Workload::default()
    };
    let t = std::time::Instant::now();
    let plans = plan(model, cluster, &workload).map_err(|e| anyhow!(e))?;
    let secs = t.elapsed().as_secs_f64();
    let name = |i: usize| cluster.nodes[i].name.as_str();
    if a.json {
        let rows: Vec<_> = plans
            .iter()
            .take(a.top)
            .map(|p| {
                let stages: Vec<Vec<&str>> = p
                    .layout
                    .order
                    .chunks(p.layout.width())
                    .map(|s| s.iter().map(|&i| name(i)).collect())
                    .collect();
                json!({
                    "layout": p.name, "tp": p.layout.tp, "ep": p.layout.ep, "pp": p.pp,
                    "stages": stages, "layers": p.layout.layers,
                    "tp_weights": p.layout.tp_weights, "ep_weights": p.layout.ep_weights,
                    "prediction": p.prediction, "memory_bytes": p.memory,
                    "fits": p.unfit.is_none(), "unfit": p.unfit,
                })
            })
            .collect();
        outln!(
            "{}",
            json!({"model": path.display().to_string(), "total_bytes": model.total_bytes(),
                   "nodes": cluster.nodes.len(), "plan_secs": secs, "plans": rows})
        )?;
        return Ok(());
    }
    outln!(
        "{} ({}) on {} nodes, ctx {} x {} sequences; {} layouts in {:.0} ms",
        path.display(),
        human_bytes(model.total_bytes() as u128),
        cluster.nodes.len(),
        a.ctx,
        workload.parallel,
        plans.len(),
        secs * 1e3
    )?;
    outln!(
        "{:<4} {:<24} {:>9} {:>10} {:>11} {:>8} {:>11}  stages (layers)",
        "rank",
        "layout",
        "tok/s",
        "batch t/s",
        "prefill t/s",
        "TTFT s",
        "max mem"
    )?;
    for (i, p) in plans.iter().take(a.top).enumerate() {
        let f = &p.prediction;
        let stages: Vec<String> = p
            .layout
            .order
            .chunks(p.layout.width())
            .zip(&p.layout.layers)
            .map(|(s, l)| {
                let names: Vec<&str> = s.iter().map(|&n| name(n)).collect();
                format!("{}({l})", names.join("+"))
            })
            .collect();
        let max_mem = p.memory.iter().copied().max().unwrap_or(0);
        outln!(
            "{:<4} {:<24} {:>9.2} {:>10.2} {:>11.1} {:>8.2} {:>11}  {}",
            i + 1,
            p.name,
            f.decode_tok_s,
            f.batch_tok_s,
            f.prefill_tok_s,
            f.ttft_s,
            human_bytes(max_mem as u128),
            stages.join(" | ")
        )?;
        if let Some(why) = &p.unfit {
            outln!("     does not fit: {why}")?;
        }
    }
    Ok(())
}
