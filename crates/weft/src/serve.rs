//! `weft serve`: the OpenAI-compatible API over the continuous batcher, on this machine
//! or as the coordinator of a cluster.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use weft_gguf::GgufFile;
use weft_model::{BatchOptions, LocalBatch};
use weft_server::{AppState, ChatTemplate, ClusterView, EngineHandle};
use weft_tokenizer::Tokenizer;

use crate::paths::resolve_model;
use crate::progress::{load_engine, resolve_threads};

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// GGUF model file (default: the model `weft pull` fetched).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require this key as `Authorization: Bearer KEY` (or WEFT_API_KEY).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Threads (default: all cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Context size of each sequence, in tokens.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Most sequences decoding together; more requests wait in a queue.
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Most prompt tokens a step carries beside running decodes.
    #[arg(long, default_value_t = 32)]
    pub prefill_chunk: usize,
    /// The model id the API reports and expects (default: the file's name).
    #[arg(long)]
    pub model_id: Option<String>,
    #[command(flatten)]
    pub layout: crate::cluster_cli::LayoutArgs,
}

/// The API key from --api-key, else WEFT_API_KEY. An empty or blank one is refused: it
/// would turn authentication off (empty) or never match (blank), while the operator
/// meant to require a key.
fn api_key(flag: Option<String>, env: Option<String>) -> Result<Option<String>> {
    let (key, from) = match (flag, env) {
        (Some(k), _) => (k, "--api-key"),
        (None, Some(k)) => (k, "WEFT_API_KEY"),
        (None, None) => return Ok(None),
    };
    let trimmed = key.trim();
    if trimmed.is_empty() {
        anyhow::bail!(
            "{from} is {}: give a non-blank key, or leave it unset to serve without one",
            if key.is_empty() { "empty" } else { "blank" }
        );
    }
    // Clients' keys are compared trimmed, so the configured one is too.
    Ok(Some(trimmed.to_string()))
}

/// The model id: the file name without `.gguf`.
fn default_model_id(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// The file's chat template, or its architecture's turn format.
pub fn chat_template(file: &GgufFile, tok: &Tokenizer) -> Result<ChatTemplate> {
    let own = file.get_str("tokenizer.chat_template").ok();
    let arch = file.get_str("general.architecture").unwrap_or("");
    let text = |id: Option<u32>| {
        id.map(|i| tok.token_text(i).to_string())
            .unwrap_or_default()
    };
    ChatTemplate::new(own, arch, &text(tok.bos_id()), &text(tok.eos_id()))
        .map_err(|e| anyhow!("{}: {e}", file.path().display()))
}

/// One node holding the whole model.
struct LocalView {
    address: String,
    layers: usize,
    weight_bytes: usize,
    kv_bytes: usize,
    threads: usize,
}

impl ClusterView for LocalView {
    fn describe(&self) -> Value {
        json!({
            "mode": "single",
            "nodes": [{
                "rank": 0,
                "address": self.address,
                "stage": 0,
                "layers": [0, self.layers],
                "tp_share": 1.0,
                "weight_bytes": self.weight_bytes,
                "kv_bytes": self.kv_bytes,
                "rss_bytes": weft_cluster::procinfo::rss_bytes(),
                "threads": self.threads,
            }],
            "links": [],
        })
    }
}

pub fn run(a: ServeArgs) -> Result<()> {
    let path = resolve_model(a.model.clone())?;
    let api_key = api_key(a.api_key.clone(), std::env::var("WEFT_API_KEY").ok())?;
    crate::memcheck::check(&path, &a.layout, a.parallel.max(1), a.ctx)?;
    let model_id = a
        .model_id
        .clone()
        .unwrap_or_else(|| default_model_id(&path));
    let opts = BatchOptions {
        max_seqs: a.parallel.max(1),
        prefill_chunk: a.prefill_chunk.max(1),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind((a.host.as_str(), a.port)))
        .with_context(|| format!("binding {}:{}", a.host, a.port))?;
    let addr = listener.local_addr()?;
    let (engine, tokenizer, template, view): (_, _, _, Box<dyn ClusterView>) =
        if a.layout.is_cluster() {
            crate::serve_cluster::start(&a, &path, opts)?
        } else {
            let threads = resolve_threads(a.threads)?;
            let (engine, _) = load_engine(&path, threads, a.ctx)?;
            let template = chat_template(engine.model.file(), &engine.tokenizer)?;
            let layers = engine.model.cfg.n_layer;
            let weight_bytes = engine.model.weight_bytes_per_token();
            let (backend, tokenizer): (LocalBatch, _) = engine.into_batch(opts.max_seqs, a.ctx);
            let view = LocalView {
                address: addr.to_string(),
                layers,
                weight_bytes,
                kv_bytes: backend.kv_bytes(),
                threads,
            };
            let tokenizer = Arc::new(tokenizer);
            let handle = EngineHandle::start(backend, tokenizer.clone(), opts)
                .context("starting the batcher thread")?;
            (handle, tokenizer, template, Box::new(view))
        };
    eprintln!(
        "weft serve: {model_id} on http://{addr}/v1 ({} sequences, chat template: {}{})",
        engine.options.max_seqs,
        template.source,
        if api_key.is_some() {
            ", API key required"
        } else {
            ""
        }
    );
    outln!("listening on http://{addr}")?;
    std::io::stdout().flush()?;
    let state = Arc::new(AppState::new(
        engine, tokenizer, template, model_id, api_key, view,
    ));
    runtime
        .block_on(weft_server::serve(listener, state.clone()))
        .context("serving HTTP")?;
    // Exit non-zero when the engine died, so a supervisor restarts the server.
    match state.engine.stopped() {
        Some(why) => Err(anyhow!("the inference engine stopped: {why}")),
        None => Ok(()),
    }
}
