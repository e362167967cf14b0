//! Ollama's API on the same port (`/api/tags`, `/api/show`, `/api/generate`, `/api/chat`,
//! `/api/version`), streamed as NDJSON by default as Ollama does, so Ollama clients work
//! unchanged.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use weft_model::{Event, FinishReason, Generated};

use crate::api::{check_sampling, parse_body, GenOptions, MAX_STOPS};
use crate::chat::{prepare, rule_for};
use crate::details::rfc3339;
use crate::error::ApiError;
use crate::responses::model_error;
use crate::state::{finished, json_body, submit, AppState, Prepared};
use crate::tools::{parse_calls, CallSplitter, Piece, ToolCall, ToolChoice, ToolSpec};
use crate::turn::{ChatInput, ChatTurn, OutputFormat};

/// An error in Ollama's shape: `{"error": "..."}`.
pub struct OllamaError(pub ApiError);

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> Self {
        OllamaError(e)
    }
}

impl OllamaError {
    fn text(&self) -> String {
        match &self.0.param {
            Some(p) if !self.0.message.contains(p.as_str()) => format!("{p}: {}", self.0.message),
            _ => self.0.message.clone(),
        }
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        (self.0.status, Json(json!({"error": self.text()}))).into_response()
    }
}

/// Ollama reads any body as JSON whatever its Content-Type (its users' curl lines send
/// none), so these endpoints do too; the size limit still holds.
fn any_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    json_body(&HeaderMap::new(), body)
}

fn now() -> String {
    rfc3339(crate::responses::unix_now())
}

/// Ollama names models `name:tag`; the served id, bare or with `:latest`, is this one.
fn check_model(asked: &str, st: &AppState) -> Result<(), ApiError> {
    let bare = asked.strip_suffix(":latest").unwrap_or(asked);
    if bare == st.model_id {
        return Ok(());
    }
    Err(ApiError::not_found(format!(
        "model '{asked}' not found; this server serves '{}'",
        st.model_id
    ))
    .with_param("model"))
}

pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

fn tag(st: &AppState) -> Value {
    let d = &st.details;
    json!({
        "name": format!("{}:latest", st.model_id),
        "model": format!("{}:latest", st.model_id),
        "modified_at": rfc3339(d.modified_unix),
        "size": d.size_bytes,
        "digest": "",
        "details": d.json(),
    })
}

pub async fn tags(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"models": [tag(&st)]}))
}

#[derive(Deserialize)]
struct ShowRequest {
    #[serde(alias = "name")]
    model: String,
}

pub async fn show(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OllamaError> {
    let req: ShowRequest = parse_body(&any_body(body)?)?;
    check_model(&req.model, &st)?;
    let d = &st.details;
    Ok(Json(json!({
        "modelfile": format!("FROM {}\n", st.model_id),
        "parameters": "",
        "template": "",
        "details": d.json(),
        "model_info": {
            "general.architecture": d.family,
            "general.parameter_count": d.parameters,
            format!("{}.context_length", d.family): d.context_length,
        },
        "capabilities": ["completion", "tools"],
        "modified_at": rfc3339(d.modified_unix),
    })))
}

#[derive(Debug, Default, Deserialize)]
struct Options {
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    num_predict: Option<i64>,
    #[serde(default)]
    stop: Option<Vec<String>>,
}

impl Options {
    fn check(&self, stream: bool) -> Result<GenOptions, ApiError> {
        // Ollama's own defaults.
        let (temperature, top_p) =
            check_sampling(self.temperature, 0.8, 2.0, self.top_p, 0.9, "options.")?;
        let max_tokens = match self.num_predict {
            None | Some(-1) | Some(-2) => None,
            Some(n) if n < 1 => {
                return Err(ApiError::bad_request(
                    "options.num_predict",
                    format!("num_predict = {n} must be at least 1 (or -1 for no limit)"),
                ))
            }
            Some(n) => Some(n.min(u32::MAX as i64) as usize),
        };
        let stop = self.stop.clone().unwrap_or_default();
        if stop.len() > MAX_STOPS * 4 {
            return Err(ApiError::bad_request(
                "options.stop",
                format!("{} stop sequences; at most {}", stop.len(), MAX_STOPS * 4),
            ));
        }
        Ok(GenOptions {
            max_tokens,
            max_tokens_field: "options.num_predict",
            cap_max_tokens: true,
            temperature,
            top_p,
            seed: self.seed.map(|s| s as u64).unwrap_or_else(rand::random),
            stop,
            stream,
            include_usage: false,
            logprobs: None,
        })
    }
}

/// `format`: "json" or a JSON Schema.
fn output_format(format: &Option<Value>) -> Result<OutputFormat, ApiError> {
    match format {
        None => Ok(OutputFormat::Text),
        Some(Value::String(s)) if s.is_empty() => Ok(OutputFormat::Text),
        Some(Value::String(s)) if s == "json" => Ok(OutputFormat::JsonObject),
        Some(v @ Value::Object(_)) => Ok(OutputFormat::JsonSchema(v.clone())),
        Some(other) => Err(ApiError::bad_request(
            "format",
            format!("format must be \"json\" or a JSON Schema object, not {other}"),
        )),
    }
}

#[derive(Deserialize)]
struct GenerateBody {
    model: String,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    system: Option<String>,
    #[serde(default)]
    raw: Option<bool>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    options: Option<Options>,
}

#[derive(Deserialize)]
struct OllamaCall {
    function: OllamaFunction,
}

#[derive(Deserialize)]
struct OllamaFunction {
    name: String,
    #[serde(default)]
    arguments: Option<Value>,
}

#[derive(Deserialize)]
struct OllamaMessage {
    role: String,
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<OllamaCall>>,
    #[serde(default)]
    tool_name: Option<String>,
}

#[derive(Deserialize)]
struct ChatBody {
    model: String,
    #[serde(default)]
    messages: Vec<OllamaMessage>,
    #[serde(default)]
    tools: Option<Vec<crate::api::ToolDecl>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    options: Option<Options>,
}

/// Which endpoint a response is for: generate writes `response`, chat a `message`.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Generate,
    Chat,
}

pub async fn generate(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OllamaError> {
    let req: GenerateBody = parse_body(&any_body(body)?)?;
    check_model(&req.model, &st)?;
    let opts = req
        .options
        .unwrap_or_default()
        .check(req.stream.unwrap_or(true))?;
    let prompt = req.prompt.unwrap_or_default();
    if prompt.is_empty() {
        // An empty prompt loads the model: it is loaded once the cluster has formed.
        st.engine
            .wait_ready()
            .await
            .map_err(ApiError::unavailable)?;
        return Ok(Json(
            json!({"model": st.model_id, "created_at": now(), "response": "",
                              "done": true, "done_reason": "load"}),
        )
        .into_response());
    }
    let format = output_format(&req.format)?;
    let prepared = if req.raw == Some(true) {
        let mut p = Prepared {
            prompt: st.tokenizer.encode(&prompt, true, true),
            rule: None,
        };
        let input = ChatInput {
            messages: Vec::new(),
            tools: Vec::new(),
            choice: ToolChoice::None,
            format,
            fields: ("prompt", "tools", "format"),
        };
        // A raw prompt skips the template; only the output format's rule is needed.
        p.rule = rule_for(&st, &input).await?;
        p
    } else {
        let mut messages = Vec::new();
        if let Some(s) = req.system {
            messages.push(ChatTurn {
                role: "system".into(),
                text: s,
                ..Default::default()
            });
        }
        messages.push(ChatTurn {
            role: "user".into(),
            text: prompt,
            ..Default::default()
        });
        let input = ChatInput {
            messages,
            tools: Vec::new(),
            choice: ToolChoice::None,
            format,
            fields: ("prompt", "tools", "format"),
        };
        prepare(&st, &input).await?
    };
    run(st, Shape::Generate, prepared, opts, Vec::new()).await
}

/// A chat body as a chat turn, checked.
fn chat_input(req: &ChatBody) -> Result<ChatInput, ApiError> {
    let mut messages = Vec::new();
    let mut unanswered = std::collections::VecDeque::new();
    for (i, m) in req.messages.iter().enumerate() {
        if !["system", "user", "assistant", "tool"].contains(&m.role.as_str()) {
            return Err(ApiError::bad_request(
                format!("messages[{i}].role"),
                format!(
                    "unknown role '{}' (one of system, user, assistant, tool)",
                    m.role
                ),
            ));
        }
        let calls: Vec<ToolCall> = m
            .tool_calls
            .iter()
            .flatten()
            .map(|c| {
                ToolCall::new(
                    c.function.name.clone(),
                    c.function.arguments.as_ref().unwrap_or(&json!({})),
                )
            })
            .collect();
        // Ollama's tool turns carry no call id: they answer the calls before them, in order.
        unanswered.extend(calls.iter().map(|c| c.id.clone()));
        let call_id = if m.role == "tool" {
            Some(
                unanswered
                    .pop_front()
                    .unwrap_or_else(|| format!("call_{i}")),
            )
        } else {
            None
        };
        messages.push(ChatTurn {
            role: m.role.clone(),
            text: m.content.clone().unwrap_or_default(),
            calls,
            call_id,
            tool_name: m.tool_name.clone(),
        });
    }
    let tools = crate::api::tool_specs(req.tools.as_deref().unwrap_or(&[]), "tools")?;
    Ok(ChatInput {
        messages,
        tools,
        choice: ToolChoice::Auto,
        format: output_format(&req.format)?,
        fields: ("messages", "tools", "format"),
    })
}

/// An `/api/chat` body as a chat turn, checked; the fuzz target drives it.
pub fn parse_chat(body: &[u8]) -> Result<ChatInput, ApiError> {
    chat_input(&parse_body::<ChatBody>(body)?)
}

pub async fn chat(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OllamaError> {
    let req: ChatBody = parse_body(&any_body(body)?)?;
    check_model(&req.model, &st)?;
    let opts = req
        .options
        .as_ref()
        .unwrap_or(&Options::default())
        .check(req.stream.unwrap_or(true))?;
    if req.messages.is_empty() {
        st.engine
            .wait_ready()
            .await
            .map_err(ApiError::unavailable)?;
        return Ok(Json(json!({"model": st.model_id, "created_at": now(),
                              "message": {"role": "assistant", "content": ""},
                              "done": true, "done_reason": "load"}))
        .into_response());
    }
    let input = chat_input(&req)?;
    let prepared = prepare(&st, &input).await?;
    let offered = input.offered().to_vec();
    run(st, Shape::Chat, prepared, opts, offered).await
}

/// The last object's statistics, in nanoseconds as Ollama reports them.
fn stats(g: &Generated, started: Instant) -> Value {
    let ns = |s: f64| (s * 1e9) as u64;
    json!({
        "done_reason": match g.finish { FinishReason::Stop => "stop", FinishReason::Length => "length" },
        "total_duration": started.elapsed().as_nanos() as u64,
        "load_duration": 0,
        "prompt_eval_count": g.prefill_tokens,
        "prompt_eval_duration": ns(g.prefill_secs),
        "eval_count": g.token_ids.len(),
        "eval_duration": ns(g.decode_secs),
    })
}

fn ollama_call(c: &ToolCall) -> Value {
    let args: Value = serde_json::from_str(&c.arguments).unwrap_or(json!({}));
    json!({"function": {"name": c.name, "arguments": args}})
}

/// One object of the answer: text and calls, done or not.
fn object(
    st: &AppState,
    shape: Shape,
    text: &str,
    calls: &[ToolCall],
) -> serde_json::Map<String, Value> {
    let mut o = serde_json::Map::new();
    o.insert("model".into(), json!(st.model_id));
    o.insert("created_at".into(), json!(now()));
    match shape {
        Shape::Generate => {
            o.insert("response".into(), json!(text));
        }
        Shape::Chat => {
            let mut m = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                m["tool_calls"] = calls.iter().map(ollama_call).collect();
            }
            o.insert("message".into(), m);
        }
    }
    o.insert("done".into(), json!(false));
    o
}

async fn run(
    st: Arc<AppState>,
    shape: Shape,
    prepared: Prepared,
    opts: GenOptions,
    tools: Vec<ToolSpec>,
) -> Result<Response, OllamaError> {
    let started = Instant::now();
    let field = if shape == Shape::Chat {
        "messages"
    } else {
        "prompt"
    };
    let mut rx = submit(&st, field, prepared, &opts)?;
    if !opts.stream {
        let g = finished(&mut rx).await?;
        let (text, calls) = parse_calls(&g.text, &tools);
        let mut o = object(&st, shape, &text, &calls);
        o.insert("done".into(), json!(true));
        if let Value::Object(s) = stats(&g, started) {
            o.extend(s);
        }
        return Ok(Json(Value::Object(o)).into_response());
    }
    let state = (rx, CallSplitter::default(), false);
    let lines = stream::unfold(state, move |(mut rx, mut split, ended)| {
        let st = st.clone();
        let tools = tools.clone();
        async move {
            if ended {
                return None;
            }
            let line = |v: Value| Ok::<Bytes, Infallible>(Bytes::from(format!("{v}\n")));
            let mut out = Vec::new();
            let mut ended = false;
            let emit = |pieces: Vec<Piece>, out: &mut Vec<_>| {
                for p in pieces {
                    let o = match p {
                        Piece::Text(t) => object(&st, shape, &t, &[]),
                        Piece::Call(c) => object(&st, shape, "", &[c]),
                    };
                    out.push(line(Value::Object(o)));
                }
            };
            match rx.recv().await {
                Some(Event::Token { text, .. }) => {
                    let pieces = if tools.is_empty() {
                        if text.is_empty() {
                            Vec::new()
                        } else {
                            vec![Piece::Text(text)]
                        }
                    } else {
                        split.push(&text, &tools)
                    };
                    emit(pieces, &mut out);
                }
                Some(Event::Done(g)) => {
                    emit(split.finish(&tools), &mut out);
                    let mut o = object(&st, shape, "", &[]);
                    o.insert("done".into(), json!(true));
                    if let Value::Object(s) = stats(&g, started) {
                        o.extend(s);
                    }
                    out.push(line(Value::Object(o)));
                    ended = true;
                }
                Some(Event::Failed(e)) => {
                    out.push(line(json!({"error": OllamaError(model_error(e)).text()})));
                    ended = true;
                }
                None => {
                    out.push(line(json!({"error": "the inference engine stopped"})));
                    ended = true;
                }
            }
            Some((stream::iter(out), (rx, split, ended)))
        }
    })
    .flatten();
    Ok((
        [(CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}
