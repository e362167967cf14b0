//! The gated MLP's middle, gate = act(gate) · up, with GELU-tanh (Gemma) or SiLU (llama).
//! GELU goes through a table over every f16 input, as llama.cpp (the reference peer) does:
//! it is faster than libm's tanhf (a tenth of Gemma's prefill) and keeps our rounding close
//! to the reference's, which decides greedy paths at near-ties. Both are vectorized with
//! AVX2 (GELU gathers from the table, bit for bit as the scalar lookup).

use std::sync::OnceLock;

use half::f16;

use crate::vecops::has_avx2;

/// GELU(x) for every f16 bit pattern x, rounded to f16, and one entry more (a copy of the
/// last) so that a 4-byte gather at the last pattern stays inside.
fn gelu_table() -> &'static [f16] {
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t: Vec<f16> = (0..=u16::MAX)
            .map(|b| f16::from_f32(gelu_tanh(f16::from_bits(b).to_f32())))
            .collect();
        t.push(t[usize::from(u16::MAX)]);
        t
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
    #[cfg(target_arch = "x86_64")]
    if gelu && has_avx2() && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: AVX2, FMA and F16C were detected at run time; the table has 65,537
        // entries.
        unsafe { avx2::gelu_gated(gate, up, gelu_table()) };
        return;
    }
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

    /// gate = GELU(gate) · up for 8 lanes at a time, through the f16 table as
    /// `gelu_f16_table` reads it (the same bits): each input rounded to f16 (nearest, ties
    /// to even, as `half` rounds), its entry gathered, and the saturated ends blended in.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present; `table` holds 65,537 entries (one past the last
    /// pattern, so a 4-byte gather there stays inside).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn gelu_gated(gate: &mut [f32], up: &[f32], table: &[half::f16]) {
        debug_assert!(table.len() > usize::from(u16::MAX) + 1);
        let n = gate.len().min(up.len());
        let (g, u, t) = (gate.as_mut_ptr(), up.as_ptr(), table.as_ptr().cast::<i32>());
        let (lo, hi) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0));
        let low16 = _mm256_set1_epi32(0xFFFF);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n; gathered offsets are 2 * pattern <= 2 * 65,535, and the
            // 4 bytes read there lie inside the 65,537 entries.
            unsafe {
                let x = _mm256_loadu_ps(g.add(i));
                let bits = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
                let got = _mm256_i32gather_epi32::<2>(t, _mm256_cvtepu16_epi32(bits));
                // Each lane's entry is its low 16 bits: pack them back to eight f16.
                let packed = _mm256_packus_epi32(_mm256_and_si256(got, low16), low16);
                let f16s = _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(packed));
                let mut act = _mm256_cvtph_ps(f16s);
                act =
                    _mm256_blendv_ps(act, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LE_OQ>(x, lo));
                act = _mm256_blendv_ps(act, x, _mm256_cmp_ps::<_CMP_GE_OQ>(x, hi));
                _mm256_storeu_ps(g.add(i), _mm256_mul_ps(act, _mm256_loadu_ps(u.add(i))));
            }
            i += 8;
        }
        for (g, &u) in gate[i..n].iter_mut().zip(&up[i..n]) {
            *g = super::gelu_f16_table(*g) * u;
        }
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
    fn vector_gelu_equals_the_table_bit_for_bit() {
        // Every f16 pattern's neighbourhood: exact patterns, midpoints (ties round to
        // even), the saturated ends, zeros, infinities and NaN, over a length that leaves
        // a scalar tail.
        let mut xs: Vec<f32> = Vec::new();
        for b in (0..=u16::MAX).step_by(7) {
            let v = f16::from_bits(b).to_f32();
            // A quarter, a half and three quarters of an f16 step (2^-10 relative) above.
            for q in [0.0, 1.0, 2.0, 3.0] {
                xs.push(v * (1.0 + q / 4096.0));
            }
        }
        xs.extend([
            -10.0,
            10.0,
            -9.999,
            9.999,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        xs.push(f32::NAN);
        let ups: Vec<f32> = (0..xs.len()).map(|i| 0.5 + (i % 5) as f32).collect();
        let mut vector = xs.clone();
        gated_activation(&mut vector, &ups, true);
        for (i, (&x, &u)) in xs.iter().zip(&ups).enumerate() {
            let want = gelu_f16_table(x) * u;
            let same =
                want.to_bits() == vector[i].to_bits() || (want.is_nan() && vector[i].is_nan());
            assert!(same, "x={x} ({i}): {} vs {want}", vector[i]);
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
