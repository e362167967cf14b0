//! AVX2 tiles for the 32-value formats (Q4_0, Q5_0, Q8_0) against Q8_0 activations.
//!
//! Per 32-value block and (row, token) pair: one `maddubs` (u8 x i8 -> i16 pairs), one
//! `madd` with ones (-> i32), a convert and an FMA with d_w*d_a. On the Zen-class cores
//! this was tuned on, all of those share two pipes, so the work around them is kept off
//! the per-pair path:
//! - d_w*d_a for the whole row is made first, eight blocks per instruction, and read back
//!   by a broadcast load (a load, not an ALU op);
//! - Q4_0/Q5_0 feed their unsigned levels (0..16 / 0..32) straight to `maddubs`; the
//!   offset (8 / 16) comes off at the end as OFFSET * sum_b d_w*d_a*sum(a_b), a short
//!   dot over the activation's block sums (computed once per activation by the driver);
//! - Q8_0 weights are signed, so they use the sign trick (|w| x sign(a, w)), exact even
//!   for w = -128.
//!
//! Decode runs one row with two accumulators; prefill runs one row with four tokens (eight
//! for Q5_0 and Q8_0 without VNNI: one accumulator a token leaves room for them).

use std::arch::x86_64::*;

use super::kquant::{dpbusd_acc, PLAIN};
use super::tile::{hsum_ps, load128, load256, scales8, Tile, COLS};
use std::mem::MaybeUninit;

/// Nibbles of 16 bytes as 32 unsigned levels: low nibbles are values 0..16, high 16..32.
/// The bytes go to both lanes with a broadcast load and only the upper lane is shifted,
/// one shift instead of a shift plus a lane insert.
///
/// # Safety
/// `p` is readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: forwarded from the caller.
    let v = _mm256_broadcastsi128_si256(unsafe { load128(p) });
    let shifted = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
}

/// The 32 bits of `bits` as bytes: 0xFF where bit j is set, 0 elsewhere (byte j <- bit j).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bytes_from_bits(bits: u32) -> __m256i {
    // Byte j takes byte j/8 of the word, then all bits but j%8 are forced on, so the
    // byte is all-ones exactly when bit j%8 was set.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(
            0x0303030303030303,
            0x0202020202020202,
            0x0101010101010101,
            0,
        ),
    );
    let forced = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(forced, _mm256_set1_epi64x(-1))
}

/// A 32-value weight format: how to unpack a block and dot it with activation quants
/// (8 lanes of i32 partial sums of levels x quants).
pub trait Legacy {
    const WB: usize;
    /// What the stored levels exceed the true ones by (8 for Q4_0, 16 for Q5_0, 0 for
    /// Q8_0); the tile subtracts OFFSET * d_w * d_a * sum(a) per block.
    const OFFSET: i32;
    /// What a weight block unpacks to (kept for all T tokens).
    type W: Copy;
    /// # Safety
    /// AVX2 present; `wp` points to a readable block of `WB` bytes.
    unsafe fn weights(wp: *const u8) -> Self::W;
    /// # Safety
    /// AVX2 present.
    unsafe fn dot(w: Self::W, a: __m256i) -> __m256i;
}

/// Q4_0 / Q5_0: unsigned levels straight into `maddubs` (or `vpdpbusd`, as `F` says: see
/// `kquant::dpbusd_acc`; the same i32 lanes either way, so the same results to the bit).
pub struct Offset<L, const F: u8>(std::marker::PhantomData<L>);
pub type Q4_0 = Offset<Q4Levels, PLAIN>;
pub type Q5_0 = Offset<Q5Levels, PLAIN>;

/// The unsigned levels of an offset format (Q4_0: 0..16 minus 8, Q5_0: 0..32 minus 16).
pub trait Levels {
    const WB: usize;
    const OFFSET: i32;
    /// # Safety
    /// AVX2 present; `wp` points to a readable block of `WB` bytes.
    unsafe fn levels(wp: *const u8) -> __m256i;
}

pub struct Q4Levels;
pub struct Q5Levels;

impl Levels for Q4Levels {
    const WB: usize = 18;
    const OFFSET: i32 = 8;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels(wp: *const u8) -> __m256i {
        // SAFETY: qs is bytes 2..18 of the block.
        unsafe { nibbles(wp.add(2)) }
    }
}

impl Levels for Q5Levels {
    const WB: usize = 22;
    const OFFSET: i32 = 16;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels(wp: *const u8) -> __m256i {
        // SAFETY: qh is bytes 2..6 and qs bytes 6..22 of the block.
        let (qh, lo) = unsafe { (wp.add(2).cast::<u32>().read_unaligned(), nibbles(wp.add(6))) };
        let hi = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
        _mm256_or_si256(lo, hi)
    }
}

impl<L: Levels, const F: u8> Legacy for Offset<L, F> {
    const WB: usize = L::WB;
    const OFFSET: i32 = L::OFFSET;
    type W = __m256i;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(wp: *const u8) -> __m256i {
        // SAFETY: forwarded from the caller.
        unsafe { L::levels(wp) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(u: __m256i, a: __m256i) -> __m256i {
        // No i16 saturation: pair sums stay below 2 * 31 * 128.
        dpbusd_acc::<F>(_mm256_setzero_si256(), u, a)
    }
}

/// Q8_0, its dot in the form `F` says (as for [`Offset`]).
pub struct Q8_0Of<const F: u8>;
pub type Q8_0 = Q8_0Of<PLAIN>;

impl<const F: u8> Legacy for Q8_0Of<F> {
    const WB: usize = 34;
    const OFFSET: i32 = 0;
    /// |w| and w (the sign source).
    type W = (__m256i, __m256i);

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(wp: *const u8) -> (__m256i, __m256i) {
        // SAFETY: qs is bytes 2..34 of the block.
        let q = unsafe { load256(wp.add(2)) };
        (_mm256_abs_epi8(q), q)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot((aq, q): (__m256i, __m256i), a: __m256i) -> __m256i {
        // |w| * (a with w's sign) = w * a, and |-128| = 128 is right as unsigned.
        dpbusd_acc::<F>(_mm256_setzero_si256(), aq, _mm256_sign_epi8(a, q))
    }
}

const Q8_0_AB: usize = 34;

/// `prod[t][b] = d_w[b] * d_a[t][b]` for the padded span (converting the row's f16
/// scales eight at a time, zero past nb), and, for offset formats, each token's offset
/// term OFFSET * sum_b prod[t][b] * sum(a[t] of block b).
///
/// # Safety
/// `row` holds `nb` blocks; each `as_[t]` is a record as described in [`Tile::tile`];
/// each `prod[t]` is writable for `nb` rounded up to 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn products<K: Legacy, const T: usize>(
    row: *const u8,
    nb: usize,
    as_: [*const f32; T],
    prod: [*mut f32; T],
) -> [f32; T] {
    let cp = nb.div_ceil(8) * 8;
    let mut corr = [_mm256_setzero_ps(); T];
    for k in (0..cp).step_by(8) {
        // SAFETY: k + 8 <= cp, the padded length of the records and of prod.
        unsafe {
            let dw = scales8(row, K::WB, k, nb);
            for t in 0..T {
                let v = _mm256_mul_ps(dw, _mm256_loadu_ps(as_[t].add(k)));
                _mm256_storeu_ps(prod[t].add(k), v);
                if K::OFFSET != 0 {
                    corr[t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(as_[t].add(cp + k)), corr[t]);
                }
            }
        }
    }
    let mut out = [0.0f32; T];
    for t in 0..T {
        out[t] = K::OFFSET as f32 * hsum_ps(corr[t]);
    }
    out
}

/// Adds block `b`'s contribution to `acc`.
///
/// # Safety
/// As [`Tile::tile`], with block b in bounds.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_block<K: Legacy>(
    acc: __m256,
    w: K::W,
    act: *const u8,
    b: usize,
    prod: *const f32,
) -> __m256 {
    // SAFETY: forwarded from the caller (prod[b] was written by `products`).
    unsafe {
        let p = K::dot(w, load256(act.add(b * Q8_0_AB + 2)));
        _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(p),
            _mm256_broadcast_ss(&*prod.add(b)),
            acc,
        )
    }
}

impl<K: Legacy> Tile for K {
    const WB: usize = K::WB;
    const AB: usize = Q8_0_AB;
    const SCALES: bool = true;
    const SUMS: bool = K::OFFSET != 0;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
        as_: [*const f32; T],
    ) -> [[f32; T]; R] {
        // One row per tile: the products below are per (row, token).
        const { assert!(R == 1) };
        let row = rows[0];
        let mut out = [[0.0f32; T]; R];
        // Left uninitialised: `products` writes the cp <= COLS entries that are read
        // (zeroing 8 KiB per tile cost more than short rows' dot products).
        let mut store = [[MaybeUninit::<f32>::uninit(); COLS]; T];
        let mut prod = [std::ptr::null::<f32>(); T];
        let mut prod_mut = [std::ptr::null_mut::<f32>(); T];
        for t in 0..T {
            prod_mut[t] = store[t].as_mut_ptr().cast::<f32>();
            prod[t] = prod_mut[t];
        }
        // SAFETY: the driver's records are padded to nb rounded up to 8 <= COLS.
        let corr = unsafe { products::<K, T>(row, nb, as_, prod_mut) };
        for t in 0..T {
            out[0][t] = -corr[t];
        }
        // SAFETY (all blocks below): b < nb, and the caller vouches for nb blocks.
        // One accumulator per token, blocks in order (llama.cpp's order too), whatever
        // the tile's width: a sequence's result does not depend on how many others share
        // its step (batched decode equals decode, bit for bit). Measured: this order's
        // Gemma 3 perplexity is the closest to llama.cpp's of three tried (5.753 against
        // 5.740; two accumulators over alternate blocks 5.813, the VNNI tile 5.792).
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..nb {
            let w = unsafe { K::weights(row.add(b * K::WB)) };
            for t in 0..T {
                acc[t] = unsafe { add_block::<K>(acc[t], w, acts[t], b, prod[t]) };
            }
        }
        for t in 0..T {
            out[0][t] += hsum_ps(acc[t]);
        }
        out
    }
}
