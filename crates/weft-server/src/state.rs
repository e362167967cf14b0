//! What every handler shares: the server's state (engine, tokenizer, template, model
//! details, grammar engine), the request-body gate, and `submit`, where every API's
//! checked request is queued for the batcher.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::header::CONTENT_TYPE;
use axum::http::HeaderMap;
use serde_json::{json, Value};
use weft_grammar::Grammars;
use weft_model::{Event, GenerateRequest, Generated, SamplingParams, TokenConstraint};
use weft_tokenizer::Tokenizer;

use crate::api::GenOptions;
use crate::details::ModelDetails;
use crate::engine::EngineHandle;
use crate::error::ApiError;
use crate::responses::{model_error, unix_now};
use crate::template::ChatTemplate;

/// The tokens to run and the rule to sample under.
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub rule: Option<Box<dyn TokenConstraint>>,
}

/// Describes the machines behind the server for `/v1/cluster`.
pub trait ClusterView: Send + Sync {
    /// Nodes, their shards and memory, and link latencies.
    fn describe(&self) -> Value;
}

/// Tokens a chat request without max_tokens may generate, unless the server says otherwise.
pub const DEFAULT_MAX_TOKENS: usize = 2048;

/// Everything a handler needs.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub model_id: String,
    pub api_key: Option<String>,
    pub cluster: Box<dyn ClusterView>,
    pub created: u64,
    /// Tokens a chat request that sets no max_tokens may generate (`--default-max-tokens`).
    pub default_max_tokens: usize,
    /// (time, generated tokens) samples over the last few seconds, for live tok/s.
    pub(crate) rate: Mutex<VecDeque<(Instant, u64)>>,
    /// The grammar engine over the vocabulary, built when a request first needs it.
    pub(crate) grammars: OnceLock<Result<Arc<Grammars>, String>>,
    /// Set when the server begins to shut down: endless streams end at their next tick.
    pub closing: std::sync::atomic::AtomicBool,
    /// The served file's size, family and quantization, for Ollama's model list.
    pub details: ModelDetails,
}

impl AppState {
    pub fn new(
        engine: EngineHandle,
        tokenizer: Arc<Tokenizer>,
        template: ChatTemplate,
        model_id: String,
        api_key: Option<String>,
        cluster: Box<dyn ClusterView>,
    ) -> Self {
        AppState {
            engine,
            tokenizer,
            template,
            model_id,
            api_key,
            cluster,
            created: unix_now(),
            default_max_tokens: DEFAULT_MAX_TOKENS,
            rate: Mutex::new(VecDeque::new()),
            grammars: OnceLock::new(),
            details: Default::default(),
            closing: Default::default(),
        }
    }

    /// `/v1/cluster`: the machines behind the server, the model and the live counters.
    pub fn cluster_json(&self) -> Value {
        let mut v = self.cluster.describe();
        if let Value::Object(m) = &mut v {
            m.insert("model".into(), json!(self.model_id));
            m.insert("n_ctx".into(), json!(self.engine.n_ctx));
            m.insert("details".into(), self.details.summary());
            m.insert("live".into(), self.live());
        }
        v
    }

    pub(crate) fn live(&self) -> Value {
        let s = &self.engine.stats;
        let tok_s = self
            .rate
            .lock()
            .ok()
            .and_then(|r| {
                let (a, b) = (r.front()?, r.back()?);
                let dt = (b.0 - a.0).as_secs_f64();
                (dt > 0.0).then(|| (b.1 - a.1) as f64 / dt)
            })
            .unwrap_or(0.0);
        json!({
            "decode_tok_s": tok_s,
            "active_sequences": s.active.load(Ordering::Relaxed),
            "queued_requests": s.queued.load(Ordering::Relaxed),
            "max_sequences": self.engine.options.max_seqs,
            "prefill_chunk": self.engine.options.prefill_chunk,
            "steps": s.steps.load(Ordering::Relaxed),
            "generated_tokens": s.generated_tokens.load(Ordering::Relaxed),
            "prompt_tokens": s.prompt_tokens.load(Ordering::Relaxed),
            "completed": s.completed.load(Ordering::Relaxed),
            "cancelled": s.cancelled.load(Ordering::Relaxed),
            "failed": s.failed.load(Ordering::Relaxed),
            "ttft_mean_s": s.mean_ttft_s(),
            "ttft_last_s": (s.completed.load(Ordering::Relaxed) > 0)
                .then(|| s.last_ttft_us.load(Ordering::Relaxed) as f64 / 1e6),
            "requests": s.running().iter().map(|r| json!({
                "id": r.request, "prompt_tokens": r.prompt_tokens, "prompt_done": r.prompt_done,
                "generated": r.generated, "age_s": r.age_s, "ttft_s": r.ttft_s, "tok_s": r.tok_s,
            })).collect::<Vec<_>>(),
        })
    }
}

/// The most bytes a request body may hold: room for a whole context of text many times
/// over, and a bound on what one client can make the server buffer.
pub const BODY_LIMIT: usize = 4 << 20;

/// A request body that is declared JSON (or declares nothing) and within the limit.
pub fn json_body(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    if let Some(ct) = headers.get(CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("(not text)");
        let mime = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if !(mime == "application/json" || mime.ends_with("+json")) {
            return Err(ApiError::not_json(ct));
        }
    }
    body.map_err(|e| {
        if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(BODY_LIMIT)
        } else {
            ApiError::bad_request("", format!("reading the request body: {e}"))
        }
    })
}

/// Checks the prompt against the context and queues it with its rule; its events come
/// back on the receiver. Every API's handler ends here.
pub fn submit(
    st: &AppState,
    prompt_field: &str,
    prepared: Prepared,
    opts: &GenOptions,
) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, ApiError> {
    let Prepared { prompt, rule } = prepared;
    let n_ctx = st.engine.n_ctx;
    if prompt.is_empty() {
        return Err(ApiError::bad_request(prompt_field, "the prompt is empty"));
    }
    if prompt.len() >= n_ctx {
        return Err(ApiError::bad_request(
            prompt_field,
            format!(
                "the prompt has {} tokens; this model's context holds {n_ctx}",
                prompt.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = n_ctx - prompt.len();
    let field = opts.max_tokens_field;
    let max_tokens = match opts.max_tokens {
        Some(m) if m > room && !opts.cap_max_tokens => {
            return Err(ApiError::bad_request(
                field,
                format!(
                    "the prompt's {} tokens plus {field} = {m} exceed the context of {n_ctx}",
                    prompt.len()
                ),
            )
            .with_code("context_length_exceeded"))
        }
        Some(m) => m.min(room),
        // A request that sets no limit gets the server's, not the whole context.
        None => room.min(st.default_max_tokens),
    };
    let req = GenerateRequest {
        prompt_ids: prompt,
        max_tokens,
        sampling: SamplingParams {
            temperature: opts.temperature,
            top_k: 0,
            top_p: opts.top_p,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: opts.seed,
        },
        stop: opts.stop.clone(),
        // The chosen token's logprob needs at least one alternative computed.
        logprobs: opts.logprobs.map(|k| k.max(1)).unwrap_or(0),
    };
    st.engine.submit(req, rule)
}

/// The end of a generation that is not streamed: its result, or the error that ended it.
pub async fn finished(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Result<Generated, ApiError> {
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Done(g) => return Ok(g),
            Event::Failed(e) => return Err(model_error(e)),
            Event::Token { .. } => {}
        }
    }
    Err(ApiError::unavailable("the inference engine stopped"))
}
