//! The GGUF model file: metadata, tensor index and shard byte ranges over mmap, plus a writer.

mod error;
mod open;
mod reader;
mod split;
mod types;
mod value;
mod writer;

pub use error::{FormatError, GgufError};
pub use reader::{GgufFile, PartLayout, PartialData, TensorInfo, DEFAULT_ALIGNMENT};
pub use split::{split_part_path, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS};
pub use types::GgmlType;
pub use value::{Array, Value};
pub use writer::GgufWriter;

#[cfg(test)]
mod tests;
