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
use crate::cluster_open::{open, Opened};
use crate::cluster_secret::secret_from;
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

/// What `/v1/cluster` reports: the cluster as it last formed, and every lost node and
/// what was done about it.
struct ClusterInfo {
    described: Arc<Mutex<Value>>,
    events: Arc<Mutex<Vec<ResumeEvent>>>,
    /// Nodes whose address refused a connection at the last probe.
    unreachable: Arc<Mutex<Vec<String>>>,
}

/// How often the nodes' addresses are probed, so a node that dies while the cluster is
/// idle shows as lost (the data plane notices only at the next step).
const LIVENESS_EVERY: Duration = Duration::from_secs(1);
const LIVENESS_TIMEOUT: Duration = Duration::from_millis(500);

/// Probes every node of the current description with a TCP connect, once a second, for
/// the life of the process, and keeps the list of those that did not answer.
fn probe_nodes(described: Arc<Mutex<Value>>, unreachable: Arc<Mutex<Vec<String>>>) {
    let spawned = std::thread::Builder::new()
        .name("weft-node-probe".into())
        .spawn(move || loop {
            let addrs: Vec<String> = described
                .lock()
                .map(|d| {
                    d["nodes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|n| n["address"].as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            let down: Vec<String> = addrs
                .into_iter()
                .filter(|a| {
                    // Peers may be given by name, as `--peers` takes them.
                    let reached = std::net::ToSocketAddrs::to_socket_addrs(a.as_str())
                        .into_iter()
                        .flatten()
                        .any(|sa| {
                            std::net::TcpStream::connect_timeout(&sa, LIVENESS_TIMEOUT).is_ok()
                        });
                    !reached
                })
                .collect();
            if let Ok(mut u) = unreachable.lock() {
                *u = down;
            }
            std::thread::sleep(LIVENESS_EVERY);
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the node probe: {e}");
    }
}

impl ClusterView for ClusterInfo {
    fn describe(&self) -> Value {
        let mut v = self
            .described
            .lock()
            .map(|v| v.clone())
            .unwrap_or_else(|_| json!({"mode": "cluster"}));
        if let (Some(o), Ok(e)) = (v.as_object_mut(), self.events.lock()) {
            o.insert("resumes".into(), json!(*e));
        }
        let down = self
            .unreachable
            .lock()
            .map(|u| u.clone())
            .unwrap_or_default();
        if let Some(nodes) = v.get_mut("nodes").and_then(Value::as_array_mut) {
            for n in nodes {
                let lost = n["address"]
                    .as_str()
                    .is_some_and(|a| down.iter().any(|d| d == a));
                n["state"] = json!(if lost { "lost" } else { "ready" });
            }
        }
        v
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
}

/// How long a peer has to answer a probe before a re-plan leaves it out.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a re-plan waits for the answering peers' member lists.
const MEMBERS_WAIT: Duration = Duration::from_millis(300);

impl ServeFormer {
    fn take(&mut self, opened: Opened) -> Cluster {
        let Opened {
            cluster,
            _local: local,
            planned,
            ..
        } = opened;
        self.take_parts(cluster, local, planned)
    }

    fn take_parts(
        &mut self,
        cluster: Cluster,
        local: Option<LocalNodes>,
        planned: Option<(Candidate, Survey)>,
    ) -> Cluster {
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
        self.local = local;
        cluster
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
        let opened = open(&layout, &self.path, self.ctx, TOP_K, true, self.slots)
            .map_err(|e| format!("{e:#}"))?;
        Ok(self.take(opened))
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
    let mut former = ServeFormer {
        layout: a.layout.clone(),
        path: path.to_path_buf(),
        ctx: a.ctx,
        slots: opts.max_seqs,
        local: None,
        described: described.clone(),
    };
    let first = former.take_parts(cluster, local, planned);
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
    let backend = Resuming::new(first, former, resume);
    let events = backend.events();
    let handle = EngineHandle::start(backend, tokenizer.clone(), opts)
        .context("starting the batcher thread")?;
    let unreachable = Arc::new(Mutex::new(Vec::new()));
    probe_nodes(described.clone(), unreachable.clone());
    Ok((
        handle,
        tokenizer,
        template,
        Box::new(ClusterInfo {
            described,
            events,
            unreachable,
        }),
    ))
}
