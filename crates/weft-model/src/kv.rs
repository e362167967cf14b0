//! The KV cache of one sequence: allocated once, a ring buffer on sliding-window layers.
//! GQA layers keep keys and values per KV head; MLA layers keep one latent row and one
//! RoPE key per token, and no values. Values are kept as f32 or f16 (`CacheType`).

use half::f16;

/// How cached keys and values are stored: f32 (exact), or f16 (half the memory and half
/// the bytes attention reads at long context; rounded once when written, as llama.cpp's
/// default `-ctk f16 -ctv f16` cache is).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheType {
    #[default]
    F32,
    F16,
}

impl CacheType {
    pub fn bytes(self) -> usize {
        match self {
            CacheType::F32 => 4,
            CacheType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
        }
    }
}

impl std::str::FromStr for CacheType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(CacheType::F32),
            "f16" => Ok(CacheType::F16),
            _ => Err(format!("cache type {s:?}: the known ones are f32 and f16")),
        }
    }
}

/// One buffer of cached rows in the cache's type.
pub enum CacheRows {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl CacheRows {
    fn zeroed(ty: CacheType, len: usize) -> Self {
        match ty {
            CacheType::F32 => CacheRows::F32(vec![0.0; len]),
            CacheType::F16 => CacheRows::F16(vec![f16::ZERO; len]),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            CacheRows::F32(v) => v.len(),
            CacheRows::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        match self {
            CacheRows::F32(v) => v.len() * 4,
            CacheRows::F16(v) => v.len() * 2,
        }
    }

    /// Stores `src` from value `at` on, rounded to the cache's type.
    pub fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            CacheRows::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            // half's slice conversion uses F16C where the CPU has it: round to nearest
            // even, as llama.cpp's cache stores.
            CacheRows::F16(v) => {
                half::slice::HalfFloatSliceExt::convert_from_f32_slice(
                    &mut v[at..at + src.len()],
                    src,
                );
            }
        }
    }

    /// Value `i`, widened to f32.
    pub fn get(&self, i: usize) -> f32 {
        match self {
            CacheRows::F32(v) => v[i],
            CacheRows::F16(v) => v[i].to_f32(),
        }
    }

    /// Touches one value per 4 KiB page so the kernel maps the whole buffer now.
    pub fn prefault(&mut self) {
        fn touch<T: Copy>(buf: &mut [T], zero: T) {
            let step = (4096 / std::mem::size_of::<T>()).max(1);
            for i in (0..buf.len()).step_by(step) {
                // SAFETY: i < buf.len(); volatile so the store to calloc'd zeros is not
                // elided.
                unsafe { std::ptr::write_volatile(buf.as_mut_ptr().add(i), zero) };
            }
        }
        match self {
            CacheRows::F32(v) => touch(v, 0.0),
            CacheRows::F16(v) => touch(v, f16::ZERO),
        }
    }
}

/// Keys and values of one layer for this shard's KV heads, slot-major:
/// slot `s` holds `[kv_head][head_dim]` for the position stored there (MLA: the latent
/// then the RoPE key, and `v` is empty).
pub struct LayerKv {
    /// Slots in the ring: the window plus one micro-batch for sliding layers, else n_ctx.
    pub cap: usize,
    pub k: CacheRows,
    pub v: CacheRows,
    /// Values per slot of `k` (local KV heads x head_dim; MLA: latent + RoPE key).
    pub stride: usize,
    /// Values per slot of `v`; 0 where values are read from the keys (MLA).
    pub v_stride: usize,
}

impl LayerKv {
    pub fn slot(&self, pos: usize) -> usize {
        pos % self.cap
    }

    /// The buffer values are read from and its values per slot.
    pub fn values(&self) -> (&CacheRows, usize) {
        if self.v_stride == 0 {
            (&self.k, self.stride)
        } else {
            (&self.v, self.v_stride)
        }
    }
}

/// Values per slot of a layer's cache: keys, and values (0: read from the keys).
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
    pub fn new(
        windows: &[Option<usize>],
        widths: SlotWidths,
        n_ctx: usize,
        ubatch: usize,
        ty: CacheType,
    ) -> Self {
        let layers = windows
            .iter()
            .map(|w| {
                let cap = match w {
                    Some(w) => (w + ubatch).min(n_ctx),
                    None => n_ctx,
                };
                LayerKv {
                    cap,
                    k: CacheRows::zeroed(ty, cap * widths.k),
                    v: CacheRows::zeroed(ty, cap * widths.v),
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
        ty: CacheType,
    ) -> usize {
        windows
            .iter()
            .map(|w| {
                let cap = w.map_or(n_ctx, |w| (w + ubatch).min(n_ctx));
                cap * (widths.k + widths.v) * ty.bytes()
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
        self.layers.iter().map(|l| l.k.bytes() + l.v.bytes()).sum()
    }
}
