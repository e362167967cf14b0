//! Tokenizers described by GGUF metadata — SentencePiece ("llama") and GPT-2 byte-level BPE
//! ("gpt2") — reproducing llama.cpp's tokenization and detokenization exactly.

mod bpe;
mod error;
mod index;
mod pretok;
mod special;
mod spm;
mod stream;
mod tokenizer;
mod vocab;

#[cfg(test)]
mod tests;

pub use error::TokenizerError;
pub use stream::StreamDecoder;
pub use tokenizer::{Tokenizer, TokenizerSpec};
