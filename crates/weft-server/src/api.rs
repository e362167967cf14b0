//! OpenAI request bodies and their checks: what `/v1/chat/completions` and
//! `/v1/completions` accept, parsed so that a bad body names the field at fault.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;
use crate::tools::{ToolCall, ToolChoice, ToolSpec};
use crate::turn::{ChatInput, ChatTurn, OutputFormat};

/// Parses a JSON body; errors name the field path (`messages[0].content`) and the problem.
/// Anything but whitespace after the JSON value is refused.
pub fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let value = parse_value(de)?;
    de.end().map_err(|e| {
        ApiError::bad_request(
            "",
            format!("invalid request body: bytes after the JSON value ({e})"),
        )
    })?;
    Ok(value)
}

fn parse_value<'de, T: DeserializeOwned>(
    de: &mut serde_json::Deserializer<serde_json::de::SliceRead<'de>>,
) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let param = if path == "." { String::new() } else { path };
        let at = if param.is_empty() {
            String::new()
        } else {
            format!(" (field '{param}')")
        };
        ApiError::bad_request(param, format!("invalid request body: {inner}{at}"))
    })
}

/// A string or a list of strings (`stop`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// Message content: a string, or a list of parts of which only text is supported.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's calls, fed back in.
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// A tool turn: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ToolCallIn {
    #[serde(default)]
    pub id: Option<String>,
    pub function: FunctionCallIn,
}

#[derive(Debug, Deserialize)]
pub struct FunctionCallIn {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

/// `tools[i]`: `{"type": "function", "function": {...}}`.
#[derive(Debug, Deserialize)]
pub struct ToolDecl {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDecl,
}

#[derive(Debug, Deserialize)]
pub struct FunctionDecl {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub parameters: Option<Value>,
}

/// `tool_choice`: "auto" | "none" | "required" | `{"type": "function", "function": {"name"}}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoiceIn {
    Mode(String),
    Named { function: NamedFunction },
}

#[derive(Debug, Deserialize)]
pub struct NamedFunction {
    pub name: String,
}

/// `response_format`: `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
#[derive(Debug, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub json_schema: Option<JsonSchemaSpec>,
}

#[derive(Debug, Deserialize)]
pub struct JsonSchemaSpec {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The options both endpoints share.
#[derive(Debug, Deserialize)]
pub struct CommonOptions {
    pub model: String,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<OneOrMany>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<i64>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    #[serde(default)]
    pub tools: Option<Vec<ToolDecl>>,
    #[serde(default)]
    pub tool_choice: Option<ToolChoiceIn>,
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    #[serde(flatten)]
    pub common: CommonOptions,
}

/// Roles a chat message may have.
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Declared tools in weft's terms; `field` names the list in errors.
pub fn tool_specs(tools: &[ToolDecl], field: &str) -> Result<Vec<ToolSpec>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.kind != "function" {
                return Err(ApiError::bad_request(
                    format!("{field}[{i}].type"),
                    format!("tool type '{}' is not supported (function only)", t.kind),
                ));
            }
            Ok(ToolSpec {
                name: t.function.name.clone(),
                description: t.function.description.clone().unwrap_or_default(),
                parameters: t
                    .function
                    .parameters
                    .clone()
                    .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}})),
            })
        })
        .collect()
}

/// A tool choice mode in weft's terms.
pub fn tool_choice(choice: Option<&ToolChoiceIn>, field: &str) -> Result<ToolChoice, ApiError> {
    match choice {
        None => Ok(ToolChoice::Auto),
        Some(ToolChoiceIn::Named { function }) => Ok(ToolChoice::Named(function.name.clone())),
        Some(ToolChoiceIn::Mode(m)) => match m.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" | "any" => Ok(ToolChoice::Required),
            other => Err(ApiError::bad_request(
                field,
                format!("tool_choice '{other}' is not one of auto, none, required"),
            )),
        },
    }
}

impl ChatRequest {
    /// The turn in weft's terms.
    pub fn input(&self) -> Result<ChatInput, ApiError> {
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
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
            let calls = m
                .tool_calls
                .iter()
                .flatten()
                .enumerate()
                .map(|(j, c)| {
                    let args: Value = serde_json::from_str(&c.function.arguments).map_err(|e| {
                        ApiError::bad_request(
                            format!("messages[{i}].tool_calls[{j}].function.arguments"),
                            format!("the arguments are not JSON: {e}"),
                        )
                    })?;
                    let mut call = ToolCall::new(c.function.name.clone(), &args);
                    if let Some(id) = &c.id {
                        call.id = id.clone();
                    }
                    Ok(call)
                })
                .collect::<Result<Vec<_>, ApiError>>()?;
            if m.role == "tool" && m.tool_call_id.is_none() {
                return Err(ApiError::bad_request(
                    format!("messages[{i}].tool_call_id"),
                    "a tool message must name the call it answers (tool_call_id)",
                ));
            }
            messages.push(ChatTurn {
                role: role.to_string(),
                text: m.text(i)?,
                calls,
                call_id: m.tool_call_id.clone(),
                tool_name: m.name.clone(),
            });
        }
        let format = match &self.response_format {
            None => OutputFormat::Text,
            Some(f) => OutputFormat::parse(
                &f.kind,
                f.json_schema.as_ref().and_then(|s| s.schema.as_ref()),
                "response_format.type",
                "response_format.json_schema.schema",
            )?,
        };
        Ok(ChatInput {
            messages,
            tools: tool_specs(self.tools.as_deref().unwrap_or(&[]), "tools")?,
            choice: tool_choice(self.tool_choice.as_ref(), "tool_choice")?,
            format,
            fields: ("messages", "tools", "response_format"),
        })
    }
}

/// A prompt as text or token ids (one prompt: `n` and batches of prompts are not served).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<i64>),
    TextList(Vec<String>),
    TokenLists(Vec<Vec<i64>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Legacy completions: how many top logprobs per token (0: only the chosen one's).
    #[serde(default)]
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub common: CommonOptions,
}

/// Checked generation options.
#[derive(Clone, Debug)]
pub struct GenOptions {
    /// None: up to the context's end.
    pub max_tokens: Option<usize>,
    /// The request's name for the limit, for errors (`max_tokens`, `options.num_predict`).
    pub max_tokens_field: &'static str,
    /// A limit past the context's room is cut to fit (Anthropic, Responses, Ollama, whose
    /// clients send their own large defaults) rather than refused (OpenAI's completions).
    pub cap_max_tokens: bool,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Report logprobs, with this many alternatives per token.
    pub logprobs: Option<usize>,
}

/// Most alternatives per token, as OpenAI allows.
pub const MAX_TOP_LOGPROBS: i64 = 20;
/// Most stop sequences, as OpenAI allows.
pub const MAX_STOPS: usize = 4;

impl CommonOptions {
    /// Checks the shared options against the served model and context size.
    pub fn check(
        self,
        served_model: &str,
        n_ctx: usize,
        default_max_tokens: Option<usize>,
        logprobs: Option<usize>,
    ) -> Result<GenOptions, ApiError> {
        if self.model != served_model {
            return Err(ApiError::bad_request(
                "model",
                format!(
                    "model '{}' is not served here; this server serves '{served_model}'",
                    self.model
                ),
            )
            .with_code("model_not_found"));
        }
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::bad_request(
                    "n",
                    format!("n = {n}: only n = 1 is supported"),
                ));
            }
        }
        let (field, asked) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => ("max_completion_tokens", Some(v)),
            (None, v) => ("max_tokens", v),
        };
        let max_tokens = match asked {
            Some(v) if v < 1 => {
                return Err(ApiError::bad_request(
                    field,
                    format!("{field} = {v} must be at least 1"),
                ))
            }
            Some(v) if v as u64 >= n_ctx as u64 => {
                return Err(ApiError::bad_request(
                    field,
                    format!("{field} = {v} exceeds the context of {n_ctx} tokens"),
                ))
            }
            Some(v) => Some(v as usize),
            None => default_max_tokens,
        };
        let (temperature, top_p) = check_sampling(self.temperature, 1.0, 2.0, self.top_p, 1.0, "")?;
        let stop = self.stop.map(OneOrMany::into_vec).unwrap_or_default();
        if stop.len() > MAX_STOPS {
            return Err(ApiError::bad_request(
                "stop",
                format!("{} stop sequences; at most {MAX_STOPS}", stop.len()),
            ));
        }
        let stream = self.stream.unwrap_or(false);
        Ok(GenOptions {
            max_tokens,
            max_tokens_field: field,
            cap_max_tokens: false,
            temperature,
            top_p,
            seed: self.seed.map(|s| s as u64).unwrap_or_else(rand::random),
            stop,
            stream,
            include_usage: stream
                && self
                    .stream_options
                    .map(|o| o.include_usage)
                    .unwrap_or(false),
            logprobs,
        })
    }
}

/// Temperature (default `t0`, at most `t_max`) and top_p (default `p0`) checked, with
/// `prefix` before the field names in errors (`options.` for Ollama).
pub fn check_sampling(
    temperature: Option<f32>,
    t0: f32,
    t_max: f32,
    top_p: Option<f32>,
    p0: f32,
    prefix: &str,
) -> Result<(f32, f32), ApiError> {
    let t = temperature.unwrap_or(t0);
    if !(0.0..=t_max).contains(&t) {
        return Err(ApiError::bad_request(
            format!("{prefix}temperature"),
            format!("temperature = {t} must be between 0 and {t_max}"),
        ));
    }
    let p = top_p.unwrap_or(p0);
    if !(p > 0.0 && p <= 1.0) {
        return Err(ApiError::bad_request(
            format!("{prefix}top_p"),
            format!("top_p = {p} must be in (0, 1]"),
        ));
    }
    Ok((t, p))
}

/// The text of content parts: those whose type is one of `kinds` joined, any other part
/// refused, naming it by `field(index)`.
pub fn join_text<'a>(
    parts: impl Iterator<Item = (&'a str, Option<&'a str>)>,
    kinds: &[&str],
    field: impl Fn(usize) -> String,
) -> Result<String, ApiError> {
    let mut out = String::new();
    for (j, (kind, text)) in parts.enumerate() {
        match text {
            Some(t) if kinds.contains(&kind) => out.push_str(t),
            _ => {
                return Err(ApiError::bad_request(
                    field(j),
                    format!("content of type '{kind}' is not supported here (text only)"),
                ))
            }
        }
    }
    Ok(out)
}

/// Checks a top-logprobs count.
pub fn check_top_logprobs(field: &str, v: i64) -> Result<usize, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS).contains(&v) {
        return Err(ApiError::bad_request(
            field,
            format!("{field} = {v} must be between 0 and {MAX_TOP_LOGPROBS}"),
        ));
    }
    Ok(v as usize)
}

impl ChatMessage {
    /// The message's text (text parts joined); other part types are refused.
    pub fn text(&self, index: usize) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(s)) => Ok(s.clone()),
            Some(Content::Parts(parts)) => join_text(
                parts.iter().map(|p| (p.kind.as_str(), p.text.as_deref())),
                &["text"],
                |j| format!("messages[{index}].content[{j}]"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_bodies_name_the_field() {
        let e =
            parse_body::<ChatRequest>(br#"{"model":"m","messages":[{"role":"user","content":5}]}"#)
                .unwrap_err();
        assert_eq!(e.status, 400);
        assert!(
            e.param.as_deref().unwrap_or("").starts_with("messages"),
            "{e:?}"
        );
        let e = parse_body::<ChatRequest>(br#"{"model":"m"}"#).unwrap_err();
        assert!(e.message.contains("messages"), "{e:?}");
        let e = parse_body::<ChatRequest>(b"{not json").unwrap_err();
        assert_eq!(e.status, 400);
    }

    #[test]
    fn options_are_checked() {
        let opts = |body: &str| {
            parse_body::<ChatRequest>(body.as_bytes())
                .unwrap()
                .common
                .check("m", 100, None, None)
        };
        let base = r#""model":"m","messages":[]"#;
        assert!(opts(&format!("{{{base},\"max_tokens\":5}}")).is_ok());
        let e = opts(&format!("{{{base},\"max_tokens\":-1}}")).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = opts(&format!("{{{base},\"max_tokens\":100}}")).unwrap_err();
        assert!(e.message.contains("context of 100"), "{}", e.message);
        let e = opts(r#"{"model":"x","messages":[]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
        let e = opts(&format!("{{{base},\"n\":2}}")).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = opts(&format!("{{{base},\"temperature\":3}}")).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let o = opts(&format!("{{{base},\"stop\":\"x\",\"seed\":7,\"stream\":true,\"stream_options\":{{\"include_usage\":true}}}}")).unwrap();
        assert_eq!(
            (o.stop, o.seed, o.include_usage),
            (vec!["x".to_string()], 7, true)
        );
    }
}
