//! One chat turn in weft's own terms, whatever API it came in by: its messages, the
//! tools it declares, whether a call is required, and the output format.

use serde_json::Value;

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
