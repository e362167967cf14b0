//! What the kernel files share: the [`Tile`] trait every weight format implements, the
//! column-chunk and prefetch constants, and small AVX2 helpers (unaligned loads, f16 scales,
//! horizontal sums).

use std::arch::x86_64::*;

/// R weight rows dotted with T activations over `nb` blocks.
pub(super) trait Tile {
    /// Bytes of one weight block.
    const WB: usize;
    /// Bytes of the matching activation block.
    const AB: usize;
    /// Whether the tile reads the activation's per-block f32 scales, prepared by the
    /// driver once per activation.
    const SCALES: bool;
    /// Whether it also reads the sum of each activation block's quants.
    const SUMS: bool = false;

    /// Returns `out[r][t] = dot(rows[r], acts[t])`. When `SCALES`, `as_[t]` holds the
    /// f32 value of each activation block's f16 scale, zero-padded to `cp` = nb rounded
    /// up to 8; when `SUMS`, `as_[t] + cp` holds the block sums, padded alike. Otherwise
    /// `as_` is not read.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; each `rows[r]` is readable for `nb * WB` bytes,
    /// each `acts[t]` for `nb * AB` bytes, and the scale records as described.
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
        as_: [*const f32; T],
    ) -> [[f32; T]; R];
}

/// Blocks per column chunk for the formats with driver-made activation records (bounds
/// the stack buffers; rows up to 16384 values of the 32-value formats take one chunk,
/// longer ones are summed chunk by chunk).
pub(super) const COLS: usize = 512;
/// Activation bytes a matmul's token chunk may take, so it stays in L2 while every row
/// (or group of rows) of the range is dotted with it.
pub(super) const ACT_CHUNK_BYTES: usize = 192 * 1024;
/// How far ahead of the decode stream to prefetch (a few rows of the head).
pub(super) const PREFETCH_BYTES: usize = 2560;

/// The f16 scales of blocks i..i+8 (of `stride` bytes from `p`) as f32, one
/// `vcvtph2ps`; blocks at or past `count` read as 0.
///
/// # Safety
/// `p + j * stride` is readable for 2 bytes for every j < count.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scales8(p: *const u8, stride: usize, i: usize, count: usize) -> __m256 {
    let h = if i + 8 <= count {
        // SAFETY: blocks i..i+8 are below count.
        let h = |k: usize| unsafe { read_u16(p.add((i + k) * stride)) as i16 };
        _mm_set_epi16(h(7), h(6), h(5), h(4), h(3), h(2), h(1), h(0))
    } else {
        // SAFETY: only blocks below count are read.
        let h = |k: usize| {
            if i + k < count {
                unsafe { read_u16(p.add((i + k) * stride)) as i16 }
            } else {
                0
            }
        };
        _mm_set_epi16(h(7), h(6), h(5), h(4), h(3), h(2), h(1), h(0))
    };
    _mm256_cvtph_ps(h)
}

/// The sum of the 32 quants of the Q8_0 block at `p`.
///
/// # Safety
/// `p` points to a readable Q8_0 block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_0_quant_sum(p: *const u8) -> i32 {
    // SAFETY: the quants are the block's bytes 2..34.
    let q = unsafe { load256(p.add(2)) };
    let s = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_set1_epi8(1), q),
        _mm256_set1_epi16(1),
    );
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Writes a tile result, or adds it for the second and later column chunks.
#[inline(always)]
pub(super) fn put(out: &mut [f32], i: usize, v: f32, first: bool) {
    if first {
        out[i] = v;
    } else {
        out[i] += v;
    }
}

/// Unaligned 32-byte load.
///
/// # Safety
/// `p` is readable for 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load256(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes; loadu has no alignment need.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// Unaligned 16-byte load.
///
/// # Safety
/// `p` is readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load128(p: *const u8) -> __m128i {
    // SAFETY: the caller guarantees 16 readable bytes; loadu has no alignment need.
    unsafe { _mm_loadu_si128(p.cast()) }
}

/// Unaligned little-endian u16 read.
///
/// # Safety
/// `p` is readable for 2 bytes.
#[inline(always)]
pub(super) unsafe fn read_u16(p: *const u8) -> u16 {
    // SAFETY: the caller guarantees 2 readable bytes.
    unsafe { p.cast::<u16>().read_unaligned() }
}

/// Unaligned little-endian f32 read.
///
/// # Safety
/// `p` is readable for 4 bytes.
#[inline(always)]
pub(super) unsafe fn read_f32(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 4 readable bytes.
    unsafe { p.cast::<f32>().read_unaligned() }
}

/// The two IEEE halves in `bits` (low first) as f32 lanes 0 and 1, with the F16C
/// instruction (no table, no branch).
///
/// Written as inline asm on purpose: with the intrinsics, LLVM sees that only the low
/// lanes matter and loads the halves with `vpinsrw` into whatever register is free. That
/// merges into the register's old contents, a false dependency that chained whole loop
/// iterations together (measured: 3-4x slower kernels).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn halves_to_f32(bits: u32) -> __m128 {
    let x = _mm_cvtsi32_si128(bits as i32);
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
    y
}

/// IEEE half -> f32 (see [`halves_to_f32`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16_to_f32(h: u16) -> f32 {
    _mm_cvtss_f32(halves_to_f32(h as u32))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Horizontal sums of an R x T grid of accumulators.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_grid<const R: usize, const T: usize>(acc: &[[__m256; T]; R]) -> [[f32; T]; R] {
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum_ps(acc[r][t]);
        }
    }
    out
}

/// Bit `v` (0..8) of each byte of a plane of fifth bits, moved to bit 4 and alone there:
/// what a level vector ORs in. 16-bit shifts: what crosses into the next byte lands below
/// bit 4 or above it, and the mask drops it. `v` is a constant once the callers' loops
/// unroll.
///
/// # Safety
/// The CPU runs AVX2 (every driver here is compiled for it).
#[inline(always)]
pub(super) unsafe fn fifth_bit(plane: __m256i, v: usize) -> __m256i {
    let at4 = match v {
        0 => _mm256_slli_epi16::<4>(plane),
        1 => _mm256_slli_epi16::<3>(plane),
        2 => _mm256_slli_epi16::<2>(plane),
        3 => _mm256_slli_epi16::<1>(plane),
        4 => plane,
        5 => _mm256_srli_epi16::<1>(plane),
        6 => _mm256_srli_epi16::<2>(plane),
        _ => _mm256_srli_epi16::<3>(plane),
    };
    _mm256_and_si256(at4, _mm256_set1_epi8(0x10))
}
