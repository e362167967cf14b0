//! The byte-dot instruction the kernels use, run from registers only: `roofline`'s
//! compute ceiling, in the form (AVX2 pair or a VNNI `vpdpbusd`) the kernels take here.

use std::arch::x86_64::*;

use super::kquant::{dpbusd_acc, EVEX, PLAIN, VEX};
use crate::quant::select::Fused;

/// Independent chains: enough to cover the instruction's latency at two per cycle.
const CHAINS: usize = 12;

/// Integer operations per iteration: each chain dots 32 byte pairs, 32 multiplies and 32
/// adds, counted as the kernels count their work (2 x weights x tokens).
pub(crate) const OPS_PER_ITER: f64 = CHAINS as f64 * 64.0;

/// `iters` iterations of [`CHAINS`] dependent `dpbusd` steps in form `F`.
///
/// # Safety
/// The CPU runs AVX2 and form `F`'s instruction.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_loop<const F: u8>(iters: usize) -> i32 {
    // Operands the compiler cannot see, and chains that start apart, so no two chains
    // can be merged and nothing folded away.
    let a = std::hint::black_box(_mm256_set1_epi8(3));
    let b = std::hint::black_box(_mm256_set1_epi8(5));
    let ones = _mm256_set1_epi16(1);
    let mut acc: [__m256i; CHAINS] =
        std::array::from_fn(|k| std::hint::black_box(_mm256_set1_epi32(k as i32 + 1)));
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = if F == PLAIN {
                // The pair's result is the next multiplicand, so nothing can be hoisted
                // (its i16 pairs may wrap, which a timing does not mind).
                _mm256_madd_epi16(_mm256_maddubs_epi16(a, *x), ones)
            } else {
                // Only the sum chains, as in the kernels: an operand that is also the
                // sum would cost a register copy per instruction.
                dpbusd_acc::<F>(*x, a, b)
            };
        }
    }
    let mut s = acc[0];
    for x in &acc[1..] {
        s = _mm256_xor_si256(s, *x);
    }
    _mm256_extract_epi32::<0>(s)
}

/// Runs the loop as `form` sums bytes: a VNNI `vpdpbusd` (VEX or EVEX), else the AVX2
/// pair.
///
/// # Safety
/// The CPU runs AVX2, FMA, F16C and that form's instruction.
pub(crate) unsafe fn run(form: Fused, iters: usize) -> i32 {
    // SAFETY: forwarded from the caller.
    unsafe {
        match form {
            Fused::AvxVnni => dot_loop::<VEX>(iters),
            Fused::Avx512Vnni256 => dot_loop::<EVEX>(iters),
            _ => dot_loop::<PLAIN>(iters),
        }
    }
}
