//! `weft serve` as a cluster's coordinator: the batcher drives the cluster's batched
//! steps (every node holds a KV cache per slot, and a step's sequences cross the nodes as
//! one batch), and `/v1/cluster` describes its nodes, shards, links and lost nodes. A lost
//! node pauses the running requests while the cluster forms again from the nodes that
//! answer and their caches are rebuilt (weft-cluster's `Resuming`); only when none can be
//! formed within `--resume-wait` do they fail with 503.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use weft_cluster::discovery::{self, State};
use weft_cluster::local::LocalNodes;
use weft_cluster::{Cluster, Former, ResumeEvent, ResumeOptions, Resuming};
use weft_gguf::GgufFile;
use weft_model::BatchOptions;
use weft_server::{ChatTemplate, ClusterView, EngineHandle};
use weft_tokenizer::Tokenizer;

use crate::chat_template::chat_template;
use crate::cluster_open::{check_flags, open, Opened, Watch};
use crate::cluster_secret::secret_from;
use crate::layout_args::LayoutArgs;
use crate::serve_args::ServeArgs;
use weft_cluster::activity::{ActivityBoard, NodeState};
use weft_cluster::survey::Survey;
use weft_model::ModelConfig;

type Started = (
    EngineHandle,
    Arc<Tokenizer>,
    ChatTemplate,
    Box<dyn ClusterView>,
);

/// Each rank sends its slice's top 64 (OpenAI asks for at most 20) and its normalizer.
const TOP_K: usize = 64;

/// What `/v1/cluster` reports: the cluster as it last formed, each node's state and work
/// as its heartbeats tell them, and every lost node and what was done about it.
struct ClusterInfo {
    described: Arc<Mutex<Value>>,
    events: Arc<Mutex<Vec<ResumeEvent>>>,
    board: Arc<ActivityBoard>,
}

/// A node silent this long on its control link (it beats four times a second, even while
/// it loads or computes) shows as lost; one whose link closed shows so at once.
const LOST_AFTER: Duration = Duration::from_millis(1500);

impl ClusterView for ClusterInfo {
    fn describe(&self) -> Value {
        let mut v = self
            .described
            .lock()
            .map(|v| v.clone())
            .unwrap_or(Value::Null);
        let forming = v.is_null();
        if forming {
            // Not formed yet: the nodes are being surveyed or are loading their shards.
            v = json!({"mode": "cluster", "forming": true, "nodes": []});
        }
        if let (Some(o), Ok(e)) = (v.as_object_mut(), self.events.lock()) {
            o.insert("resumes".into(), json!(*e));
        }
        if let Some(nodes) = v.get_mut("nodes").and_then(Value::as_array_mut) {
            for n in nodes.iter_mut() {
                let addr = n["address"].as_str().unwrap_or_default().to_string();
                n["state"] = json!(self.board.state(&addr, LOST_AFTER).as_str());
                if let Some(w) = self.board.get(&addr).and_then(|a| a.work) {
                    n["work"] = json!(w);
                }
            }
            // The nodes of a cluster still forming: at start every one heard (surveyed,
            // loading, or loaded and waiting for the others); when it forms again after
            // a lost node, the ones loading, beside the nodes it had.
            for (addr, state, work) in self.board.alive(LOST_AFTER) {
                let listed = nodes.iter().any(|n| n["address"] == addr.as_str());
                if !listed && (forming || state == NodeState::Loading) {
                    nodes.push(json!({"address": addr, "state": state.as_str(), "work": work}));
                }
            }
        }
        v
    }
}

/// The nodes, shards and links of `cluster`, as `/v1/cluster` shows them: what of the
/// model each node holds, and with the survey, each node's machine and the measured links.
fn describe(
    cluster: &Cluster,
    survey: Option<&Survey>,
    (file, cfg): (&GgufFile, &ModelConfig),
) -> Value {
    let layout = cluster.layout();
    let share_total: f64 = layout.tp_weights.iter().sum();
    let shards = layout
        .node_shards(file, cfg)
        .map_err(|e| tracing::warn!("describing the shards: {e}"))
        .ok();
    let surveyed = |addr: &str| survey.and_then(|s| s.peers.iter().position(|p| p == addr));
    let nodes: Vec<Value> = cluster
        .nodes()
        .into_iter()
        .enumerate()
        .map(|(i, (addr, shard, rss))| {
            let (stage, pos) = (i / layout.width(), i % layout.width());
            let mut n = json!({
                "rank": i + 1,
                "address": addr,
                "stage": stage,
                "tp_rank": pos % layout.tp,
                "ep_group": pos / layout.tp,
                "layers": [layout.layers[stage].start, layout.layers[stage].end],
                "tp_share": layout.tp_weights[pos % layout.tp] / share_total,
                "weight_bytes": shard,
                "rss_bytes_after_load": rss,
            });
            if let (Some(s), Some(k)) = (survey, surveyed(&addr)) {
                n["host"] = s.nodes[k].machine();
            }
            if let Some(Some(f)) = cluster.fetched().get(i) {
                n["fetched"] = json!(f);
            }
            if let Some(sh) = shards.as_ref().and_then(|v| v.get(i)) {
                let r = |x: &std::ops::Range<usize>| json!([x.start, x.end]);
                n["holds"] = json!({
                    "heads": r(&sh.heads), "kv_heads": r(&sh.kv_heads(cfg)),
                    "ffn_columns": r(&sh.ffn), "vocab_rows": r(&sh.vocab),
                    "experts": cfg.moe.as_ref().map(|_| r(&sh.experts)),
                    "expert_columns": cfg.moe.as_ref().map(|_| r(&sh.expert_ffn)),
                });
            }
            n
        })
        .collect();
    let o = cluster.options();
    let share = o
        .share
        .as_ref()
        .map(|h| json!({"root": h.root(), "port": h.port, "sent_bytes": h.bytes_sent()}));
    let mut links = json!({
        "transport": o.transport,
        "injected_delay_us": o.link_delay_us,
        "timeout_ms": o.timeout.as_millis() as u64,
    });
    if let Some(s) = survey {
        // The matrix in the cluster's order: the coordinator, then node 1, 2, …
        let index: Option<Vec<usize>> = std::iter::once(Some(0))
            .chain(cluster.peers().iter().map(|p| surveyed(p).map(|k| k + 1)))
            .collect();
        if let Some(ix) = index {
            let pick = |m: &Vec<Vec<f64>>| -> Vec<Vec<f64>> {
                ix.iter()
                    .map(|&a| ix.iter().map(|&b| m[a][b]).collect())
                    .collect()
            };
            let transport: Vec<Vec<&str>> = ix
                .iter()
                .map(|&a| {
                    ix.iter()
                        .map(|&b| s.links.transport[a][b].as_str())
                        .collect()
                })
                .collect();
            links["measured"] = json!({
                "between": std::iter::once("coordinator".to_string())
                    .chain(cluster.peers().iter().cloned())
                    .collect::<Vec<_>>(),
                "rtt_us": pick(&s.links.rtt_us),
                "bandwidth_gb_s": pick(&s.links.bandwidth_gb_s),
                "transport": transport,
            });
        }
    }
    json!({
        "mode": "cluster",
        "share": share,
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "ep_weights": layout.ep_weights,
        "ep_spares": layout.ep_spares,
        "stages": layout.stage_ranks(),
        "syncs_per_token": layout.syncs_per_token(),
        "nodes": nodes,
        "links": links,
    })
}

/// How `weft serve` forms its cluster again after a node is lost: with `--nodes` it starts
/// a fresh set of local nodes; with `--peers` it dials every peer, keeps those that answer
/// (a lost one restarted by its owner answers again) and forms the layout over them.
struct ServeFormer {
    layout: LayoutArgs,
    path: PathBuf,
    ctx: usize,
    slots: usize,
    local: Option<LocalNodes>,
    described: Arc<Mutex<Value>>,
    board: Arc<ActivityBoard>,
    /// The last survey, for what a re-formed cluster shows of its nodes (a re-form does
    /// not survey again with a layout given by flags: that would lengthen the pause).
    last_survey: Option<Survey>,
}

/// How long a peer has to answer a probe before a re-plan leaves it out.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a re-plan waits for the answering peers' member lists.
const MEMBERS_WAIT: Duration = Duration::from_millis(300);

impl ServeFormer {
    /// Keeps what `/v1/cluster` shows of a newly formed cluster, and its local nodes.
    fn take(&mut self, opened: Opened) -> (Cluster, Tokenizer) {
        let Opened {
            cluster,
            tokenizer,
            _local: local,
            planned,
            predicted,
            survey,
            file,
            cfg,
            ..
        } = opened;
        if survey.is_some() {
            self.last_survey = survey;
        }
        let survey = self.last_survey.as_ref();
        if let Ok(mut d) = self.described.lock() {
            *d = describe(&cluster, survey, (&file, &cfg));
            // What the planner chose (or predicts for the layout the flags gave) and the
            // measurements it worked from.
            let chosen = planned.is_some();
            if let (Some(c), Some(s)) = (planned.or(predicted), survey) {
                d["plan"] = json!({
                    "layout": c.name, "chosen": chosen, "prediction": c.prediction,
                    "memory_bytes": c.memory, "profiles": s.nodes, "links": s.links,
                    "surveyed": s.peers,
                });
            }
        }
        self.local = local;
        (cluster, tokenizer)
    }

    /// The peers that answer an authenticated dial now, in the order given, then any
    /// other member their member lists know to be up (a node started since with `--join`).
    fn answering(&self) -> Result<Vec<String>, String> {
        let secret = secret_from(&self.layout.secret).map_err(|e| format!("{e:#}"))?;
        let mut up: Vec<String> = self
            .layout
            .peers
            .iter()
            .filter(|p| weft_cluster::control::dial(p, secret.as_bytes(), PROBE_TIMEOUT).is_ok())
            .cloned()
            .collect();
        // A full shape needs only so many; the member lists are asked only for more.
        let needed = self.layout.full_shape_nodes().unwrap_or(usize::MAX);
        if !up.is_empty() && up.len() < needed {
            // The membership stops watching when dropped.
            if let Ok((_, members)) =
                discovery::discover(secret.as_bytes(), &up, false, MEMBERS_WAIT)
            {
                for x in members {
                    if x.state == State::Up && !up.contains(&x.addr) {
                        up.push(x.addr);
                    }
                }
            }
        }
        if up.is_empty() {
            return Err(format!(
                "none of the {} nodes answers",
                self.layout.peers.len()
            ));
        }
        Ok(up)
    }
}

impl Former for ServeFormer {
    fn form(&mut self) -> Result<Cluster, String> {
        // Local nodes are replaced whole: stop what is left of the old set first.
        self.local = None;
        let mut layout = self.layout.clone();
        if !layout.peers.is_empty() {
            layout.peers = self.answering()?;
            let left_out: Vec<&String> = self
                .layout
                .peers
                .iter()
                .filter(|p| !layout.peers.contains(p))
                .collect();
            eprintln!(
                "weft serve: forming the cluster over {} (not answering: {left_out:?})",
                layout.peers.join(", ")
            );
        } else {
            eprintln!("weft serve: forming the cluster again");
        }
        let opened = open(
            &layout,
            &self.path,
            self.ctx,
            TOP_K,
            true,
            self.slots,
            Some(Watch {
                board: self.board.clone(),
                survey: false,
            }),
        )
        .map_err(|e| format!("{e:#}"))?;
        Ok(self.take(opened).0)
    }
}

/// Starts serving a cluster: the chat template and tokenizer come from the file at once,
/// and the cluster forms on the batcher thread (nodes surveyed, planned, each loading
/// its shard) while the server already answers: `/v1/cluster` and the dashboard show
/// the nodes loading, requests wait, and the engine's `wait_ready` says when it is done.
pub fn start(a: &ServeArgs, path: &Path, opts: BatchOptions) -> Result<Started> {
    let file = crate::model_source::open_model(path)?;
    let cfg = ModelConfig::from_gguf(&file)?;
    // What the flags get wrong is said before the server answers.
    check_flags(&a.layout, &cfg, path)?;
    let tokenizer = Arc::new(weft_model::vocab::tokenizer_from_gguf(&file)?);
    let template = chat_template(&file, &tokenizer)?;
    if !(a.resume_wait.is_finite() && a.resume_wait >= 0.0) {
        bail!(
            "--resume-wait {} must be a number of seconds >= 0",
            a.resume_wait
        );
    }
    let resume = ResumeOptions {
        wait: Duration::from_secs_f64(a.resume_wait.min(86_400.0)),
        ..ResumeOptions::default()
    };
    let board = Arc::new(ActivityBoard::default());
    let described = Arc::new(Mutex::new(Value::Null));
    let events = Arc::new(Mutex::new(Vec::new()));
    let mut former = ServeFormer {
        layout: a.layout.clone(),
        path: path.to_path_buf(),
        ctx: a.ctx,
        slots: opts.max_seqs,
        local: None,
        described: described.clone(),
        board: board.clone(),
        last_survey: None,
    };
    let (layout, ctx, path_buf, watch, kept) = (
        a.layout.clone(),
        a.ctx,
        path.to_path_buf(),
        board.clone(),
        events.clone(),
    );
    let build = move || {
        let opened = open(
            &layout,
            &path_buf,
            ctx,
            TOP_K,
            true,
            opts.max_seqs,
            Some(Watch {
                board: watch,
                survey: true,
            }),
        )
        .map_err(|e| format!("{e:#}"))?;
        let (first, _) = former.take(opened);
        Ok(Resuming::new(first, former, resume).with_events(kept))
    };
    let n_ctx = a.ctx.min(cfg.n_ctx_train).max(1);
    // As the batcher will clamp it: a cluster's steps carry at most a micro-batch.
    let opts = BatchOptions {
        prefill_chunk: opts.prefill_chunk.clamp(1, weft_model::DEFAULT_UBATCH),
        ..opts
    };
    let handle = EngineHandle::start_deferred(build, tokenizer.clone(), opts, n_ctx)
        .context("starting the batcher thread")?;
    Ok((
        handle,
        tokenizer,
        template,
        Box::new(ClusterInfo {
            described,
            events,
            board,
        }),
    ))
}
