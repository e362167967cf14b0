//! Response bodies shaped exactly as OpenAI's: chat completions, text completions, their
//! streamed chunks, usage and logprobs.

use serde_json::{json, Value};
use weft_model::{Generated, ModelError};
use weft_tokenizer::Tokenizer;

use crate::error::ApiError;
use crate::tools::ToolCall;

/// One generated token, its logprob, and the top alternatives `(id, logprob)`.
pub type TokenLogprob<'a> = (u32, f32, &'a [(u32, f32)]);

/// Which endpoint a response belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// What every response of one request shares.
#[derive(Clone, Debug)]
pub struct Meta {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub prompt_tokens: usize,
    /// Alternatives per token when logprobs were asked for.
    pub top_logprobs: Option<usize>,
}

impl Meta {
    pub fn new(kind: Kind, model: &str, prompt_tokens: usize, top: Option<usize>) -> Self {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        };
        Meta {
            kind,
            id: format!("{prefix}-{:016x}", rand::random::<u64>()),
            created: unix_now(),
            model: model.to_string(),
            prompt_tokens,
            top_logprobs: top,
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    pub fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }

    /// The whole (non-streamed) response: `text` and `calls` are what the output reads
    /// as (the calls taken out of the text when tools were declared).
    pub fn full(&self, g: &Generated, text: &str, calls: &[ToolCall], tok: &Tokenizer) -> Value {
        let lp: Vec<TokenLogprob<'_>> = g
            .token_ids
            .iter()
            .zip(&g.logprobs)
            .map(|(&t, (l, top))| (t, *l, top.as_slice()))
            .collect();
        let logprobs = self.logprobs(&lp, tok, 0);
        let choice = match self.kind {
            Kind::Chat => {
                let mut message = json!({"role": "assistant", "content": text, "refusal": null});
                let mut finish = g.finish.as_str();
                if !calls.is_empty() {
                    if text.is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = calls.iter().map(call_json).collect();
                    finish = "tool_calls";
                }
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                })
            }
            Kind::Completion => json!({
                "index": 0,
                "text": g.text,
                "logprobs": logprobs,
                "finish_reason": g.finish.as_str(),
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": [choice],
            "usage": self.usage(g.token_ids.len()),
            "timings": timings(g),
        })
    }

    /// A call streamed as OpenAI streams one: a chunk with its index, id and name (and
    /// empty arguments), then its arguments in pieces.
    pub fn call_chunks(&self, index: usize, call: &ToolCall) -> Vec<Value> {
        let wrap = |delta: Value| {
            json!({
                "id": self.id,
                "object": self.object(true),
                "created": self.created,
                "model": self.model,
                "system_fingerprint": null,
                "choices": [{"index": 0, "delta": {"tool_calls": [delta]}, "logprobs": null, "finish_reason": null}],
            })
        };
        let mut out = vec![wrap(json!({
            "index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }))];
        for piece in split_pieces(&call.arguments, 24) {
            out.push(wrap(
                json!({"index": index, "function": {"arguments": piece}}),
            ));
        }
        out
    }

    /// One streamed chunk: `text` (chat: the delta's content), logprobs of the tokens it
    /// carries, and the finish reason on the last one. `role` opens a chat stream.
    pub fn chunk(
        &self,
        text: Option<&str>,
        role: bool,
        lp: &[TokenLogprob<'_>],
        offset: usize,
        finish: Option<&str>,
        tok: &Tokenizer,
    ) -> Value {
        let logprobs = if lp.is_empty() {
            Value::Null
        } else {
            self.logprobs(lp, tok, offset)
        };
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Completion => json!({
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": [choice],
        })
    }

    /// The last chunk of a stream that asked for usage: no choices, only usage.
    pub fn usage_chunk(&self, completion_tokens: usize) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": [],
            "usage": self.usage(completion_tokens),
        })
    }

    /// Logprobs of `lp` (token, its logprob, top alternatives) in the endpoint's format;
    /// `offset`: text offset of the first token (completions).
    fn logprobs(&self, lp: &[TokenLogprob<'_>], tok: &Tokenizer, offset: usize) -> Value {
        let Some(k) = self.top_logprobs else {
            return Value::Null;
        };
        let piece = |id: u32| String::from_utf8_lossy(&tok.token_bytes(id)).into_owned();
        match self.kind {
            Kind::Chat => {
                let content: Vec<Value> = lp
                    .iter()
                    .map(|&(t, l, top)| {
                        let alts: Vec<Value> = top
                            .iter()
                            .take(k)
                            .map(|&(a, al)| {
                                json!({"token": piece(a), "logprob": al, "bytes": tok.token_bytes(a)})
                            })
                            .collect();
                        json!({
                            "token": piece(t),
                            "logprob": l,
                            "bytes": tok.token_bytes(t),
                            "top_logprobs": alts,
                        })
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Kind::Completion => {
                let mut at = offset;
                let mut offsets = Vec::new();
                let mut tokens = Vec::new();
                let mut lps = Vec::new();
                let mut tops = Vec::new();
                for &(t, l, top) in lp {
                    let p = piece(t);
                    offsets.push(at);
                    at += p.len();
                    tokens.push(p);
                    lps.push(l);
                    let m: serde_json::Map<String, Value> = top
                        .iter()
                        .take(k)
                        .map(|&(a, al)| (piece(a), json!(al)))
                        .collect();
                    tops.push(Value::Object(m));
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": lps,
                    "top_logprobs": tops,
                    "text_offset": offsets,
                })
            }
        }
    }
}

/// A call in OpenAI's shape.
pub fn call_json(c: &ToolCall) -> Value {
    json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

/// `text` cut into pieces of about `size` bytes, on character boundaries.
pub fn split_pieces(text: &str, size: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let mut end = (at + size).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.push(&text[at..end]);
        at = end;
    }
    out
}

/// Speed of one generation, as llama-server reports it beside the usage.
pub fn timings(g: &Generated) -> Value {
    let per_s = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    json!({
        "prompt_n": g.prefill_tokens,
        "prompt_ms": g.prefill_secs * 1e3,
        "prompt_per_second": per_s(g.prefill_tokens, g.prefill_secs),
        "predicted_n": g.token_ids.len(),
        "predicted_ms": g.decode_secs * 1e3,
        "predicted_per_second": per_s(g.decode_steps, g.decode_secs),
    })
}

/// A failed generation as an API error: a lost node or a stopped engine is 503.
pub fn model_error(e: ModelError) -> ApiError {
    match e {
        ModelError::Collective(m) => ApiError::unavailable(format!("the cluster failed: {m}")),
        ModelError::Invalid(m) => ApiError::bad_request("", m),
        ModelError::ContextFull { .. } | ModelError::BadToken { .. } => {
            ApiError::bad_request("", e.to_string())
        }
        ModelError::Constraint(_) => {
            ApiError::internal(e.to_string()).with_code("constraint_failed")
        }
        ModelError::NonFiniteLogits { .. } => {
            ApiError::internal(e.to_string()).with_code("non_finite_logits")
        }
        other => ApiError::internal(other.to_string()),
    }
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
