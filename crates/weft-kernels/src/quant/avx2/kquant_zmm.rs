//! AVX-512 VNNI tiles for the K formats (Q4_K, Q5_K, Q6_K) on 512-bit registers, for two
//! tokens or more (batched decode, prefill).
//!
//! Why: the AVX2 tile spends two ops per 32 values and token (`maddubs`, then the scale
//! `madd`). Here one 512-bit `vpdpbusd` takes 64 values (the unsigned levels against the
//! signed activation bytes) into sixteen i32 sums of four products, and one `vpdpwssd`
//! multiplies each sum by its sub-block's scale and adds it up: two ops per 64 values.
//! A sum of four products stays within i16 for every K format (at most 4 x 63 x 128 =
//! 32256 for Q6_K), so `vpdpwssd` against the scale in the low i16 and zero in the high
//! one is an exact i32 multiply.
//!
//! Same results to the bit as the AVX2 tile: each i32 lane sums the same four bytes of
//! each sub-block (lane j of the low half bytes 4j..4j+4 of the even sub-block, of the
//! high half those of the odd one), the halves are added in i32 at the end of a
//! super-block (exact), and the float steps after are the AVX2 tile's. So it is one
//! more timed candidate, and a token sums alike alone (matvec on AVX2) and in a batch.

use std::arch::x86_64::*;

use super::kquant::{act_d, scales_mins_k4, two_halves, Q8_K_AB, Q8_K_BSUMS, Q8_K_QS};
use super::tile::{f16_to_f32, hsum_grid, load128, load256, read_u16, Tile};

/// `lo` and `hi` as the low and high halves of one 512-bit vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// i32 lanes holding `s` (an i16 scale) in the low half and zero in the high half, from
/// the sixteen signed scale bytes `sc` picked by `pick` (byte i of the result's source:
/// the scale of lane i).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn scale_lanes(sc: __m128i, pick: __m128i) -> __m512i {
    let wide = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(sc, pick));
    _mm512_and_si512(wide, _mm512_set1_epi32(0xFFFF))
}

/// `acc + scale * dot4(w, a)` per i32 lane: the fused 64-value step.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn step(acc: __m512i, w: __m512i, a: __m512i, s: __m512i) -> __m512i {
    let x = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
    _mm512_dpwssd_epi32(acc, x, s)
}

/// The sum of the two 256-bit halves' i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn fold(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// Levels of chunk c (64 values, two 32-value sub-blocks) of a Q4_K or Q5_K block.
trait LevelsZ {
    const WB: usize;
    /// Whatever the block keeps for all four chunks (Q5_K's qh, in both halves).
    ///
    /// # Safety
    /// `wp` points to a readable block.
    unsafe fn high_bits(wp: *const u8) -> __m512i;
    /// # Safety
    /// `wp` points to a readable block; c < 4.
    unsafe fn levels(wp: *const u8, hbits: __m512i, c: usize) -> __m512i;
}

pub struct Q4KZ;
pub struct Q5KZ;
pub struct Q6KZ;

impl LevelsZ for Q4KZ {
    const WB: usize = 144;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn high_bits(_wp: *const u8) -> __m512i {
        _mm512_setzero_si512()
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn levels(wp: *const u8, _hbits: __m512i, c: usize) -> __m512i {
        // SAFETY: qs is bytes 16..144; chunk c is 32 of them. Low nibbles are the even
        // sub-block, high nibbles the odd one.
        let q = unsafe { load256(wp.add(16 + 32 * c)) };
        _mm512_and_si512(join(q, _mm256_srli_epi16::<4>(q)), _mm512_set1_epi8(0x0F))
    }
}

impl LevelsZ for Q5KZ {
    const WB: usize = 176;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn high_bits(wp: *const u8) -> __m512i {
        // SAFETY: qh is bytes 16..48.
        let qh = unsafe { load256(wp.add(16)) };
        join(qh, qh)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn levels(wp: *const u8, hbits: __m512i, c: usize) -> __m512i {
        // SAFETY: qs is bytes 48..176; chunk c is 32 of them.
        let q = unsafe { load256(wp.add(48 + 32 * c)) };
        let low = _mm512_and_si512(join(q, _mm256_srli_epi16::<4>(q)), _mm512_set1_epi8(0x0F));
        // Bit 2c of qh[l] is the fifth bit of value 64c+l, bit 2c+1 that of 64c+32+l.
        let bits = join(
            _mm256_set1_epi8((1u8 << (2 * c)) as i8),
            _mm256_set1_epi8((2u8 << (2 * c)) as i8),
        );
        let fifth = _mm512_test_epi8_mask(hbits, bits);
        _mm512_or_si512(low, _mm512_maskz_mov_epi8(fifth, _mm512_set1_epi8(0x10)))
    }
}

/// `pshufb` pattern giving, per i32 lane of chunk c, the byte of `scales_mins_k4`'s low
/// half (scale k as i16 at byte 2k) that applies: scale 2c, then scale 2c + 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn k4_scale_pick(c: usize) -> __m128i {
    let (a, b) = ((4 * c) as i8, (4 * c + 2) as i8);
    _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
}

/// Two tokens' i32 sums folded to their AVX2 lanes side by side: `[fold(a) | fold(b)]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn fold_pair(a: __m512i, b: __m512i) -> __m512i {
    _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b01_00_01_00>(a, b),
        _mm512_shuffle_i64x2::<0b11_10_11_10>(a, b),
    )
}

/// Two 256-bit float vectors side by side.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn join_ps(lo: __m256, hi: __m256) -> __m512 {
    // (insertf64x4 of the halves: insertf32x8 would need AVX-512DQ.)
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
        _mm256_castps_pd(hi),
    ))
}

/// The tile's float accumulators back in the AVX2 tile's shape: pair p of `pairs` holds
/// tokens 2p and 2p+1; an odd last token sits in `last`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn unpair<const T: usize>(pairs: &[__m512; T], last: __m256) -> [__m256; T] {
    std::array::from_fn(|t| {
        if t + 1 == T && T % 2 == 1 {
            last
        } else if t % 2 == 0 {
            _mm512_castps512_ps256(pairs[t / 2])
        } else {
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(pairs[t / 2])))
        }
    })
}

/// Shared driver of Q4_K/Q5_K. The float steps after each super-block's integer sums
/// are the AVX2 tile's, lane for lane, done for two tokens per 512-bit op.
///
/// # Safety
/// As [`Tile::tile`] with `L::WB`-byte weight blocks, on a CPU with AVX-512 F/BW/VNNI.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn k4_tile<L: LevelsZ, const R: usize, const T: usize>(
    rows: [*const u8; R],
    acts: [*const u8; T],
    nb: usize,
) -> [[f32; T]; R] {
    let mut pairs = [[_mm512_setzero_ps(); T]; R];
    let mut last = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        for r in 0..R {
            // SAFETY (this block): block b of row r and of every activation is in bounds;
            // every read below stays inside those blocks.
            unsafe {
                let wp = rows[r].add(b * L::WB);
                let (d, dmin) = two_halves(wp);
                let (scales, mins) = scales_mins_k4(wp.add(4));
                // Scale k as i16 at bytes 2k, 2k+1 (below 64, so the high byte is 0).
                let sc = _mm256_castsi256_si128(scales);
                let hbits = L::high_bits(wp);
                let mut isum = [_mm512_setzero_si512(); T];
                for c in 0..4 {
                    let w = L::levels(wp, hbits, c);
                    let s = scale_lanes(sc, k4_scale_pick(c));
                    for (t, sum) in isum.iter_mut().enumerate() {
                        let qs = acts[t].add(b * Q8_K_AB + Q8_K_QS + 64 * c);
                        *sum = step(*sum, w, _mm512_loadu_si512(qs.cast()), s);
                    }
                }
                // d * sum(scale * q * a) - dmin * sum(min * bsum), times the act's d.
                let ap = |t: usize| acts[t].add(b * Q8_K_AB);
                let (d2, dmin2) = (join_ps(d, d), join_ps(dmin, dmin));
                let mins2 = join(mins, mins);
                let mut t = 0;
                while t + 2 <= T {
                    let bsums = join(
                        load256(ap(t).add(Q8_K_BSUMS)),
                        load256(ap(t + 1).add(Q8_K_BSUMS)),
                    );
                    let msum = _mm512_madd_epi16(mins2, bsums);
                    let m = _mm512_mul_ps(dmin2, _mm512_cvtepi32_ps(msum));
                    let sums = fold_pair(isum[t], isum[t + 1]);
                    let v = _mm512_fmsub_ps(d2, _mm512_cvtepi32_ps(sums), m);
                    let ad = join_ps(act_d(ap(t)), act_d(ap(t + 1)));
                    pairs[r][t / 2] = _mm512_fmadd_ps(v, ad, pairs[r][t / 2]);
                    t += 2;
                }
                if t < T {
                    let msum = _mm256_madd_epi16(mins, load256(ap(t).add(Q8_K_BSUMS)));
                    let m = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(msum));
                    let v = _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(fold(isum[t])), m);
                    last[r] = _mm256_fmadd_ps(v, act_d(ap(t)), last[r]);
                }
            }
        }
    }
    let acc: [[__m256; T]; R] = std::array::from_fn(|r| unpair(&pairs[r], last[r]));
    hsum_grid(&acc)
}

impl Tile for Q4KZ {
    const WB: usize = 144;
    const AB: usize = Q8_K_AB;
    const SCALES: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
        _as: [*const f32; T],
    ) -> [[f32; T]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { k4_tile::<Self, R, T>(rows, acts, nb) }
    }
}

impl Tile for Q5KZ {
    const WB: usize = 176;
    const AB: usize = Q8_K_AB;
    const SCALES: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
        _as: [*const f32; T],
    ) -> [[f32; T]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { k4_tile::<Self, R, T>(rows, acts, nb) }
    }
}

/// `pshufb` pattern for Q6_K's 64-value step `k` (0..4) of a block: lane i takes the
/// scale of sub-block 4k + i/4 (sixteen values each).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn k6_scale_pick(k: usize) -> __m128i {
    let s = |i: i8| (4 * k) as i8 + i;
    _mm_setr_epi8(
        s(0),
        s(0),
        s(0),
        s(0),
        s(1),
        s(1),
        s(1),
        s(1),
        s(2),
        s(2),
        s(2),
        s(2),
        s(3),
        s(3),
        s(3),
        s(3),
    )
}

impl Tile for Q6KZ {
    const WB: usize = 210;
    const AB: usize = Q8_K_AB;
    const SCALES: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
        _as: [*const f32; T],
    ) -> [[f32; T]; R] {
        let m4 = _mm512_set1_epi8(0x0F);
        let m30 = _mm512_set1_epi8(0x30);
        let mut pairs = [[_mm512_setzero_ps(); T]; R];
        let mut last = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            for r in 0..R {
                // SAFETY (this block): block b of row r and of every activation is in
                // bounds; every read below stays inside those blocks.
                unsafe {
                    let wp = rows[r].add(b * 210);
                    let d = _mm256_set1_ps(f16_to_f32(read_u16(wp.add(208))));
                    let sc8 = load128(wp.add(192));
                    let sc16 = _mm256_cvtepi8_epi16(sc8);
                    let mut isum = [_mm512_setzero_si512(); T];
                    let mut isum2 = [_mm512_setzero_si512(); T];
                    for h in 0..2 {
                        // Quarters 0|1 and 2|3 of this half (128 values): the low nibbles
                        // of ql1|ql2 (one 64-byte load) and then their high nibbles, with
                        // bits 2k..2k+2 of qh as bits 4..6.
                        let ql = _mm512_loadu_si512(wp.add(64 * h).cast());
                        let qh = load256(wp.add(128 + 32 * h));
                        let qh2 = join(qh, qh);
                        let q01 = _mm512_or_si512(
                            _mm512_and_si512(ql, m4),
                            _mm512_and_si512(
                                _mm512_sllv_epi64(qh2, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2)),
                                m30,
                            ),
                        );
                        let q23 = _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                            _mm512_and_si512(
                                _mm512_srlv_epi64(qh2, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)),
                                m30,
                            ),
                        );
                        for (p, &w) in [q01, q23].iter().enumerate() {
                            let s = scale_lanes(sc8, k6_scale_pick(2 * h + p));
                            for t in 0..T {
                                let qa = acts[t].add(b * Q8_K_AB + Q8_K_QS + 128 * h + 64 * p);
                                let a = _mm512_loadu_si512(qa.cast());
                                if p == 0 {
                                    isum[t] = step(isum[t], w, a, s);
                                } else {
                                    isum2[t] = step(isum2[t], w, a, s);
                                }
                            }
                        }
                    }
                    // Levels are stored +32: take -32 * sum_g scale_g * bsum_g off, in the
                    // AVX2 tile's lanes (its starting value there), after the folding; the
                    // float steps are the AVX2 tile's, two tokens per 512-bit op.
                    let ap = |t: usize| acts[t].add(b * Q8_K_AB);
                    let (sc2, d2) = (join(sc16, sc16), join_ps(d, d));
                    let mut t = 0;
                    while t + 2 <= T {
                        let bsums = join(
                            load256(ap(t).add(Q8_K_BSUMS)),
                            load256(ap(t + 1).add(Q8_K_BSUMS)),
                        );
                        let off = _mm512_sub_epi32(
                            _mm512_setzero_si512(),
                            _mm512_slli_epi32::<5>(_mm512_madd_epi16(sc2, bsums)),
                        );
                        let sums = _mm512_add_epi32(
                            off,
                            fold_pair(
                                _mm512_add_epi32(isum[t], isum2[t]),
                                _mm512_add_epi32(isum[t + 1], isum2[t + 1]),
                            ),
                        );
                        let v = _mm512_mul_ps(d2, _mm512_cvtepi32_ps(sums));
                        let ad = join_ps(act_d(ap(t)), act_d(ap(t + 1)));
                        pairs[r][t / 2] = _mm512_fmadd_ps(v, ad, pairs[r][t / 2]);
                        t += 2;
                    }
                    if t < T {
                        let off = _mm256_sub_epi32(
                            _mm256_setzero_si256(),
                            _mm256_slli_epi32::<5>(_mm256_madd_epi16(
                                sc16,
                                load256(ap(t).add(Q8_K_BSUMS)),
                            )),
                        );
                        let sums = _mm256_add_epi32(off, fold(_mm512_add_epi32(isum[t], isum2[t])));
                        let v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sums));
                        last[r] = _mm256_fmadd_ps(v, act_d(ap(t)), last[r]);
                    }
                }
            }
        }
        let acc: [[__m256; T]; R] = std::array::from_fn(|r| unpair(&pairs[r], last[r]));
        hsum_grid(&acc)
    }
}
