//! AVX2 tiles for the K formats (Q4_K, Q5_K, Q6_K) against Q8_K activations.
//!
//! A 256-value super-block has integer sub-block scales, so a whole super-block is summed
//! in i32 (`maddubs` of the unsigned levels with the activation, `madd` with the
//! broadcast scale) and converted to float once. Offsets are applied through the
//! activation's 16-value sums (`bsums`): mins for Q4_K/Q5_K, the constant 32 for Q6_K.
//! Rows are walked one at a time inside a tile (nothing row-specific is shared), tokens
//! innermost so each row's unpacked levels are reused for all T activations.

use super::*;

const Q8_K_AB: usize = 292;
const Q8_K_QS: usize = 4;
const Q8_K_BSUMS: usize = 260;

/// `pshufb` pattern that repeats i16 lane `j` of each 128-bit half (broadcasts scale j).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pick_i16(j: usize) -> __m256i {
    let lo = (2 * j) as i16;
    _mm256_set1_epi16(lo | ((lo + 1) << 8))
}

/// Per-token data of one activation super-block.
#[derive(Clone, Copy)]
struct ActK {
    d: f32,
    qs: *const u8,
    /// Sums of each 32-value sub-block (8 x i16), for the Q4_K/Q5_K mins.
    sums32: __m128i,
    /// Sums of each 16-value group (16 x i16), for the Q6_K offset.
    sums16: __m256i,
}

/// # Safety
/// `p` points to a readable 292-byte Q8_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn act_k(p: *const u8) -> ActK {
    // SAFETY: d, qs and bsums are inside the block.
    let (d, sums16) = unsafe { (read_f32(p), load256(p.add(Q8_K_BSUMS))) };
    let sums32 = _mm_hadd_epi16(
        _mm256_castsi256_si128(sums16),
        _mm256_extracti128_si256::<1>(sums16),
    );
    ActK {
        d,
        qs: unsafe { p.add(Q8_K_QS) },
        sums32,
        sums16,
    }
}

/// Scales (bytes 0..8) and mins (8..16) of a Q4_K/Q5_K super-block, as i16 vectors: the
/// eight scales repeated in both 128-bit halves, and the eight mins.
///
/// # Safety
/// `sc` points to the 12 readable scale bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales_mins_k4(sc: *const u8) -> (__m256i, __m128i) {
    const M1: u32 = 0x3f3f_3f3f;
    const M2: u32 = 0x0f0f_0f0f;
    const M3: u32 = 0x0303_0303;
    // SAFETY: 12 bytes, read as three unaligned u32.
    let (u0, u1, u2) = unsafe {
        let p = sc.cast::<u32>();
        (
            p.read_unaligned(),
            p.add(1).read_unaligned(),
            p.add(2).read_unaligned(),
        )
    };
    // The bit layout of blocks::scale_min_k4, for all eight sub-blocks at once.
    let sc_lo = u0 & M1;
    let sc_hi = (u2 & M2) | (((u0 >> 6) & M3) << 4);
    let mn_lo = u1 & M1;
    let mn_hi = ((u2 >> 4) & M2) | (((u1 >> 6) & M3) << 4);
    let packed = _mm_set_epi32(mn_hi as i32, mn_lo as i32, sc_hi as i32, sc_lo as i32);
    let wide = _mm256_cvtepu8_epi16(packed);
    let scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(wide));
    (scales, _mm256_extracti128_si256::<1>(wide))
}

/// Shared driver of Q4_K/Q5_K: `levels(wp, c)` gives the (low, high) 32-value level
/// vectors of chunk c (values 64c..64c+32 and 64c+32..64c+64).
///
/// # Safety
/// As [`Tile::tile`] with `WB`-byte weight blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_tile<L: LevelsK, const R: usize, const T: usize>(
    rows: [*const u8; R],
    acts: [*const u8; T],
    nb: usize,
) -> [[f32; T]; R] {
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for b in 0..nb {
        let mut a = [ActK {
            d: 0.0,
            qs: acts[0],
            sums32: _mm_setzero_si128(),
            sums16: _mm256_setzero_si256(),
        }; T];
        for t in 0..T {
            // SAFETY: block b of activation t is in bounds.
            a[t] = unsafe { act_k(acts[t].add(b * Q8_K_AB)) };
        }
        for r in 0..R {
            // SAFETY: block b of row r is in bounds; every read below stays in the block.
            let wp = unsafe { rows[r].add(b * L::WB) };
            let (d, dmin) = unsafe { (f16_to_f32(read_u16(wp)), f16_to_f32(read_u16(wp.add(2)))) };
            let (scales, mins) = unsafe { scales_mins_k4(wp.add(4)) };
            let hbits = unsafe { L::high_bits(wp) };
            let mut isum = [_mm256_setzero_si256(); T];
            for c in 0..4 {
                let (lo, hi) = unsafe { L::levels(wp, hbits, c) };
                let s_lo = _mm256_shuffle_epi8(scales, pick_i16(2 * c));
                let s_hi = _mm256_shuffle_epi8(scales, pick_i16(2 * c + 1));
                for t in 0..T {
                    // SAFETY: chunk c of the activation's 256 quants.
                    let (q_lo, q_hi) = unsafe {
                        (
                            load256(a[t].qs.add(64 * c)),
                            load256(a[t].qs.add(64 * c + 32)),
                        )
                    };
                    let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, q_lo), s_lo);
                    let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, q_hi), s_hi);
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(p_lo, p_hi));
                }
            }
            for t in 0..T {
                let main = _mm256_cvtepi32_ps(isum[t]);
                acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[t].d), main, acc[r][t]);
                // Subtract dmin * sum_j min_j * (sum of a over sub-block j).
                let m = _mm256_cvtepi32_ps(_mm256_set_m128i(
                    _mm_setzero_si128(),
                    _mm_madd_epi16(mins, a[t].sums32),
                ));
                acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * a[t].d), m, acc[r][t]);
            }
        }
    }
    hsum_grid(&acc)
}

/// Level extraction of Q4_K (nibbles) and Q5_K (nibbles plus a fifth bit).
trait LevelsK {
    const WB: usize;
    /// Whatever the block keeps for all four chunks (Q5_K's qh).
    ///
    /// # Safety
    /// `wp` points to a readable block.
    unsafe fn high_bits(wp: *const u8) -> __m256i;
    /// # Safety
    /// `wp` points to a readable block; c < 4.
    unsafe fn levels(wp: *const u8, hbits: __m256i, c: usize) -> (__m256i, __m256i);
}

pub struct Q4K;
pub struct Q5K;
pub struct Q6K;

impl LevelsK for Q4K {
    const WB: usize = 144;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn high_bits(_wp: *const u8) -> __m256i {
        _mm256_setzero_si256()
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels(wp: *const u8, _hbits: __m256i, c: usize) -> (__m256i, __m256i) {
        let m4 = _mm256_set1_epi8(0x0F);
        // SAFETY: qs is bytes 16..144; chunk c is 32 of them.
        let q = unsafe { load256(wp.add(16 + 32 * c)) };
        (
            _mm256_and_si256(q, m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4),
        )
    }
}

impl LevelsK for Q5K {
    const WB: usize = 176;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn high_bits(wp: *const u8) -> __m256i {
        // SAFETY: qh is bytes 16..48.
        unsafe { load256(wp.add(16)) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels(wp: *const u8, hbits: __m256i, c: usize) -> (__m256i, __m256i) {
        let m4 = _mm256_set1_epi8(0x0F);
        let sixteen = _mm256_set1_epi8(0x10);
        // SAFETY: qs is bytes 48..176; chunk c is 32 of them.
        let q = unsafe { load256(wp.add(48 + 32 * c)) };
        // Bit 2c of qh[l] is the fifth bit of value 64c+l, bit 2c+1 that of 64c+32+l.
        let bit_lo = _mm256_set1_epi8((1u8 << (2 * c)) as i8);
        let bit_hi = _mm256_set1_epi8((2u8 << (2 * c)) as i8);
        let h_lo = _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(hbits, bit_lo), bit_lo),
            sixteen,
        );
        let h_hi = _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(hbits, bit_hi), bit_hi),
            sixteen,
        );
        (
            _mm256_or_si256(_mm256_and_si256(q, m4), h_lo),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4), h_hi),
        )
    }
}

impl Tile for Q4K {
    const WB: usize = 144;
    const AB: usize = Q8_K_AB;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
    ) -> [[f32; T]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { k4_tile::<Self, R, T>(rows, acts, nb) }
    }
}

impl Tile for Q5K {
    const WB: usize = 176;
    const AB: usize = Q8_K_AB;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
    ) -> [[f32; T]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { k4_tile::<Self, R, T>(rows, acts, nb) }
    }
}

/// `pshufb` pattern for Q6_K scales: bytes 0..8 take scale i, 8..16 scale i+1 (one per
/// 16-value group of a 32-value chunk).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pick_pair(i: usize) -> __m128i {
    let rep = 0x0101_0101_0101_0101u64;
    _mm_set_epi64x((rep * (i as u64 + 1)) as i64, (rep * i as u64) as i64)
}

impl Tile for Q6K {
    const WB: usize = 210;
    const AB: usize = Q8_K_AB;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
    ) -> [[f32; T]; R] {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for b in 0..nb {
            let mut a = [ActK {
                d: 0.0,
                qs: acts[0],
                sums32: _mm_setzero_si128(),
                sums16: _mm256_setzero_si256(),
            }; T];
            for t in 0..T {
                // SAFETY: block b of activation t is in bounds.
                a[t] = unsafe { act_k(acts[t].add(b * Q8_K_AB)) };
            }
            for r in 0..R {
                // SAFETY: block b of row r is in bounds; every read below stays in the block.
                let wp = unsafe { rows[r].add(b * 210) };
                let d = f16_to_f32(unsafe { read_u16(wp.add(208)) });
                let sc8 = unsafe { load128(wp.add(192)) };
                let sc16 = _mm256_cvtepi8_epi16(sc8);
                // Levels are stored +32: start from -32 * sum_g scale_g * bsum_g.
                let mut isum = [_mm256_setzero_si256(); T];
                for t in 0..T {
                    isum[t] = _mm256_sub_epi32(
                        isum[t],
                        _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc16, a[t].sums16)),
                    );
                }
                for h in 0..2 {
                    let (ql1, ql2, qh) = unsafe {
                        (
                            load256(wp.add(64 * h)),
                            load256(wp.add(64 * h + 32)),
                            load256(wp.add(128 + 32 * h)),
                        )
                    };
                    // Quarter k takes a nibble of ql1/ql2 and bits 2k..2k+2 of qh as bits 4..6.
                    let q = [
                        _mm256_or_si256(
                            _mm256_and_si256(ql1, m4),
                            _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(ql2, m4),
                            _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                            _mm256_and_si256(qh, m30),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(ql2), m4),
                            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
                        ),
                    ];
                    let mut s = [_mm256_setzero_si256(); 4];
                    for k in 0..4 {
                        s[k] =
                            _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick_pair(8 * h + 2 * k)));
                    }
                    for t in 0..T {
                        for k in 0..4 {
                            // SAFETY: quants 128h+32k.. of the activation block.
                            let qa = unsafe { load256(a[t].qs.add(128 * h + 32 * k)) };
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], qa), s[k]);
                            isum[t] = _mm256_add_epi32(isum[t], p);
                        }
                    }
                }
                for t in 0..T {
                    acc[r][t] = _mm256_fmadd_ps(
                        _mm256_set1_ps(d * a[t].d),
                        _mm256_cvtepi32_ps(isum[t]),
                        acc[r][t],
                    );
                }
            }
        }
        hsum_grid(&acc)
    }
}
