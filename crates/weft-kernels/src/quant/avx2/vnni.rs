//! AVX-512 VNNI matmul for the 32-value formats (Q8_0, Q5_0, Q4_0) against Q8_0
//! activations, a candidate for two or more tokens (batched decode, prefill) where the CPU
//! has it; matvec stays on AVX2, where a single token is bound by memory, not arithmetic.
//!
//! Why a separate driver: the AVX2 tile spends five ops per (block, token) pair (sign,
//! maddubs, madd, convert, FMA). Here a 512-bit register holds two blocks and one
//! `vpdpbusd` does their whole integer dot, so a pair of blocks costs four ops per token
//! (dot, convert, scale product, FMA), about 2.5x fewer. `vpdpbusd` multiplies unsigned
//! by signed bytes, so the activations are stored offset by 128 (a ^ 0x80 = a + 128) in
//! a per-call buffer, and the excess 128 * sum(w) is subtracted through the
//! accumulator's starting value, computed once per weight pair for all tokens. Both are
//! exact in i32, for every byte value including -128. Q5_0 and Q4_0 blocks are unpacked
//! to signed bytes (levels minus 16 or 8) once per weight pair and then take the same
//! path, so the unpacking is shared by the tile's eight tokens.

use std::arch::x86_64::*;
use std::ops::Range;

use super::legacy;
use super::tile::{f16_to_f32, load256, put, read_u16, PREFETCH_BYTES};

/// Blocks per column chunk: bounds the per-call activation buffers (32 KiB each).
const VCOLS: usize = 128;
/// Tokens per tile: eight accumulators plus the pair's weights stay in registers.
const VT: usize = 8;
/// Bytes of a Q8_0 activation block.
const QB: usize = 34;

/// A 32-value weight format as the tile reads it: an f16 scale in the block's first two
/// bytes and 32 signed levels.
pub(super) trait Signed {
    /// Bytes of one weight block.
    const WB: usize;
    /// The block's 32 levels as signed bytes.
    ///
    /// # Safety
    /// AVX2 present; `wp` points to a readable block of `WB` bytes.
    unsafe fn levels(wp: *const u8) -> __m256i;
}

impl Signed for legacy::Q8_0 {
    const WB: usize = QB;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels(wp: *const u8) -> __m256i {
        // SAFETY: the quants are bytes 2..34 of the block.
        unsafe { load256(wp.add(2)) }
    }
}

impl<L: legacy::Levels, const F: u8> Signed for legacy::Offset<L, F> {
    const WB: usize = L::WB;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels(wp: *const u8) -> __m256i {
        // SAFETY: forwarded from the caller. The levels are below 32, so the byte
        // subtraction cannot wrap.
        unsafe { _mm256_sub_epi8(L::levels(wp), _mm256_set1_epi8(L::OFFSET as i8)) }
    }
}

/// The activations of one token chunk and column chunk, laid out for the tile: quants
/// offset to unsigned, two blocks per 64 bytes, and each pair's scales as 16 lanes
/// (8 of block 2p, 8 of block 2p+1), zero for the padding block of an odd count.
#[repr(C, align(64))]
struct ActChunk {
    quants: [[u8; VCOLS * 32]; VT],
    scales: [[f32; VCOLS * 8]; VT],
}

/// Fills `chunk` for tokens `acts[t]` (t < tn), blocks `c0..c0 + cl` of each.
///
/// # Safety
/// AVX-512F/BW present; each `acts[t]` is readable for `(c0 + cl) * 34` bytes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn prepare(chunk: &mut ActChunk, acts: &[*const u8], c0: usize, cl: usize) {
    let pairs = cl.div_ceil(2);
    let flip = _mm256_set1_epi8(0x80u8 as i8);
    for (t, &a) in acts.iter().enumerate() {
        for b in 0..2 * pairs {
            let (q, d) = if b < cl {
                // SAFETY: block c0 + b is below c0 + cl.
                let p = unsafe { a.add((c0 + b) * QB) };
                (
                    _mm256_xor_si256(unsafe { load256(p.add(2)) }, flip),
                    f16_to_f32(unsafe { read_u16(p) }),
                )
            } else {
                (flip, 0.0)
            };
            // SAFETY: b < 2 * pairs <= VCOLS, inside both arrays.
            unsafe {
                _mm256_storeu_si256(chunk.quants[t].as_mut_ptr().add(32 * b).cast(), q);
                _mm256_storeu_ps(chunk.scales[t].as_mut_ptr().add(8 * b), _mm256_set1_ps(d));
            }
        }
    }
}

/// Dot products of one weight row (blocks from `rp`, `cl` of them) with the T prepared
/// tokens of `chunk`.
///
/// # Safety
/// AVX-512F/BW/VNNI present; `rp` is readable for `cl * W::WB` bytes; `chunk` was
/// prepared for at least T tokens and `cl` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn row_tile<W: Signed, const T: usize>(
    rp: *const u8,
    cl: usize,
    chunk: &ActChunk,
) -> [f32; T] {
    let mut acc = [_mm512_setzero_ps(); T];
    let offset = _mm512_set1_epi8(0x80u8 as i8);
    let mut b = 0;
    while b < cl {
        // SAFETY (this pair): block b is below cl, and b + 1 is read only when below cl;
        // the chunk holds pair b / 2 for every token below T.
        unsafe {
            let p0 = rp.add(b * W::WB);
            let (w1, d1) = if b + 1 < cl {
                let p1 = p0.add(W::WB);
                (W::levels(p1), f16_to_f32(read_u16(p1)))
            } else {
                (_mm256_setzero_si256(), 0.0)
            };
            let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(W::levels(p0)), w1);
            // (insertf64x4 of the 256-bit halves: insertf32x8 would need AVX-512DQ.)
            let dw = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(f16_to_f32(read_u16(p0))))),
                _mm256_castps_pd(_mm256_set1_ps(d1)),
            ));
            // Start at -128 * sum(w) per lane, cancelling the activations' offset.
            let start = _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, w),
            );
            for (t, a) in acc.iter_mut().enumerate() {
                let q = _mm512_loadu_si512(chunk.quants[t].as_ptr().add(32 * b).cast());
                let dot = _mm512_dpbusd_epi32(start, q, w);
                let s = _mm512_mul_ps(dw, _mm512_loadu_ps(chunk.scales[t].as_ptr().add(8 * b)));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, *a);
            }
        }
        b += 2;
    }
    acc.map(|a| _mm512_reduce_add_ps(a))
}

/// `out[t * out_stride + i] (+)= dot(row rows.start + i, token t)` for the T tokens of
/// the chunk, every row of the range; `first` writes, later column chunks add.
///
/// # Safety
/// As [`row_tile`] for every row of `rows` (rows of `rb` bytes from `w`, column offset
/// `c0` blocks); `out` covers `(T - 1) * out_stride + rows.len()` values.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn rows_tile<W: Signed, const T: usize>(
    w: *const u8,
    rb: usize,
    rows: Range<usize>,
    c0: usize,
    cl: usize,
    chunk: &ActChunk,
    out: &mut [f32],
    out_stride: usize,
    first: bool,
) {
    for (i, r) in rows.enumerate() {
        // SAFETY: the caller vouches for every row of the range.
        let rp = unsafe { w.add(r * rb + c0 * W::WB) };
        // Even 8 tokens leave this tile waiting on the weight stream: keep misses in
        // flight as matvec does (prefetches never fault; wrapping_add keeps the address
        // defined past the end).
        let mut off = 0;
        while off < cl * W::WB {
            _mm_prefetch::<_MM_HINT_T0>(rp.wrapping_add(PREFETCH_BYTES + off).cast());
            off += 64;
        }
        // SAFETY: forwarded from the caller.
        let v = unsafe { row_tile::<W, T>(rp, cl, chunk) };
        for (t, x) in v.into_iter().enumerate() {
            put(out, t * out_stride + i, x, first);
        }
    }
}

/// Matmul of format `W` with the VNNI tile; same contract as `matmul_with`.
///
/// # Safety
/// [`available`] returned true; `weights` holds `rows.end` rows of `nb` `W` blocks;
/// `acts` holds `m` activations of `nb` blocks; `out` covers
/// `(m - 1) * out_stride + rows.len()` values.
pub(super) unsafe fn matmul<W: Signed>(
    nb: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    if nb == 0 {
        for t in 0..m {
            out[t * out_stride..t * out_stride + rows.len()].fill(0.0);
        }
        return;
    }
    let (rb, ab) = (nb * W::WB, nb * QB);
    let mut chunk = ActChunk {
        quants: [[0; VCOLS * 32]; VT],
        scales: [[0.0; VCOLS * 8]; VT],
    };
    let mut ptrs = [std::ptr::null::<u8>(); VT];
    let mut c0 = 0;
    while c0 < nb {
        let cl = VCOLS.min(nb - c0);
        let mut t0 = 0;
        while t0 < m {
            let tn = VT.min(m - t0);
            for (t, p) in ptrs.iter_mut().enumerate().take(tn) {
                *p = acts[(t0 + t) * ab..].as_ptr();
            }
            let o = &mut out[t0 * out_stride..];
            let (w, rows) = (weights.as_ptr(), rows.clone());
            let first = c0 == 0;
            // SAFETY: the caller vouches for the sizes; every token pointer is below m.
            unsafe {
                prepare(&mut chunk, &ptrs[..tn], c0, cl);
                match tn {
                    8 => rows_tile::<W, 8>(w, rb, rows, c0, cl, &chunk, o, out_stride, first),
                    7 => rows_tile::<W, 7>(w, rb, rows, c0, cl, &chunk, o, out_stride, first),
                    6 => rows_tile::<W, 6>(w, rb, rows, c0, cl, &chunk, o, out_stride, first),
                    5 => rows_tile::<W, 5>(w, rb, rows, c0, cl, &chunk, o, out_stride, first),
                    4 => rows_tile::<W, 4>(w, rb, rows, c0, cl, &chunk, o, out_stride, first),
                    3 => rows_tile::<W, 3>(w, rb, rows, c0, cl, &chunk, o, out_stride, first),
                    2 => rows_tile::<W, 2>(w, rb, rows, c0, cl, &chunk, o, out_stride, first),
                    _ => rows_tile::<W, 1>(w, rb, rows, c0, cl, &chunk, o, out_stride, first),
                }
            }
            t0 += tn;
        }
        c0 += cl;
    }
}
