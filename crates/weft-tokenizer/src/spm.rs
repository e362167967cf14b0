//! SentencePiece-style BPE over a scored vocabulary (GGUF model "llama"), reproducing llama.cpp's
//! `llm_tokenizer_spm`: characters start as symbols and the adjacent pair whose concatenation is
//! the highest-scoring vocabulary token merges first (leftmost on ties), driven by a priority
//! queue so a text of n characters costs O(n log n).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::vocab::Vocab;

/// U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's stand-in for a space.
pub(crate) const SPACE_MARK: char = '\u{2581}';

/// One symbol of the linked list being merged: a byte range of the text.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of symbols `left` and `left`'s successor.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Combined byte length when queued: symbols only grow, so a mismatch means it is stale.
    len: usize,
}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        // Max-heap: higher score first, then the leftmost pair.
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}

/// Tokenizes `text`, whose spaces are already escaped to U+2581, appending ids to `out`.
/// `byte_ids` maps each byte to its fallback token for symbols missing from the vocabulary.
pub(crate) fn tokenize(
    vocab: &Vocab,
    byte_ids: &[Option<u32>; 256],
    text: &str,
    out: &mut Vec<u32>,
) {
    if text.is_empty() {
        return;
    }
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (i, (start, ch)) in text.char_indices().enumerate() {
        symbols.push(Symbol {
            start,
            len: ch.len_utf8(),
            prev: i.checked_sub(1),
            next: None,
        });
        if i > 0 {
            symbols[i - 1].next = Some(i);
        }
    }

    let mut queue = BinaryHeap::with_capacity(symbols.len());
    let try_add = |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: usize| {
        let Some(right) = symbols[left].next else {
            return;
        };
        let (l, r) = (symbols[left], symbols[right]);
        let piece = &text[l.start..r.start + r.len];
        if let Some(id) = vocab.id(piece) {
            queue.push(Bigram {
                score: vocab.scores[id as usize],
                left,
                right,
                len: piece.len(),
            });
        }
    };
    for i in 0..symbols.len() {
        try_add(&mut queue, &symbols, i);
    }

    while let Some(bigram) = queue.pop() {
        let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != bigram.len {
            continue;
        }
        symbols[bigram.left].len += r.len;
        symbols[bigram.right].len = 0;
        symbols[bigram.left].next = r.next;
        if let Some(n) = r.next {
            symbols[n].prev = Some(bigram.left);
        }
        if let Some(p) = l.prev {
            try_add(&mut queue, &symbols, p);
        }
        try_add(&mut queue, &symbols, bigram.left);
    }

    let mut cur = Some(0);
    while let Some(i) = cur {
        let sym = symbols[i];
        let piece = &text[sym.start..sym.start + sym.len];
        // Every merged symbol is a vocabulary token by construction, so only single characters
        // can miss; llama.cpp's re-segmentation through recorded merges never triggers for them
        // and they go straight to byte fallback.
        match vocab.id(piece) {
            Some(id) => out.push(id),
            None => out.extend(piece.bytes().filter_map(|b| byte_ids[b as usize])),
        }
        cur = sym.next;
    }
}
