//! `weft serve` as a cluster's coordinator: the batcher drives the cluster's batched
//! steps (every node holds a KV cache per slot, and a step's sequences cross the nodes as
//! one batch), and `/v1/cluster` describes its nodes, shards and links. A lost node fails
//! the requests of that step with 503; the next request forms the cluster again.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use weft_cluster::local::LocalNodes;
use weft_cluster::Cluster;
use weft_gguf::GgufFile;
use weft_model::{BatchBackend, BatchOptions, ModelError, SeqSpan};
use weft_server::{ChatTemplate, ClusterView, EngineHandle};
use weft_tokenizer::Tokenizer;

use crate::chat_template::chat_template;
use crate::cluster_open::{open, Opened};
use crate::layout_args::LayoutArgs;
use crate::serve_args::ServeArgs;
use weft_cluster::survey::Survey;
use weft_plan::Candidate;

type Started = (
    EngineHandle,
    Arc<Tokenizer>,
    ChatTemplate,
    Box<dyn ClusterView>,
);

/// Each rank sends its slice's top 64 (OpenAI asks for at most 20) and its normalizer.
const TOP_K: usize = 64;

/// What `/v1/cluster` reports: the cluster as it last formed.
struct ClusterInfo(Arc<Mutex<Value>>);

impl ClusterView for ClusterInfo {
    fn describe(&self) -> Value {
        self.0
            .lock()
            .map(|v| v.clone())
            .unwrap_or_else(|_| json!({"mode": "cluster"}))
    }
}

/// The nodes, shards and links of `cluster`, as `/v1/cluster` shows them.
fn describe(cluster: &Cluster) -> Value {
    let layout = cluster.layout();
    let share_total: f64 = layout.tp_weights.iter().sum();
    let nodes: Vec<Value> = cluster
        .nodes()
        .into_iter()
        .enumerate()
        .map(|(i, (addr, shard, rss))| {
            let (stage, pos) = (i / layout.width(), i % layout.width());
            json!({
                "rank": i + 1,
                "address": addr,
                "stage": stage,
                "tp_rank": pos % layout.tp,
                "ep_group": pos / layout.tp,
                "layers": [layout.layers[stage].start, layout.layers[stage].end],
                "tp_share": layout.tp_weights[pos % layout.tp] / share_total,
                "weight_bytes": shard,
                "rss_bytes_after_load": rss,
            })
        })
        .collect();
    let o = cluster.options();
    json!({
        "mode": "cluster",
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "stages": layout.stage_ranks(),
        "syncs_per_token": layout.syncs_per_token(),
        "nodes": nodes,
        "links": {
            "transport": o.transport,
            "injected_delay_us": o.link_delay_us,
            "timeout_ms": o.timeout.as_millis() as u64,
        },
    })
}

/// The cluster behind the batcher, formed again after it failed: with `--nodes` that
/// starts fresh local nodes, with `--peers` it dials the nodes again (one restarted by its
/// owner rejoins). While it cannot be formed, requests fail with 503 saying why.
struct Reforming {
    layout: LayoutArgs,
    path: PathBuf,
    ctx: usize,
    slots: usize,
    n_ctx: usize,
    max_rows: usize,
    live: Option<(Cluster, Option<LocalNodes>)>,
    described: Arc<Mutex<Value>>,
    /// Handed out by `logits` if asked with no cluster (the batcher never does).
    empty: Vec<f32>,
}

impl Reforming {
    fn take(
        &mut self,
        cluster: Cluster,
        local: Option<LocalNodes>,
        planned: Option<(Candidate, Survey)>,
    ) {
        if let Ok(mut d) = self.described.lock() {
            *d = describe(&cluster);
            // What the planner chose and the measurements it chose from (only when the
            // layout was planned, not given by flags).
            if let Some((c, s)) = planned {
                d["plan"] = json!({
                    "layout": c.name, "prediction": c.prediction, "memory_bytes": c.memory,
                    "profiles": s.nodes, "links": s.links, "surveyed": s.peers,
                });
            }
        }
        self.live = Some((cluster, local));
    }

    fn cluster(&mut self) -> Result<&mut Cluster, ModelError> {
        if self.live.is_none() {
            eprintln!("weft serve: forming the cluster again");
            let opened = open(&self.layout, &self.path, self.ctx, TOP_K, true, self.slots)
                .map_err(|e| ModelError::Collective(format!("the cluster is down: {e:#}")))?;
            self.take(opened.cluster, opened._local, opened.planned);
        }
        self.live
            .as_mut()
            .map(|(c, _)| c)
            .ok_or_else(|| ModelError::Collective("the cluster is down".into()))
    }
}

impl BatchBackend for Reforming {
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn slots(&self) -> usize {
        self.slots
    }
    fn max_rows(&self) -> usize {
        self.max_rows
    }
    fn reset(&mut self, slot: usize) -> Result<(), ModelError> {
        BatchBackend::reset(self.cluster()?, slot)
    }
    fn step(&mut self, tokens: &[u32], spans: &[SeqSpan]) -> Result<(), ModelError> {
        let r = BatchBackend::step(self.cluster()?, tokens, spans);
        if r.is_err() {
            // Stop what is left of it (and its local nodes); the next request re-forms it.
            self.live = None;
        }
        r
    }
    fn logits(&mut self, i: usize) -> &mut [f32] {
        match self.live.as_mut() {
            Some((c, _)) => BatchBackend::logits(c, i),
            None => &mut self.empty,
        }
    }
    fn log_normalizer(&self, i: usize) -> Option<f32> {
        self.live
            .as_ref()
            .and_then(|(c, _)| BatchBackend::log_normalizer(c, i))
    }
}

pub fn start(a: &ServeArgs, path: &Path, opts: BatchOptions) -> Result<Started> {
    let file = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    let opened = open(&a.layout, path, a.ctx, TOP_K, true, opts.max_seqs)?;
    let template = chat_template(&file, &opened.tokenizer)?;
    let Opened {
        cluster,
        tokenizer,
        _local: local,
        planned,
        ..
    } = opened;
    let tokenizer = Arc::new(tokenizer);
    let described = Arc::new(Mutex::new(Value::Null));
    let mut backend = Reforming {
        layout: a.layout.clone(),
        path: path.to_path_buf(),
        ctx: a.ctx,
        slots: BatchBackend::slots(&cluster),
        n_ctx: BatchBackend::n_ctx(&cluster),
        max_rows: BatchBackend::max_rows(&cluster),
        live: None,
        described: described.clone(),
        empty: Vec::new(),
    };
    backend.take(cluster, local, planned);
    let handle = EngineHandle::start(backend, tokenizer.clone(), opts)
        .context("starting the batcher thread")?;
    Ok((
        handle,
        tokenizer,
        template,
        Box::new(ClusterInfo(described)),
    ))
}
