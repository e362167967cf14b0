//! GPT-2 byte-level BPE (GGUF model "gpt2"), reproducing llama.cpp's `llm_tokenizer_bpe`: each
//! pre-tokenized word is mapped into the GPT-2 byte alphabet, split into characters, and the
//! adjacent pair with the lowest merge rank merges first (leftmost on ties), via a priority queue.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::vocab::Vocab;
use crate::TokenizerError;

/// GPT-2's reversible byte→char table: printable Latin-1 bytes map to themselves and the rest to
/// U+0100.. in byte order, so every byte sequence becomes printable text without spaces.
pub(crate) struct ByteAlphabet {
    to_char: [char; 256],
    /// Indexed by code point (all mapped chars are below U+0144); -1 where not a mapped char.
    to_byte: [i16; 0x144],
}

impl ByteAlphabet {
    pub fn new() -> ByteAlphabet {
        let mut to_char = ['\0'; 256];
        let mut to_byte = [-1i16; 0x144];
        let mut extra = 0u32;
        for b in 0..=255u8 {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let cp = if printable {
                b as u32
            } else {
                extra += 1;
                255 + extra
            };
            // Every value here is below 0x144, so from_u32 cannot fail; keep a fallback anyway.
            let ch = char::from_u32(cp).unwrap_or('\0');
            to_char[b as usize] = ch;
            to_byte[cp as usize] = b as i16;
        }
        ByteAlphabet { to_char, to_byte }
    }

    pub fn encode(&self, bytes: &[u8], out: &mut String) {
        out.extend(bytes.iter().map(|&b| self.to_char[b as usize]));
    }

    /// Undoes the mapping. Characters outside the alphabet (rare: hand-added tokens) keep their
    /// own UTF-8 bytes; llama.cpp would print an "[UNK_BYTE_..]" marker there instead.
    pub fn decode(&self, text: &str, out: &mut Vec<u8>) {
        for ch in text.chars() {
            match self.to_byte.get(ch as usize) {
                Some(&b) if b >= 0 => out.push(b as u8),
                _ => {
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
    }
}

/// Merge ranks keyed by interned piece ids, so the hot loop hashes integers, not strings, and the
/// pair is exact even if a piece were to contain a space.
pub(crate) struct Merges {
    piece_ids: HashMap<Box<str>, u32>,
    ranks: HashMap<(u32, u32), u32>,
}

impl Merges {
    pub fn new(lines: &[String]) -> Result<Merges, TokenizerError> {
        let mut merges = Merges {
            piece_ids: HashMap::with_capacity(lines.len()),
            ranks: HashMap::with_capacity(lines.len()),
        };
        for (index, line) in lines.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte, so a merge whose left
            // piece is itself a space still parses.
            let split = line
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(i, _)| i);
            let (first, second) = match split {
                Some(i) if i + 1 < line.len() => (&line[..i], &line[i + 1..]),
                _ => {
                    return Err(TokenizerError::BadMerge {
                        index,
                        line: line.clone(),
                    })
                }
            };
            let a = merges.intern(first);
            let b = merges.intern(second);
            // The first occurrence wins, as with llama.cpp's map emplace.
            merges.ranks.entry((a, b)).or_insert(index as u32);
        }
        Ok(merges)
    }

    fn intern(&mut self, piece: &str) -> u32 {
        let next = self.piece_ids.len() as u32;
        *self.piece_ids.entry(piece.into()).or_insert(next)
    }

    fn piece(&self, text: &str) -> Option<u32> {
        self.piece_ids.get(text).copied()
    }

    fn rank(&self, left: Option<u32>, right: Option<u32>) -> Option<u32> {
        self.ranks.get(&(left?, right?)).copied()
    }
}

/// A queued merge of `left` with its successor `right`. Field order gives the derived ordering:
/// lowest rank first, then leftmost (reversed into a min-heap). The lengths recorded at queue
/// time detect pairs made stale by other merges, as symbols only grow.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Pair {
    rank: u32,
    left: usize,
    right: usize,
    left_len: usize,
    right_len: usize,
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    piece: Option<u32>,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Tokenizes one pre-tokenized word already mapped into the byte alphabet.
/// `ignore_merges`: take the whole word when it is a vocabulary token (Llama 3 style).
pub(crate) fn tokenize_word(
    vocab: &Vocab,
    merges: &Merges,
    word: &str,
    ignore_merges: bool,
    out: &mut Vec<u32>,
) {
    if word.is_empty() {
        return;
    }
    if ignore_merges {
        if let Some(id) = vocab.id(word) {
            out.push(id);
            return;
        }
    }
    let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
    for (i, (start, ch)) in word.char_indices().enumerate() {
        let len = ch.len_utf8();
        symbols.push(Symbol {
            start,
            len,
            piece: merges.piece(&word[start..start + len]),
            prev: i.checked_sub(1),
            next: None,
        });
        if i > 0 {
            symbols[i - 1].next = Some(i);
        }
    }

    let mut queue: BinaryHeap<Reverse<Pair>> = BinaryHeap::new();
    let try_add = |queue: &mut BinaryHeap<_>, symbols: &[Symbol], left: usize| {
        let Some(right) = symbols[left].next else {
            return;
        };
        let (l, r) = (symbols[left], symbols[right]);
        if let Some(rank) = merges.rank(l.piece, r.piece) {
            queue.push(Reverse(Pair {
                rank,
                left,
                right,
                left_len: l.len,
                right_len: r.len,
            }));
        }
    };
    for i in 0..symbols.len() {
        try_add(&mut queue, &symbols, i);
    }
    while let Some(Reverse(pair)) = queue.pop() {
        let (left, right) = (pair.left, pair.right);
        let (l, r) = (symbols[left], symbols[right]);
        if l.len != pair.left_len || r.len != pair.right_len || l.next != Some(right) {
            continue;
        }
        let len = l.len + r.len;
        symbols[left].len = len;
        symbols[left].piece = merges.piece(&word[l.start..l.start + len]);
        symbols[left].next = r.next;
        symbols[right].len = 0;
        if let Some(n) = r.next {
            symbols[n].prev = Some(left);
        }
        if let Some(p) = l.prev {
            try_add(&mut queue, &symbols, p);
        }
        try_add(&mut queue, &symbols, left);
    }

    let mut cur = Some(0);
    while let Some(i) = cur {
        let sym = symbols[i];
        let piece = &word[sym.start..sym.start + sym.len];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            // As llama.cpp: try each byte of the mapped text as a one-byte token, dropping the
            // rest (only ASCII bytes can form such a token).
            None => {
                let mut buf = [0u8; 4];
                for b in piece.bytes().filter(u8::is_ascii) {
                    let s: &str = (b as char).encode_utf8(&mut buf);
                    out.extend(vocab.id(s));
                }
            }
        }
        cur = sym.next;
    }
}
