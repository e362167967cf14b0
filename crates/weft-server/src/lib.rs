//! weft's OpenAI-compatible HTTP API: chat and text completions (whole or streamed as
//! server-sent events), models, health and the cluster view, in front of the continuous
//! batcher running on one node or a cluster.

pub mod api;
pub mod engine;
pub mod error;
pub mod listen;
pub mod responses;
pub mod server;
pub mod template;

pub use engine::EngineHandle;
pub use error::ApiError;
pub use listen::{fit_connections, Limits};
pub use server::{router, serve, AppState, ClusterView, DEFAULT_MAX_TOKENS};
pub use template::ChatTemplate;
