//! The vocabulary: token texts, scores, llama.cpp-style attributes, the text→id map and the
//! end-of-generation set, all validated and built once from the spec.

use crate::index::TextIndex;
use crate::TokenizerError;

/// Token attribute bits, the same set llama.cpp derives from `tokenizer.ggml.token_type`.
/// Bits rather than an enum because llama.cpp ORs CONTROL onto tokens it recognises by text.
pub(crate) mod attr {
    pub const UNKNOWN: u8 = 1 << 0;
    pub const UNUSED: u8 = 1 << 1;
    pub const NORMAL: u8 = 1 << 2;
    pub const CONTROL: u8 = 1 << 3;
    pub const USER_DEFINED: u8 = 1 << 4;
    pub const BYTE: u8 = 1 << 5;
}

/// Token texts that llama.cpp treats as end-of-generation whatever their declared type; each is
/// also forced to CONTROL there (so it decodes to nothing and needs parse_special to be matched).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle token texts by role; llama.cpp forces the first found of each to CONTROL,
/// and the last three roles (pad, repo, file separator) also end generation.
const FIM_TEXTS: &[(&[&str], bool)] = &[
    (
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
        false,
    ),
    (
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
        false,
    ),
    (
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
        false,
    ),
    (
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
        true,
    ),
    (
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
        true,
    ),
    (&["<|file_sep|>"], true),
];

/// gpt-oss structural tokens that llama.cpp always renders (forced to USER_DEFINED).
const ALWAYS_RENDERED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

pub(crate) struct Vocab {
    pub texts: Vec<String>,
    pub scores: Vec<f32>,
    pub attrs: Vec<u8>,
    index: TextIndex,
}

impl Vocab {
    /// Validates lengths and uniqueness and derives attributes exactly as llama.cpp's loader.
    pub fn new(
        mut texts: Vec<String>,
        scores: Option<Vec<f32>>,
        token_types: Option<Vec<i32>>,
    ) -> Result<Vocab, TokenizerError> {
        let n = texts.len();
        if n == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::LengthMismatch {
                field: "tokenizer.ggml.tokens",
                expected: u32::MAX as usize,
                found: n,
            });
        }
        let scores = match scores {
            Some(s) if s.len() != n => {
                return Err(TokenizerError::LengthMismatch {
                    field: "tokenizer.ggml.scores",
                    expected: n,
                    found: s.len(),
                })
            }
            // -0.0 and +0.0 compare equal in llama.cpp's queue; normalise so a total order agrees.
            Some(s) => s
                .into_iter()
                .map(|x| if x == 0.0 { 0.0 } else { x })
                .collect(),
            None => vec![0.0; n],
        };
        let attrs = match token_types {
            Some(t) if t.len() != n => {
                return Err(TokenizerError::LengthMismatch {
                    field: "tokenizer.ggml.token_type",
                    expected: n,
                    found: t.len(),
                })
            }
            Some(t) => t.into_iter().map(attr_from_type).collect(),
            None => vec![attr::NORMAL; n],
        };

        for (i, text) in texts.iter_mut().enumerate() {
            // llama.cpp renames empty tokens so they can never match (an empty special token
            // would otherwise split text at every position).
            if text.is_empty() {
                *text = format!("[EMPTY_{i}]");
            }
        }
        let index =
            TextIndex::new(&texts).map_err(|(first, second)| TokenizerError::DuplicateToken {
                text: texts[second as usize].clone(),
                first,
                second,
            })?;
        Ok(Vocab {
            texts,
            scores,
            attrs,
            index,
        })
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn id(&self, text: &str) -> Option<u32> {
        self.index.get(&self.texts, text)
    }

    pub fn attr(&self, id: u32) -> u8 {
        self.attrs.get(id as usize).copied().unwrap_or(0)
    }

    pub fn text(&self, id: u32) -> &str {
        self.texts.get(id as usize).map_or("", String::as_str)
    }

    /// Applies llama.cpp's by-text attribute fixes and returns the sorted end-of-generation set,
    /// which also holds `eos` and the caller's extra `eot_ids`.
    pub fn finish_special(&mut self, eos: Option<u32>, eot_ids: &[u32]) -> Vec<u32> {
        let mut eog = Vec::new();
        for (texts, ends_generation) in FIM_TEXTS {
            // The lowest id wins where several texts of one role exist (llama.cpp's pick is
            // hash-order dependent; lowest id is at least deterministic).
            let found = texts.iter().filter_map(|t| self.id(t)).min();
            if let Some(id) = found {
                self.attrs[id as usize] |= attr::CONTROL;
                if *ends_generation {
                    eog.push(id);
                }
            }
        }
        for text in EOG_TEXTS {
            if let Some(id) = self.id(text) {
                self.attrs[id as usize] |= attr::CONTROL;
                eog.push(id);
            }
        }
        for text in ALWAYS_RENDERED {
            if let Some(id) = self.id(text) {
                self.attrs[id as usize] = attr::USER_DEFINED;
            }
        }
        eog.extend(eos);
        eog.extend_from_slice(eot_ids);
        eog.sort_unstable();
        eog.dedup();

        let in_eog = |t: &str| self.id(t).filter(|id| eog.binary_search(id).is_ok());
        let call = in_eog("<|call|>").or(in_eog("<|calls|>")).is_some();
        let end = in_eog("<|end|>");
        // o200k_harmony / solar-open: "<|end|>" separates messages there and must not stop.
        let drop_end = call && (in_eog("<|return|>").is_some() || in_eog("<|flush|>").is_some());
        // Gemma 4 / PaddleOCR: "</s>" is ordinary text where "<|tool_response>" exists.
        let slash_s = in_eog("</s>").filter(|_| in_eog("<|tool_response>").is_some());
        if let Some(id) = end.filter(|_| drop_end) {
            eog.retain(|&e| e != id);
            self.attrs[id as usize] = attr::USER_DEFINED;
        }
        if let Some(id) = slash_s {
            eog.retain(|&e| e != id);
            self.attrs[id as usize] = attr::NORMAL;
        }
        eog
    }
}

/// llama.cpp's mapping from GGUF token type to attribute; unknown codes become "undefined" (0),
/// which decodes to nothing.
fn attr_from_type(t: i32) -> u8 {
    match t {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        _ => 0,
    }
}

/// Parses a SentencePiece byte token text "<0xAB>".
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
