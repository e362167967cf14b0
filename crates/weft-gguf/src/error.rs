//! Errors of reading a GGUF file; each names the file and the field involved.

use std::path::PathBuf;

/// What went wrong inside the bytes, independent of where they came from.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum FormatError {
    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {version} (weft reads versions 2 and 3)")]
    UnsupportedVersion { version: u32 },
    #[error("file is truncated: {field} needs {needed} bytes at offset {offset}, file has {len}")]
    Truncated {
        field: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    #[error("{field}: {count} entries cannot fit in the {remaining} bytes left")]
    CountTooLarge {
        field: String,
        count: u64,
        remaining: u64,
    },
    #[error("{field}: string is not valid UTF-8")]
    BadUtf8 { field: String },
    #[error("{field}: unknown metadata value type {type_id}")]
    BadValueType { field: String, type_id: u32 },
    #[error("tensor '{tensor}': unknown tensor type id {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },
    #[error("tensor '{tensor}': tensor type {name} (id {type_id}) is not supported by weft")]
    UnsupportedTensorType {
        tensor: String,
        name: &'static str,
        type_id: u32,
    },
    #[error("tensor '{tensor}': {detail}")]
    BadTensor { tensor: String, detail: String },
    #[error(
        "tensor '{tensor}': data [{start}, {end}) lies past the end of the file ({len} bytes)"
    )]
    TensorPastEnd {
        tensor: String,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("metadata key '{key}' is missing")]
    MissingKey { key: String },
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        key: String,
        found: &'static str,
        expected: &'static str,
    },
    #[error("metadata key '{key}': {detail}")]
    BadValue { key: String, detail: String },
    #[error("tensor '{name}' is missing")]
    MissingTensor { name: String },
    #[error("tensor '{tensor}': shard {detail}")]
    BadShard { tensor: String, detail: String },
}

/// A [`FormatError`] or I/O error, with the file's path.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    // The cause is part of the message, not a `source`, so `{:#}` chains print it once.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: {error}")]
    Format { path: PathBuf, error: FormatError },
}

impl GgufError {
    /// The format error inside, if this is one (tests match on it).
    pub fn format(&self) -> Option<&FormatError> {
        match self {
            GgufError::Format { error, .. } => Some(error),
            GgufError::Io { .. } => None,
        }
    }
}
