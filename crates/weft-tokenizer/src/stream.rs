//! Incremental detokenization for streaming generated text: bytes of partial UTF-8 characters
//! (a 4-byte emoji arriving as four byte tokens) wait until the character completes, so the text
//! emitted so far always equals `decode` of the ids pushed so far, minus any held-back tail.

use crate::tokenizer::Tokenizer;

/// Turns a stream of token ids into text chunks that never split a character.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        StreamDecoder {
            tok,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text it completed (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.tok.append_piece(id, &mut self.pending);
        let mut out = String::new();
        let mut start = 0;
        while start < self.pending.len() {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    // The prefix was just validated; the lossy conversion is a cheap no-op copy.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid]));
                    match e.error_len() {
                        // An incomplete sequence at the end: wait for more bytes.
                        None => {
                            start = valid;
                            break;
                        }
                        // An invalid sequence can never complete: replace it as decode would.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + n;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Flushes whatever is held back (an unfinished character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
