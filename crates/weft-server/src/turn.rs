//! One chat turn in weft's own terms, whatever API it came in by: its messages, the
//! tools it declares, whether a call is required, and the output format.

use serde_json::Value;

use crate::error::ApiError;
use crate::tools::{ToolCall, ToolChoice, ToolSpec};

/// What the output must be.
#[derive(Clone, Debug, Default)]
pub enum OutputFormat {
    #[default]
    Text,
    /// Any one JSON object.
    JsonObject,
    /// One JSON value valid against this schema.
    JsonSchema(Value),
}

impl OutputFormat {
    /// `text`, `json_object` or `json_schema` (with its schema), as OpenAI's two APIs
    /// name them; errors name `kind_field` or `schema_field`.
    pub fn parse(
        kind: &str,
        schema: Option<&Value>,
        kind_field: &str,
        schema_field: &str,
    ) -> Result<Self, ApiError> {
        match (kind, schema) {
            ("text", _) => Ok(OutputFormat::Text),
            ("json_object", _) => Ok(OutputFormat::JsonObject),
            ("json_schema", Some(s)) if s.is_object() || s.is_boolean() => {
                Ok(OutputFormat::JsonSchema(s.clone()))
            }
            ("json_schema", _) => Err(ApiError::bad_request(
                schema_field,
                "json_schema output needs a schema object",
            )),
            (other, _) => Err(ApiError::bad_request(
                kind_field,
                format!("format type '{other}' is not one of text, json_object, json_schema"),
            )),
        }
    }
}

/// A chat turn in weft's own terms.
#[derive(Debug)]
pub struct ChatInput {
    pub messages: Vec<ChatTurn>,
    pub tools: Vec<ToolSpec>,
    pub choice: ToolChoice,
    pub format: OutputFormat,
    /// The request's names for its fields, for errors: (messages, tools, format).
    pub fields: (&'static str, &'static str, &'static str),
}

/// One message: a role, its text, and the calls or call result it carries.
#[derive(Clone, Debug, Default)]
pub struct ChatTurn {
    pub role: String,
    pub text: String,
    /// An assistant turn's calls.
    pub calls: Vec<ToolCall>,
    /// A tool turn: the id of the call it answers, and the tool's name when known.
    pub call_id: Option<String>,
    pub tool_name: Option<String>,
}

impl ChatInput {
    /// The tools the model is shown (none when calls are turned off).
    pub fn offered(&self) -> &[ToolSpec] {
        match self.choice {
            ToolChoice::None => &[],
            _ => &self.tools,
        }
    }
}
