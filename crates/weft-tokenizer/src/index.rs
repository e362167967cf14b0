//! A text→id index over the vocabulary's own strings: open addressing on token ids, so the
//! 262,144-token Gemma vocabulary is indexed without copying a single string.

/// Slot value for "empty".
const EMPTY: u32 = u32::MAX;

pub(crate) struct TextIndex {
    slots: Vec<u32>,
    /// log2 of the slot count, for Fibonacci hashing (top bits of the hash pick the slot).
    bits: u32,
}

/// A fast non-cryptographic hash (FxHash-style over 8-byte words); token texts are not
/// attacker-chosen keys in a long-lived shared table, so DoS resistance buys nothing here.
fn hash(text: &str) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let bytes = text.as_bytes();
    let mut h = bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = (h.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        h = (h.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
    }
    // Final avalanche so the top bits depend on every input bit.
    h ^= h >> 29;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^ (h >> 32)
}

impl TextIndex {
    /// Indexes `texts`; on a duplicate returns `Err((first_id, second_id))`.
    pub fn new(texts: &[String]) -> Result<TextIndex, (u32, u32)> {
        // Load factor at most 1/2 keeps linear probes short.
        let bits = (texts.len().max(1) * 2)
            .next_power_of_two()
            .trailing_zeros()
            .max(4);
        let mut index = TextIndex {
            slots: vec![EMPTY; 1 << bits],
            bits,
        };
        for (id, text) in texts.iter().enumerate() {
            let id = id as u32;
            let mask = index.slots.len() - 1;
            let mut slot = index.home(text);
            loop {
                match index.slots[slot] {
                    EMPTY => {
                        index.slots[slot] = id;
                        break;
                    }
                    other if texts[other as usize] == *text => return Err((other, id)),
                    _ => slot = (slot + 1) & mask,
                }
            }
        }
        Ok(index)
    }

    fn home(&self, text: &str) -> usize {
        (hash(text) >> (64 - self.bits)) as usize
    }

    pub fn get(&self, texts: &[String], text: &str) -> Option<u32> {
        let mask = self.slots.len() - 1;
        let mut slot = self.home(text);
        loop {
            match self.slots[slot] {
                EMPTY => return None,
                id if texts.get(id as usize).is_some_and(|t| t == text) => return Some(id),
                _ => slot = (slot + 1) & mask,
            }
        }
    }
}
