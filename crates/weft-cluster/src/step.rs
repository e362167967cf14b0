//! The data-plane step protocol between the coordinator (rank 0) and the nodes: a fixed
//! header, the token ids, and each last-stage rank's top-k reply. Little-endian words.

pub const KIND_RUN: u32 = 1;
pub const KIND_STOP: u32 = 2;
/// A batched step: `pos0` holds the number of spans, which follow the header as
/// `(slot, tokens, flags)` words before the token ids.
pub const KIND_BATCH: u32 = 3;
/// Span flags of a batched step.
pub const SPAN_LOGITS: u32 = 1;
pub const SPAN_RESET: u32 = 2;
pub const SPAN_BYTES: usize = 12;
pub const HEADER_BYTES: usize = 24;
/// Per-node statistics sent after a stop: compute, comm and idle seconds, steps, syncs,
/// peak RSS bytes.
pub const STATS_BYTES: usize = 48;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepHeader {
    pub kind: u32,
    pub n_tokens: u32,
    /// Position of the first token; 0 starts a new sequence.
    pub pos0: u32,
    /// Whether the last token's logits are wanted.
    pub want_logits: u32,
    pub top_k: u32,
    /// Whether replies carry the slice's log-sum-exp (only logprobs need it; it costs an
    /// exp per vocabulary entry).
    pub want_norm: u32,
}

impl StepHeader {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        for (i, w) in [
            self.kind,
            self.n_tokens,
            self.pos0,
            self.want_logits,
            self.top_k,
            self.want_norm,
        ]
        .iter()
        .enumerate()
        {
            b[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Self, String> {
        let w = |i: usize| u32::from_le_bytes([b[i * 4], b[i * 4 + 1], b[i * 4 + 2], b[i * 4 + 3]]);
        let h = StepHeader {
            kind: w(0),
            n_tokens: w(1),
            pos0: w(2),
            want_logits: w(3),
            top_k: w(4),
            want_norm: w(5),
        };
        if ![KIND_RUN, KIND_STOP, KIND_BATCH].contains(&h.kind) {
            return Err(format!("unknown step kind {}", h.kind));
        }
        Ok(h)
    }
}

/// Bytes of a top-k reply: k (id, logit) pairs and the slice's log-sum-exp.
pub fn reply_bytes(k: usize) -> usize {
    k * 8 + 4
}

/// The best `k` of a vocabulary slice starting at `base`, best first (ties: lower id),
/// encoded with the slice's log-sum-exp when `norm` (else 0). One pass keeps a sorted
/// candidate list and skips anything below its smallest entry. `best` is scratch.
pub fn encode_top_k(
    logits: &[f32],
    base: usize,
    k: usize,
    norm: bool,
    best: &mut Vec<(f32, u32)>,
    out: &mut Vec<u8>,
) {
    weft_model::sampler::top_k_into(logits, k, best);
    out.clear();
    for &(v, i) in best.iter() {
        out.extend_from_slice(&((base + i as usize) as u32).to_le_bytes());
        out.extend_from_slice(&v.to_le_bytes());
    }
    let lse = if norm {
        weft_model::sampler::log_sum_exp(logits)
    } else {
        0.0
    };
    out.extend_from_slice(&lse.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = StepHeader {
            kind: KIND_RUN,
            n_tokens: 7,
            pos0: 12,
            want_logits: 1,
            top_k: 64,
            want_norm: 1,
        };
        assert_eq!(StepHeader::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = 9;
        assert!(StepHeader::decode(&bad).is_err());
    }

    #[test]
    fn top_k_is_best_first_with_global_ids() {
        let logits = [0.5f32, 3.0, -1.0, 3.0, 2.0];
        let (mut best, mut out) = (Vec::new(), Vec::new());
        encode_top_k(&logits, 100, 3, true, &mut best, &mut out);
        assert_eq!(out.len(), reply_bytes(3));
        let ids: Vec<u32> = out[..24]
            .chunks(8)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(ids, vec![101, 103, 104]);
    }
}
