//! AVX2 tiles for the K formats (Q4_K, Q5_K, Q6_K) against Q8_K activations.
//!
//! A 256-value super-block has integer sub-block scales, so a whole super-block is summed
//! in i32 (`maddubs` of the unsigned levels with the activation, `madd` with the
//! broadcast scale) and converted to float once. Offsets are applied through the
//! activation's 16-value sums (`bsums`): mins for Q4_K/Q5_K, the constant 32 for Q6_K.
//! Rows are walked one at a time inside a tile (nothing row-specific is shared), tokens
//! innermost so each row's unpacked levels are reused for all T activations.
//!
//! Each type takes `const F: u8`, how the scale multiply-add is done ([`PLAIN`], [`VEX`],
//! [`EVEX`]): fused, the `madd` by the scales and the add into the super-block sum are
//! one `vpdpwssd`, one op fewer per 32 values and token. Which one runs is chosen by
//! timing them on the running CPU (see `quant::select`).

use std::arch::x86_64::*;

use super::tile::{
    f16_to_f32, fifth_bit, halves_to_f32, hsum_grid, load128, load256, read_u16, Tile,
};

pub(super) const Q8_K_AB: usize = 292;
pub(super) const Q8_K_QS: usize = 4;
pub(super) const Q8_K_BSUMS: usize = 260;

/// `madd` then `add` (AVX2 only).
pub const PLAIN: u8 = 0;
/// One AVX-VNNI `vpdpwssd` (VEX encoding; e.g. Intel Alder Lake, AMD Zen 5).
pub const VEX: u8 = 1;
/// One AVX-512 VNNI `vpdpwssd` on 256-bit registers (EVEX encoding, needs AVX512VL;
/// e.g. AMD Zen 4, which runs 256-bit EVEX ops at full rate).
pub const EVEX: u8 = 2;

/// `acc + OP(x, y)` as the VNNI instruction `$op` on 256-bit registers, in the encoding
/// `$f` says (VEX or EVEX); any other `$f` runs `$plain`. Written as asm so the AVX2
/// driver around it needs no extra target feature (intrinsics would not inline into it).
macro_rules! fused {
    ($op:literal, $f:expr, $acc:expr, $x:expr, $y:expr, $plain:expr) => {{
        let mut acc = $acc;
        // SAFETY (both asm blocks): register-only; the caller takes a fused form only
        // after detecting the CPU feature it needs.
        match $f {
            VEX => unsafe {
                std::arch::asm!(
                    concat!("{{vex}} ", $op, " {acc}, {x}, {y}"),
                    acc = inout(ymm_reg) acc,
                    x = in(ymm_reg) $x,
                    y = in(ymm_reg) $y,
                    options(pure, nomem, nostack, preserves_flags)
                );
            },
            EVEX => unsafe {
                std::arch::asm!(
                    concat!("{{evex}} ", $op, " {acc}, {x}, {y}"),
                    acc = inout(ymm_reg) acc,
                    x = in(ymm_reg) $x,
                    y = in(ymm_reg) $y,
                    options(pure, nomem, nostack, preserves_flags)
                );
            },
            _ => acc = $plain,
        }
        acc
    }};
}

/// `acc + madd(p, s)`: i16 pairs times the scales, summed into i32 lanes (`vpdpwssd`
/// fused); exact either way.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn madd_acc<const F: u8>(acc: __m256i, p: __m256i, s: __m256i) -> __m256i {
    fused!(
        "vpdpwssd",
        F,
        acc,
        p,
        s,
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, s))
    )
}

/// `acc + dot4(u, a)`: unsigned bytes times signed bytes, four products summed into each
/// i32 lane (`vpdpbusd`), in the form `F` says; PLAIN is `maddubs` then `madd` with ones,
/// exact where the pair sums stay within i16 (the callers' levels keep them there).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dpbusd_acc<const F: u8>(acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
    fused!(
        "vpdpbusd",
        F,
        acc,
        u,
        a,
        _mm256_add_epi32(
            acc,
            _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)),
        )
    )
}

/// `pshufb` pattern that repeats i16 lane `j` of each 128-bit half (broadcasts scale j).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn pick_i16(j: usize) -> __m256i {
    let lo = (2 * j) as i16;
    _mm256_set1_epi16(lo | ((lo + 1) << 8))
}

/// Broadcast of an activation super-block's f32 scale.
///
/// # Safety
/// `p` points to a readable Q8_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn act_d(p: *const u8) -> __m256 {
    // SAFETY: d is the first 4 bytes of the block (unaligned is fine for vbroadcastss).
    unsafe { _mm256_broadcast_ss(&*p.cast::<f32>()) }
}

/// Scales and mins of a Q4_K/Q5_K super-block as i16 vectors: the eight scales repeated
/// in both 128-bit halves (for `pick_i16`), and each min twice in a row, lined up with
/// the activation's sixteen 16-value sums so one `madd` gives min_j * sum of sub-block j.
/// The bit layout of blocks::scale_min_k4, for all sixteen values in a few vector ops.
///
/// # Safety
/// `sc` points to the 12 scale bytes, followed by at least 4 more readable bytes (the
/// block's quants).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scales_mins_k4(sc: *const u8) -> (__m256i, __m256i) {
    const M1: i32 = 0x3f3f_3f3f;
    const M2: i32 = 0x0f0f_0f0f;
    // SAFETY: 16 bytes: the 12 scale bytes and 4 quant bytes (u3, unused).
    let v = unsafe { load128(sc) };
    // u32 lanes (u0, u2, u1, u2) and (u0, u0, u1, u1).
    let a = _mm_shuffle_epi32::<0b10_01_10_00>(v);
    let b = _mm_shuffle_epi32::<0b01_01_00_00>(v);
    // Low bits: sc_lo = u0 & M1, sc_hi = u2 & M2, mn_lo = u1 & M1, mn_hi = (u2 >> 4) & M2.
    let low = _mm_and_si128(
        _mm_srlv_epi32(a, _mm_set_epi32(4, 0, 0, 0)),
        _mm_set_epi32(M2, M1, M2, M1),
    );
    // High bits of sc_hi / mn_hi: bits 6..8 of each byte of u0 / u1, moved to bits 4..6.
    let high = _mm_and_si128(
        _mm_srli_epi32::<2>(b),
        _mm_set_epi32(0x3030_3030, 0, 0x3030_3030, 0),
    );
    let r = _mm_or_si128(low, high);
    let mins = _mm_unpackhi_epi64(r, r);
    (
        _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(r, r)),
        _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins)),
    )
}

/// The two f16 values at `p` (a Q4_K/Q5_K block's d and dmin) as broadcast f32 vectors.
///
/// # Safety
/// `p` is readable for 4 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn two_halves(p: *const u8) -> (__m256, __m256) {
    // SAFETY: 4 readable bytes.
    let bits = unsafe { p.cast::<u32>().read_unaligned() };
    let y = halves_to_f32(bits);
    (
        _mm256_broadcastss_ps(y),
        _mm256_broadcastss_ps(_mm_movehdup_ps(y)),
    )
}

/// Shared driver of Q4_K/Q5_K; `L` extracts the levels of each 64-value chunk.
///
/// # Safety
/// As [`Tile::tile`] with `L::WB`-byte weight blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_tile<L: LevelsK, const R: usize, const T: usize, const F: u8>(
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
                let (d, dmin) = two_halves(wp);
                let (scales, mins) = scales_mins_k4(wp.add(4));
                let hbits = L::high_bits(wp);
                // Two sums per token, for the low and high halves of each chunk: a fused
                // multiply-add has a few cycles of latency, and one chain of eight per
                // block would leave a single token waiting on it.
                let mut isum = [_mm256_setzero_si256(); T];
                let mut isum2 = [_mm256_setzero_si256(); T];
                for c in 0..4 {
                    let (lo, hi) = L::levels(wp, hbits, c);
                    let s_lo = _mm256_shuffle_epi8(scales, pick_i16(2 * c));
                    let s_hi = _mm256_shuffle_epi8(scales, pick_i16(2 * c + 1));
                    for t in 0..T {
                        let qs = acts[t].add(b * Q8_K_AB + Q8_K_QS + 64 * c);
                        let p_lo = _mm256_maddubs_epi16(lo, load256(qs));
                        let p_hi = _mm256_maddubs_epi16(hi, load256(qs.add(32)));
                        isum[t] = madd_acc::<F>(isum[t], p_lo, s_lo);
                        isum2[t] = madd_acc::<F>(isum2[t], p_hi, s_hi);
                    }
                }
                for t in 0..T {
                    isum[t] = _mm256_add_epi32(isum[t], isum2[t]);
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
pub(super) trait LevelsK {
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

pub struct Q4K<const F: u8>;
pub struct Q5K<const F: u8>;
pub struct Q6K<const F: u8>;

impl<const F: u8> LevelsK for Q4K<F> {
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

impl<const F: u8> LevelsK for Q5K<F> {
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
        // SAFETY: qs is bytes 48..176; chunk c is 32 of them.
        let q = unsafe { load256(wp.add(48 + 32 * c)) };
        // Bit 2c of qh[l] is the fifth bit of value 64c+l, bit 2c+1 that of 64c+32+l:
        // shifted to bit 4 and masked, two operations a vector.
        // SAFETY: AVX2, as this function.
        let (h_lo, h_hi) = unsafe { (fifth_bit(hbits, 2 * c), fifth_bit(hbits, 2 * c + 1)) };
        (
            _mm256_or_si256(_mm256_and_si256(q, m4), h_lo),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4), h_hi),
        )
    }
}

impl<const F: u8> Tile for Q4K<F> {
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
        unsafe { k4_tile::<Self, R, T, F>(rows, acts, nb) }
    }
}

impl<const F: u8> Tile for Q5K<F> {
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
        unsafe { k4_tile::<Self, R, T, F>(rows, acts, nb) }
    }
}

/// `pshufb` pattern putting bytes 0, 2, .., 14 first and 1, 3, .., 15 after.
pub(super) const EVEN_ODD: __m128i = unsafe {
    // SAFETY: a plain 16-byte value reinterpreted as a vector.
    std::mem::transmute::<[u8; 16], __m128i>([0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15])
};

/// The levels (0..64, stored +32) of half `h` of a Q6_K block, quarter k being values
/// `128h + 32k ..+ 32`: a nibble of the low bits and two bits of `qh` as bits 4..6.
///
/// # Safety
/// `wp` points to a readable Q6_K block; h < 2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k_quarters(wp: *const u8, h: usize) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    // SAFETY: ql is bytes 0..128, qh 128..192.
    let (ql1, ql2, qh) = unsafe {
        (
            load256(wp.add(64 * h)),
            load256(wp.add(64 * h + 32)),
            load256(wp.add(128 + 32 * h)),
        )
    };
    [
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
    ]
}

impl<const F: u8> Tile for Q6K<F> {
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
                    // The sixteen scales as i16, even-numbered in the low 128-bit half and
                    // odd-numbered in the high one: the pair (2j, 2j+1) that a 32-value
                    // chunk needs (one scale per 16 values, per half) is then lane j of
                    // each half, one `pshufb` away.
                    let sc_eo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, EVEN_ODD));
                    // Levels are stored +32: start from -32 * sum_g scale_g * bsum_g.
                    let mut isum = [_mm256_setzero_si256(); T];
                    let mut isum2 = [_mm256_setzero_si256(); T];
                    for t in 0..T {
                        let bsums = load256(acts[t].add(b * Q8_K_AB + Q8_K_BSUMS));
                        isum[t] = _mm256_sub_epi32(
                            isum[t],
                            _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc16, bsums)),
                        );
                    }
                    for h in 0..2 {
                        let q = q6k_quarters(wp, h);
                        for (k, &qk) in q.iter().enumerate() {
                            let s = _mm256_shuffle_epi8(sc_eo, pick_i16(4 * h + k));
                            for t in 0..T {
                                let qa =
                                    load256(acts[t].add(b * Q8_K_AB + Q8_K_QS + 128 * h + 32 * k));
                                let p = _mm256_maddubs_epi16(qk, qa);
                                // Alternate two sums (see k4_tile).
                                if k % 2 == 0 {
                                    isum[t] = madd_acc::<F>(isum[t], p, s);
                                } else {
                                    isum2[t] = madd_acc::<F>(isum2[t], p, s);
                                }
                            }
                        }
                    }
                    for t in 0..T {
                        let isum = _mm256_add_epi32(isum[t], isum2[t]);
                        let v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum));
                        acc[r][t] = _mm256_fmadd_ps(v, act_d(acts[t].add(b * Q8_K_AB)), acc[r][t]);
                    }
                }
            }
        }
        hsum_grid(&acc)
    }
}
