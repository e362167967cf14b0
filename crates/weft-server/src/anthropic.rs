//! Anthropic's Messages API (`POST /v1/messages`): text and tool_use / tool_result blocks,
//! whole or streamed with Anthropic's event types, errors in Anthropic's shape.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use weft_model::{Event, FinishReason, Generated};

use crate::api::{check_sampling, join_text, parse_body, GenOptions, MAX_STOPS};
use crate::chat::prepare;
use crate::error::ApiError;
use crate::responses::{model_error, split_pieces};
use crate::state::{finished, json_body, submit, AppState};
use crate::tools::{parse_calls, CallSplitter, Piece, ToolCall, ToolChoice, ToolSpec};
use crate::turn::{ChatInput, ChatTurn, OutputFormat};

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

impl AnthropicError {
    pub fn body(&self) -> Value {
        let e = &self.0;
        let kind = match e.status.as_u16() {
            400 | 415 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            503 => "overloaded_error",
            _ => "api_error",
        };
        // Anthropic names the field at the front of the message.
        let message = match &e.param {
            Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
            _ => e.message.clone(),
        };
        json!({"type": "error", "error": {"type": kind, "message": message}})
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        (self.0.status, Json(self.body())).into_response()
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Text {
    Plain(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
    // tool_use
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    input: Option<Value>,
    // tool_result
    #[serde(default)]
    tool_use_id: Option<String>,
    #[serde(default)]
    content: Option<Text>,
    #[serde(default)]
    is_error: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Text,
}

#[derive(Debug, Deserialize)]
struct Tool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    input_schema: Value,
}

#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    name: Option<String>,
}

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: String,
    max_tokens: i64,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<Text>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    tools: Option<Vec<Tool>>,
    #[serde(default)]
    tool_choice: Option<Choice>,
}

/// The text of a block list (text blocks only; `field` names it in errors).
fn plain(t: &Text, field: &str) -> Result<String, ApiError> {
    match t {
        Text::Plain(s) => Ok(s.clone()),
        Text::Blocks(blocks) => join_text(
            blocks.iter().map(|b| (b.kind.as_str(), b.text.as_deref())),
            &["text"],
            |i| format!("{field}.{i}.type"),
        ),
    }
}

impl MessagesRequest {
    fn input(&self) -> Result<ChatInput, ApiError> {
        let mut turns = Vec::new();
        if let Some(s) = &self.system {
            turns.push(ChatTurn {
                role: "system".into(),
                text: plain(s, "system")?,
                ..Default::default()
            });
        }
        if self.messages.is_empty() {
            return Err(ApiError::bad_request("messages", "messages is empty"));
        }
        for (i, m) in self.messages.iter().enumerate() {
            if m.role != "user" && m.role != "assistant" {
                return Err(ApiError::bad_request(
                    format!("messages.{i}.role"),
                    format!("role '{}' must be user or assistant", m.role),
                ));
            }
            let blocks = match &m.content {
                Text::Plain(s) => {
                    turns.push(ChatTurn {
                        role: m.role.clone(),
                        text: s.clone(),
                        ..Default::default()
                    });
                    continue;
                }
                Text::Blocks(b) => b,
            };
            let mut turn = ChatTurn {
                role: m.role.clone(),
                ..Default::default()
            };
            for (j, b) in blocks.iter().enumerate() {
                let at = format!("messages.{i}.content.{j}");
                match b.kind.as_str() {
                    "text" => turn.text.push_str(b.text.as_deref().unwrap_or("")),
                    "tool_use" if m.role == "assistant" => {
                        let (Some(id), Some(name)) = (&b.id, &b.name) else {
                            return Err(ApiError::bad_request(
                                at,
                                "a tool_use block needs id and name",
                            ));
                        };
                        let mut call =
                            ToolCall::new(name.clone(), b.input.as_ref().unwrap_or(&json!({})));
                        call.id = id.clone();
                        turn.calls.push(call);
                    }
                    "tool_result" if m.role == "user" => {
                        let Some(id) = &b.tool_use_id else {
                            return Err(ApiError::bad_request(
                                format!("{at}.tool_use_id"),
                                "a tool_result block needs tool_use_id",
                            ));
                        };
                        let mut text = match &b.content {
                            Some(c) => plain(c, &format!("{at}.content"))?,
                            None => String::new(),
                        };
                        if b.is_error == Some(true) {
                            text = format!("Error: {text}");
                        }
                        turns.push(ChatTurn {
                            role: "tool".into(),
                            text,
                            call_id: Some(id.clone()),
                            ..Default::default()
                        });
                    }
                    kind => {
                        return Err(ApiError::bad_request(
                            format!("{at}.type"),
                            format!(
                                "block type '{kind}' is not supported in a {} message",
                                m.role
                            ),
                        ))
                    }
                }
            }
            if !turn.text.is_empty() || !turn.calls.is_empty() {
                turns.push(turn);
            }
        }
        let tools: Vec<ToolSpec> = self
            .tools
            .iter()
            .flatten()
            .map(|t| ToolSpec {
                name: t.name.clone(),
                description: t.description.clone().unwrap_or_default(),
                parameters: t.input_schema.clone(),
            })
            .collect();
        let choice = match &self.tool_choice {
            None => ToolChoice::Auto,
            Some(c) => match (c.kind.as_str(), &c.name) {
                ("auto", _) => ToolChoice::Auto,
                ("none", _) => ToolChoice::None,
                ("any", _) => ToolChoice::Required,
                ("tool", Some(n)) => ToolChoice::Named(n.clone()),
                ("tool", None) => {
                    return Err(ApiError::bad_request(
                        "tool_choice.name",
                        "tool_choice of type tool needs a name",
                    ))
                }
                (other, _) => {
                    return Err(ApiError::bad_request(
                        "tool_choice.type",
                        format!("tool_choice type '{other}' is not one of auto, any, tool, none"),
                    ))
                }
            },
        };
        Ok(ChatInput {
            messages: turns,
            tools,
            choice,
            format: OutputFormat::Text,
            fields: ("messages", "tools", ""),
        })
    }

    fn options(&self, st: &AppState) -> Result<GenOptions, ApiError> {
        check_model(&self.model, &st.model_id)?;
        if self.max_tokens < 1 {
            return Err(ApiError::bad_request(
                "max_tokens",
                format!("max_tokens = {} must be at least 1", self.max_tokens),
            ));
        }
        let (temperature, top_p) = check_sampling(self.temperature, 1.0, 1.0, self.top_p, 1.0, "")?;
        let stop = self.stop_sequences.clone().unwrap_or_default();
        if stop.len() > MAX_STOPS * 4 {
            return Err(ApiError::bad_request(
                "stop_sequences",
                format!("{} stop sequences; at most {}", stop.len(), MAX_STOPS * 4),
            ));
        }
        // Clients send large limits of their own: the context's room caps it.
        let max = (self.max_tokens as u64).min(st.engine.n_ctx as u64) as usize;
        Ok(GenOptions {
            max_tokens: Some(max),
            max_tokens_field: "max_tokens",
            cap_max_tokens: true,
            temperature,
            top_p,
            seed: rand::random(),
            stop,
            stream: self.stream.unwrap_or(false),
            include_usage: false,
            logprobs: None,
        })
    }
}

/// A Messages body as a chat turn, checked (what the handler does before the model is
/// involved); the fuzz target drives it.
pub fn parse(body: &[u8]) -> Result<ChatInput, ApiError> {
    parse_body::<MessagesRequest>(body)?.input()
}

/// The model a request names must be the one served.
pub fn check_model(asked: &str, served: &str) -> Result<(), ApiError> {
    if asked == served {
        return Ok(());
    }
    Err(ApiError::not_found(format!(
        "model '{asked}' is not served here; this server serves '{served}'"
    ))
    .with_param("model"))
}

pub async fn messages(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AnthropicError> {
    let req: MessagesRequest = parse_body(&json_body(&headers, body)?)?;
    let input = req.input()?;
    let opts = req.options(&st)?;
    let prepared = prepare(&st, &input).await?;
    let prompt_tokens = prepared.prompt.len();
    let mut rx = submit(&st, "messages", prepared, &opts)?;
    let id = format!("msg_{:024x}", rand::random::<u128>() >> 32);
    let tools = input.offered().to_vec();
    if opts.stream {
        let s = AnthropicStream {
            st: st.clone(),
            rx,
            id,
            prompt_tokens,
            tools,
            splitter: CallSplitter::default(),
            block: None,
            blocks: 0,
            started: false,
            ended: false,
            tokens: 0,
        };
        return Ok(Sse::new(s.events()).into_response());
    }
    let g = finished(&mut rx).await?;
    let (text, calls) = parse_calls(&g.text, &tools);
    let mut content = Vec::new();
    if !text.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    for c in &calls {
        content.push(tool_use(c, true));
    }
    let (reason, seq) = stop_reason(&g, !calls.is_empty());
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": st.model_id,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": g.token_ids.len()},
    }))
    .into_response())
}

/// A tool_use block; streamed ones start with an empty input that deltas fill in.
fn tool_use(c: &ToolCall, whole: bool) -> Value {
    let input: Value = if whole {
        serde_json::from_str(&c.arguments).unwrap_or(json!({}))
    } else {
        json!({})
    };
    let id = c.id.replacen("call_", "toolu_", 1);
    json!({"type": "tool_use", "id": id, "name": c.name, "input": input})
}

fn stop_reason(g: &Generated, called: bool) -> (&'static str, Value) {
    if called {
        return ("tool_use", Value::Null);
    }
    match (&g.finish, &g.stop_sequence) {
        (FinishReason::Length, _) => ("max_tokens", Value::Null),
        (FinishReason::Stop, Some(s)) => ("stop_sequence", json!(s)),
        (FinishReason::Stop, None) => ("end_turn", Value::Null),
    }
}

struct AnthropicStream {
    st: Arc<AppState>,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    id: String,
    prompt_tokens: usize,
    tools: Vec<ToolSpec>,
    splitter: CallSplitter,
    /// The open content block: its index, and whether it is text.
    block: Option<usize>,
    blocks: usize,
    started: bool,
    ended: bool,
    tokens: usize,
}

fn event(name: &str, v: Value) -> SseEvent {
    SseEvent::default().event(name).data(v.to_string())
}

impl AnthropicStream {
    fn close_block(&mut self, out: &mut Vec<SseEvent>) {
        if let Some(i) = self.block.take() {
            out.push(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": i}),
            ));
        }
    }

    fn pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<SseEvent>) {
        for p in pieces {
            match p {
                Piece::Text(t) => {
                    let i = match self.block {
                        Some(i) => i,
                        None => {
                            let i = self.blocks;
                            self.blocks += 1;
                            self.block = Some(i);
                            out.push(event(
                                "content_block_start",
                                json!({"type": "content_block_start", "index": i,
                                       "content_block": {"type": "text", "text": ""}}),
                            ));
                            i
                        }
                    };
                    out.push(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": i,
                               "delta": {"type": "text_delta", "text": t}}),
                    ));
                }
                Piece::Call(c) => {
                    self.close_block(out);
                    let i = self.blocks;
                    self.blocks += 1;
                    out.push(event(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": i,
                               "content_block": tool_use(&c, false)}),
                    ));
                    for piece in split_pieces(&c.arguments, 24) {
                        out.push(event(
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": i,
                                   "delta": {"type": "input_json_delta", "partial_json": piece}}),
                        ));
                    }
                    out.push(event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": i}),
                    ));
                }
            }
        }
    }

    fn events(self) -> impl Stream<Item = Result<SseEvent, Infallible>> {
        stream::unfold(self, |mut s| async move {
            if s.ended {
                return None;
            }
            let mut out = Vec::new();
            if !s.started {
                s.started = true;
                out.push(event(
                    "message_start",
                    json!({"type": "message_start", "message": {
                        "id": s.id, "type": "message", "role": "assistant", "model": s.st.model_id,
                        "content": [], "stop_reason": null, "stop_sequence": null,
                        "usage": {"input_tokens": s.prompt_tokens, "output_tokens": 0},
                    }}),
                ));
                out.push(event("ping", json!({"type": "ping"})));
            }
            match s.rx.recv().await {
                Some(Event::Token { text, token, .. }) => {
                    s.tokens += token.is_some() as usize;
                    let pieces = if s.tools.is_empty() {
                        if text.is_empty() {
                            Vec::new()
                        } else {
                            vec![Piece::Text(text)]
                        }
                    } else {
                        s.splitter.push(&text, &s.tools)
                    };
                    s.pieces(pieces, &mut out);
                }
                Some(Event::Done(g)) => {
                    let pieces = s.splitter.finish(&s.tools);
                    s.pieces(pieces, &mut out);
                    s.close_block(&mut out);
                    let (reason, seq) = stop_reason(&g, s.splitter.calls > 0);
                    out.push(event(
                        "message_delta",
                        json!({"type": "message_delta",
                               "delta": {"stop_reason": reason, "stop_sequence": seq},
                               "usage": {"output_tokens": g.token_ids.len()}}),
                    ));
                    out.push(event("message_stop", json!({"type": "message_stop"})));
                    s.ended = true;
                }
                Some(Event::Failed(e)) => {
                    out.push(event("error", AnthropicError(model_error(e)).body()));
                    s.ended = true;
                }
                None => {
                    let e = ApiError::unavailable("the inference engine stopped");
                    out.push(event("error", AnthropicError(e).body()));
                    s.ended = true;
                }
            }
            Some((stream::iter(out.into_iter().map(Ok)), s))
        })
        .flatten()
    }
}
