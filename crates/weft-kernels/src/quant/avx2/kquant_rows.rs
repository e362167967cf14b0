//! K-format matmul (Q4_K, Q5_K, Q6_K) on AVX2 without VNNI: each weight row is unpacked
//! once per token chunk into its levels, its sub-block scales as broadcast vectors and its
//! mins, and every tile of tokens then runs only `maddubs`, `madd` and `add` per 32 values.
//!
//! `kquant`'s tiles unpack a row again for every four tokens, and with AVX2's sixteen
//! registers the levels of a super-block spill: on a Zen 3 core (no VNNI) that was half
//! the instructions of a Q5_K prefill. Here the integer sums land in the same i32 lanes
//! and the float steps are `kquant`'s, so a row gives the same bits as its matvec.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::ops::Range;

use super::kquant::{
    act_d, pick_i16, q6k_quarters, scales_mins_k4, LevelsK, EVEN_ODD, Q8_K_AB, Q8_K_BSUMS, Q8_K_QS,
};
use super::tile::{f16_to_f32, hsum_ps, load128, load256, read_u16, ACT_CHUNK_BYTES};

/// Bytes of one unpacked super-block: the 256 levels in value order, the eight 32-value
/// chunks' scales as i16 vectors (a scale per 16 values for Q6_K), the 16 i16 lined up
/// with the activation's 16-value sums (Q4_K/Q5_K's mins, Q6_K's scales), d and dmin.
const UB: usize = 576;
const OFF_SCALES: usize = 256;
const OFF_MINS: usize = 512;
const OFF_D: usize = 544;
/// Longest row unpacked, in super-blocks (32,768 values); longer ones take `kquant`.
pub(super) const MAX_BLOCKS: usize = 128;
/// Tokens per tile: four accumulators and four sums leave room for a level, a scale and
/// a product in sixteen registers.
const T: usize = 4;

/// A K format's super-block, unpacked.
pub(super) trait Unpack {
    /// Bytes of one packed super-block.
    const WB: usize;
    /// Q6_K: levels stored +32, the offset summed in integers through the scales (times
    /// 32); Q4_K/Q5_K: the mins applied in float through dmin.
    const INT_OFFSET: bool;
    /// # Safety
    /// `wp` is a readable block of `WB` bytes, `out` writable for `UB` bytes, AVX2.
    unsafe fn unpack(wp: *const u8, out: *mut u8);
}

/// Q4_K and Q5_K, through `kquant`'s level extraction.
pub(super) struct KMin<L>(std::marker::PhantomData<L>);

impl<L: LevelsK> Unpack for KMin<L> {
    const WB: usize = L::WB;
    const INT_OFFSET: bool = false;

    #[inline(always)]
    unsafe fn unpack(wp: *const u8, out: *mut u8) {
        // SAFETY: reads inside the block, writes inside `out`'s UB bytes.
        unsafe {
            let (scales, mins) = scales_mins_k4(wp.add(4));
            let hbits = L::high_bits(wp);
            for c in 0..4 {
                let (lo, hi) = L::levels(wp, hbits, c);
                store(out.add(64 * c), lo);
                store(out.add(64 * c + 32), hi);
                let s_lo = _mm256_shuffle_epi8(scales, pick_i16(2 * c));
                let s_hi = _mm256_shuffle_epi8(scales, pick_i16(2 * c + 1));
                store(out.add(OFF_SCALES + 64 * c), s_lo);
                store(out.add(OFF_SCALES + 64 * c + 32), s_hi);
            }
            store(out.add(OFF_MINS), mins);
            out.add(OFF_D)
                .cast::<f32>()
                .write_unaligned(f16_to_f32(read_u16(wp)));
            out.add(OFF_D + 4)
                .cast::<f32>()
                .write_unaligned(f16_to_f32(read_u16(wp.add(2))));
        }
    }
}

pub(super) struct Q6K;

impl Unpack for Q6K {
    const WB: usize = 210;
    const INT_OFFSET: bool = true;

    #[inline(always)]
    unsafe fn unpack(wp: *const u8, out: *mut u8) {
        // SAFETY: reads inside the block, writes inside `out`'s UB bytes.
        unsafe {
            let sc8 = load128(wp.add(192));
            // Even-numbered scales in the low half, odd in the high: the pair a 32-value
            // chunk needs is lane j of each half (as `kquant`'s Q6_K tile).
            let sc_eo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, EVEN_ODD));
            for h in 0..2 {
                for (k, q) in q6k_quarters(wp, h).into_iter().enumerate() {
                    store(out.add(128 * h + 32 * k), q);
                    let s = _mm256_shuffle_epi8(sc_eo, pick_i16(4 * h + k));
                    store(out.add(OFF_SCALES + 128 * h + 32 * k), s);
                }
            }
            store(out.add(OFF_MINS), _mm256_cvtepi8_epi16(sc8));
            out.add(OFF_D)
                .cast::<f32>()
                .write_unaligned(f16_to_f32(read_u16(wp.add(208))));
        }
    }
}

/// # Safety
/// `p` writable for 32 bytes.
#[inline(always)]
unsafe fn store(p: *mut u8, v: __m256i) {
    // SAFETY: forwarded from the caller.
    unsafe { _mm256_storeu_si256(p.cast(), v) }
}

/// One unpacked row of `U` dotted with `N` activations over `nb` blocks: the same lanes
/// and float steps as `kquant`'s tiles.
///
/// # Safety
/// `row` holds `nb` unpacked blocks, each `acts[t]` `nb` Q8_K blocks; AVX2/FMA/F16C.
#[inline(always)]
unsafe fn tile<U: Unpack, const N: usize>(
    row: *const u8,
    acts: [*const u8; N],
    nb: usize,
) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    // SAFETY (every read): block b of the row and of each activation.
    unsafe {
        for b in 0..nb {
            let bp = row.add(b * UB);
            let mut isum = [_mm256_setzero_si256(); N];
            if U::INT_OFFSET {
                let sc16 = load256(bp.add(OFF_MINS));
                for t in 0..N {
                    let bsums = load256(acts[t].add(b * Q8_K_AB + Q8_K_BSUMS));
                    isum[t] = _mm256_sub_epi32(
                        isum[t],
                        _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc16, bsums)),
                    );
                }
            }
            for j in 0..8 {
                let levels = load256(bp.add(32 * j));
                let scale = load256(bp.add(OFF_SCALES + 32 * j));
                for t in 0..N {
                    let a = load256(acts[t].add(b * Q8_K_AB + Q8_K_QS + 32 * j));
                    let p = _mm256_maddubs_epi16(levels, a);
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, scale));
                }
            }
            let d = _mm256_broadcast_ss(&*bp.add(OFF_D).cast::<f32>());
            let dmin = _mm256_broadcast_ss(&*bp.add(OFF_D + 4).cast::<f32>());
            for t in 0..N {
                let ap = acts[t].add(b * Q8_K_AB);
                let v = if U::INT_OFFSET {
                    _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum[t]))
                } else {
                    // d * sum(scale * q * a) - dmin * sum(min * bsum).
                    let msum =
                        _mm256_madd_epi16(load256(bp.add(OFF_MINS)), load256(ap.add(Q8_K_BSUMS)));
                    let m = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(msum));
                    _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(isum[t]), m)
                };
                acc[t] = _mm256_fmadd_ps(v, act_d(ap), acc[t]);
            }
        }
    }
    std::array::from_fn(|t| hsum_ps(acc[t]))
}

/// Matmul of rows `rows` of K-format `U` (`nb` super-blocks a row, at most
/// [`MAX_BLOCKS`]) with `m` Q8_K activations: token chunks that stay in L2, then rows,
/// each unpacked once, then tiles of four tokens (two and one at the end).
///
/// # Safety
/// AVX2/FMA/F16C present; `weights` holds every row of the range, `acts` `m`
/// activations of `nb` Q8_K blocks; `out` as `quant::matmul` checked it.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn matmul<U: Unpack>(
    nb: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    #[repr(align(64))]
    struct Buf([MaybeUninit<u8>; MAX_BLOCKS * UB]);
    assert!(
        nb <= MAX_BLOCKS,
        "{nb} super-blocks a row: above {MAX_BLOCKS}"
    );
    let mut buf = Buf([MaybeUninit::uninit(); MAX_BLOCKS * UB]);
    let unpacked = buf.0.as_mut_ptr().cast::<u8>();
    let (rb, ab) = (nb * U::WB, nb * Q8_K_AB);
    let chunk = (ACT_CHUNK_BYTES / ab.max(1)).max(T) / T * T;
    let a = acts.as_ptr();
    let act = |t: usize| a.wrapping_add(t * ab);
    let mut t0 = 0;
    while t0 < m {
        let t1 = (t0 + chunk).min(m);
        for (i, r) in rows.clone().enumerate() {
            // SAFETY: row r is inside `weights` and its nb blocks fit the buffer, which
            // the tiles then read only where this wrote.
            unsafe {
                let wp = weights.as_ptr().add(r * rb);
                for b in 0..nb {
                    U::unpack(wp.add(b * U::WB), unpacked.add(b * UB));
                }
            }
            let mut t = t0;
            // SAFETY (tiles): tokens below m, blocks below nb.
            while t + T <= t1 {
                let v = unsafe { tile::<U, T>(unpacked, std::array::from_fn(|k| act(t + k)), nb) };
                for (k, x) in v.into_iter().enumerate() {
                    out[(t + k) * out_stride + i] = x;
                }
                t += T;
            }
            if t + 2 <= t1 {
                let v = unsafe { tile::<U, 2>(unpacked, [act(t), act(t + 1)], nb) };
                out[t * out_stride + i] = v[0];
                out[(t + 1) * out_stride + i] = v[1];
                t += 2;
            }
            if t < t1 {
                let v = unsafe { tile::<U, 1>(unpacked, [act(t)], nb) };
                out[t * out_stride + i] = v[0];
            }
        }
        t0 = t1;
    }
}
