//! The HTTP server: routes, API-key check, request checks, and the bridge from checked
//! requests to the batcher, answering whole or as a stream of server-sent events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::HeaderMap;
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use weft_model::{Event, GenerateRequest, SamplingParams};
use weft_tokenizer::Tokenizer;

use crate::api::{
    check_top_logprobs, parse_body, ChatRequest, CompletionRequest, GenOptions, Prompt,
};
use crate::engine::EngineHandle;
use crate::error::ApiError;
use crate::responses::{model_error, unix_now, Kind, Meta, TokenLogprob};
use crate::template::{ChatTemplate, TemplateMessage};

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
    rate: Mutex<VecDeque<(Instant, u64)>>,
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
        }
    }

    fn live(&self) -> Value {
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
        })
    }
}

/// The router: `/health` is open; everything under `/v1` needs the API key if one is set.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/cluster", get(cluster))
        .route_layer(middleware::from_fn_with_state(state.clone(), check_key))
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    Router::new()
        .route("/health", get(health))
        .merge(v1)
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .with_state(state)
}

/// Serves until ctrl-c, SIGTERM, or shortly after the batcher thread dies (the caller
/// then finds `engine.stopped()` set and exits non-zero); samples the decode rate every
/// half second for `/v1/cluster`.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    limits: crate::listen::Limits,
) -> std::io::Result<()> {
    let sampler = state.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            let n = sampler
                .engine
                .stats
                .generated_tokens
                .load(Ordering::Relaxed);
            if let Ok(mut r) = sampler.rate.lock() {
                r.push_back((Instant::now(), n));
                while r.len() > 11 {
                    r.pop_front();
                }
            }
        }
    });
    let watch = state.clone();
    let engine_died = async move {
        let why = watch.engine.wait_stopped().await;
        tracing::error!(
            "the inference engine stopped ({why}); shutting down in {} s",
            STOPPED_GRACE.as_secs_f64()
        );
        // Long enough for health checks to see the 503 before the port closes.
        tokio::time::sleep(STOPPED_GRACE).await;
    };
    let shutdown = async move {
        tokio::select! {
            _ = shutdown_signal() => {}
            _ = engine_died => {}
        }
    };
    crate::listen::serve_limited(listener, router(state), limits, shutdown).await
}

/// How long a server whose engine died keeps answering (503 on /health) before it exits.
const STOPPED_GRACE: Duration = Duration::from_secs(2);

/// Ctrl-C or SIGTERM: stop accepting, finish open responses, then return.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn check_key(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let given = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.strip_prefix("Bearer "));
        match given {
            None => {
                return ApiError::unauthorized(
                    "missing API key: send the header 'Authorization: Bearer <key>'",
                )
                .into_response()
            }
            Some(k) if !same_secret(k.trim().as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("incorrect API key").into_response()
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

/// Compares without an early exit, so timing does not reveal how much of a key matched.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if let Some(why) = st.engine.stopped() {
        let body = json!({"status": "engine stopped", "reason": why, "model": st.model_id});
        return (axum::http::StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    Json(json!({"status": "ok", "model": st.model_id, "live": st.live()})).into_response()
}

fn model_card(st: &AppState) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.created, "owned_by": "weft"})
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&st)]}))
}

async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id == st.model_id {
        Json(model_card(&st)).into_response()
    } else {
        ApiError::not_found(format!("model '{id}' is not served here")).into_response()
    }
}

async fn cluster(State(st): State<Arc<AppState>>) -> Json<Value> {
    let mut v = st.cluster.describe();
    if let Value::Object(m) = &mut v {
        m.insert("model".into(), json!(st.model_id));
        m.insert("n_ctx".into(), json!(st.engine.n_ctx));
        m.insert("live".into(), st.live());
    }
    Json(v)
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The most bytes a request body may hold: room for a whole context of text many times
/// over, and a bound on what one client can make the server buffer.
pub const BODY_LIMIT: usize = 4 << 20;

/// A request body that is declared JSON (or declares nothing) and within the limit.
fn json_body(headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
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

async fn chat(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(&json_body(&headers, body)?)?;
    let top = match (req.logprobs, req.top_logprobs) {
        (Some(true), t) => Some(check_top_logprobs("top_logprobs", t.unwrap_or(0))?),
        (_, Some(_)) => {
            return Err(ApiError::bad_request(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        _ => None,
    };
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("messages", "messages is empty"));
    }
    let mut msgs = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::bad_request(
                format!("messages[{i}].role"),
                format!("unknown role '{}' (one of {})", m.role, ROLES.join(", ")),
            ));
        }
        let role = if m.role == "developer" {
            "system"
        } else {
            &m.role
        };
        msgs.push(TemplateMessage {
            role: role.to_string(),
            content: m.text(i)?,
        });
    }
    let (text, texts_at) = st
        .template
        .render_protected(&msgs)
        .map_err(|e| ApiError::bad_request("messages", e))?;
    // A template that writes BOS itself must not get a second one from the tokenizer.
    let bos = st.tokenizer.bos_id().map(|b| st.tokenizer.token_text(b));
    let add_bos = st.tokenizer.add_bos() && !bos.is_some_and(|b| text.starts_with(b));
    // Control tokens come from the template only: the messages' texts stay text.
    let prompt = match texts_at {
        Some(ranges) => st.tokenizer.encode_protected(&text, add_bos, &ranges),
        None => {
            // The template rewrote the texts past locating them: refuse a text that would
            // read as control tokens rather than let it forge turns.
            let t = &st.tokenizer;
            if let Some(i) = msgs.iter().position(|m| {
                t.encode(&m.content, false, true) != t.encode(&m.content, false, false)
            }) {
                return Err(ApiError::bad_request(
                    format!("messages[{i}].content"),
                    "the text holds the model's control-token text, which this model's chat \
                     template does not let weft keep as plain text",
                ));
            }
            t.encode(&text, add_bos, true)
        }
    };
    let opts = req.common.check(&st.model_id, st.engine.n_ctx, None, top)?;
    respond(&st, Kind::Chat, "messages", prompt, opts).await
}

async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(&json_body(&headers, body)?)?;
    if req.echo == Some(true) {
        return Err(ApiError::bad_request("echo", "echo is not supported"));
    }
    let top = req
        .logprobs
        .map(|v| check_top_logprobs("logprobs", v))
        .transpose()?;
    let n_vocab = st.tokenizer.vocab_size();
    let ids = |v: &[i64]| -> Result<Vec<u32>, ApiError> {
        v.iter()
            .enumerate()
            .map(|(i, &t)| {
                if t < 0 || t as u64 >= n_vocab as u64 {
                    Err(ApiError::bad_request(
                        format!("prompt[{i}]"),
                        format!("token id {t} is outside the vocabulary of {n_vocab}"),
                    ))
                } else {
                    Ok(t as u32)
                }
            })
            .collect()
    };
    let one = |n: usize| -> Result<(), ApiError> {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::bad_request(
                "prompt",
                format!("{n} prompts: only one prompt per request is supported"),
            ))
        }
    };
    let prompt = match &req.prompt {
        Prompt::Text(s) => st.tokenizer.encode(s, true, true),
        Prompt::TextList(v) => {
            one(v.len())?;
            st.tokenizer.encode(&v[0], true, true)
        }
        Prompt::Tokens(v) => ids(v)?,
        Prompt::TokenLists(v) => {
            one(v.len())?;
            ids(&v[0])?
        }
    };
    let opts = req
        .common
        .check(&st.model_id, st.engine.n_ctx, Some(16), top)?;
    respond(&st, Kind::Completion, "prompt", prompt, opts).await
}

/// Checks the prompt against the context, submits it, and answers whole or streamed.
async fn respond(
    st: &Arc<AppState>,
    kind: Kind,
    prompt_field: &str,
    prompt: Vec<u32>,
    opts: GenOptions,
) -> Result<Response, ApiError> {
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
    let max_tokens = match opts.max_tokens {
        Some(m) if m > room => {
            return Err(ApiError::bad_request(
                "max_tokens",
                format!(
                    "the prompt's {} tokens plus max_tokens = {m} exceed the context of {n_ctx}",
                    prompt.len()
                ),
            )
            .with_code("context_length_exceeded"))
        }
        Some(m) => m,
        // A request that sets no limit gets the server's, not the whole context.
        None => room.min(st.default_max_tokens),
    };
    let meta = Meta::new(kind, &st.model_id, prompt.len(), opts.logprobs);
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
    let mut rx = st.engine.submit(req)?;
    if opts.stream {
        let stream = sse_stream(st.clone(), meta, rx, opts.include_usage);
        return Ok(Sse::new(stream).into_response());
    }
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Done(g) => return Ok(Json(meta.full(&g, &st.tokenizer)).into_response()),
            Event::Failed(e) => return Err(model_error(e)),
            Event::Token { .. } => {}
        }
    }
    Err(ApiError::unavailable("the inference engine stopped"))
}

struct StreamState {
    st: Arc<AppState>,
    meta: Meta,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
    opened: bool,
    finished: bool,
    text_len: usize,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// The SSE chunks of one generation, ending with `data: [DONE]`.
fn sse_stream(
    st: Arc<AppState>,
    meta: Meta,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let state = StreamState {
        st,
        meta,
        rx,
        include_usage,
        opened: false,
        finished: false,
        text_len: 0,
    };
    stream::unfold(state, |mut s| async move {
        if s.finished {
            return None;
        }
        let mut out = Vec::new();
        let tok = s.st.tokenizer.clone();
        let open = !s.opened && s.meta.kind == Kind::Chat;
        match s.rx.recv().await {
            Some(Event::Token {
                text,
                token,
                logprob,
            }) => {
                let lp: Vec<TokenLogprob<'_>> = match (&logprob, token) {
                    (Some((l, top)), Some(t)) if s.meta.top_logprobs.is_some() => {
                        vec![(t, *l, top.as_slice())]
                    }
                    _ => Vec::new(),
                };
                if open {
                    out.push(data(&s.meta.chunk(Some(""), true, &[], 0, None, &tok)));
                    s.opened = true;
                }
                if !text.is_empty() || !lp.is_empty() {
                    let c = s
                        .meta
                        .chunk(Some(&text), false, &lp, s.text_len, None, &tok);
                    out.push(data(&c));
                }
                s.text_len += text.len();
            }
            Some(Event::Done(g)) => {
                if open {
                    out.push(data(&s.meta.chunk(Some(""), true, &[], 0, None, &tok)));
                }
                let text = (s.meta.kind == Kind::Completion).then_some("");
                let last =
                    s.meta
                        .chunk(text, false, &[], s.text_len, Some(g.finish.as_str()), &tok);
                out.push(data(&last));
                if s.include_usage {
                    out.push(data(&s.meta.usage_chunk(g.token_ids.len())));
                }
                out.push(SseEvent::default().data("[DONE]"));
                s.finished = true;
            }
            Some(Event::Failed(e)) => {
                out.push(data(&model_error(e).body()));
                out.push(SseEvent::default().data("[DONE]"));
                s.finished = true;
            }
            None => {
                out.push(data(
                    &ApiError::unavailable("the inference engine stopped").body(),
                ));
                s.finished = true;
            }
        }
        Some((stream::iter(out.into_iter().map(Ok)), s))
    })
    .flatten()
}
