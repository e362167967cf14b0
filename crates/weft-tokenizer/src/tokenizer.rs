//! `Tokenizer`: built from a `TokenizerSpec` (GGUF vocabulary metadata), it splits out
//! special tokens, tokenizes the rest with SentencePiece or byte-level BPE, and detokenizes.

use crate::error::TokenizerError;
use crate::special::{Fragment, SpecialMatcher};
use crate::vocab::{self, attr, Vocab};
use crate::{bpe, pretok, spm};

/// The tokenizer part of a GGUF file's metadata (`tokenizer.ggml.*`), already read out.
#[derive(Clone, Debug, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: "llama" (SentencePiece) or "gpt2" (byte-level BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`: pre-tokenizer type for gpt2 ("llama-bpe", "qwen2", "default", ...).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores` (merge priority for SentencePiece).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
    /// 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges` ("a b" lines), gpt2 only.
    pub merges: Option<Vec<String>>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    /// Extra end-of-generation ids (e.g. `<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`).
    pub eot_ids: Vec<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix`.
    pub add_space_prefix: Option<bool>,
}

enum Model {
    Spm {
        /// Fallback token per byte for characters missing from the vocabulary.
        byte_ids: Box<[Option<u32>; 256]>,
        add_space_prefix: bool,
    },
    Bpe {
        merges: bpe::Merges,
        pre: pretok::PreTokenizer,
        /// Boxed: its tables would make every `Model` a couple of kilobytes.
        alphabet: Box<bpe::ByteAlphabet>,
    },
}

/// A ready tokenizer; all lookup tables are built once in [`Tokenizer::new`].
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    special: SpecialMatcher,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    /// Sorted end-of-generation ids.
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
}

impl Tokenizer {
    /// Validates the spec and builds the tokenizer. Errors name the offending metadata key.
    pub fn new(spec: TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        let is_spm = match spec.model.as_str() {
            "llama" => true,
            "gpt2" => false,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let mut vocab = Vocab::new(spec.tokens, spec.scores, spec.token_types)?;
        let n = vocab.len();
        let check = |field: &'static str, id: Option<u32>| match id {
            Some(id) if id as usize >= n => Err(TokenizerError::IdOutOfRange {
                field,
                id,
                vocab_size: n,
            }),
            _ => Ok(id),
        };
        // llama.cpp's SentencePiece defaults (<unk>=0, <s>=1, </s>=2) apply when the file is
        // silent, and are dropped if the vocabulary is too small for them.
        let spm_default = |id: u32| Some(id).filter(|&i| is_spm && (i as usize) < n);
        let bos = check("tokenizer.ggml.bos_token_id", spec.bos_id)?.or(spm_default(1));
        let eos = check("tokenizer.ggml.eos_token_id", spec.eos_id)?.or(spm_default(2));
        let unk = check("tokenizer.ggml.unknown_token_id", spec.unk_id)?.or(spm_default(0));
        let pad = check("tokenizer.ggml.padding_token_id", spec.pad_id)?;
        for &id in &spec.eot_ids {
            check("tokenizer.ggml.eot_token_id", Some(id))?;
        }

        let model = if is_spm {
            let mut byte_ids = Box::new([None; 256]);
            for (b, slot) in byte_ids.iter_mut().enumerate() {
                // "<0xAB>" first, then the byte as a one-character token, as llama.cpp;
                // where neither exists (llama.cpp would abort) fall back to <unk>.
                let single = (b < 0x80).then(|| (b as u8 as char).to_string());
                *slot = vocab
                    .id(&format!("<0x{b:02X}>"))
                    .or_else(|| single.and_then(|s| vocab.id(&s)))
                    .or(unk);
            }
            Model::Spm {
                byte_ids,
                add_space_prefix: spec.add_space_prefix.unwrap_or(true),
            }
        } else {
            let lines = spec.merges.ok_or(TokenizerError::MissingMerges)?;
            Model::Bpe {
                merges: bpe::Merges::new(&lines)?,
                pre: pretok::PreTokenizer::new(spec.pre.as_deref())?,
                alphabet: Box::new(bpe::ByteAlphabet::new()),
            }
        };
        let default_add_bos = match &model {
            Model::Spm { .. } => true,
            Model::Bpe { pre, .. } => pre.default_add_bos,
        };
        let add_bos = spec.add_bos.unwrap_or(default_add_bos);
        let add_eos = spec.add_eos.unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(TokenizerError::MissingSpecialToken {
                flag: "tokenizer.ggml.add_bos_token",
                id_field: "tokenizer.ggml.bos_token_id",
            });
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::MissingSpecialToken {
                flag: "tokenizer.ggml.add_eos_token",
                id_field: "tokenizer.ggml.eos_token_id",
            });
        }

        // Attribute fixes must precede the special-token matcher, which depends on them.
        let eog = vocab.finish_special(eos, &spec.eot_ids);
        let special = SpecialMatcher::new(&vocab);
        Ok(Tokenizer {
            vocab,
            model,
            special,
            bos,
            eos,
            unk,
            pad,
            eog,
            add_bos,
            add_eos,
        })
    }

    /// Tokenizes `text`. `add_special`: prepend BOS when the model adds one (and append EOS when
    /// it adds that). `parse_special`: let control-token texts such as "<start_of_turn>" in the
    /// text become their tokens; user-defined tokens are matched either way, as in llama.cpp.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let fragments = self.special.partition(&self.vocab, text, parse_special);
        self.encode_fragments(fragments, text.len(), add_special)
    }

    /// Tokenizes `text` reading special tokens in it, except inside the `protected` byte
    /// ranges (text a user wrote, placed by a chat template), whose text stays text: a
    /// user cannot forge the template's control tokens.
    pub fn encode_protected(
        &self,
        text: &str,
        add_special: bool,
        protected: &[std::ops::Range<usize>],
    ) -> Vec<u32> {
        let fragments = self
            .special
            .partition_protected(&self.vocab, text, protected);
        self.encode_fragments(fragments, text.len(), add_special)
    }

    fn encode_fragments(
        &self,
        fragments: Vec<Fragment>,
        len: usize,
        add_special: bool,
    ) -> Vec<u32> {
        let mut out = Vec::with_capacity(len / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        match &self.model {
            Model::Spm {
                byte_ids,
                add_space_prefix,
            } => {
                // The space prefix goes on the first text and on text right after a special
                // token, as llama.cpp does.
                let mut prev_special = true;
                let mut buf = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(t) => {
                            buf.clear();
                            if *add_space_prefix && prev_special {
                                buf.push(spm::SPACE_MARK);
                            }
                            buf.extend(
                                t.chars()
                                    .map(|c| if c == ' ' { spm::SPACE_MARK } else { c }),
                            );
                            spm::tokenize(&self.vocab, byte_ids, &buf, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Model::Bpe {
                merges,
                pre,
                alphabet,
            } => {
                let mut word = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(t) => {
                            for piece in pre.split(t) {
                                word.clear();
                                alphabet.encode(piece.as_bytes(), &mut word);
                                bpe::tokenize_word(
                                    &self.vocab,
                                    merges,
                                    &word,
                                    pre.ignore_merges,
                                    &mut out,
                                );
                            }
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Concatenates the pieces of `ids` (see [`Tokenizer::token_bytes`]); invalid UTF-8 becomes
    /// U+FFFD. No leading space is stripped, so streaming and whole decoding agree.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            self.append_piece(id, &mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes one token contributes to decoded text, as llama.cpp's `token_to_piece` with
    /// `special = false`: control, unknown and unused tokens give nothing, user-defined tokens
    /// their text, byte tokens their byte, normal tokens their text with '▁' as space (spm) or
    /// the GPT-2 byte alphabet undone (gpt2). Out-of-range ids give nothing.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let mut out = Vec::new();
        self.append_piece(id, &mut out);
        out
    }

    pub(crate) fn append_piece(&self, id: u32, out: &mut Vec<u8>) {
        let a = self.vocab.attr(id);
        if a & (attr::CONTROL | attr::UNKNOWN) != 0 {
            return;
        }
        let text = self.vocab.text(id);
        if a & attr::USER_DEFINED != 0 {
            out.extend_from_slice(text.as_bytes());
        } else if a & attr::NORMAL != 0 {
            match &self.model {
                Model::Spm { .. } => {
                    for ch in text.chars() {
                        let ch = if ch == spm::SPACE_MARK { ' ' } else { ch };
                        let mut buf = [0u8; 4];
                        out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                    }
                }
                Model::Bpe { alphabet, .. } => alphabet.decode(text, out),
            }
        } else if a & attr::BYTE != 0 {
            out.extend(vocab::parse_byte_token(text));
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// True for EOS, the spec's `eot_ids`, and the end-of-turn texts llama.cpp recognises
    /// (e.g. `<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Whether a token is a control token (after llama.cpp's by-text fixes); such tokens decode
    /// to nothing.
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab.attr(id) & attr::CONTROL != 0
    }

    /// The raw vocabulary string ("" for an out-of-range id).
    pub fn token_text(&self, id: u32) -> &str {
        self.vocab.text(id)
    }

    /// Exact vocabulary lookup of a raw token string.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }
}
