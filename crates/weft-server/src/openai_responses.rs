//! OpenAI's Responses API (`POST /v1/responses`): input as text or items (messages,
//! function calls and their outputs), instructions, tools, `text.format`, answered whole
//! or as its stream of typed events.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use weft_model::{Event, FinishReason, Generated};

use crate::api::{check_sampling, join_text, parse_body, tool_choice, GenOptions, ToolChoiceIn};
use crate::chat::prepare;
use crate::error::ApiError;
use crate::responses::{model_error, split_pieces, unix_now};
use crate::state::{finished, json_body, submit, AppState};
use crate::tools::{parse_calls, CallSplitter, Piece, ToolCall, ToolChoice, ToolSpec};
use crate::turn::{ChatInput, ChatTurn, OutputFormat};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Item>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ItemContent {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Item {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<ItemContent>,
    #[serde(default)]
    call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
    #[serde(default)]
    output: Option<String>,
}

#[derive(Debug, Deserialize)]
struct FunctionTool {
    #[serde(rename = "type")]
    kind: String,
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct TextFormat {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct TextOptions {
    #[serde(default)]
    format: Option<TextFormat>,
}

/// `tool_choice` here names a function as `{"type": "function", "name"}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ChoiceIn {
    Mode(String),
    Named { name: String },
}

#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: String,
    input: Input,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    max_output_tokens: Option<i64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    tools: Option<Vec<FunctionTool>>,
    #[serde(default)]
    tool_choice: Option<ChoiceIn>,
    #[serde(default)]
    text: Option<TextOptions>,
    #[serde(default)]
    previous_response_id: Option<String>,
}

fn item_text(c: &Option<ItemContent>, field: &str) -> Result<String, ApiError> {
    match c {
        None => Ok(String::new()),
        Some(ItemContent::Text(s)) => Ok(s.clone()),
        Some(ItemContent::Parts(parts)) => join_text(
            parts.iter().map(|p| (p.kind.as_str(), p.text.as_deref())),
            &["input_text", "output_text", "text"],
            |j| format!("{field}[{j}].type"),
        ),
    }
}

impl ResponsesRequest {
    fn input(&self) -> Result<ChatInput, ApiError> {
        if self.previous_response_id.is_some() {
            return Err(ApiError::bad_request(
                "previous_response_id",
                "responses are not stored here: send the whole conversation as input",
            ));
        }
        let mut turns = Vec::new();
        if let Some(i) = &self.instructions {
            turns.push(ChatTurn {
                role: "system".into(),
                text: i.clone(),
                ..Default::default()
            });
        }
        match &self.input {
            Input::Text(t) => turns.push(ChatTurn {
                role: "user".into(),
                text: t.clone(),
                ..Default::default()
            }),
            Input::Items(items) => {
                for (i, it) in items.iter().enumerate() {
                    let at = format!("input[{i}]");
                    match it.kind.as_deref().unwrap_or("message") {
                        "message" => {
                            let role = it.role.as_deref().unwrap_or("");
                            let role = match role {
                                "developer" => "system",
                                "system" | "user" | "assistant" => role,
                                other => {
                                    return Err(ApiError::bad_request(
                                        format!("{at}.role"),
                                        format!("role '{other}' is not one of system, developer, user, assistant"),
                                    ))
                                }
                            };
                            let text = item_text(&it.content, &format!("{at}.content"))?;
                            turns.push(ChatTurn {
                                role: role.into(),
                                text,
                                ..Default::default()
                            });
                        }
                        "function_call" => {
                            let (Some(id), Some(name)) = (&it.call_id, &it.name) else {
                                return Err(ApiError::bad_request(
                                    at,
                                    "a function_call item needs call_id and name",
                                ));
                            };
                            let args = it.arguments.as_deref().unwrap_or("{}");
                            let args: Value = serde_json::from_str(args).map_err(|e| {
                                ApiError::bad_request(
                                    format!("{at}.arguments"),
                                    format!("the arguments are not JSON: {e}"),
                                )
                            })?;
                            let mut call = ToolCall::new(name.clone(), &args);
                            call.id = id.clone();
                            // Calls of one turn join the assistant turn before them.
                            match turns.last_mut() {
                                Some(t) if t.role == "assistant" => t.calls.push(call),
                                _ => turns.push(ChatTurn {
                                    role: "assistant".into(),
                                    calls: vec![call],
                                    ..Default::default()
                                }),
                            }
                        }
                        "function_call_output" => {
                            let Some(id) = &it.call_id else {
                                return Err(ApiError::bad_request(
                                    format!("{at}.call_id"),
                                    "a function_call_output item needs call_id",
                                ));
                            };
                            turns.push(ChatTurn {
                                role: "tool".into(),
                                text: it.output.clone().unwrap_or_default(),
                                call_id: Some(id.clone()),
                                ..Default::default()
                            });
                        }
                        other => {
                            return Err(ApiError::bad_request(
                                format!("{at}.type"),
                                format!("input item type '{other}' is not supported"),
                            ))
                        }
                    }
                }
            }
        }
        let mut tools = Vec::new();
        for (i, t) in self.tools.iter().flatten().enumerate() {
            if t.kind != "function" {
                return Err(ApiError::bad_request(
                    format!("tools[{i}].type"),
                    format!("tool type '{}' is not supported (function only)", t.kind),
                ));
            }
            tools.push(ToolSpec {
                name: t.name.clone(),
                description: t.description.clone().unwrap_or_default(),
                parameters: t
                    .parameters
                    .clone()
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            });
        }
        let choice = match &self.tool_choice {
            None => tool_choice(None, "tool_choice")?,
            Some(ChoiceIn::Mode(m)) => {
                tool_choice(Some(&ToolChoiceIn::Mode(m.clone())), "tool_choice")?
            }
            Some(ChoiceIn::Named { name }) => crate::tools::ToolChoice::Named(name.clone()),
        };
        let format = match self.text.as_ref().and_then(|t| t.format.as_ref()) {
            None => OutputFormat::Text,
            Some(f) => OutputFormat::parse(
                &f.kind,
                f.schema.as_ref(),
                "text.format.type",
                "text.format.schema",
            )?,
        };
        Ok(ChatInput {
            messages: turns,
            tools,
            choice,
            format,
            fields: ("input", "tools", "text.format"),
        })
    }

    fn options(&self, st: &AppState) -> Result<GenOptions, ApiError> {
        if self.model != st.model_id {
            return Err(ApiError::bad_request(
                "model",
                format!(
                    "model '{}' is not served here; this server serves '{}'",
                    self.model, st.model_id
                ),
            )
            .with_code("model_not_found"));
        }
        let max_tokens = match self.max_output_tokens {
            Some(v) if v < 1 => {
                return Err(ApiError::bad_request(
                    "max_output_tokens",
                    format!("max_output_tokens = {v} must be at least 1"),
                ))
            }
            Some(v) => Some((v as u64).min(st.engine.n_ctx as u64) as usize),
            None => None,
        };
        let (temperature, top_p) = check_sampling(self.temperature, 1.0, 2.0, self.top_p, 1.0, "")?;
        Ok(GenOptions {
            max_tokens,
            max_tokens_field: "max_output_tokens",
            cap_max_tokens: true,
            temperature,
            top_p,
            seed: rand::random(),
            stop: Vec::new(),
            stream: self.stream.unwrap_or(false),
            include_usage: false,
            logprobs: None,
        })
    }
}

/// What every event and the final object of one response share.
struct Shell {
    id: String,
    msg_id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    instructions: Option<String>,
    max_output_tokens: Option<usize>,
    temperature: f32,
    top_p: f32,
    /// The request's tools, tool choice and text format, echoed as the API does.
    tools: Value,
    tool_choice: Value,
    format: Value,
}

impl Shell {
    /// The response object with `output` so far.
    fn object(&self, status: &str, output: Vec<Value>, g: Option<&Generated>) -> Value {
        let incomplete = g
            .filter(|g| g.finish == FinishReason::Length)
            .map(|_| json!({"reason": "max_output_tokens"}));
        let usage = g.map(|g| {
            let n = g.token_ids.len();
            json!({
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": n,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + n,
            })
        });
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "error": null,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": true,
            "text": {"format": self.format},
            "truncation": "disabled",
            "metadata": {},
            "timings": g.map(crate::responses::timings),
        })
    }

    fn message(&self, text: &str, status: &str) -> Value {
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([{"type": "output_text", "text": text, "annotations": []}])
        };
        json!({"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content})
    }
}

fn call_item(c: &ToolCall, arguments: &str, status: &str) -> Value {
    json!({
        "type": "function_call",
        "id": c.id.replacen("call_", "fc_", 1),
        "call_id": c.id,
        "name": c.name,
        "arguments": arguments,
        "status": status,
    })
}

/// The response's status, and its message's: cut by the token limit is incomplete.
fn status_of(g: &Generated) -> &'static str {
    match g.finish {
        FinishReason::Length => "incomplete",
        FinishReason::Stop => "completed",
    }
}

/// A Responses body as a chat turn, checked; the fuzz target drives it.
pub fn parse(body: &[u8]) -> Result<ChatInput, ApiError> {
    parse_body::<ResponsesRequest>(body)?.input()
}

pub async fn create(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse_body(&json_body(&headers, body)?)?;
    let input = req.input()?;
    let opts = req.options(&st)?;
    let prepared = prepare(&st, &input).await?;
    let shell = Shell {
        id: format!("resp_{:032x}", rand::random::<u128>()),
        msg_id: new_message_id(),
        created: unix_now(),
        model: st.model_id.clone(),
        prompt_tokens: prepared.prompt.len(),
        instructions: req.instructions.clone(),
        max_output_tokens: opts.max_tokens,
        temperature: opts.temperature,
        top_p: opts.top_p,
        tools: input
            .tools
            .iter()
            .map(|t| {
                json!({"type": "function", "name": t.name, "description": t.description,
                       "parameters": t.parameters, "strict": false})
            })
            .collect(),
        tool_choice: match &input.choice {
            ToolChoice::Auto => json!("auto"),
            ToolChoice::None => json!("none"),
            ToolChoice::Required => json!("required"),
            ToolChoice::Named(n) => json!({"type": "function", "name": n}),
        },
        format: match &input.format {
            OutputFormat::Text => json!({"type": "text"}),
            OutputFormat::JsonObject => json!({"type": "json_object"}),
            OutputFormat::JsonSchema(s) => {
                json!({"type": "json_schema", "name": "output", "schema": s, "strict": true})
            }
        },
    };
    let mut rx = submit(&st, "input", prepared, &opts)?;
    let tools = input.offered().to_vec();
    if opts.stream {
        return Ok(Sse::new(events(shell, rx, tools)).into_response());
    }
    let g = finished(&mut rx).await?;
    let (text, calls) = parse_calls(&g.text, &tools);
    let mut output = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        output.push(shell.message(&text, status_of(&g)));
    }
    output.extend(
        calls
            .iter()
            .map(|c| call_item(c, &c.arguments, "completed")),
    );
    Ok(Json(shell.object(status_of(&g), output, Some(&g))).into_response())
}

fn new_message_id() -> String {
    format!("msg_{:032x}", rand::random::<u128>())
}

/// The stream's state: what has been said, to number events and build the final object.
struct Streamed {
    shell: Shell,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    tools: Vec<ToolSpec>,
    splitter: CallSplitter,
    seq: u64,
    /// The message item's index once opened, and its text so far.
    message: Option<usize>,
    text: String,
    /// Every output item, finished, for the final object.
    done_items: Vec<Value>,
    started: bool,
    ended: bool,
}

impl Streamed {
    fn ev(&mut self, kind: &str, mut v: Value) -> SseEvent {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        SseEvent::default().event(kind).data(v.to_string())
    }

    fn close_message(&mut self, status: &str, out: &mut Vec<SseEvent>) {
        let Some(i) = self.message.take() else { return };
        let id = self.shell.msg_id.clone();
        let text = std::mem::take(&mut self.text);
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        let e = self.ev(
            "response.output_text.done",
            json!({"item_id": id, "output_index": i, "content_index": 0, "text": text}),
        );
        out.push(e);
        let e = self.ev(
            "response.content_part.done",
            json!({"item_id": id, "output_index": i, "content_index": 0, "part": part}),
        );
        out.push(e);
        let item = self.shell.message(&text, status);
        let e = self.ev(
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
        );
        out.push(e);
        self.done_items.push(item);
    }

    fn pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<SseEvent>) {
        for p in pieces {
            match p {
                Piece::Text(t) => {
                    if self.message.is_none() {
                        // Each message item has its own id (text can follow a call).
                        self.shell.msg_id = new_message_id();
                    }
                    let id = self.shell.msg_id.clone();
                    let i = match self.message {
                        Some(i) => i,
                        None => {
                            let i = self.done_items.len();
                            self.message = Some(i);
                            let item = self.shell.message("", "in_progress");
                            let e = self.ev(
                                "response.output_item.added",
                                json!({"output_index": i, "item": item}),
                            );
                            out.push(e);
                            let part =
                                json!({"type": "output_text", "text": "", "annotations": []});
                            let e = self.ev("response.content_part.added", json!({"item_id": id, "output_index": i, "content_index": 0, "part": part}));
                            out.push(e);
                            i
                        }
                    };
                    self.text.push_str(&t);
                    let e = self.ev(
                        "response.output_text.delta",
                        json!({"item_id": id, "output_index": i, "content_index": 0, "delta": t}),
                    );
                    out.push(e);
                }
                Piece::Call(c) => {
                    self.close_message("completed", out);
                    let i = self.done_items.len();
                    let item_id = c.id.replacen("call_", "fc_", 1);
                    let e = self.ev(
                        "response.output_item.added",
                        json!({"output_index": i, "item": call_item(&c, "", "in_progress")}),
                    );
                    out.push(e);
                    for piece in split_pieces(&c.arguments, 24) {
                        let e = self.ev(
                            "response.function_call_arguments.delta",
                            json!({"item_id": item_id, "output_index": i, "delta": piece}),
                        );
                        out.push(e);
                    }
                    let e = self.ev(
                        "response.function_call_arguments.done",
                        json!({"item_id": item_id, "output_index": i, "arguments": c.arguments}),
                    );
                    out.push(e);
                    let item = call_item(&c, &c.arguments, "completed");
                    let e = self.ev(
                        "response.output_item.done",
                        json!({"output_index": i, "item": item}),
                    );
                    out.push(e);
                    self.done_items.push(item);
                }
            }
        }
    }
}

fn events(
    shell: Shell,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    tools: Vec<ToolSpec>,
) -> impl futures_util::Stream<Item = Result<SseEvent, Infallible>> {
    let s = Streamed {
        shell,
        rx,
        tools,
        splitter: CallSplitter::default(),
        seq: 0,
        message: None,
        text: String::new(),
        done_items: Vec::new(),
        started: false,
        ended: false,
    };
    stream::unfold(s, |mut s| async move {
        if s.ended {
            return None;
        }
        let mut out = Vec::new();
        if !s.started {
            s.started = true;
            let r = s.shell.object("in_progress", Vec::new(), None);
            let e = s.ev("response.created", json!({"response": r}));
            out.push(e);
            let r = s.shell.object("in_progress", Vec::new(), None);
            let e = s.ev("response.in_progress", json!({"response": r}));
            out.push(e);
        }
        match s.rx.recv().await {
            Some(Event::Token { text, .. }) => {
                let pieces = if s.tools.is_empty() {
                    if text.is_empty() { Vec::new() } else { vec![Piece::Text(text)] }
                } else {
                    s.splitter.push(&text, &s.tools)
                };
                s.pieces(pieces, &mut out);
            }
            Some(Event::Done(g)) => {
                let pieces = s.splitter.finish(&s.tools);
                s.pieces(pieces, &mut out);
                if s.done_items.is_empty() && s.message.is_none() {
                    // An empty answer is still one (empty) message.
                    s.pieces(vec![Piece::Text(String::new())], &mut out);
                }
                s.close_message(status_of(&g), &mut out);
                let items = std::mem::take(&mut s.done_items);
                let status = status_of(&g);
                let r = s.shell.object(status, items, Some(&g));
                let kind = if status == "completed" { "response.completed" } else { "response.incomplete" };
                let e = s.ev(kind, json!({"response": r}));
                out.push(e);
                s.ended = true;
            }
            Some(Event::Failed(e)) => {
                let err = model_error(e);
                let ev = s.ev("error", json!({"code": err.code, "message": err.message, "param": err.param}));
                out.push(ev);
                s.ended = true;
            }
            None => {
                let ev = s.ev("error", json!({"code": "service_unavailable", "message": "the inference engine stopped", "param": null}));
                out.push(ev);
                s.ended = true;
            }
        }
        Some((stream::iter(out.into_iter().map(Ok)), s))
    })
    .flatten()
}
