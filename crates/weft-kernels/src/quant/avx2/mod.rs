//! x86-64 AVX2+FMA+F16C kernels, compiled with `#[target_feature]` so a generic x86-64
//! build still gets them; entered only after run-time detection.
//!
//! Every weight format implements [`Tile`]: the dot products of R weight rows with T
//! activations. Decode (matvec) runs R-row, 1-token tiles so a row group shares each
//! activation block load; prefill (matmul) runs R x T tiles so each weight block is
//! unpacked once per T tokens while the row group stays in L1.

mod act;
mod float;
mod kquant;
mod legacy;

use std::arch::x86_64::*;
use std::ops::Range;
use weft_gguf::GgmlType;

pub(super) use act::quantize_act;

pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Weight types with AVX2 kernels (Q8_K, an activation format, uses the scalar path).
pub(super) fn supports(w: GgmlType) -> bool {
    w != GgmlType::Q8_K
}

/// R weight rows dotted with T activations over `nb` blocks.
pub(super) trait Tile {
    /// Bytes of one weight block.
    const WB: usize;
    /// Bytes of the matching activation block.
    const AB: usize;

    /// Returns `out[r][t] = dot(rows[r], acts[t])`.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; each `rows[r]` is readable for `nb * WB` bytes and
    /// each `acts[t]` for `nb * AB` bytes.
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
    ) -> [[f32; T]; R];
}

/// Pointers to `N` consecutive items of `stride` bytes from `base + first * stride`.
///
/// # Safety
/// All of them must lie inside (or one past) the allocation `base` points into.
#[inline(always)]
unsafe fn ptrs<const N: usize>(base: *const u8, first: usize, stride: usize) -> [*const u8; N] {
    let mut p = [base; N];
    for (i, q) in p.iter_mut().enumerate() {
        // SAFETY: the caller guarantees the offsets stay inside the allocation.
        *q = unsafe { base.add((first + i) * stride) };
    }
    p
}

/// Matvec with R-row tiles, then single rows for the remainder.
///
/// # Safety
/// AVX2/FMA/F16C present; `weights` holds `rows.end` rows of `nb * K::WB` bytes; `act`
/// holds `nb * K::AB` bytes; `out.len() >= rows.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn matvec_with<K: Tile, const R: usize>(
    nb: usize,
    weights: &[u8],
    rows: Range<usize>,
    act: &[u8],
    out: &mut [f32],
) {
    let rb = nb * K::WB;
    let (w, a) = (weights.as_ptr(), act.as_ptr());
    let mut r = rows.start;
    let mut o = 0;
    // SAFETY (all tile calls): rows r..r+R are below rows.end, which the caller checked
    // against weights.len(); act covers nb blocks.
    while r + R <= rows.end {
        let res = unsafe { K::tile::<R, 1>(ptrs(w, r, rb), [a], nb) };
        for i in 0..R {
            out[o + i] = res[i][0];
        }
        r += R;
        o += R;
    }
    while r < rows.end {
        out[o] = unsafe { K::tile::<1, 1>(ptrs(w, r, rb), [a], nb) }[0][0];
        r += 1;
        o += 1;
    }
}

/// Activation bytes a token chunk may take so that it stays in L2 while every row group
/// of the range is dotted with it.
const ACT_CHUNK_BYTES: usize = 192 * 1024;

/// Matmul with R x T tiles: rows outer (each weight row group is read from memory once
/// per token chunk and then hits L1), tokens inner.
///
/// # Safety
/// As `matvec_with`, plus `acts` holds `m` activations and `out` is large enough for
/// `(m - 1) * out_stride + rows.len()` values.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn matmul_with<K: Tile, const R: usize, const T: usize>(
    nb: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let (rb, ab) = (nb * K::WB, nb * K::AB);
    let (w, a) = (weights.as_ptr(), acts.as_ptr());
    let chunk = (ACT_CHUNK_BYTES / ab.max(1)).max(T) / T * T;
    let mut t0 = 0;
    // SAFETY (all tile calls): every row index is below rows.end and every token index
    // below m, both checked by the caller against the slice lengths.
    while t0 < m {
        let t1 = (t0 + chunk).min(m);
        let mut r = rows.start;
        while r < rows.end {
            let i = r - rows.start;
            if r + R <= rows.end {
                let p: [*const u8; R] = unsafe { ptrs(w, r, rb) };
                let mut t = t0;
                while t + T <= t1 {
                    let res = unsafe { K::tile::<R, T>(p, ptrs(a, t, ab), nb) };
                    for (ri, row) in res.iter().enumerate() {
                        for (ti, v) in row.iter().enumerate() {
                            out[(t + ti) * out_stride + i + ri] = *v;
                        }
                    }
                    t += T;
                }
                while t < t1 {
                    let res = unsafe { K::tile::<R, 1>(p, ptrs(a, t, ab), nb) };
                    for (ri, row) in res.iter().enumerate() {
                        out[t * out_stride + i + ri] = row[0];
                    }
                    t += 1;
                }
                r += R;
            } else {
                let p: [*const u8; 1] = unsafe { ptrs(w, r, rb) };
                let mut t = t0;
                while t + T <= t1 {
                    let res = unsafe { K::tile::<1, T>(p, ptrs(a, t, ab), nb) };
                    for (ti, v) in res[0].iter().enumerate() {
                        out[(t + ti) * out_stride + i] = *v;
                    }
                    t += T;
                }
                while t < t1 {
                    out[t * out_stride + i] =
                        unsafe { K::tile::<1, 1>(p, ptrs(a, t, ab), nb) }[0][0];
                    t += 1;
                }
                r += 1;
            }
        }
        t0 = t1;
    }
}

/// AVX2 matvec for every weight type but Q8_K.
///
/// # Safety
/// AVX2/FMA/F16C present; lengths as checked by `quant::matvec`.
pub(super) unsafe fn matvec(
    w: GgmlType,
    n: usize,
    weights: &[u8],
    rows: Range<usize>,
    act: &[u8],
    out: &mut [f32],
) {
    let nb = n / w.block_size();
    // SAFETY: forwarded from the caller.
    unsafe {
        match w {
            GgmlType::F32 => matvec_with::<float::F32, 4>(nb, weights, rows, act, out),
            GgmlType::F16 => matvec_with::<float::F16, 4>(nb, weights, rows, act, out),
            GgmlType::BF16 => matvec_with::<float::Bf16, 4>(nb, weights, rows, act, out),
            GgmlType::Q4_0 => matvec_with::<legacy::Q4_0, 4>(nb, weights, rows, act, out),
            GgmlType::Q5_0 => matvec_with::<legacy::Q5_0, 4>(nb, weights, rows, act, out),
            GgmlType::Q8_0 => matvec_with::<legacy::Q8_0, 4>(nb, weights, rows, act, out),
            GgmlType::Q4_K => matvec_with::<kquant::Q4K, 2>(nb, weights, rows, act, out),
            GgmlType::Q5_K => matvec_with::<kquant::Q5K, 2>(nb, weights, rows, act, out),
            GgmlType::Q6_K => matvec_with::<kquant::Q6K, 2>(nb, weights, rows, act, out),
            GgmlType::Q8_K => unreachable!("Q8_K weights take the scalar path"),
        }
    }
}

/// AVX2 matmul for every weight type but Q8_K.
///
/// # Safety
/// AVX2/FMA/F16C present; lengths as checked by `quant::matmul`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul(
    w: GgmlType,
    n: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let nb = n / w.block_size();
    // SAFETY: forwarded from the caller.
    unsafe {
        match w {
            GgmlType::F32 => {
                matmul_with::<float::F32, 4, 2>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::F16 => {
                matmul_with::<float::F16, 4, 2>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::BF16 => {
                matmul_with::<float::Bf16, 4, 2>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q4_0 => {
                matmul_with::<legacy::Q4_0, 2, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q5_0 => {
                matmul_with::<legacy::Q5_0, 2, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q8_0 => {
                matmul_with::<legacy::Q8_0, 2, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q4_K => {
                matmul_with::<kquant::Q4K, 1, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q5_K => {
                matmul_with::<kquant::Q5K, 1, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q6_K => {
                matmul_with::<kquant::Q6K, 1, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q8_K => unreachable!("Q8_K weights take the scalar path"),
        }
    }
}

// ---- small helpers shared by the kernel files ----

/// Unaligned 32-byte load.
///
/// # Safety
/// `p` is readable for 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load256(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes; loadu has no alignment need.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// Unaligned 16-byte load.
///
/// # Safety
/// `p` is readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load128(p: *const u8) -> __m128i {
    // SAFETY: the caller guarantees 16 readable bytes; loadu has no alignment need.
    unsafe { _mm_loadu_si128(p.cast()) }
}

/// Unaligned little-endian u16 read.
///
/// # Safety
/// `p` is readable for 2 bytes.
#[inline(always)]
unsafe fn read_u16(p: *const u8) -> u16 {
    // SAFETY: the caller guarantees 2 readable bytes.
    unsafe { p.cast::<u16>().read_unaligned() }
}

/// Unaligned little-endian f32 read.
///
/// # Safety
/// `p` is readable for 4 bytes.
#[inline(always)]
unsafe fn read_f32(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 4 readable bytes.
    unsafe { p.cast::<f32>().read_unaligned() }
}

/// IEEE half -> f32 with the F16C instruction (no table, no branch).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_to_f32(h: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Horizontal sums of an R x T grid of accumulators.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_grid<const R: usize, const T: usize>(acc: &[[__m256; T]; R]) -> [[f32; T]; R] {
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum_ps(acc[r][t]);
        }
    }
    out
}
