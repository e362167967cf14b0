//! Splitting special-token texts (control, user-defined, unknown) out of raw text before the
//! model's tokenizer sees it, reproducing llama.cpp's `tokenizer_st_partition`.
//!
//! llama.cpp takes each special token in turn, longest text first, and cuts every remaining text
//! fragment at each leftmost non-overlapping occurrence. Doing that for all ~6,400 special tokens
//! of Gemma would cost O(tokens × text); instead a byte trie finds, in one pass, which special
//! tokens occur in the text at all, and only those run the llama.cpp procedure. Fragments are
//! substrings of the text, so a token absent from the text can never split a fragment: the result
//! is identical.

use std::ops::Range;

use crate::vocab::{attr, Vocab};

/// One piece of the partitioned input: raw text still to tokenize, or a special token's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

struct Node {
    /// (byte, child node index); few children per node, so a linear scan beats a map.
    children: Vec<(u8, u32)>,
    token: Option<u32>,
}

pub(crate) struct SpecialMatcher {
    nodes: Vec<Node>,
    /// Priority of each special token (index into llama.cpp's sorted cache), by token id.
    rank: std::collections::HashMap<u32, u32>,
}

const SPECIAL: u8 = attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN;
/// Attributes that only match when the caller asks for special-token parsing.
const PARSE_ONLY: u8 = attr::CONTROL | attr::UNKNOWN;

impl SpecialMatcher {
    pub fn new(vocab: &Vocab) -> SpecialMatcher {
        let mut order: Vec<u32> = (0..vocab.len() as u32)
            .filter(|&id| vocab.attr(id) & SPECIAL != 0)
            .collect();
        // llama.cpp sorts by length only with an unstable sort; ties by id keep us deterministic.
        order.sort_by(|&a, &b| {
            let (la, lb) = (vocab.text(a).len(), vocab.text(b).len());
            lb.cmp(&la).then(a.cmp(&b))
        });
        let mut matcher = SpecialMatcher {
            nodes: vec![Node {
                children: Vec::new(),
                token: None,
            }],
            rank: order
                .iter()
                .enumerate()
                .map(|(r, &id)| (id, r as u32))
                .collect(),
        };
        for &id in &order {
            matcher.insert(vocab.text(id).as_bytes(), id);
        }
        matcher
    }

    fn insert(&mut self, key: &[u8], id: u32) {
        let mut node = 0usize;
        for &b in key {
            let found = self.nodes[node]
                .children
                .iter()
                .find(|&&(c, _)| c == b)
                .map(|&(_, n)| n as usize);
            node = match found {
                Some(n) => n,
                None => {
                    let n = self.nodes.len();
                    self.nodes.push(Node {
                        children: Vec::new(),
                        token: None,
                    });
                    self.nodes[node].children.push((b, n as u32));
                    n
                }
            };
        }
        // Texts are unique, so no two ids land on one node.
        self.nodes[node].token = Some(id);
    }

    fn child(&self, node: usize, b: u8) -> Option<usize> {
        self.nodes[node]
            .children
            .iter()
            .find(|&&(c, _)| c == b)
            .map(|&(_, n)| n as usize)
    }

    /// Special tokens occurring anywhere in `text`, in llama.cpp's processing order.
    fn candidates(&self, vocab: &Vocab, text: &str, parse_special: bool) -> Vec<u32> {
        let bytes = text.as_bytes();
        let mut found = Vec::new();
        for start in 0..bytes.len() {
            let mut node = 0usize;
            for &b in &bytes[start..] {
                match self.child(node, b) {
                    Some(n) => node = n,
                    None => break,
                }
                if let Some(id) = self.nodes[node].token {
                    if parse_special || vocab.attr(id) & PARSE_ONLY == 0 {
                        found.push(id);
                    }
                }
            }
        }
        found.sort_unstable_by_key(|id| self.rank.get(id).copied().unwrap_or(u32::MAX));
        found.dedup();
        found
    }

    /// Partitions `text` as `partition` does with special-token parsing, except that no
    /// special token is read inside (or across the edge of) the `protected` byte ranges:
    /// their text stays text, joined with the text around it.
    pub fn partition_protected<'a>(
        &self,
        vocab: &Vocab,
        text: &'a str,
        protected: &[Range<usize>],
    ) -> Vec<Fragment<'a>> {
        // Byte ranges of text, each searchable or not, and tokens between them.
        enum Part {
            Text(Range<usize>, bool),
            Token(u32),
        }
        let mut parts = Vec::new();
        let mut at = 0;
        let mut sorted: Vec<Range<usize>> = protected
            .iter()
            .filter(|r| {
                r.start < r.end
                    && r.end <= text.len()
                    && text.is_char_boundary(r.start)
                    && text.is_char_boundary(r.end)
            })
            .cloned()
            .collect();
        sorted.sort_by_key(|r| r.start);
        for r in sorted {
            let start = r.start.max(at);
            if start > at {
                parts.push(Part::Text(at..start, true));
            }
            if r.end > start {
                parts.push(Part::Text(start..r.end, false));
            }
            at = at.max(r.end);
        }
        if at < text.len() {
            parts.push(Part::Text(at..text.len(), true));
        }
        for id in self.candidates(vocab, text, true) {
            let needle = vocab.text(id);
            // Protected text reads only what text without special parsing reads
            // (user-defined tokens), never a control token.
            let anywhere = vocab.attr(id) & PARSE_ONLY == 0;
            let mut next = Vec::with_capacity(parts.len() + 2);
            for part in parts {
                let Part::Text(mut rest, searchable) = part else {
                    next.push(part);
                    continue;
                };
                if !(searchable || anywhere) {
                    next.push(Part::Text(rest, searchable));
                    continue;
                }
                while let Some(pos) = text[rest.clone()].find(needle) {
                    if pos > 0 {
                        next.push(Part::Text(rest.start..rest.start + pos, searchable));
                    }
                    next.push(Part::Token(id));
                    rest.start += pos + needle.len();
                }
                if !rest.is_empty() {
                    next.push(Part::Text(rest, searchable));
                }
            }
            parts = next;
        }
        // Neighbouring text ranges join, as the one text they were.
        let mut out: Vec<Fragment<'a>> = Vec::with_capacity(parts.len());
        let mut open: Option<Range<usize>> = None;
        for part in parts {
            match part {
                Part::Text(r, _) => {
                    open = Some(match open {
                        Some(o) if o.end == r.start => o.start..r.end,
                        Some(o) => {
                            out.push(Fragment::Text(&text[o]));
                            r
                        }
                        None => r,
                    })
                }
                Part::Token(id) => {
                    if let Some(o) = open.take() {
                        out.push(Fragment::Text(&text[o]));
                    }
                    out.push(Fragment::Token(id));
                }
            }
        }
        if let Some(o) = open {
            out.push(Fragment::Text(&text[o]));
        }
        out
    }

    /// Partitions `text` into raw-text fragments and special tokens.
    pub fn partition<'a>(
        &self,
        vocab: &Vocab,
        text: &'a str,
        parse_special: bool,
    ) -> Vec<Fragment<'a>> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(text)];
        for id in self.candidates(vocab, text, parse_special) {
            let needle = vocab.text(id);
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(pos) = rest.find(needle) {
                    if pos > 0 {
                        next.push(Fragment::Text(&rest[..pos]));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[pos + needle.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }
}
