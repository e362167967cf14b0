//! The planner's best layout for running nodes: survey their profiles and links, then
//! rank the layouts (what `--nodes`/`--peers` without layout flags run).

use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use weft_cluster::planning::{cluster_profile, type_mix};
use weft_cluster::survey::{survey, Survey, SurveyOptions};
use weft_cluster::Layout;
use weft_gguf::GgufFile;
use weft_model::ModelConfig;
use weft_plan::cost::LayoutSpec;
use weft_plan::search::evaluate;
use weft_plan::{plan, Candidate, Workload};

use crate::layout_args::LayoutArgs;

/// Surveys `peers` and returns the planner's best layout that fits, with the peers in its
/// order (a prefix of them when fewer nodes are faster); an error naming why when no
/// layout fits.
pub fn best_layout(
    file: &GgufFile,
    cfg: &ModelConfig,
    peers: &[String],
    secret: &str,
    l: &LayoutArgs,
    threads: usize,
    workload: &Workload,
) -> Result<(Candidate, Vec<String>, Survey)> {
    let model = weft_cluster::model_profile(file, cfg, l.cache_type);
    let s = survey(peers, &survey_options(secret, l, l.link_delay_us, threads))
        .map_err(|e| anyhow!("surveying the nodes to plan: {e}"))?;
    let cluster = cluster_profile(&s, &type_mix(file, cfg));
    let plans = plan(&model, &cluster, workload).map_err(|e| anyhow!(e))?;
    let best = plans
        .into_iter()
        .next()
        .ok_or_else(|| anyhow!("the planner found no layout"))?;
    if let Some(why) = &best.unfit {
        bail!(
            "the model fits no layout of these {} nodes: {} (best tried: {})",
            peers.len(),
            why,
            best.name
        );
    }
    let order = best
        .layout
        .order
        .iter()
        .map(|&i| peers[i].clone())
        .collect();
    Ok((best, order, s))
}

/// The planner's prediction for a layout given by flags, from the survey of its nodes
/// (`survey.peers` in the layout's node order).
pub fn predict_given(
    file: &GgufFile,
    cfg: &ModelConfig,
    survey: &Survey,
    (layout, cache): (&Layout, weft_model::CacheType),
    workload: &Workload,
) -> Candidate {
    let model = weft_cluster::model_profile(file, cfg, cache);
    let cluster = cluster_profile(survey, &type_mix(file, cfg));
    let spec = LayoutSpec {
        tp: layout.tp,
        ep: layout.ep,
        order: (0..layout.nodes()).collect(),
        layers: layout.layers.iter().map(|r| r.len()).collect(),
        tp_weights: layout.tp_weights.clone(),
        ep_weights: layout.ep_weights.clone(),
        ep_spares: layout.ep_spares,
    };
    evaluate(&model, &cluster, workload, spec, survey.peers.len())
}

pub fn survey_options(secret: &str, l: &LayoutArgs, delay: f64, threads: usize) -> SurveyOptions {
    SurveyOptions {
        fresh: false,
        activity: None,
        secret: secret.as_bytes().to_vec(),
        transport: l.transport.clone(),
        link_delay_us: delay,
        timeout: Duration::from_secs(2),
        threads_per_node: threads,
        pings: 200,
        bulk: 1 << 20,
    }
}
