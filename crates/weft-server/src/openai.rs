//! OpenAI's chat and text completions (`/v1/chat/completions`, `/v1/completions`): tool
//! calls read out of the output, answered whole or as server-sent events.

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
use serde_json::Value;
use weft_model::Event;

use crate::api::{
    check_top_logprobs, parse_body, ChatRequest, CompletionRequest, GenOptions, Prompt,
};
use crate::chat::prepare;
use crate::error::ApiError;
use crate::responses::{model_error, Kind, Meta, TokenLogprob};
use crate::state::{finished, json_body, submit, AppState, Prepared};
use crate::tools::{parse_calls, CallSplitter, Piece, ToolSpec};

pub async fn chat(
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
    let input = req.input()?;
    let opts = req.common.check(&st.model_id, st.engine.n_ctx, None, top)?;
    let prepared = prepare(&st, &input).await?;
    let tools = input.offered().to_vec();
    respond(&st, Kind::Chat, "messages", prepared, opts, tools).await
}

pub async fn completions(
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
    let prepared = Prepared { prompt, rule: None };
    respond(&st, Kind::Completion, "prompt", prepared, opts, Vec::new()).await
}

/// Submits an OpenAI request and answers whole or streamed; `tools`: the tools whose
/// calls are read out of the output.
async fn respond(
    st: &Arc<AppState>,
    kind: Kind,
    prompt_field: &str,
    prepared: Prepared,
    opts: GenOptions,
    tools: Vec<ToolSpec>,
) -> Result<Response, ApiError> {
    let meta = Meta::new(kind, &st.model_id, prepared.prompt.len(), opts.logprobs);
    let mut rx = submit(st, prompt_field, prepared, &opts)?;
    if opts.stream {
        let stream = sse_stream(st.clone(), meta, rx, opts.include_usage, tools);
        return Ok(Sse::new(stream).into_response());
    }
    let g = finished(&mut rx).await?;
    let (text, calls) = parse_calls(&g.text, &tools);
    Ok(Json(meta.full(&g, &text, &calls, &st.tokenizer)).into_response())
}

struct StreamState {
    st: Arc<AppState>,
    meta: Meta,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
    opened: bool,
    finished: bool,
    text_len: usize,
    /// Declared tools: text is split into content and calls as it streams.
    tools: Vec<ToolSpec>,
    splitter: CallSplitter,
    calls_sent: usize,
}

impl StreamState {
    /// Content deltas for text, and each call as OpenAI streams one: its id and name,
    /// then its arguments in pieces.
    fn pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<SseEvent>) {
        for p in pieces {
            match p {
                Piece::Text(t) => {
                    let c = self
                        .meta
                        .chunk(Some(&t), false, &[], 0, None, &self.st.tokenizer);
                    out.push(data(&c));
                    self.text_len += t.len();
                }
                Piece::Call(call) => {
                    for c in self.meta.call_chunks(self.calls_sent, &call) {
                        out.push(data(&c));
                    }
                    self.calls_sent += 1;
                }
            }
        }
    }
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
    tools: Vec<ToolSpec>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let state = StreamState {
        st,
        meta,
        rx,
        include_usage,
        opened: false,
        finished: false,
        text_len: 0,
        tools,
        splitter: CallSplitter::default(),
        calls_sent: 0,
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
                if s.tools.is_empty() {
                    if !text.is_empty() || !lp.is_empty() {
                        let c = s
                            .meta
                            .chunk(Some(&text), false, &lp, s.text_len, None, &tok);
                        out.push(data(&c));
                    }
                    s.text_len += text.len();
                } else {
                    // Text may be held back as a possible call; its tokens' logprobs
                    // go out at once, on a chunk of their own.
                    if !lp.is_empty() {
                        out.push(data(&s.meta.chunk(Some(""), false, &lp, 0, None, &tok)));
                    }
                    let pieces = s.splitter.push(&text, &s.tools);
                    s.pieces(pieces, &mut out);
                }
            }
            Some(Event::Done(g)) => {
                if open {
                    out.push(data(&s.meta.chunk(Some(""), true, &[], 0, None, &tok)));
                }
                let pieces = s.splitter.finish(&s.tools);
                s.pieces(pieces, &mut out);
                let finish = if s.splitter.calls > 0 {
                    "tool_calls"
                } else {
                    g.finish.as_str()
                };
                let text = (s.meta.kind == Kind::Completion).then_some("");
                let last = s
                    .meta
                    .chunk(text, false, &[], s.text_len, Some(finish), &tok);
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
