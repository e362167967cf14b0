//! `weft serve`'s flags.

use std::path::PathBuf;

use clap::Args;

use crate::layout_args::LayoutArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// GGUF model file (default: the model `weft pull` fetched).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to listen on; the default answers this machine only (0.0.0.0 for every
    /// interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require this key as `Authorization: Bearer KEY` (or WEFT_API_KEY).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Threads (default: all cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Context size of each sequence, in tokens.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Most sequences decoding together; more requests wait in a queue.
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Most prompt tokens a step carries beside running decodes.
    #[arg(long, default_value_t = 32)]
    pub prefill_chunk: usize,
    /// Connections open at once (lowered to fit the descriptor limit, which is raised to
    /// its hard limit at start); past it `/health` still answers and other requests get
    /// a 503 at once.
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers; a kept-alive connection idle
    /// this long is closed.
    #[arg(long, default_value_t = 15.0)]
    pub header_timeout: f64,
    /// Tokens a chat request that sets no max_tokens may generate (at most what is left
    /// of its context).
    #[arg(long, default_value_t = weft_server::DEFAULT_MAX_TOKENS)]
    pub default_max_tokens: usize,
    /// With a cluster: seconds to keep trying to form it again after a node is lost
    /// (from the nodes that answer, or with the lost one once it is back) before the
    /// running requests fail with 503.
    #[arg(long, default_value_t = 60.0)]
    pub resume_wait: f64,
    /// The model id the API reports and expects (default: the file's name).
    #[arg(long)]
    pub model_id: Option<String>,
    #[command(flatten)]
    pub layout: LayoutArgs,
}
