//! The coordinator: connects to nodes, sends each its part of the plan, joins the data-plane
//! group as rank 0, and runs sequences as a generation `Backend`: it sends each step's
//! tokens, gathers the last stage's top-k replies, and samples. Only it sees logits.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use weft_comm::{CommError, Group, Liveness};
use weft_model::{Backend, BatchBackend, CacheType, ModelError, SeqSpan};

use crate::activity::ActivityBoard;
use crate::control::{FromNode, NodePlan, ToNode};
use crate::forming::{connect, form_group, GroupSpec};
use crate::heartbeat::ControlLink;
use crate::layout::Layout;
use crate::node::CONTROL_SILENCE;
use crate::step::{
    reply_bytes, StepHeader, KIND_BATCH, KIND_RUN, KIND_STOP, SPAN_LOGITS, SPAN_RESET, STATS_BYTES,
};

/// How long a node has to answer a dial after a data-plane error before it is the one
/// named lost.
const LOST_PROBE: Duration = Duration::from_millis(500);

#[derive(Clone, Debug)]
pub struct ClusterOptions {
    pub secret: Vec<u8>,
    /// The model path sent to nodes (a node started with `--model` uses its own).
    pub model: String,
    pub n_vocab: usize,
    pub n_ctx: usize,
    pub ubatch: usize,
    /// How the nodes' KV caches store keys and values.
    pub cache_type: CacheType,
    /// Sequences the nodes hold at once for batched steps (one KV cache each).
    pub slots: usize,
    pub threads_per_node: usize,
    pub transport: String,
    pub link_delay_us: f64,
    /// How long a node may be silent (no data, no heartbeat) before it is lost; a node
    /// that computes for longer, but keeps beating, is busy, not lost.
    pub timeout: Duration,
    /// Candidates each last-stage rank sends per step (sampling sees these).
    pub top_k: usize,
    /// Whether log-probabilities will be asked for (ranks then send their normalizers).
    pub logprobs: bool,
    /// Where the nodes' beats (their work, their loading, their end) are kept for a
    /// watcher such as the dashboard; None: nobody watches.
    pub activity: Option<Arc<ActivityBoard>>,
    /// The coordinator's share server over its model file: nodes without a copy fetch
    /// their shards from it and from each other. None: every node must hold the file.
    pub share: Option<Arc<crate::share::ShareHost>>,
}

/// What one node reported when the cluster stopped.
#[derive(Clone, Debug, Default, Serialize)]
pub struct NodeStats {
    pub addr: String,
    pub compute_secs: f64,
    pub comm_secs: f64,
    pub idle_secs: f64,
    pub steps: u64,
    pub syncs: u64,
    pub peak_rss_bytes: u64,
    pub shard_bytes: u64,
    pub load_rss_bytes: u64,
}

pub struct Cluster {
    group: Group,
    layout: Layout,
    peers: Vec<String>,
    /// Control links, held open for the session: their heartbeats feed `liveness`.
    _controls: Vec<ControlLink<FromNode, ToNode>>,
    liveness: Arc<Liveness>,
    shard_bytes: Vec<u64>,
    load_rss: Vec<u64>,
    /// What each node fetched of its shard (None: it had the file).
    fetched: Vec<Option<weft_share::FetchReport>>,
    opts: ClusterOptions,
    pos: usize,
    /// The single sequence's merged logits (`Backend`).
    row: MergedRow,
    /// Batched steps' merged logits, one per span that wanted them (`BatchBackend`).
    rows: Vec<MergedRow>,
    /// Per slot: reset its cache with its next span, and its length so far.
    resets: Vec<bool>,
    slot_pos: Vec<usize>,
    /// The last stage's ranks, which send the top-k replies, one buffer each.
    last_stage: Vec<usize>,
    replies: Vec<Vec<u8>>,
    norms: Vec<f32>,
    id_bytes: Vec<u8>,
    span_bytes: Vec<u8>,
    stopped: bool,
    /// The node the last data-plane error named, if any.
    blamed: Option<String>,
}

/// One token's logits as the coordinator sees them: the merged top-k of the vocabulary
/// slices over a full-vocabulary vector of -inf, and the full vocabulary's normalizer.
struct MergedRow {
    logits: Vec<f32>,
    set: Vec<u32>,
    log_norm: f32,
}

impl MergedRow {
    fn new(n_vocab: usize) -> Self {
        MergedRow {
            logits: vec![f32::NEG_INFINITY; n_vocab],
            set: Vec::new(),
            log_norm: 0.0,
        }
    }

    /// Replaces the row with the merge of `replies` (each rank's top-k and normalizer),
    /// keeping the best k overall, as one node would see them. `norms` is scratch.
    fn merge<'a>(
        &mut self,
        replies: impl Iterator<Item = &'a [u8]>,
        k: usize,
        norms: &mut Vec<f32>,
    ) {
        for &i in &self.set {
            self.logits[i as usize] = f32::NEG_INFINITY;
        }
        self.set.clear();
        norms.clear();
        for reply in replies {
            for c in reply[..k * 8].chunks_exact(8) {
                let id = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                let v = f32::from_le_bytes([c[4], c[5], c[6], c[7]]);
                if (id as usize) < self.logits.len() {
                    self.logits[id as usize] = v;
                    self.set.push(id);
                }
            }
            let z = &reply[k * 8..k * 8 + 4];
            norms.push(f32::from_le_bytes([z[0], z[1], z[2], z[3]]));
        }
        self.log_norm = weft_model::sampler::log_sum_exp(norms);
        if self.set.len() > k {
            let lg = &self.logits;
            self.set.sort_unstable_by(|a, b| {
                lg[*b as usize].total_cmp(&lg[*a as usize]).then(a.cmp(b))
            });
            for &i in &self.set[k..] {
                self.logits[i as usize] = f32::NEG_INFINITY;
            }
            self.set.truncate(k);
        }
    }
}

impl Cluster {
    /// Sends every node (`peers[i]` is node i of `layout`) its plan and forms the group.
    pub fn connect(
        peers: &[String],
        layout: Layout,
        opts: ClusterOptions,
    ) -> Result<Cluster, String> {
        if peers.len() != layout.nodes() {
            return Err(format!(
                "{} peers for a layout of {} nodes",
                peers.len(),
                layout.nodes()
            ));
        }
        let stages = layout.stage_ranks();
        let liveness = Arc::new(Liveness::new(peers.len() + 1, None));
        let mut controls = Vec::new();
        for (i, addr) in peers.iter().enumerate() {
            let c = connect(addr, &opts.secret, &liveness, i + 1, opts.activity.as_ref())?;
            let stage = i / layout.width();
            let share = match &opts.share {
                Some(host) => Some(crate::control::ShareSpec {
                    // Empty until a node has asked for the manifest: a node that lacks
                    // the file asks the coordinator's share port for it then.
                    root: host.root().unwrap_or_default(),
                    sources: std::iter::once(
                        std::net::SocketAddr::new(c.local_ip()?, host.port).to_string(),
                    )
                    .chain(peers.iter().filter(|p| *p != addr).cloned())
                    .collect(),
                    hub_urls: host.hub_urls.clone(),
                }),
                None => None,
            };
            let plan = NodePlan {
                model: opts.model.clone(),
                rank: i + 1,
                group_size: peers.len() + 1,
                stage,
                stages: stages.clone(),
                layers: (layout.layers[stage].start, layout.layers[stage].end),
                tp_rank: i % layout.width(),
                tp_weights: layout.tp_weights.clone(),
                ep_weights: layout.ep_weights.clone(),
                ep_spares: layout.ep_spares,
                threads: opts.threads_per_node,
                n_ctx: opts.n_ctx,
                ubatch: opts.ubatch,
                cache_type: opts.cache_type,
                slots: opts.slots,
                transport: opts.transport.clone(),
                link_delay_us: opts.link_delay_us,
                timeout_ms: opts.timeout.as_millis() as u64,
                share,
            };
            c.send(&ToNode::Plan(Box::new(plan)))
                .map_err(|e| format!("node {addr}: {e}"))?;
            controls.push(c);
        }
        let mut addrs = vec![String::new()];
        let (mut shard_bytes, mut load_rss) = (Vec::new(), Vec::new());
        let mut fetched = Vec::new();
        // Loading may take long: nodes beat while they load, and only silence fails.
        for (c, addr) in controls.iter().zip(peers) {
            match c
                .recv(CONTROL_SILENCE)
                .map_err(|e| format!("node {addr}: {e}"))?
            {
                FromNode::Ready {
                    data_addr,
                    shard_bytes: b,
                    rss_bytes,
                    fetched: f,
                } => {
                    if let Some(f) = &f {
                        tracing::info!(
                            "node {addr} fetched {} bytes of its shard in {:.2} s ({} of {} pieces held already): {}",
                            f.fetched_bytes,
                            f.seconds,
                            f.already,
                            f.wanted,
                            f.sources
                                .iter()
                                .map(|s| format!("{} from {}", s.bytes, s.name))
                                .collect::<Vec<_>>()
                                .join(", ")
                        );
                    }
                    fetched.push(f);
                    if let Some(board) = &opts.activity {
                        board.loaded(addr);
                    }
                    addrs.push(data_addr);
                    shard_bytes.push(b);
                    load_rss.push(rss_bytes);
                }
                FromNode::Failed { error } => return Err(format!("node {addr}: {error}")),
                other => {
                    return Err(format!(
                        "node {addr}: expected ready or failed, got {other:?}"
                    ))
                }
            }
        }
        let spec = GroupSpec {
            transport: &opts.transport,
            link_delay_us: opts.link_delay_us,
            timeout: opts.timeout,
            secret: &opts.secret,
            liveness: liveness.clone(),
        };
        let group = form_group(&controls, peers, &mut addrs, spec)?;
        Ok(Cluster {
            group,
            layout,
            peers: peers.to_vec(),
            _controls: controls,
            liveness,
            shard_bytes,
            load_rss,
            fetched,
            row: MergedRow::new(opts.n_vocab),
            rows: Vec::new(),
            resets: vec![true; opts.slots.max(1)],
            slot_pos: vec![0; opts.slots.max(1)],
            replies: vec![Vec::new(); stages.last().map(Vec::len).unwrap_or(0)],
            last_stage: stages.last().cloned().unwrap_or_default(),
            norms: Vec::new(),
            id_bytes: Vec::new(),
            span_bytes: Vec::new(),
            opts,
            pos: 0,
            stopped: false,
            blamed: None,
        })
    }

    /// What each node fetched of its shard when the cluster formed (None: its own copy).
    pub fn fetched(&self) -> &[Option<weft_share::FetchReport>] {
        &self.fetched
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Each node's address, shard weight bytes and resident memory after loading.
    pub fn nodes(&self) -> Vec<(String, u64, u64)> {
        (0..self.peers.len())
            .map(|i| (self.peers[i].clone(), self.shard_bytes[i], self.load_rss[i]))
            .collect()
    }

    pub fn options(&self) -> &ClusterOptions {
        &self.opts
    }

    /// How long each node (in node order) has been silent on its control link.
    pub fn silences(&self) -> Vec<Duration> {
        (1..=self.peers.len())
            .map(|r| self.liveness.silent_for(r))
            .collect()
    }

    /// Names the node behind a data-plane error. The rank an error blames may only have
    /// failed because its own peer did (and a survivor ends its session, closing its
    /// links, as soon as it notices), so the nodes are asked first: one that no longer
    /// answers a dial is the lost one. Only if all answer does the error's word stand.
    fn lost(&mut self, e: CommError) -> ModelError {
        let gone = (1..=self.peers.len()).find(|&r| {
            crate::control::dial(&self.peers[r - 1], &self.opts.secret, LOST_PROBE).is_err()
        });
        let rank = gone
            .or(e.lost_rank())
            .filter(|&r| r >= 1 && r <= self.peers.len());
        self.blamed = rank.map(|r| self.peers[r - 1].clone());
        ModelError::Collective(match rank {
            Some(r) => format!("node {} (rank {r}) was lost: {e}", self.peers[r - 1]),
            None => e.to_string(),
        })
    }

    /// The node the last data-plane error named, if any.
    pub fn lost_peer(&self) -> Option<&str> {
        self.blamed.as_deref()
    }

    /// The nodes' addresses, in rank order.
    pub fn peers(&self) -> &[String] {
        &self.peers
    }

    /// Drops a cluster that failed without the stop exchange: its sockets close, so every
    /// node still running ends its session and waits for the next coordinator.
    pub fn abandon(mut self) {
        self.stopped = true;
    }

    fn run(&mut self, tokens: &[u32], pos0: usize) -> Result<(), ModelError> {
        if pos0 + tokens.len() > self.opts.n_ctx {
            return Err(ModelError::Invalid(format!(
                "{} tokens exceed the {}-token context",
                pos0 + tokens.len(),
                self.opts.n_ctx
            )));
        }
        let k = self.opts.top_k.min(self.opts.n_vocab).max(1);
        let h = StepHeader {
            kind: KIND_RUN,
            n_tokens: tokens.len() as u32,
            pos0: pos0 as u32,
            want_logits: 1,
            top_k: k as u32,
            want_norm: u32::from(self.opts.logprobs),
        }
        .encode();
        self.id_bytes.clear();
        for t in tokens {
            self.id_bytes.extend_from_slice(&t.to_le_bytes());
        }
        let ids = std::mem::take(&mut self.id_bytes);
        let sent = self.broadcast_step(&[&h, &ids]);
        self.id_bytes = ids;
        sent?;
        self.recv_replies(1, k)?;
        let rb = reply_bytes(k);
        let replies = self.replies.iter().map(|r| &r[..rb]);
        self.row.merge(replies, k, &mut self.norms);
        self.pos = pos0 + tokens.len();
        // `run` drives the nodes' slot 0 directly.
        self.resets[0] = false;
        self.slot_pos[0] = self.pos;
        Ok(())
    }

    /// Receives each last-stage rank's reply of `rows` top-k records.
    fn recv_replies(&mut self, rows: usize, k: usize) -> Result<(), ModelError> {
        for i in 0..self.last_stage.len() {
            let r = self.last_stage[i];
            let mut reply = std::mem::take(&mut self.replies[i]);
            reply.resize(rows * reply_bytes(k), 0);
            let got = self.group.recv(r, &mut reply);
            self.replies[i] = reply;
            got.map_err(|e| self.lost(e))?;
        }
        Ok(())
    }

    /// Sends `parts` (header, then payloads) to every node.
    fn broadcast_step(&mut self, parts: &[&[u8]]) -> Result<(), ModelError> {
        let mut sent = Ok(());
        'nodes: for r in 1..=self.peers.len() {
            for p in parts {
                sent = self.group.send(r, p);
                if sent.is_err() {
                    break 'nodes;
                }
            }
        }
        sent.map_err(|e| self.lost(e))
    }

    /// Stops every node's session and returns what each reported.
    pub fn stop(&mut self) -> Result<Vec<NodeStats>, String> {
        self.stopped = true;
        let h = StepHeader {
            kind: KIND_STOP,
            n_tokens: 0,
            pos0: 0,
            want_logits: 0,
            top_k: 0,
            want_norm: 0,
        }
        .encode();
        let mut out = Vec::new();
        for r in 1..=self.peers.len() {
            self.group.send(r, &h).map_err(|e| e.to_string())?;
        }
        for r in 1..=self.peers.len() {
            let mut b = [0u8; STATS_BYTES];
            self.group.recv(r, &mut b).map_err(|e| e.to_string())?;
            let f = |i: usize| f64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            let u = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            out.push(NodeStats {
                addr: self.peers[r - 1].clone(),
                compute_secs: f(0),
                comm_secs: f(1),
                idle_secs: f(2),
                steps: u(3),
                syncs: u(4),
                peak_rss_bytes: u(5),
                shard_bytes: self.shard_bytes[r - 1],
                load_rss_bytes: self.load_rss[r - 1],
            });
        }
        Ok(out)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !self.stopped {
            let _ = self.stop();
        }
    }
}

impl Backend for Cluster {
    fn n_ctx(&self) -> usize {
        self.opts.n_ctx
    }
    fn prefill(&mut self, prompt: &[u32]) -> Result<(), ModelError> {
        self.run(prompt, 0)
    }
    fn decode(&mut self, token: u32) -> Result<(), ModelError> {
        let p = self.pos;
        self.run(&[token], p)
    }
    fn logits(&mut self) -> &mut [f32] {
        &mut self.row.logits
    }
    fn log_normalizer(&self) -> Option<f32> {
        self.opts.logprobs.then_some(self.row.log_norm)
    }
}

/// Batched steps across the nodes: every span's rows cross the pipeline together and the
/// last stage sends one top-k record per span that wants logits.
impl BatchBackend for Cluster {
    fn n_ctx(&self) -> usize {
        self.opts.n_ctx
    }
    fn slots(&self) -> usize {
        self.resets.len()
    }
    fn max_rows(&self) -> usize {
        self.opts.ubatch
    }
    fn reset(&mut self, slot: usize) -> Result<(), ModelError> {
        let n = self.resets.len();
        *self
            .resets
            .get_mut(slot)
            .ok_or_else(|| ModelError::Invalid(format!("slot {slot} of {n}")))? = true;
        self.slot_pos[slot] = 0;
        Ok(())
    }
    fn step(&mut self, tokens: &[u32], spans: &[SeqSpan]) -> Result<(), ModelError> {
        let rows: usize = spans.iter().map(|s| s.n_tokens).sum();
        if rows != tokens.len() || rows == 0 || rows > self.opts.ubatch {
            return Err(ModelError::Invalid(format!(
                "a step of {} tokens for spans of {rows} rows (1..={})",
                tokens.len(),
                self.opts.ubatch
            )));
        }
        self.span_bytes.clear();
        for s in spans {
            let pos = *self.slot_pos.get(s.cache).ok_or_else(|| {
                ModelError::Invalid(format!("slot {} of {}", s.cache, self.resets.len()))
            })?;
            if pos + s.n_tokens > self.opts.n_ctx {
                return Err(ModelError::ContextFull {
                    pos: pos + s.n_tokens,
                    n_ctx: self.opts.n_ctx,
                });
            }
            let mut flags = if s.logits { SPAN_LOGITS } else { 0 };
            if self.resets[s.cache] {
                flags |= SPAN_RESET;
            }
            for w in [s.cache as u32, s.n_tokens as u32, flags] {
                self.span_bytes.extend_from_slice(&w.to_le_bytes());
            }
        }
        let k = self.opts.top_k.min(self.opts.n_vocab).max(1);
        let h = StepHeader {
            kind: KIND_BATCH,
            n_tokens: rows as u32,
            pos0: spans.len() as u32,
            want_logits: 0,
            top_k: k as u32,
            want_norm: u32::from(self.opts.logprobs),
        }
        .encode();
        self.id_bytes.clear();
        for t in tokens {
            self.id_bytes.extend_from_slice(&t.to_le_bytes());
        }
        let (ids, span_bytes) = (
            std::mem::take(&mut self.id_bytes),
            std::mem::take(&mut self.span_bytes),
        );
        let sent = self.broadcast_step(&[&h, &span_bytes, &ids]);
        (self.id_bytes, self.span_bytes) = (ids, span_bytes);
        sent?;
        for s in spans {
            self.resets[s.cache] = false;
            self.slot_pos[s.cache] += s.n_tokens;
        }
        let wanted = spans.iter().filter(|s| s.logits).count();
        if wanted > 0 {
            self.recv_replies(wanted, k)?;
        }
        while self.rows.len() < wanted {
            self.rows.push(MergedRow::new(self.opts.n_vocab)); // once per new batch width
        }
        let rb = reply_bytes(k);
        for (i, row) in self.rows.iter_mut().take(wanted).enumerate() {
            let replies = self.replies.iter().map(|r| &r[i * rb..(i + 1) * rb]);
            row.merge(replies, k, &mut self.norms);
        }
        Ok(())
    }
    fn logits(&mut self, i: usize) -> &mut [f32] {
        &mut self.rows[i].logits
    }
    fn log_normalizer(&self, i: usize) -> Option<f32> {
        self.opts.logprobs.then_some(self.rows[i].log_norm)
    }
}
