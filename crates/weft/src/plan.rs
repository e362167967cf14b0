//! `weft plan`: the planner's ranked layouts for a model, with predicted speed and memory
//! per node and why each layout that does not fit does not, on a cluster described in a
//! file (nodes with memory and speeds, links with round trip and bandwidth) or on running
//! nodes it surveys (`--nodes N` local ones, or `--peers`); `--check` then runs each
//! layout and prints the measured speed beside the predicted one.

use anyhow::{anyhow, Context, Result};
use weft_gguf::GgufFile;
use weft_model::ModelConfig;
use weft_plan::ClusterProfile;

use crate::paths::resolve_model;
use crate::plan_args::PlanArgs;
use crate::plan_table::print_plans;

pub fn run(a: PlanArgs) -> Result<()> {
    let path = resolve_model(a.model.clone())?;
    let file = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let cfg = ModelConfig::from_gguf(&file)?;
    let model = weft_cluster::model_profile(&file, &cfg, a.live.cache_type);
    let Some(cluster_file) = &a.cluster else {
        return crate::plan_live::run(&a, &path, &file, &cfg, &model);
    };
    let text = std::fs::read_to_string(cluster_file)
        .with_context(|| format!("reading {}", cluster_file.display()))?;
    let cluster =
        ClusterProfile::from_json(&text).map_err(|e| anyhow!("{}: {e}", cluster_file.display()))?;
    print_plans(&a, &path, &model, &cluster)
}
