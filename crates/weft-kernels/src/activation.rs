//! The gated MLP's middle, gate = act(gate) · up, with GELU-tanh (Gemma) or SiLU (llama).
//! GELU goes through a table over every f16 input, as llama.cpp (the reference peer) does:
//! it is faster than libm's tanhf (a tenth of Gemma's prefill) and keeps our rounding close
//! to the reference's, which decides greedy paths at near-ties. SiLU is vectorized with AVX2.

use std::sync::OnceLock;

use half::f16;

use crate::vecops::has_avx2;

/// GELU(x) for every f16 bit pattern x, rounded to f16.
fn gelu_table() -> &'static [f16] {
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|b| f16::from_f32(gelu_tanh(f16::from_bits(b).to_f32())))
            .collect()
    })
}

/// GELU through the f16 table; exact identity and zero beyond ±10 where it saturates.
#[inline]
pub fn gelu_f16_table(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        gelu_table()[f16::from_f32(x).to_bits() as usize].to_f32()
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// GELU, tanh approximation (Gemma's MLP activation).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
}

/// SiLU (llama's MLP activation).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// gate[i] = act(gate[i]) · up[i].
pub fn gated_activation(gate: &mut [f32], up: &[f32], gelu: bool) {
    assert_eq!(gate.len(), up.len(), "gate and up lengths differ");
    if gelu {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = gelu_f16_table(*g) * u;
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time.
        unsafe { avx2::silu_gated(gate, up) };
        return;
    }
    gated_scalar(gate, up, false);
}

/// The scalar reference, also the tail of the vector path.
pub fn gated_scalar(gate: &mut [f32], up: &[f32], gelu: bool) {
    let act = if gelu { gelu_tanh } else { silu };
    // (gated_activation's GELU uses the f16 table; this is the exact formula.)
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = act(*g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::vecops::avx2::exp;

    /// gate = silu(gate) · up for 8 lanes at a time.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_gated(gate: &mut [f32], up: &[f32]) {
        let n = gate.len();
        let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_loadu_ps(g.add(i));
            let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let act = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(g.add(i), _mm256_mul_ps(act, _mm256_loadu_ps(u.add(i))));
            i += 8;
        }
        super::gated_scalar(&mut gate[i..], &up[i..], false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same formulas in f64: the oracle for both paths.
    fn reference(x: f32, up: f32, gelu: bool) -> f64 {
        let (x, up) = (x as f64, up as f64);
        let a = if gelu {
            let u = (2.0 / std::f64::consts::PI).sqrt() * x * (1.0 + 0.044715 * x * x);
            0.5 * x * (1.0 + u.tanh())
        } else {
            x / (1.0 + (-x).exp())
        };
        a * up
    }

    #[test]
    fn both_paths_match_an_f64_reference() {
        for gelu in [true, false] {
            let xs: Vec<f32> = (0..2003).map(|i| (i as f32 - 1000.0) * 0.013).collect();
            let ups: Vec<f32> = (0..2003).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
            let mut scalar = xs.clone();
            gated_scalar(&mut scalar, &ups, gelu);
            let mut vector = xs.clone();
            gated_activation(&mut vector, &ups, gelu);
            // GELU's table rounds its input and output to f16 (11 significant bits).
            let table_slack = if gelu { 2e-3 } else { 0.0 };
            for i in 0..xs.len() {
                let want = reference(xs[i], ups[i], gelu);
                // Relative to the value, plus the absolute slack the scalar GELU needs where
                // tanh(u) is nearly -1 and 1 + tanh(u) cancels.
                let size = (xs[i] * ups[i]).abs() as f64;
                for (path, got, abs) in [
                    ("fast", vector[i], 1e-12 + table_slack * size),
                    ("scalar", scalar[i], 2e-7),
                ] {
                    let err = (got as f64 - want).abs();
                    assert!(
                        err <= 4e-6 * want.abs() + abs,
                        "{path} gelu={gelu} x={}: {got} vs {want}",
                        xs[i]
                    );
                }
            }
        }
    }

    #[test]
    fn extremes_stay_finite() {
        let mut g = [-1e4f32, -90.0, 90.0, 1e4, 0.0, f32::MIN_POSITIVE];
        gated_activation(&mut g, &[1.0; 6], true);
        assert_eq!(g[0], 0.0);
        assert_eq!(g[3], 1e4);
        assert!(g.iter().all(|v| v.is_finite()), "{g:?}");
    }
}
