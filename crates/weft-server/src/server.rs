//! The HTTP server: routes, the API-key check, health, models and the cluster view, and
//! the accept loop's shutdown; each API's handlers live in their own file.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::error::ApiError;
use crate::state::{AppState, BODY_LIMIT};

/// The router: `/health` is open; everything under `/v1` needs the API key if one is set.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(crate::openai::chat))
        .route("/v1/completions", post(crate::openai::completions))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route("/v1/responses", post(crate::openai_responses::create))
        .route("/api/tags", get(crate::ollama::tags))
        .route("/api/show", post(crate::ollama::show))
        .route("/api/generate", post(crate::ollama::generate))
        .route("/api/chat", post(crate::ollama::chat))
        .route("/v1/cluster", get(cluster))
        .route("/v1/dashboard/events", get(crate::dashboard::events))
        .route_layer(middleware::from_fn_with_state(state.clone(), check_key))
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    Router::new()
        .route("/", get(crate::dashboard::page))
        .route("/health", get(health))
        .route("/api/version", get(crate::ollama::version))
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
    let closing = state.clone();
    let shutdown = async move {
        tokio::select! {
            _ = shutdown_signal() => {}
            _ = engine_died => {}
        }
        // Endless responses (the dashboard's stream) end now, so shutdown need not wait.
        closing.closing.store(true, Ordering::Relaxed);
    };
    crate::listen::serve_limited(listener, router(state), limits, shutdown).await
}

/// How long a server whose engine died keeps answering (503 on /health) before it exits.
const STOPPED_GRACE: Duration = Duration::from_secs(2);

/// Ctrl-C or SIGTERM: stop accepting, finish open responses, then return.
pub async fn shutdown_signal() {
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

/// The API key, from `Authorization: Bearer` (OpenAI, Ollama clients) or `x-api-key`
/// (Anthropic's); a refusal is shaped as the called API shapes its errors.
async fn check_key(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let h = req.headers();
        let given = h
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.strip_prefix("Bearer "))
            .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()));
        let refusal = match given {
            None => Some(ApiError::unauthorized(
                "missing API key: send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            )),
            Some(k) if !same_secret(k.trim().as_bytes(), key.as_bytes()) => {
                Some(ApiError::unauthorized("incorrect API key"))
            }
            Some(_) => None,
        };
        if let Some(e) = refusal {
            return shaped_error(req.uri().path(), e);
        }
    }
    next.run(req).await
}

/// An error in the shape of the API `path` belongs to.
fn shaped_error(path: &str, e: ApiError) -> Response {
    if path.starts_with("/v1/messages") {
        crate::anthropic::AnthropicError(e).into_response()
    } else if path.starts_with("/api/") {
        crate::ollama::OllamaError(e).into_response()
    } else {
        e.into_response()
    }
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
    // Whether a key is needed is said here, so the dashboard asks for one before it
    // makes a request that would be refused.
    if !st.engine.is_ready() {
        // As llama-server answers while it loads: not yet, but alive.
        let body = json!({"status": "loading", "model": st.model_id,
                          "api_key_required": st.api_key.is_some()});
        return (axum::http::StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    let body = json!({"status": "ok", "model": st.model_id, "api_key_required": st.api_key.is_some(),
                      "live": st.live()});
    Json(body).into_response()
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
    Json(st.cluster_json())
}
