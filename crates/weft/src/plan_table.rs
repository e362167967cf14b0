//! `weft plan`'s output: the planner's ranked layouts of a cluster as a table or JSON, with
//! predicted speed, memory and why a layout does not fit.

use std::path::Path;

use anyhow::{anyhow, Result};
use serde_json::json;
use weft_model::memory::human_bytes;
use weft_plan::{plan, ClusterProfile, ModelProfile, Workload};

use crate::plan_args::PlanArgs;

/// The ranked table (or JSON) of `cluster`'s layouts for `model`.
pub fn print_plans(
    a: &PlanArgs,
    path: &Path,
    model: &ModelProfile,
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
                    "ep_spares": p.layout.ep_spares,
                    "prediction": p.prediction, "memory_bytes": p.memory,
                    "fits": p.unfit.is_none(), "unfit": p.unfit,
                })
            })
            .collect();
        outln!(
            "{}",
            json!({"model": path.display().to_string(), "total_bytes": model.total_bytes(),
                   "nodes": cluster.nodes.len(), "plan_secs": secs, "cluster": cluster, "plans": rows})
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
