//! x86-64 AVX2+FMA+F16C kernels, compiled with `#[target_feature]` so a generic x86-64
//! build still gets them; entered only after run-time detection.
//!
//! Every weight format implements [`Tile`]: the dot products of R weight rows with T
//! activations. Decode (matvec) walks one row at a time: on this class of machine a
//! single sequential stream reads memory ~25% faster than several interleaved rows, and
//! the activation sits in L1 either way. Prefill (matmul) runs 1 x 4 tiles (2 x 4 for
//! floats) so each weight block is unpacked once per 4 tokens, rows outer so a row is read
//! from memory once per token chunk while the chunk's activations stay in L2.
//!
//! The 32-value formats carry an f16 scale per 32 values; converting those one at a time
//! inside the dot loop costs as much as the dot itself, so the drivers convert them to
//! f32 up front, eight per instruction (the activation's once per call, a row's once per
//! row group), and the tiles read them with broadcast loads.

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
    /// Whether the tile reads per-block f32 scales prepared by the driver.
    const SCALES: bool;
    /// Whether it also reads the sum of each activation block's quants.
    const SUMS: bool = false;

    /// Returns `out[r][t] = dot(rows[r], acts[t])`. When `SCALES`, `ws[r]` and `as_[t]`
    /// hold the f32 value of each block's f16 scale, zero-padded to `cp` = nb rounded up
    /// to 8; when `SUMS`, `as_[t] + cp` holds the activation's block sums, padded alike.
    /// Otherwise they are not read.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; each `rows[r]` is readable for `nb * WB` bytes,
    /// each `acts[t]` for `nb * AB` bytes, and the scale records as described.
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
        ws: [*const f32; R],
        as_: [*const f32; T],
    ) -> [[f32; T]; R];
}

/// Blocks per column chunk for formats with driver-made scales (bounds the stack
/// buffers; rows up to 16384 values of the 32-value formats take one chunk).
const COLS: usize = 512;
/// f32 activation scales the matmul driver keeps for a token chunk.
const ACT_SCALES: usize = 8192;
/// Activation bytes a token chunk may take, so it stays in L2 while every row of the
/// range is dotted with it.
const ACT_CHUNK_BYTES: usize = 192 * 1024;

/// The f16 scales at the start of `count` consecutive blocks of `stride` bytes, as f32,
/// eight per `vcvtph2ps`; the rest of `out` (the padding) is zeroed.
///
/// # Safety
/// `p + i * stride` is readable for 2 bytes for every i < count <= out.len().
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn convert_scales(p: *const u8, stride: usize, count: usize, out: &mut [f32]) {
    let mut i = 0;
    // SAFETY (all reads): i + k < count for every block touched.
    while i + 8 <= count {
        let h = |k: usize| unsafe { read_u16(p.add((i + k) * stride)) } as i16;
        let v = _mm_set_epi16(h(7), h(6), h(5), h(4), h(3), h(2), h(1), h(0));
        // SAFETY: i + 8 <= count <= out.len().
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(v)) };
        i += 8;
    }
    while i < count {
        out[i] = f16_to_f32(unsafe { read_u16(p.add(i * stride)) });
        i += 1;
    }
    out[count..].fill(0.0);
}

/// Sums of the 32 quants of each of `count` Q8_0 blocks, as f32; the rest of `out` is
/// zeroed.
///
/// # Safety
/// `p` holds `count` readable Q8_0 blocks, count <= out.len().
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_sums(p: *const u8, count: usize, out: &mut [f32]) {
    for (b, o) in out.iter_mut().enumerate().take(count) {
        // SAFETY: block b < count.
        let q = unsafe { load256(p.add(b * 34 + 2)) };
        let s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        *o = _mm_cvtsi128_si32(s) as f32;
    }
    out[count..].fill(0.0);
}

/// The driver-made record of one activation span: scales, then (if `K::SUMS`) sums.
///
/// # Safety
/// `p` holds `cl` readable activation blocks; `out` is `record_len::<K>(cl)` long.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn act_record<K: Tile>(p: *const u8, cl: usize, out: &mut [f32]) {
    let cp = cl.div_ceil(8) * 8;
    // SAFETY: forwarded from the caller.
    unsafe {
        convert_scales(p, K::AB, cl, &mut out[..cp]);
        if K::SUMS {
            block_sums(p, cl, &mut out[cp..2 * cp]);
        }
    }
}

/// Floats of an activation record for `cl` blocks.
fn record_len<K: Tile>(cl: usize) -> usize {
    cl.div_ceil(8) * 8 * if K::SUMS { 2 } else { 1 }
}

/// Writes a tile result, or adds it for the second and later column chunks.
#[inline(always)]
fn put(out: &mut [f32], i: usize, v: f32, first: bool) {
    if first {
        out[i] = v;
    } else {
        out[i] += v;
    }
}

/// Matvec, one row at a time.
///
/// # Safety
/// AVX2/FMA/F16C present; `weights` holds `rows.end` rows of `nb * K::WB` bytes; `act`
/// holds `nb * K::AB` bytes; `out.len() >= rows.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn matvec_with<K: Tile>(nb: usize, weights: &[u8], rows: Range<usize>, act: &[u8], out: &mut [f32]) {
    let rb = nb * K::WB;
    let (w, a) = (weights.as_ptr(), act.as_ptr());
    if nb == 0 {
        out[..rows.len()].fill(0.0);
        return;
    }
    let cols = if K::SCALES { COLS } else { nb };
    let mut asc = [0.0f32; 2 * COLS];
    let mut wsc = [0.0f32; COLS];
    let mut c0 = 0;
    // SAFETY (pointer arithmetic and tile calls): rows are below rows.end and blocks
    // below nb, both checked by the caller against the slice lengths.
    while c0 < nb {
        let cl = cols.min(nb - c0);
        let cp = cl.div_ceil(8) * 8;
        let ap = unsafe { a.add(c0 * K::AB) };
        if K::SCALES {
            unsafe { act_record::<K>(ap, cl, &mut asc[..record_len::<K>(cl)]) };
        }
        let pfd: usize = std::env::var("PFD").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        for (o, r) in rows.clone().enumerate() {
            let rp = unsafe { w.add(r * rb + c0 * K::WB) };
            if pfd > 0 && r + 1 < rows.end {
                let end = (rows.end * rb) as isize;
                let mut off = (rb * pfd) as isize;
                let stop = off + rb as isize;
                while off < stop && (r * rb) as isize + off < end {
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(rp.offset(off).cast()) };
                    off += 64;
                }
            }
            if K::SCALES {
                unsafe { convert_scales(rp, K::WB, cl, &mut wsc[..cp]) };
            }
            let v = unsafe { K::tile::<1, 1>([rp], [ap], cl, [wsc.as_ptr()], [asc.as_ptr()]) };
            put(out, o, v[0][0], c0 == 0);
        }
        c0 += cl;
    }
}

/// Matmul with R x T tiles (and R x 1, 1 x T, 1 x 1 at the edges): column chunks, then
/// token chunks, then rows, then tokens.
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
    if nb == 0 {
        for t in 0..m {
            out[t * out_stride..t * out_stride + rows.len()].fill(0.0);
        }
        return;
    }
    let cols = if K::SCALES { COLS } else { nb };
    let mut asc = [0.0f32; ACT_SCALES];
    let mut wsc = [[0.0f32; COLS]; R];
    let mut c0 = 0;
    // SAFETY (pointer arithmetic and tile calls): every row index is below rows.end,
    // every token below m and every block below nb, all checked by the caller.
    while c0 < nb {
        let cl = cols.min(nb - c0);
        let first = c0 == 0;
        let (cp, rec) = (cl.div_ceil(8) * 8, record_len::<K>(cl));
        let mut chunk = (ACT_CHUNK_BYTES / (cl * K::AB)).max(T);
        if K::SCALES {
            chunk = chunk.min(ACT_SCALES / rec);
        }
        let chunk = (chunk / T * T).max(1);
        let mut t0 = 0;
        while t0 < m {
            let t1 = (t0 + chunk).min(m);
            let act = |t: usize| unsafe { a.add(t * ab + c0 * K::AB) };
            if K::SCALES {
                for t in t0..t1 {
                    let o = (t - t0) * rec;
                    unsafe { act_record::<K>(act(t), cl, &mut asc[o..o + rec]) };
                }
            }
            let asp = |t: usize| unsafe { asc.as_ptr().add((t - t0) * rec) };
            let mut r = rows.start;
            while r < rows.end {
                let i = r - rows.start;
                let group = if r + R <= rows.end { R } else { 1 };
                let row = |k: usize| unsafe { w.add((r + k) * rb + c0 * K::WB) };
                if K::SCALES {
                    for (k, ws) in wsc.iter_mut().enumerate().take(group) {
                        unsafe { convert_scales(row(k), K::WB, cl, &mut ws[..cp]) };
                    }
                }
                let mut t = t0;
                if group == R {
                    let p: [*const u8; R] = std::array::from_fn(row);
                    let ws: [*const f32; R] = std::array::from_fn(|k| wsc[k].as_ptr());
                    while t + T <= t1 {
                        let res = unsafe {
                            K::tile::<R, T>(p, std::array::from_fn(|k| act(t + k)), cl, ws, std::array::from_fn(|k| asp(t + k)))
                        };
                        for (ri, v) in res.iter().enumerate() {
                            for (ti, x) in v.iter().enumerate() {
                                put(out, (t + ti) * out_stride + i + ri, *x, first);
                            }
                        }
                        t += T;
                    }
                    while t < t1 {
                        let res = unsafe { K::tile::<R, 1>(p, [act(t)], cl, ws, [asp(t)]) };
                        for (ri, v) in res.iter().enumerate() {
                            put(out, t * out_stride + i + ri, v[0], first);
                        }
                        t += 1;
                    }
                } else {
                    let (p, ws) = ([row(0)], [wsc[0].as_ptr()]);
                    while t + T <= t1 {
                        let res = unsafe {
                            K::tile::<1, T>(p, std::array::from_fn(|k| act(t + k)), cl, ws, std::array::from_fn(|k| asp(t + k)))
                        };
                        for (ti, x) in res[0].iter().enumerate() {
                            put(out, (t + ti) * out_stride + i, *x, first);
                        }
                        t += T;
                    }
                    while t < t1 {
                        let res = unsafe { K::tile::<1, 1>(p, [act(t)], cl, ws, [asp(t)]) };
                        put(out, t * out_stride + i, res[0][0], first);
                        t += 1;
                    }
                }
                r += group;
            }
            t0 = t1;
        }
        c0 += cl;
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
            GgmlType::F32 => matvec_with::<float::F32>(nb, weights, rows, act, out),
            GgmlType::F16 => matvec_with::<float::F16>(nb, weights, rows, act, out),
            GgmlType::BF16 => matvec_with::<float::Bf16>(nb, weights, rows, act, out),
            GgmlType::Q4_0 => matvec_with::<legacy::Q4_0>(nb, weights, rows, act, out),
            GgmlType::Q5_0 => matvec_with::<legacy::Q5_0>(nb, weights, rows, act, out),
            GgmlType::Q8_0 => matvec_with::<legacy::Q8_0>(nb, weights, rows, act, out),
            GgmlType::Q4_K => matvec_with::<kquant::Q4K>(nb, weights, rows, act, out),
            GgmlType::Q5_K => matvec_with::<kquant::Q5K>(nb, weights, rows, act, out),
            GgmlType::Q6_K => matvec_with::<kquant::Q6K>(nb, weights, rows, act, out),
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
                matmul_with::<float::F32, 2, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::F16 => {
                matmul_with::<float::F16, 2, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::BF16 => {
                matmul_with::<float::Bf16, 2, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q4_0 => {
                matmul_with::<legacy::Q4_0, 1, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q5_0 => {
                matmul_with::<legacy::Q5_0, 1, 4>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q8_0 => {
                matmul_with::<legacy::Q8_0, 1, 4>(nb, weights, rows, acts, m, out, out_stride)
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
///
/// Written as inline asm on purpose: with the intrinsics, LLVM sees that only lane 0
/// matters and loads the half with `vpinsrw` into whatever register is free. That merges
/// into the register's old contents, a false dependency that chained whole loop
/// iterations together (measured: 3-4x slower kernels).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_to_f32(h: u16) -> f32 {
    let x = _mm_cvtsi32_si128(h as i32);
    let y: __m128;
    // SAFETY: a register-only conversion; F16C is enabled for this function.
    unsafe {
        std::arch::asm!(
            "vcvtph2ps {y}, {x}",
            x = in(xmm_reg) x,
            y = lateout(xmm_reg) y,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    _mm_cvtss_f32(y)
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
