//! Pre-tokenizers for byte-level BPE: the regex sequence llama.cpp uses for each
//! `tokenizer.ggml.pre` value, and the split that applies them.
//!
//! llama.cpp applies its regexes in order; each one cuts every current piece into its matches
//! and the gaps between them (gaps are kept, not dropped). The patterns are llama.cpp's own
//! adaptations of the Hugging Face ones (e.g. case-insensitive contractions spelt out), since
//! those are the behaviour to match.

use fancy_regex::Regex;

use crate::TokenizerError;

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How llama.cpp treats one pre-tokenizer type.
struct PreConfig {
    patterns: &'static [&'static str],
    /// Whole words found in the vocabulary skip merging (Llama 3, Tekken).
    ignore_merges: bool,
    /// Default for `add_bos` when the file does not say.
    add_bos: bool,
}

fn config(pre: &str) -> Option<PreConfig> {
    let (patterns, ignore_merges, add_bos): (&'static [&'static str], bool, bool) = match pre {
        "default" => (
            &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
            false,
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => (&[LLAMA3], true, true),
        "dbrx" | "smaug-bpe" => (&[LLAMA3], false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan"
        | "solar-open" => (&[QWEN2], false, false),
        "qwen35" => (&[QWEN35], false, false),
        "gpt-2" | "gpt2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
        | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo"
        | "jais" | "trillion" | "granite-docling" => (&[GPT2], false, false),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => (&[r"\p{N}", GPT2], false, false),
        "falcon" => (
            &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
            false,
            false,
        ),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => (&[GPT4O], false, false),
        "tekken" => (&[TEKKEN], true, true),
        _ => return None,
    };
    Some(PreConfig {
        patterns,
        ignore_merges,
        add_bos,
    })
}

pub(crate) struct PreTokenizer {
    regexes: Vec<Regex>,
    pub ignore_merges: bool,
    pub default_add_bos: bool,
}

impl PreTokenizer {
    /// `None` means the file had no `tokenizer.ggml.pre`, which llama.cpp treats as "default".
    pub fn new(pre: Option<&str>) -> Result<PreTokenizer, TokenizerError> {
        let name = pre.unwrap_or("default");
        let cfg =
            config(name).ok_or_else(|| TokenizerError::UnknownPreTokenizer(name.to_string()))?;
        let regexes = cfg
            .patterns
            .iter()
            .map(|p| {
                Regex::new(p).map_err(|e| TokenizerError::Regex {
                    pre: name.to_string(),
                    message: e.to_string(),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(PreTokenizer {
            regexes,
            ignore_merges: cfg.ignore_merges,
            default_add_bos: cfg.add_bos,
        })
    }

    /// Splits `text` into words (contiguous, covering all of it).
    pub fn split<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut pieces = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                split_one(re, piece, &mut next);
            }
            pieces = next;
        }
        pieces.retain(|p| !p.is_empty());
        pieces
    }
}

fn split_one<'a>(re: &Regex, piece: &'a str, out: &mut Vec<&'a str>) {
    let mut last = 0;
    for m in re.find_iter(piece) {
        // A backtracking-limit error leaves the remainder as one piece rather than failing.
        let Ok(m) = m else { break };
        if m.start() > last {
            out.push(&piece[last..m.start()]);
        }
        if m.end() > m.start() {
            out.push(m.as_str());
        }
        last = m.end();
    }
    if last < piece.len() {
        out.push(&piece[last..]);
    }
}
