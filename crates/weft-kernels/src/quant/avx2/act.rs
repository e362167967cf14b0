//! AVX2 activation quantizers (f32 -> Q8_0 / Q8_K). Bit-identical to the reference ones
//! in `quantize.rs` (same products, same rounding), just eight lanes at a time.

use super::super::{blocks, quantize};
use std::arch::x86_64::*;

use weft_gguf::GgmlType;

/// Quantize `x` into `dst` in activation format `at` (F32, Q8_0 or Q8_K).
pub fn quantize_act(at: GgmlType, x: &[f32], dst: &mut [u8]) {
    match at {
        // SAFETY: only reached after AVX2/FMA/F16C detection; the caller sized dst.
        GgmlType::Q8_0 => unsafe { q8_0(x, dst) },
        GgmlType::Q8_K => unsafe { q8_k(x, dst) },
        _ => quantize::quantize_into(at, x, dst),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hmax_ps(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    _mm_cvtss_f32(m)
}

/// Four vectors of 8 i32 (each in -128..=127) -> 32 bytes in order.
///
/// # Safety
/// `dst` is writable for 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_store(i: [__m256i; 4], dst: *mut u8) {
    // packs works per 128-bit half, leaving the 4-lane groups in order 0,2,4,6,1,3,5,7.
    let ab = _mm256_packs_epi32(i[0], i[1]);
    let cd = _mm256_packs_epi32(i[2], i[3]);
    let bytes = _mm256_packs_epi16(ab, cd);
    let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: the caller guarantees 32 writable bytes.
    unsafe { _mm256_storeu_si256(dst.cast(), ordered) }
}

/// roundf for 8 lanes: half-way cases away from zero (the reference uses f32::round).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn round_away(s: __m256) -> __m256 {
    let sign = _mm256_set1_ps(-0.0);
    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(s);
    // s - trunc(s) is exact, so this compares the true fraction with one half.
    let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(s, t));
    let away = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
    let unit = _mm256_or_ps(_mm256_and_ps(s, sign), _mm256_set1_ps(1.0));
    _mm256_add_ps(t, _mm256_and_ps(away, unit))
}

/// # Safety
/// AVX2/FMA/F16C present; `x.len()` is a multiple of 32 and `dst` is 34 bytes per block.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0(x: &[f32], dst: &mut [u8]) {
    let sign = _mm256_set1_ps(-0.0);
    for (xs, y) in x.chunks_exact(32).zip(dst.chunks_exact_mut(34)) {
        let mut v = [_mm256_setzero_ps(); 4];
        let mut m = _mm256_setzero_ps();
        for (k, vk) in v.iter_mut().enumerate() {
            // SAFETY: xs has 32 values.
            *vk = unsafe { _mm256_loadu_ps(xs.as_ptr().add(8 * k)) };
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vk));
        }
        let d = hmax_ps(m) / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        blocks::write_f16(y, 0, d);
        let mut q = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            q[k] = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(v[k], id)));
        }
        // SAFETY: bytes 2..34 of the block.
        unsafe { pack_store(q, y.as_mut_ptr().add(2)) };
    }
}

/// # Safety
/// AVX2/FMA/F16C present; `x.len()` is a multiple of 256 and `dst` is 292 bytes per block.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_k(x: &[f32], dst: &mut [u8]) {
    let sign = _mm256_set1_ps(-0.0);
    for (xs, y) in x.chunks_exact(256).zip(dst.chunks_exact_mut(292)) {
        let p = xs.as_ptr();
        let mut m = _mm256_setzero_ps();
        for k in 0..32 {
            // SAFETY: xs has 256 values.
            m = _mm256_max_ps(
                m,
                _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(p.add(8 * k)) }),
            );
        }
        let amax = hmax_ps(m);
        if amax == 0.0 {
            y.fill(0);
            continue;
        }
        // The reference scales by the first value of largest magnitude, sign included.
        let amaxv = _mm256_set1_ps(amax);
        let mut first = None;
        for k in 0..32 {
            // SAFETY: as above.
            let a = _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(p.add(8 * k)) });
            let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(a, amaxv));
            if hit != 0 {
                first = Some(8 * k + hit.trailing_zeros() as usize);
                break;
            }
        }
        let Some(j) = first else {
            // Only with NaNs about; let the reference decide what that means.
            quantize::q8_k(xs, y);
            continue;
        };
        let iscale = -127.0 / xs[j];
        let iv = _mm256_set1_ps(iscale);
        let cap = _mm256_set1_epi32(127);
        for g in 0..8 {
            let mut q = [_mm256_setzero_si256(); 4];
            for (k, qk) in q.iter_mut().enumerate() {
                // SAFETY: values 32g+8k..+8 of the block; cvtps rounds half to even
                // (the default MXCSR mode), as ggml's nearest_int does.
                let v = unsafe { _mm256_loadu_ps(p.add(32 * g + 8 * k)) };
                *qk = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, iv)), cap);
            }
            // Two 16-value sums: lanes of q[0]+q[1] and of q[2]+q[3].
            let s = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s = _mm256_hadd_epi32(s, s);
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let (s0, s1) = (
                _mm_cvtsi128_si32(s) as i16,
                _mm_extract_epi32::<1>(s) as i16,
            );
            let o = blocks::Q8_K_BSUMS + 4 * g;
            y[o..o + 2].copy_from_slice(&s0.to_le_bytes());
            y[o + 2..o + 4].copy_from_slice(&s1.to_le_bytes());
            // SAFETY: quants 32g..32g+32 of the block.
            unsafe { pack_store(q, y.as_mut_ptr().add(blocks::Q8_K_QS + 32 * g)) };
        }
        y[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}
