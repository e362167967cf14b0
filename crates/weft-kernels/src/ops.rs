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
        Rope {
            style,
            n_rot,
            inv_freq,
            mscale,
        }
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
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let (s, c) = (pos as f64 * f).sin_cos();
            let (s, c) = (s as f32 * self.mscale, c as f32 * self.mscale);
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
