//! The KV cache of one sequence: allocated once, a ring buffer on sliding-window layers.
//! GQA layers keep keys and values per KV head; MLA layers keep one latent row and one
//! RoPE key per token, and no values.

/// Keys and values of one layer for this shard's KV heads, slot-major:
/// slot `s` holds `[kv_head][head_dim]` for the position stored there (MLA: the latent
/// then the RoPE key, and `v` is empty).
pub struct LayerKv {
    /// Slots in the ring: the window plus one micro-batch for sliding layers, else n_ctx.
    pub cap: usize,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Floats per slot of `k` (local KV heads x head_dim; MLA: latent + RoPE key).
    pub stride: usize,
    /// Floats per slot of `v`; 0 where values are read from the keys (MLA).
    pub v_stride: usize,
}

impl LayerKv {
    pub fn slot(&self, pos: usize) -> usize {
        pos % self.cap
    }

    /// The buffer values are read from and its floats per slot.
    pub fn values(&self) -> (&[f32], usize) {
        if self.v_stride == 0 {
            (&self.k, self.stride)
        } else {
            (&self.v, self.v_stride)
        }
    }
}

/// Floats per slot of a layer's cache: keys, and values (0: read from the keys).
#[derive(Clone, Copy, Debug)]
pub struct SlotWidths {
    pub k: usize,
    pub v: usize,
}

/// One sequence's cache over this shard's layers.
pub struct KvCache {
    pub layers: Vec<LayerKv>,
    /// Tokens already in the cache (the next token's position).
    pub pos: usize,
    pub n_ctx: usize,
}

impl KvCache {
    /// `windows[i]` is layer i's sliding window (None: global). `ubatch` is the largest
    /// number of tokens written in one forward call.
    pub fn new(windows: &[Option<usize>], widths: SlotWidths, n_ctx: usize, ubatch: usize) -> Self {
        let layers = windows
            .iter()
            .map(|w| {
                let cap = match w {
                    Some(w) => (w + ubatch).min(n_ctx),
                    None => n_ctx,
                };
                LayerKv {
                    cap,
                    k: vec![0.0; cap * widths.k],
                    v: vec![0.0; cap * widths.v],
                    stride: widths.k,
                    v_stride: widths.v,
                }
            })
            .collect();
        KvCache {
            layers,
            pos: 0,
            n_ctx,
        }
    }

    /// What `new` with these arguments allocates, in bytes, without allocating it.
    pub fn planned_bytes(
        windows: &[Option<usize>],
        widths: SlotWidths,
        n_ctx: usize,
        ubatch: usize,
    ) -> usize {
        windows
            .iter()
            .map(|w| {
                let cap = w.map_or(n_ctx, |w| (w + ubatch).min(n_ctx));
                cap * (widths.k + widths.v) * 4
            })
            .sum()
    }

    /// Forgets the sequence (the memory stays allocated for the next one).
    pub fn clear(&mut self) {
        self.pos = 0;
    }

    /// Drops tokens after `pos` (e.g. to reuse a shared prompt prefix).
    pub fn truncate(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
    }

    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| (l.k.len() + l.v.len()) * 4)
            .sum()
    }
}
