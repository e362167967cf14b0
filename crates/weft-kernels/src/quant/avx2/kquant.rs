//! AVX2 tiles for the K formats (Q4_K, Q5_K, Q6_K) against Q8_K activations.
//!
//! A 256-value super-block has integer sub-block scales, so a whole super-block is summed
//! in i32 (`maddubs` of the unsigned levels with the activation, `madd` with the
//! broadcast scale) and converted to float once. Offsets are applied through the
//! activation's 16-value sums (`bsums`): mins for Q4_K/Q5_K, the constant 32 for Q6_K.
//! Rows are walked one at a time inside a tile (nothing row-specific is shared), tokens
//! innermost so each row's unpacked levels are reused for all T activations.
//!
//! Each type takes `const VNNI: bool`: with it, the `madd` by the scales and the add
//! into the super-block sum fuse into one AVX-VNNI `vpdpwssd`, one op fewer per 32 values
//! and token (the matmul driver picks it where the CPU has AVX-VNNI).

use std::arch::x86_64::*;

use super::tile::{f16_to_f32, hsum_grid, load128, load256, read_u16, Tile};

const Q8_K_AB: usize = 292;
const Q8_K_QS: usize = 4;
const Q8_K_BSUMS: usize = 260;

/// `acc + madd(p, s)`: i16 pairs times the scales, summed into i32 lanes. With VNNI one
/// `vpdpwssd` (VEX form), written as asm so the AVX2 driver around it needs no extra
/// target feature (intrinsics would not inline into it); exact either way.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn madd_acc<const VNNI: bool>(acc: __m256i, p: __m256i, s: __m256i) -> __m256i {
    if VNNI {
        let mut acc = acc;
        // SAFETY: register-only; the driver takes VNNI only after detecting AVX-VNNI.
        unsafe {
            std::arch::asm!(
                "{{vex}} vpdpwssd {acc}, {p}, {s}",
                acc = inout(ymm_reg) acc,
                p = in(ymm_reg) p,
                s = in(ymm_reg) s,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        acc
    } else {
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, s))
    }
}

/// `pshufb` pattern that repeats i16 lane `j` of each 128-bit half (broadcasts scale j).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pick_i16(j: usize) -> __m256i {
    let lo = (2 * j) as i16;
    _mm256_set1_epi16(lo | ((lo + 1) << 8))
}

/// Broadcast of an activation super-block's f32 scale.
///
/// # Safety
/// `p` points to a readable Q8_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn act_d(p: *const u8) -> __m256 {
    // SAFETY: d is the first 4 bytes of the block (unaligned is fine for vbroadcastss).
    unsafe { _mm256_broadcast_ss(&*p.cast::<f32>()) }
}

/// Scales and mins of a Q4_K/Q5_K super-block as i16 vectors: the eight scales repeated
/// in both 128-bit halves (for `pick_i16`), and each min twice in a row, lined up with
/// the activation's sixteen 16-value sums so one `madd` gives min_j * sum of sub-block j.
///
/// # Safety
/// `sc` points to the 12 readable scale bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales_mins_k4(sc: *const u8) -> (__m256i, __m256i) {
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
    let scales = _mm256_cvtepu8_epi16(_mm_set_epi32(
        sc_hi as i32,
        sc_lo as i32,
        sc_hi as i32,
        sc_lo as i32,
    ));
    let mins = _mm_set_epi32(0, 0, mn_hi as i32, mn_lo as i32);
    (scales, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins)))
}

/// Shared driver of Q4_K/Q5_K; `L` extracts the levels of each 64-value chunk.
///
/// # Safety
/// As [`Tile::tile`] with `L::WB`-byte weight blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_tile<L: LevelsK, const R: usize, const T: usize, const VNNI: bool>(
    rows: [*const u8; R],
    acts: [*const u8; T],
    nb: usize,
) -> [[f32; T]; R] {
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for b in 0..nb {
        for r in 0..R {
            // SAFETY (this block): block b of row r and of every activation is in bounds;
            // every read below stays inside those blocks.
            unsafe {
                let wp = rows[r].add(b * L::WB);
                let d = _mm256_set1_ps(f16_to_f32(read_u16(wp)));
                let dmin = _mm256_set1_ps(f16_to_f32(read_u16(wp.add(2))));
                let (scales, mins) = scales_mins_k4(wp.add(4));
                let hbits = L::high_bits(wp);
                let mut isum = [_mm256_setzero_si256(); T];
                for c in 0..4 {
                    let (lo, hi) = L::levels(wp, hbits, c);
                    let s_lo = _mm256_shuffle_epi8(scales, pick_i16(2 * c));
                    let s_hi = _mm256_shuffle_epi8(scales, pick_i16(2 * c + 1));
                    for t in 0..T {
                        let qs = acts[t].add(b * Q8_K_AB + Q8_K_QS + 64 * c);
                        let p_lo = _mm256_maddubs_epi16(lo, load256(qs));
                        let p_hi = _mm256_maddubs_epi16(hi, load256(qs.add(32)));
                        isum[t] = madd_acc::<VNNI>(isum[t], p_lo, s_lo);
                        isum[t] = madd_acc::<VNNI>(isum[t], p_hi, s_hi);
                    }
                }
                for t in 0..T {
                    let ap = acts[t].add(b * Q8_K_AB);
                    // d * sum(scale * q * a) - dmin * sum(min * bsum), times the act's d.
                    let msum = _mm256_madd_epi16(mins, load256(ap.add(Q8_K_BSUMS)));
                    let m = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(msum));
                    let v = _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(isum[t]), m);
                    acc[r][t] = _mm256_fmadd_ps(v, act_d(ap), acc[r][t]);
                }
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

pub struct Q4K<const VNNI: bool>;
pub struct Q5K<const VNNI: bool>;
pub struct Q6K<const VNNI: bool>;

impl<const VNNI: bool> LevelsK for Q4K<VNNI> {
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

impl<const VNNI: bool> LevelsK for Q5K<VNNI> {
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

impl<const VNNI: bool> Tile for Q4K<VNNI> {
    const WB: usize = 144;
    const AB: usize = Q8_K_AB;
    const SCALES: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
        _as: [*const f32; T],
    ) -> [[f32; T]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { k4_tile::<Self, R, T, VNNI>(rows, acts, nb) }
    }
}

impl<const VNNI: bool> Tile for Q5K<VNNI> {
    const WB: usize = 176;
    const AB: usize = Q8_K_AB;
    const SCALES: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
        _as: [*const f32; T],
    ) -> [[f32; T]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { k4_tile::<Self, R, T, VNNI>(rows, acts, nb) }
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

impl<const VNNI: bool> Tile for Q6K<VNNI> {
    const WB: usize = 210;
    const AB: usize = Q8_K_AB;
    const SCALES: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
        _as: [*const f32; T],
    ) -> [[f32; T]; R] {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for b in 0..nb {
            for r in 0..R {
                // SAFETY (this block): block b of row r and of every activation is in
                // bounds; every read below stays inside those blocks.
                unsafe {
                    let wp = rows[r].add(b * 210);
                    let d = _mm256_set1_ps(f16_to_f32(read_u16(wp.add(208))));
                    let sc8 = load128(wp.add(192));
                    let sc16 = _mm256_cvtepi8_epi16(sc8);
                    // Levels are stored +32: start from -32 * sum_g scale_g * bsum_g.
                    let mut isum = [_mm256_setzero_si256(); T];
                    for t in 0..T {
                        let bsums = load256(acts[t].add(b * Q8_K_AB + Q8_K_BSUMS));
                        isum[t] = _mm256_sub_epi32(
                            isum[t],
                            _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc16, bsums)),
                        );
                    }
                    for h in 0..2 {
                        let (ql1, ql2, qh) = (
                            load256(wp.add(64 * h)),
                            load256(wp.add(64 * h + 32)),
                            load256(wp.add(128 + 32 * h)),
                        );
                        // Quarter k: a nibble of ql1/ql2, and bits 2k..2k+2 of qh as bits 4..6.
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
                        for (k, &qk) in q.iter().enumerate() {
                            let s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                                sc8,
                                pick_pair(8 * h + 2 * k),
                            ));
                            for t in 0..T {
                                let qa =
                                    load256(acts[t].add(b * Q8_K_AB + Q8_K_QS + 128 * h + 32 * k));
                                let p = _mm256_maddubs_epi16(qk, qa);
                                isum[t] = madd_acc::<VNNI>(isum[t], p, s);
                            }
                        }
                    }
                    for t in 0..T {
                        let v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum[t]));
                        acc[r][t] = _mm256_fmadd_ps(v, act_d(acts[t].add(b * Q8_K_AB)), acc[r][t]);
                    }
                }
            }
        }
        hsum_grid(&acc)
    }
}
