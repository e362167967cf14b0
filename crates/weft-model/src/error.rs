//! Errors of loading and running a model.

use weft_gguf::GgufError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: tensor '{tensor}': {detail}")]
    Tensor {
        path: String,
        tensor: String,
        detail: String,
    },
    #[error("{0}")]
    Tokenizer(String),
    #[error("invalid shard: {0}")]
    Shard(String),
    #[error("context full: position {pos} reaches the context size {n_ctx}")]
    ContextFull { pos: usize, n_ctx: usize },
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    BadToken { id: u32, n_vocab: usize },
    #[error("collective failed: {0}")]
    Collective(String),
    #[error("{0}")]
    Invalid(String),
    /// The output rule (a grammar) failed mid-generation: the server's fault, not the
    /// request's.
    #[error("constrained decoding: {0}")]
    Constraint(String),
    /// The forward pass produced logits no token can be sampled from (NaN weights, an
    /// overflow): this request fails, the engine goes on.
    #[error("the model produced non-finite logits ({what}) at token position {pos}")]
    NonFiniteLogits { what: &'static str, pos: usize },
}
