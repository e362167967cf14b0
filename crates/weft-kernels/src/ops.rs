//! Element-wise and per-row operations of transformer layers: RMS norm, RoPE, softmax,
//! activations. Each works in place on caller-owned buffers (no allocation).

/// out = x / sqrt(mean(x²) + eps) · w.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let inv = (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32;
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

/// In-place RMS norm.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let inv = (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32;
    for (v, &g) in x.iter_mut().zip(w) {
        *v *= inv * g;
    }
}

/// How RoPE pairs dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): llama's GGUF layout.
    Normal,
    /// Pairs (i, i + n_rot/2): GPT-NeoX, Gemma, Qwen.
    Neox,
}

/// YaRN's blend of interpolated and extrapolated frequencies (as ggml's `rope_yarn` with
/// ext_factor 1): pairs rotating faster than `beta_fast` turns over the original context
/// keep their frequency, those slower than `beta_slow` turns are interpolated, and a
/// linear ramp blends the pairs between.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnRamp {
    /// The context the model was trained at before scaling.
    pub n_ctx_orig: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// Precomputed inverse frequencies for one RoPE base.
#[derive(Clone, Debug)]
pub struct Rope {
    pub style: RopeStyle,
    pub n_rot: usize,
    inv_freq: Vec<f64>,
    /// Magnitude of the sines and cosines (YaRN's and `rope.scaling.attn_factor`'s scale).
    mscale: f32,
    /// Names these frequencies in the per-thread angle cache (a clone shares them).
    id: u64,
    /// The angles of the first positions, shared by clones and threads.
    table: std::sync::Arc<AngleTable>,
}

/// Ropes' angles that a thread keeps for positions past the shared table: every layer of
/// a token rotates its queries and keys at the same position, so a token's sines and
/// cosines (f64, a few dozen ns each) are computed once per rope, not twice per layer.
const CACHED_ANGLES: usize = 4;

/// Positions a block of a rope's shared angle table holds, and the blocks it may hold:
/// the first 8,192 positions. A prompt's rows pass through every layer, so a few-entry
/// cache computed each row's angles twice a layer (Gemma 3 270M, 512 tokens: 2-3 % of
/// the prefill in `sincos`); a block is computed once, at its first position's first
/// use, and kept for the rope's life (Gemma 3's 128 pairs: 256 KiB a block).
const TABLE_BLOCK: usize = 256;
const TABLE_BLOCKS: usize = 32;

/// One block of a rope's angle table: `TABLE_BLOCK` positions, each its pairs' scaled
/// sines and cosines in turn; made at the first use of one of its positions.
type AngleBlock = std::sync::OnceLock<Box<[(f32, f32)]>>;

/// A rope's angle table: block k holds positions `k * TABLE_BLOCK..`.
struct AngleTable([AngleBlock; TABLE_BLOCKS]);

impl std::fmt::Debug for AngleTable {
    /// The blocks made, not their angles (a rope's debug line stays a line).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let made = self.0.iter().filter(|b| b.get().is_some()).count();
        write!(f, "AngleTable({made} of {TABLE_BLOCKS} blocks)")
    }
}

/// (rope id, position, the scaled sine and cosine of each pair), most recent first.
type Angles = Vec<(u64, usize, Vec<(f32, f32)>)>;

thread_local! {
    static ANGLES: std::cell::RefCell<Angles> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Rope {
    pub fn new(style: RopeStyle, n_rot: usize, base: f32, freq_scale: f32) -> Self {
        Self::scaled(style, n_rot, base, freq_scale, None, 1.0)
    }

    /// RoPE with its frequencies scaled by `freq_scale`, through YaRN's ramp where
    /// `yarn` is given, and its sines and cosines multiplied by `mscale`.
    pub fn scaled(
        style: RopeStyle,
        n_rot: usize,
        base: f32,
        freq_scale: f32,
        yarn: Option<YarnRamp>,
        mscale: f32,
    ) -> Self {
        let base = base as f64;
        let fs = freq_scale as f64;
        // The pair index where a pair turns `beta` times over the original context.
        let corr = |n_ctx: usize, beta: f32| {
            n_rot as f64 * (n_ctx as f64 / (beta as f64 * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let dims = yarn.map(|y| {
            let low = corr(y.n_ctx_orig, y.beta_fast).floor().max(0.0);
            let high = corr(y.n_ctx_orig, y.beta_slow)
                .ceil()
                .min(n_rot as f64 - 1.0);
            (low, high)
        });
        let inv_freq = (0..n_rot / 2)
            .map(|i| {
                let extrapolated = base.powf(-2.0 * i as f64 / n_rot as f64);
                let scale = match dims {
                    None => fs,
                    Some((low, high)) => {
                        let y = (i as f64 - low) / (high - low).max(0.001);
                        let ramp = 1.0 - y.clamp(0.0, 1.0);
                        fs * (1.0 - ramp) + ramp
                    }
                };
                extrapolated * scale
            })
            .collect();
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Rope {
            style,
            n_rot,
            inv_freq,
            mscale,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            table: std::sync::Arc::new(AngleTable(std::array::from_fn(|_| {
                std::sync::OnceLock::new()
            }))),
        }
    }

    /// The scaled sine and cosine of each pair's angle at `pos`, into `out`.
    fn angles_into(&self, pos: usize, out: &mut Vec<(f32, f32)>) {
        out.clear();
        out.extend(self.inv_freq.iter().map(|&f| {
            let (s, c) = (pos as f64 * f).sin_cos();
            (s as f32 * self.mscale, c as f32 * self.mscale)
        }));
    }

    /// Runs `f` on the angles at `pos`: from the shared table for its first positions
    /// (a block allocated once, at its first use), else from this thread's cache (whose
    /// buffers are reused, so a steady decode allocates nothing).
    fn with_angles<R>(&self, pos: usize, f: impl FnOnce(&[(f32, f32)]) -> R) -> R {
        let half = self.inv_freq.len();
        if let Some(slot) = self.table.0.get(pos / TABLE_BLOCK) {
            let block = slot.get_or_init(|| {
                let first = pos / TABLE_BLOCK * TABLE_BLOCK;
                let mut all = Vec::with_capacity(TABLE_BLOCK * half);
                let mut one = Vec::with_capacity(half);
                for p in first..first + TABLE_BLOCK {
                    self.angles_into(p, &mut one);
                    all.extend_from_slice(&one);
                }
                all.into_boxed_slice()
            });
            let at = pos % TABLE_BLOCK * half;
            return f(&block[at..at + half]);
        }
        ANGLES.with(|cell| {
            let mut cache = cell.borrow_mut();
            match cache.iter().position(|e| e.0 == self.id && e.1 == pos) {
                Some(i) => cache[..=i].rotate_right(1),
                None => {
                    if cache.len() < CACHED_ANGLES {
                        cache.push((0, 0, Vec::new()));
                    }
                    cache.rotate_right(1);
                    let e = &mut cache[0];
                    (e.0, e.1) = (self.id, pos);
                    self.angles_into(pos, &mut e.2);
                }
            }
            f(&cache[0].2)
        })
    }

    /// Rotates one head vector (len ≥ n_rot) for position `pos`.
    pub fn apply(&self, head: &mut [f32], pos: usize) {
        let n = head.len();
        self.apply_heads(head, n, pos);
    }

    /// Rotates every head of `row` (heads `head_dim` apart) for position `pos`; each
    /// angle's sine and cosine (in f64, for long contexts) is computed once for all heads.
    pub fn apply_heads(&self, row: &mut [f32], head_dim: usize, pos: usize) {
        let half = self.n_rot / 2;
        self.with_angles(pos, |angles| {
            for (i, &(s, c)) in angles.iter().enumerate() {
                let (a, b) = match self.style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                for head in row.chunks_exact_mut(head_dim) {
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * c - x1 * s;
                    head[b] = x0 * s + x1 * c;
                }
            }
        })
    }
}

/// In-place softmax; returns nothing, leaves probabilities summing to 1.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

pub use crate::activation::{gated_activation, gelu_tanh, silu};

/// Final logit soft-capping: c · tanh(x / c).
pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = (*v / cap).tanh() * cap;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit() {
        let x = [3.0f32, 4.0];
        let mut o = [0f32; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut o);
        let r = (12.5f32).sqrt();
        assert!((o[0] - 3.0 / r).abs() < 1e-6 && (o[1] - 8.0 / r).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs() {
        let r = Rope::new(RopeStyle::Neox, 4, 10000.0, 1.0);
        let mut h = [1.0f32, 0.0, 0.0, 0.0];
        r.apply(&mut h, 1);
        // pair (0, 2) at frequency 1 rotates by 1 radian
        assert!((h[0] - 1f32.cos()).abs() < 1e-6 && (h[2] - 1f32.sin()).abs() < 1e-6);
        let r = Rope::new(RopeStyle::Normal, 4, 10000.0, 1.0);
        let mut h = [1.0f32, 0.0, 0.0, 0.0];
        r.apply(&mut h, 1);
        assert!((h[1] - 1f32.sin()).abs() < 1e-6);
        // rotation keeps the norm
        let mut h = [0.3f32, -1.2, 0.7, 2.0];
        r.apply(&mut h, 1234);
        let n: f32 = h.iter().map(|v| v * v).sum();
        assert!((n - (0.09 + 1.44 + 0.49 + 4.0)).abs() < 1e-4);
    }

    #[test]
    fn cached_angles_equal_fresh_ones_across_ropes_and_positions() {
        // More ropes than the cache holds, visited in an order that both hits and evicts,
        // each rotation checked bit for bit against angles computed afresh.
        let ropes: Vec<Rope> = (0..CACHED_ANGLES + 2)
            .map(|k| Rope::new(RopeStyle::Neox, 8, 1e4 * (k + 1) as f32, 1.0))
            .collect();
        // Positions past the shared table, which this cache serves.
        let past = TABLE_BLOCK * TABLE_BLOCKS;
        let head: Vec<f32> = (0..16).map(|i| 0.25 * i as f32 - 1.5).collect();
        // Hits (the same ropes at the same position again), one position under several
        // ropes in a row, evictions, and a mix.
        let mut visits: Vec<(usize, usize)> = Vec::new();
        for _ in 0..2 {
            visits.extend((0..3).map(|k| (k, 5)));
        }
        visits.extend((0..ropes.len()).map(|k| (k, 9)));
        visits.extend((0..ropes.len()).rev().map(|k| (k, 9)));
        visits.extend((0..30).map(|i| (i % ropes.len(), i % 4)));
        let mut fresh = Vec::new();
        for (step, &(k, pos)) in visits.iter().enumerate() {
            let (r, pos) = (&ropes[k], past + pos);
            let mut got = head.clone();
            r.apply_heads(&mut got, 8, pos);
            r.angles_into(pos, &mut fresh);
            let mut want = head.clone();
            for h in want.chunks_exact_mut(8) {
                for (i, &(s, c)) in fresh.iter().enumerate() {
                    let (x0, x1) = (h[i], h[i + 4]);
                    (h[i], h[i + 4]) = (x0 * c - x1 * s, x0 * s + x1 * c);
                }
            }
            assert_eq!(got, want, "step {step}: rope {} at {pos}", r.id);
        }
        let cached = ANGLES.with(|c| c.borrow().len());
        assert_eq!(cached, CACHED_ANGLES);
    }

    #[test]
    fn table_angles_equal_fresh_ones_at_every_block_edge() {
        // A block's first and last positions, blocks first used out of order, a clone
        // (which shares the table) and the table's last position; the same bits as
        // angles computed afresh, and blocks only where a position was asked for.
        let rope = Rope::new(RopeStyle::Normal, 12, 5e5, 0.5);
        let clone = rope.clone();
        let last = TABLE_BLOCK * TABLE_BLOCKS - 1;
        let positions = [
            3 * TABLE_BLOCK + 7,
            0,
            TABLE_BLOCK - 1,
            TABLE_BLOCK,
            3 * TABLE_BLOCK,
            last,
        ];
        let mut fresh = Vec::new();
        for (i, &pos) in positions.iter().enumerate() {
            let r = if i % 2 == 0 { &rope } else { &clone };
            let got = r.with_angles(pos, |a| a.to_vec());
            rope.angles_into(pos, &mut fresh);
            assert_eq!(got, fresh, "position {pos}");
        }
        let made: Vec<usize> = (0..TABLE_BLOCKS)
            .filter(|&k| rope.table.0[k].get().is_some())
            .collect();
        assert_eq!(made, [0, 1, 3, TABLE_BLOCKS - 1]);
        assert_eq!(format!("{:?}", rope.table), "AngleTable(4 of 32 blocks)");
    }

    #[test]
    fn yarn_keeps_fast_pairs_and_interpolates_slow_ones() {
        // 64 dimensions, base 10000, 4x over an original context of 512: the ramp runs
        // from pair floor(corr(32)) = floor(3.25) = 3 to ceil(corr(1)) = ceil(15.3) = 16,
        // corr(beta) = 64 ln(512 / (2 pi beta)) / (2 ln 10000).
        let (n, base, fs) = (64, 10000f32, 0.25f32);
        let ramp = YarnRamp {
            n_ctx_orig: 512,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let y = Rope::scaled(RopeStyle::Normal, n, base, fs, Some(ramp), 1.0);
        let plain = Rope::new(RopeStyle::Normal, n, base, 1.0);
        let linear = Rope::new(RopeStyle::Normal, n, base, fs);
        for i in 0..n / 2 {
            let (got, p, l) = (y.inv_freq[i], plain.inv_freq[i], linear.inv_freq[i]);
            if i <= 3 {
                assert!((got - p).abs() <= 1e-12 * p, "pair {i} keeps its frequency");
            } else if i >= 16 {
                assert!((got - l).abs() <= 1e-12 * l, "pair {i} is interpolated");
            } else {
                assert!(got < p && got > l, "pair {i} is blended");
            }
        }
        // mscale multiplies the rotation's sines and cosines.
        let m = Rope::scaled(RopeStyle::Normal, 4, base, 1.0, None, 1.5);
        let mut h = [1.0f32, 0.0, 0.0, 0.0];
        m.apply(&mut h, 1);
        assert!((h[0] - 1.5 * 1f32.cos()).abs() < 1e-6 && (h[1] - 1.5 * 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = [1.0f32, 2.0, 3.0, -1000.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[3] == 0.0);
    }

    #[test]
    fn activations() {
        assert!((gelu_tanh(1.0) - 0.841192).abs() < 1e-5);
        assert!((silu(1.0) - 0.731059).abs() < 1e-5);
    }
}
