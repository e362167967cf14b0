//! weft's HTTP APIs in front of the continuous batcher (one node or a cluster): OpenAI
//! chat and text completions with tool calls and structured output, OpenAI Responses,
//! Anthropic Messages and Ollama, whole or streamed; models, health and the cluster view.

pub mod anthropic;
pub mod api;
pub mod chat;
pub mod dashboard;
pub mod details;
pub mod engine;
pub mod error;
pub mod listen;
pub mod ollama;
pub mod openai;
pub mod openai_responses;
pub mod responses;
pub mod server;
pub mod state;
pub mod template;
pub mod tools;
pub mod turn;

pub use engine::EngineHandle;
pub use error::ApiError;
pub use listen::{fit_connections, Limits};
pub use server::{router, serve, shutdown_signal};
pub use state::{AppState, ClusterView, DEFAULT_MAX_TOKENS};
pub use template::ChatTemplate;
