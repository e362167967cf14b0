//! Errors raised while building a tokenizer from (possibly malformed) GGUF metadata.

/// Why a [`crate::TokenizerSpec`] could not become a [`crate::Tokenizer`]. Every variant names the
/// GGUF metadata key at fault so a user can tell which part of the file is broken.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "tokenizer.ggml.model: unsupported tokenizer model {0:?} (expected \"llama\" or \"gpt2\")"
    )]
    UnsupportedModel(String),

    #[error("tokenizer.ggml.pre: unknown pre-tokenizer type {0:?}")]
    UnknownPreTokenizer(String),

    #[error("tokenizer.ggml.tokens: the vocabulary is empty")]
    EmptyVocab,

    #[error("tokenizer.ggml.tokens: token {text:?} appears twice, at ids {first} and {second}")]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },

    #[error("{field}: has {found} entries but the vocabulary has {expected} tokens")]
    LengthMismatch {
        field: &'static str,
        expected: usize,
        found: usize,
    },

    #[error("{field}: token id {id} is out of range for a vocabulary of {vocab_size} tokens")]
    IdOutOfRange {
        field: &'static str,
        id: u32,
        vocab_size: usize,
    },

    #[error("tokenizer.ggml.merges: missing, but a gpt2 (byte-level BPE) tokenizer needs it")]
    MissingMerges,

    #[error("tokenizer.ggml.merges[{index}]: {line:?} is not two pieces separated by a space")]
    BadMerge { index: usize, line: String },

    #[error("{flag} is true but {id_field} is not set")]
    MissingSpecialToken {
        flag: &'static str,
        id_field: &'static str,
    },

    /// A built-in pre-tokenizer pattern failed to compile; a bug in this crate, not in the file.
    #[error("tokenizer.ggml.pre: pre-tokenizer {pre:?} pattern failed to compile: {message}")]
    Regex { pre: String, message: String },
}
