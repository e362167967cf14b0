//! `weft serve`: the OpenAI-compatible API over the continuous batcher, on this machine
//! or as the coordinator of a cluster.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use weft_model::{BatchOptions, LocalBatch};
use weft_server::{AppState, ClusterView, EngineHandle};

use crate::chat_template::chat_template;
use crate::paths::resolve_model;
use crate::progress::{load_engine, resolve_threads};
use crate::serve_args::ServeArgs;

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

/// One node holding the whole model.
struct LocalView {
    address: String,
    layers: usize,
    weight_bytes: usize,
    kv_bytes: usize,
    threads: usize,
    /// This machine, as a cluster's survey shows a node's.
    host: Value,
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
                "host": self.host,
                "state": "ready",
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
            let (engine, _) = load_engine(&path, threads, a.ctx, a.layout.cache_type)?;
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
                host: weft_cluster::profile::local_facts(None, threads, None, 1.0).machine(),
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
    // Raise the descriptor limit first: the cap must fit under what the process may open.
    let limits = weft_server::Limits {
        max_connections: weft_server::fit_connections(a.max_connections.max(1)),
        header_timeout: std::time::Duration::from_secs_f64(a.header_timeout.clamp(0.1, 3600.0)),
    };
    let mut state = AppState::new(engine, tokenizer, template, model_id, api_key, view);
    state.default_max_tokens = a.default_max_tokens.max(1);
    state.details = weft_server::details::ModelDetails::from_gguf(&path).map_err(|e| anyhow!(e))?;
    let state = Arc::new(state);
    // The server answers at once; a cluster may still be forming (its nodes loading
    // their shards, shown on the dashboard). "listening on" says it is ready to serve.
    let server = runtime.spawn(weft_server::serve(listener, state.clone(), limits));
    if !state.engine.is_ready() {
        eprintln!("weft serve: the cluster is forming; http://{addr}/ shows its nodes loading");
    }
    // Ready, failed, or stopped (ctrl-c, SIGTERM) while still forming.
    let formed = runtime.block_on(async {
        tokio::select! {
            r = state.engine.wait_ready() => Some(r),
            _ = weft_server::shutdown_signal() => None,
        }
    });
    match formed {
        Some(Ok(())) => {}
        Some(Err(why)) => {
            // The server answers the requests that waited (the engine has stopped) and
            // closes, then the process ends with the reason.
            let _ = runtime.block_on(server);
            bail!("{why}");
        }
        None => {
            // Nothing was served yet: no request to finish, so no grace to wait out.
            eprintln!("weft serve: stopped before the cluster had formed");
            return Ok(());
        }
    }
    outln!("listening on http://{addr}")?;
    std::io::stdout().flush()?;
    runtime
        .block_on(server)
        .context("the HTTP server task")?
        .context("serving HTTP")?;
    // Exit non-zero when the engine died, so a supervisor restarts the server.
    match state.engine.stopped() {
        Some(why) => Err(anyhow!("the inference engine stopped: {why}")),
        None => Ok(()),
    }
}
