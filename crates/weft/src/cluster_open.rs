//! A coordinator's cluster from the layout flags: start local nodes (`--nodes N`) or reach
//! running ones (`--peers`), take the planner's best layout when no layout flag is given,
//! and connect.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use weft_cluster::local::LocalNodes;
use weft_cluster::{Cluster, ClusterOptions, Layout, LayoutRequest};
use weft_gguf::GgufFile;
use weft_model::{ModelConfig, DEFAULT_UBATCH};
use weft_tokenizer::Tokenizer;

use crate::best_layout::{best_layout, predict_given, survey_options};
use crate::cluster_secret::secret_from;
use crate::layout_args::LayoutArgs;
use weft_cluster::activity::ActivityBoard;
use weft_cluster::survey::{survey as survey_nodes, Survey, SurveyOptions};

/// Someone watching the cluster form and run (the dashboard): the nodes' beats go to
/// `board`, and with `survey` a layout given by flags is surveyed first, as the planner
/// would survey it (a re-form after a lost node skips that: it would lengthen the pause).
pub struct Watch {
    pub board: Arc<ActivityBoard>,
    pub survey: bool,
}

/// A running cluster and what a coordinator needs beside it.
pub struct Opened {
    pub cluster: Cluster,
    /// The model file and its configuration, as read to plan it.
    pub file: Arc<GgufFile>,
    pub cfg: ModelConfig,
    pub tokenizer: Tokenizer,
    pub n_vocab: usize,
    pub peers: Vec<String>,
    /// Local nodes (with --nodes); dropped after the cluster.
    pub _local: Option<LocalNodes>,
    /// Without layout flags: the planner's choice.
    pub planned: Option<weft_plan::Candidate>,
    /// With layout flags and a watcher: the planner's prediction for that layout.
    pub predicted: Option<weft_plan::Candidate>,
    /// The survey the planner chose from, or, for a watcher, the nodes' facts and the
    /// links measured before a layout given by flags.
    pub survey: Option<Survey>,
}

pub fn open(
    l: &LayoutArgs,
    model: &Path,
    n_ctx: usize,
    top_k: usize,
    logprobs: bool,
    slots: usize,
    watch: Option<Watch>,
) -> Result<Opened> {
    check_nodes(l)?;
    // A weak --peers secret is refused before the model is read or anything started.
    let given = if l.peers.is_empty() {
        None
    } else {
        Some(secret_from(&l.secret)?)
    };
    // Nodes reached with --peers may lack the model: they fetch their shards from this
    // process's copy, or from the hub it names, and from each other. Local nodes
    // (--nodes) read the file itself.
    let sharing = l.nodes.is_none() && !l.no_share;
    if !sharing && crate::model_source::hub_spec(model).is_some() {
        bail!(
            "{}: without sharing (--nodes or --no-share) every node reads the model file \
             itself; `weft pull {}` first, or give --peers to share it from the hub",
            model.display(),
            model.display()
        );
    }
    let (file, share) = crate::model_source::open_shared(
        model,
        sharing,
        given.as_deref().unwrap_or_default().as_bytes(),
    )?;
    let cfg = ModelConfig::from_gguf(&file)?;
    let tokenizer = weft_model::vocab::tokenizer_from_gguf(&file)?;
    let cores = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(1);
    let (local, peers, secret) = match (l.nodes, given) {
        (Some(n), _) => {
            let secret = weft_comm::secret::random_secret();
            let threads = if l.pin {
                1
            } else {
                l.node_threads.unwrap_or((cores / n).max(1))
            };
            let (nodes, addrs) = l.start_local_nodes(n, &secret, threads, model)?;
            (Some(nodes), addrs, secret)
        }
        (None, Some(secret)) => (None, l.peers.clone(), secret),
        (None, None) => bail!("no nodes: give --nodes N or --peers A,B"),
    };
    let threads = if l.pin {
        1
    } else {
        l.node_threads.unwrap_or((cores / peers.len()).max(1))
    };
    let no_layout_flags = !has_layout_flags(l);
    let workload = weft_plan::Workload {
        n_ctx: n_ctx.min(cfg.n_ctx_train).max(1),
        parallel: slots.max(1),
        ..weft_plan::Workload::default()
    };
    let (peers, request, planned, survey) = if no_layout_flags && peers.len() > 1 {
        // No layout given: survey the nodes and run the planner's best layout.
        let (best, order, survey) =
            best_layout(&file, &cfg, &peers, &secret, l, threads, &workload)?;
        let f = &best.prediction;
        eprintln!(
            "plan: {} on {} of {} nodes (layers {:?}): predicted {:.1} tok/s decode, {:.0} tok/s prefill; `weft plan` shows every layout, --tp/--pp/--ep override",
            best.name,
            order.len(),
            peers.len(),
            best.layout.layers,
            f.decode_tok_s,
            f.prefill_tok_s
        );
        let request = LayoutRequest {
            nodes: order.len(),
            tp: Some(best.layout.tp),
            pp: Some(best.pp),
            ep: Some(best.layout.ep),
            n_layer: cfg.n_layer,
            layer_counts: Some(best.layout.layers.clone()),
            tp_weights: Some(best.layout.tp_weights.clone()),
            ep_weights: Some(best.layout.ep_weights.clone()),
            ep_spares: best.layout.ep_spares,
        };
        (order, request, Some(best), Some(survey))
    } else {
        // A full shape (--tp and --pp) over more nodes than it needs runs on the first
        // ones; the others are spares a re-plan after a lost node can take.
        let mut peers = peers;
        if let Some(needed) = l.full_shape_nodes() {
            if needed > 0 && needed < peers.len() {
                eprintln!(
                    "using {needed} of {} nodes ({}); the others are spares",
                    peers.len(),
                    peers[..needed].join(", ")
                );
                peers.truncate(needed);
            }
        }
        let request = flag_request(l, peers.len(), cfg.n_layer);
        (peers, request, None, None)
    };
    let layout = checked_layout(&request, &cfg, model)?;
    let board = watch.as_ref().map(|w| w.board.clone());
    // A watcher (the dashboard) that asks shows the nodes, their links and the planner's
    // prediction for a layout given by flags too: surveyed as the planner would.
    let survey = match (survey, &watch) {
        (None, Some(w)) if w.survey => {
            let opts = SurveyOptions {
                activity: board.clone(),
                ..survey_options(&secret, l, l.link_delay_us, threads)
            };
            survey_nodes(&peers, &opts)
                .map_err(|e| eprintln!("warning: the nodes and links could not be surveyed: {e}"))
                .ok()
        }
        (s, _) => s,
    };
    let predicted = match (&planned, &survey) {
        (None, Some(s)) => Some(predict_given(
            &file,
            &cfg,
            s,
            (&layout, l.cache_type),
            &workload,
        )),
        _ => None,
    };
    let opts = ClusterOptions {
        secret: secret.into_bytes(),
        model: model.to_string_lossy().into_owned(),
        n_vocab: cfg.n_vocab,
        n_ctx: n_ctx.min(cfg.n_ctx_train).max(1),
        ubatch: DEFAULT_UBATCH,
        cache_type: l.cache_type,
        slots: slots.max(1),
        threads_per_node: threads,
        transport: l.transport.clone(),
        link_delay_us: l.link_delay_us,
        timeout: Duration::from_secs(2),
        top_k,
        logprobs,
        activity: board,
        share,
    };
    // Nodes fetching their shards say so in their beats: bars on this terminal meanwhile.
    let opts = ClusterOptions {
        activity: opts.activity.clone().or_else(|| {
            opts.share
                .as_ref()
                .map(|_| Arc::new(ActivityBoard::default()))
        }),
        ..opts
    };
    let bars = opts
        .share
        .as_ref()
        .zip(opts.activity.clone())
        .map(|(_, board)| crate::fetch_progress::FetchBars::start(board, peers.clone()));
    let cluster = Cluster::connect(&peers, layout, opts).map_err(|e| anyhow!(e))?;
    drop(bars);
    Ok(Opened {
        cluster,
        tokenizer,
        n_vocab: cfg.n_vocab,
        peers,
        _local: local,
        planned,
        predicted,
        survey,
        file,
        cfg,
    })
}

/// Whether any layout flag is given (none: the planner chooses).
fn has_layout_flags(l: &LayoutArgs) -> bool {
    l.tp.is_some()
        || l.pp.is_some()
        || l.ep.is_some()
        || !l.layers.is_empty()
        || !l.tp_weights.is_empty()
        || !l.ep_weights.is_empty()
        || l.ep_spares > 0
}

/// The layout the flags ask of `nodes` nodes.
fn flag_request(l: &LayoutArgs, nodes: usize, n_layer: usize) -> LayoutRequest {
    LayoutRequest {
        nodes,
        tp: l.tp,
        pp: l.pp,
        ep: l.ep,
        n_layer,
        layer_counts: (!l.layers.is_empty()).then(|| l.layers.clone()),
        tp_weights: (!l.tp_weights.is_empty()).then(|| l.tp_weights.clone()),
        ep_weights: (!l.ep_weights.is_empty()).then(|| l.ep_weights.clone()),
        ep_spares: l.ep_spares,
    }
}

/// `request` made into a layout, refused if it splits experts a model does not have.
fn checked_layout(request: &LayoutRequest, cfg: &ModelConfig, model: &Path) -> Result<Layout> {
    let layout = Layout::plan(request).map_err(|e| anyhow!(e))?;
    if layout.ep > 1 && cfg.moe.is_none() {
        bail!(
            "--ep {}: {} has no routed experts to split",
            layout.ep,
            model.display()
        );
    }
    Ok(layout)
}

/// Both or neither of --nodes and --peers, or --nodes 0.
fn check_nodes(l: &LayoutArgs) -> Result<()> {
    if l.nodes.is_some() && !l.peers.is_empty() {
        bail!("give either --nodes (local) or --peers (running nodes), not both");
    }
    match (l.nodes, l.peers.is_empty()) {
        (Some(0), _) => bail!("--nodes must be at least 1"),
        (None, true) => bail!("no nodes: give --nodes N or --peers A,B"),
        _ => Ok(()),
    }
}

/// The flags' own errors, found before anything starts (what `open` would refuse first):
/// the node flags, a weak `--peers` secret, a layout the flags give that cannot be made
/// of the nodes (or splits experts the model lacks). `weft serve` checks them before it
/// answers, as the cluster then forms behind it.
pub fn check_flags(l: &LayoutArgs, cfg: &ModelConfig, model: &Path) -> Result<()> {
    check_nodes(l)?;
    if !l.peers.is_empty() {
        secret_from(&l.secret)?;
    }
    if has_layout_flags(l) {
        let mut nodes = l.nodes.unwrap_or(l.peers.len());
        if let Some(needed) = l.full_shape_nodes() {
            if needed > 0 && needed < nodes {
                nodes = needed;
            }
        }
        checked_layout(&flag_request(l, nodes, cfg.n_layer), cfg, model)?;
    }
    Ok(())
}
