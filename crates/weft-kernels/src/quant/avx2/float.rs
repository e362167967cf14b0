//! AVX2 tiles for float weights (F32, F16, BF16) against f32 activations: widen 8
//! weights to f32 once, FMA them into every token's accumulator. A "block" is one value.

use std::arch::x86_64::*;

use super::tile::{f16_to_f32, hsum_grid, hsum_ps, load128, read_f32, read_u16, Tile};

/// How to widen 8 weights of a float format.
pub trait Widen {
    const WB: usize;
    /// # Safety
    /// AVX2/F16C present; `p` is readable for `8 * WB` bytes.
    unsafe fn load8(p: *const u8) -> __m256;
    /// # Safety
    /// `p` is readable for `WB` bytes.
    unsafe fn load1(p: *const u8) -> f32;
}

pub struct F32W;
pub struct F16W;
pub struct Bf16W;

impl Widen for F32W {
    const WB: usize = 4;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 32 readable bytes; loadu needs no alignment.
        unsafe { _mm256_loadu_ps(p.cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load1(p: *const u8) -> f32 {
        // SAFETY: 4 readable bytes.
        unsafe { read_f32(p) }
    }
}

impl Widen for F16W {
    const WB: usize = 2;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes.
        _mm256_cvtph_ps(unsafe { load128(p) })
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load1(p: *const u8) -> f32 {
        // SAFETY: 2 readable bytes.
        f16_to_f32(unsafe { read_u16(p) })
    }
}

impl Widen for Bf16W {
    const WB: usize = 2;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // bf16 is the top half of an f32: zero-extend and shift into place.
        // SAFETY: 16 readable bytes.
        let wide = _mm256_cvtepu16_epi32(unsafe { load128(p) });
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load1(p: *const u8) -> f32 {
        // SAFETY: 2 readable bytes.
        f32::from_bits((unsafe { read_u16(p) } as u32) << 16)
    }
}

pub struct Float<W>(std::marker::PhantomData<W>);
pub type F32 = Float<F32W>;
pub type F16 = Float<F16W>;
pub type Bf16 = Float<Bf16W>;

/// One row with one activation, four accumulators (32 values per step) so the FMA
/// latency does not bound a decode stream.
///
/// # Safety
/// As [`Tile::tile`] with R = T = 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot1<W: Widen>(row: *const u8, act: *const u8, n: usize) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (all reads): values i..i+32 (or i..i+8) are below n.
    while i + 32 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let j = i + 8 * k;
            unsafe {
                *a = _mm256_fmadd_ps(
                    W::load8(row.add(W::WB * j)),
                    _mm256_loadu_ps(act.add(4 * j).cast()),
                    *a,
                )
            };
        }
        i += 32;
    }
    while i + 8 <= n {
        unsafe {
            acc[0] = _mm256_fmadd_ps(
                W::load8(row.add(W::WB * i)),
                _mm256_loadu_ps(act.add(4 * i).cast()),
                acc[0],
            )
        };
        i += 8;
    }
    let mut sum = hsum_ps(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ));
    while i < n {
        sum += unsafe { W::load1(row.add(W::WB * i)) * read_f32(act.add(4 * i)) };
        i += 1;
    }
    sum
}

impl<W: Widen> Tile for Float<W> {
    const WB: usize = W::WB;
    const AB: usize = 4;
    const SCALES: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const T: usize>(
        rows: [*const u8; R],
        acts: [*const u8; T],
        n: usize,
        _as: [*const f32; T],
    ) -> [[f32; T]; R] {
        if R * T == 1 {
            let mut out = [[0.0f32; T]; R];
            // SAFETY: forwarded from the caller.
            out[0][0] = unsafe { dot1::<W>(rows[0], acts[0], n) };
            return out;
        }
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let full = n / 8 * 8;
        let mut i = 0;
        while i < full {
            let mut a = [_mm256_setzero_ps(); T];
            for t in 0..T {
                // SAFETY: values i..i+8 < n of activation t.
                a[t] = unsafe { _mm256_loadu_ps(acts[t].add(4 * i).cast()) };
            }
            for r in 0..R {
                // SAFETY: values i..i+8 < n of row r.
                let w = unsafe { W::load8(rows[r].add(W::WB * i)) };
                for t in 0..T {
                    acc[r][t] = _mm256_fmadd_ps(w, a[t], acc[r][t]);
                }
            }
            i += 8;
        }
        let mut out = hsum_grid(&acc);
        for r in 0..R {
            for t in 0..T {
                for j in full..n {
                    // SAFETY: j < n.
                    out[r][t] +=
                        unsafe { W::load1(rows[r].add(W::WB * j)) * read_f32(acts[t].add(4 * j)) };
                }
            }
        }
        out
    }
}
