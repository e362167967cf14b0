//! `weft serve` as a cluster's coordinator: the batcher drives the cluster's batched
//! steps (every node holds a KV cache per slot, and a step's sequences cross the nodes as
//! one batch), and `/v1/cluster` describes its nodes, shards and links.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use weft_gguf::GgufFile;
use weft_model::BatchOptions;
use weft_server::{ChatTemplate, ClusterView, EngineHandle};
use weft_tokenizer::Tokenizer;

use crate::cluster_cli::{open, LocalNodes};
use crate::serve::{chat_template, ServeArgs};

type Started = (
    EngineHandle,
    Arc<Tokenizer>,
    ChatTemplate,
    Box<dyn ClusterView>,
);

/// What `/v1/cluster` reports, fixed when the cluster formed.
struct ClusterInfo {
    described: Value,
    /// Local node processes (with --nodes), stopped when the server exits.
    _local: Option<LocalNodes>,
}

impl ClusterView for ClusterInfo {
    fn describe(&self) -> Value {
        self.described.clone()
    }
}

pub fn start(a: &ServeArgs, path: &Path, opts: BatchOptions) -> Result<Started> {
    let file = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    // Each rank sends its slice's top 64 (OpenAI asks for at most 20) and its normalizer.
    let opened = open(&a.layout, path, a.ctx, 64, true, opts.max_seqs)?;
    let template = chat_template(&file, &opened.tokenizer)?;
    let cluster = opened.cluster;
    let layout = cluster.layout().clone();
    let stages = layout.stage_ranks();
    let nodes: Vec<Value> = cluster
        .nodes()
        .into_iter()
        .enumerate()
        .map(|(i, (addr, shard, rss))| {
            let stage = i / layout.tp;
            json!({
                "rank": i + 1,
                "address": addr,
                "stage": stage,
                "tp_rank": i % layout.tp,
                "layers": [layout.layers[stage].start, layout.layers[stage].end],
                "tp_share": layout.tp_weights[i % layout.tp] / layout.tp_weights.iter().sum::<f64>(),
                "weight_bytes": shard,
                "rss_bytes_after_load": rss,
            })
        })
        .collect();
    let o = cluster.options();
    let described = json!({
        "mode": "cluster",
        "tp": layout.tp,
        "pp": layout.pp,
        "stages": stages,
        "syncs_per_token": layout.syncs_per_token(),
        "nodes": nodes,
        "links": {
            "transport": o.transport,
            "injected_delay_us": o.link_delay_us,
            "timeout_ms": o.timeout.as_millis() as u64,
        },
    });
    let tokenizer = Arc::new(opened.tokenizer);
    let handle = EngineHandle::start(cluster, tokenizer.clone(), opts)
        .context("starting the batcher thread")?;
    let info = ClusterInfo {
        described,
        _local: opened._local,
    };
    Ok((handle, tokenizer, template, Box::new(info)))
}
