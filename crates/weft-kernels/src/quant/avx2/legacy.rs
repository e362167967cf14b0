//! AVX2 tiles for the 32-value formats (Q4_0, Q5_0, Q8_0) against Q8_0 activations.
//!
//! Per 32-value block and (row, token) pair: one `maddubs` (u8 x i8 -> i16 pairs), one
//! `madd` with ones (-> i32), a convert and an FMA with d_w*d_a. Q4_0/Q5_0 keep their
//! levels unsigned (0..16 / 0..32) for `maddubs` and subtract offset*sum(a), computed once
//! per token block; Q8_0 weights are signed, so they use the sign trick
//! (|w| x sign(a, w)), which stays exact even for w = -128.

use super::*;

/// Nibbles of 16 bytes as 32 unsigned levels: low nibbles are values 0..16, high 16..32.
///
/// # Safety
/// `p` is readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: forwarded from the caller.
    let v = unsafe { load128(p) };
    _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(v), v),
        _mm256_set1_epi8(0x0F),
    )
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

/// The unsigned levels of an offset format (Q4_0: 0..16 minus 8, Q5_0: 0..32 minus 16).
pub trait Levels {
    const WB: usize;
    const OFFSET: i8;
    /// The 32 levels of the block at `wp`.
    ///
    /// # Safety
    /// AVX2 present; `wp` points to a readable block of `WB` bytes.
    unsafe fn levels(wp: *const u8) -> __m256i;
}

pub struct Q4Levels;
pub struct Q5Levels;

impl Levels for Q4Levels {
    const WB: usize = 18;
    const OFFSET: i8 = 8;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels(wp: *const u8) -> __m256i {
        // SAFETY: qs is bytes 2..18 of the block.
        unsafe { nibbles(wp.add(2)) }
    }
}

impl Levels for Q5Levels {
    const WB: usize = 22;
    const OFFSET: i8 = 16;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels(wp: *const u8) -> __m256i {
        // SAFETY: qh is bytes 2..6 and qs bytes 6..22 of the block.
        let (qh, lo) = unsafe { (wp.add(2).cast::<u32>().read_unaligned(), nibbles(wp.add(6))) };
        let hi = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
        _mm256_or_si256(lo, hi)
    }
}

/// Q4_0 / Q5_0: unsigned levels, the offset subtracted through sum(a).
pub struct Offset<L>(std::marker::PhantomData<L>);
pub type Q4_0 = Offset<Q4Levels>;
pub type Q5_0 = Offset<Q5Levels>;
pub struct Q8_0;

const Q8_0_AB: usize = 34;

impl<L: Levels> Tile for Offset<L> {
    const WB: usize = L::WB;
    const AB: usize = Q8_0_AB;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
    ) -> [[f32; T]; R] {
        let ones = _mm256_set1_epi16(1);
        let offset = _mm256_set1_epi8(L::OFFSET);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for b in 0..nb {
            let mut da = [0.0f32; T];
            let mut a = [_mm256_setzero_si256(); T];
            let mut off = [_mm256_setzero_si256(); T];
            for t in 0..T {
                // SAFETY: block b of activation t is in bounds (nb blocks).
                let ap = unsafe { acts[t].add(b * Q8_0_AB) };
                da[t] = f16_to_f32(unsafe { read_u16(ap) });
                a[t] = unsafe { load256(ap.add(2)) };
                off[t] = _mm256_maddubs_epi16(offset, a[t]);
            }
            for r in 0..R {
                // SAFETY: block b of row r is in bounds (nb blocks).
                let wp = unsafe { rows[r].add(b * L::WB) };
                let dw = f16_to_f32(unsafe { read_u16(wp) });
                let u = unsafe { L::levels(wp) };
                for t in 0..T {
                    // No i16 overflow: |u*a| pair sums stay below 2*31*128.
                    let p = _mm256_sub_epi16(_mm256_maddubs_epi16(u, a[t]), off[t]);
                    let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                    acc[r][t] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * da[t]), acc[r][t]);
                }
            }
        }
        hsum_grid(&acc)
    }
}

impl Tile for Q8_0 {
    const WB: usize = 34;
    const AB: usize = Q8_0_AB;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        nb: usize,
    ) -> [[f32; T]; R] {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for b in 0..nb {
            let mut da = [0.0f32; T];
            let mut a = [_mm256_setzero_si256(); T];
            for t in 0..T {
                // SAFETY: block b of activation t is in bounds (nb blocks).
                let ap = unsafe { acts[t].add(b * Q8_0_AB) };
                da[t] = f16_to_f32(unsafe { read_u16(ap) });
                a[t] = unsafe { load256(ap.add(2)) };
            }
            for r in 0..R {
                // SAFETY: block b of row r is in bounds (nb blocks).
                let wp = unsafe { rows[r].add(b * 34) };
                let dw = f16_to_f32(unsafe { read_u16(wp) });
                let q = unsafe { load256(wp.add(2)) };
                let aq = _mm256_abs_epi8(q);
                for t in 0..T {
                    let p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(a[t], q));
                    let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                    acc[r][t] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * da[t]), acc[r][t]);
                }
            }
        }
        hsum_grid(&acc)
    }
}
