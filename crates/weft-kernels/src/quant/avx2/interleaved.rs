//! Matvec and matmul on the interleaved layouts (`quant::pack`): eight rows a group, one
//! row per i32 lane, so `vpdpbusd` of a level vector against four activation bytes
//! broadcast sums 8 rows x 4 values with nothing to fold afterwards.
//!
//! - Q4_K and Q5_K (its fifth bits ORed in from a plane per sub-block), per sub-block
//!   (32 values) and token: eight `vpdpbusd` into an exact i32 sum,
//!   one `vpmulld` by the eight rows' scales; per super-block and token: the mins through
//!   the activation's sub-block sums (four `vpdpwssd`), then two float steps for all
//!   eight rows.
//! - Q6_K likewise per 16-value sub-block, its offset of 32 through the activation's
//!   16-value sums, and one float step per super-block.
//! - Q4_0/Q5_0/Q8_0, per block and token: eight `vpdpbusd` of the unsigned levels into a
//!   sum that starts at -OFFSET * sum(a), so it ends exact and offset-free, then one
//!   convert and one FMA by d_w * d_a for all eight rows; Q4_1/Q5_1 start at zero and add
//!   their minimums times d_a * sum(a) in a second FMA.
//!
//! Where AVX2 runs alone, `vpdpbusd` is `vpmaddubsw` (pairs of products in i16 lanes) and
//! a widening `vpmaddwd`: the pairs of a sub-block are summed in i16 as far as their
//! bounds allow and widened once, by a `vpmaddwd` with the rows' scales for the K
//! formats, in place of a widening per product and a `vpmulld` per sub-block.
//!
//! The integer sums are exact, so their order is free; the float steps run in one order
//! for every token count, which makes a batched token equal the same token alone, and a
//! row's result the same whichever group or thread computes it.

use std::arch::x86_64::*;
use std::ops::Range;

use super::kquant::{dpbusd_acc, madd_acc, EVEX, PLAIN, Q8_K_AB, Q8_K_BSUMS, Q8_K_QS};
use super::tile::{
    f16_to_f32, fifth_bit, load128, load256, q8_0_quant_sum, read_f32, read_u16, ACT_CHUNK_BYTES,
    PREFETCH_BYTES,
};
use crate::quant::blocks::Q8_0_BYTES;
use crate::quant::pack::{
    legacy_layout, legacy_offset, q5k_fifth, q6k_pair, Windows, GROUP_ROWS, LEGACY_MAX_BLOCKS,
    OFF_DMIN, OFF_LEVELS, OFF_MINS, OFF_SCALES, Q4K_GROUP_BYTES, Q4K_MAX_BLOCKS, Q5K_GROUP_BYTES,
    Q6K_GROUP_BYTES, Q6K_OFF_SCALES,
};
use weft_gguf::GgmlType;

/// Tokens a tile serves with one unpacking of the levels: 4 in 16 vector registers, 8
/// where AVX-512VL gives 32.
const T_AVX2: usize = 4;
const T_AVX512: usize = 8;
/// i32 terms the driver keeps per token chunk (every kernel's `TERMS * MAX_BLOCKS`).
const TERMS_LEN: usize = 4 * Q4K_MAX_BLOCKS;
const _: () = assert!(2 * LEGACY_MAX_BLOCKS <= TERMS_LEN);

/// One format's kernel over a group of eight interleaved rows.
trait GroupKernel {
    /// Values of a row one block holds.
    const BLOCK_VALUES: usize;
    /// Bytes of a group's block and of an activation's block.
    const GB: usize;
    const AB: usize;
    /// i32 terms the driver makes per activation block (with [`Self::terms`]).
    const TERMS: usize;
    /// The most blocks a row may have (`TERMS * MAX_BLOCKS` fits the driver's buffer).
    const MAX_BLOCKS: usize;

    /// The terms of the activation block at `ap`.
    ///
    /// # Safety
    /// `ap` points to a readable activation block; `out` has `TERMS` slots.
    unsafe fn terms(ap: *const u8, out: &mut [i32]);

    /// Adds block `b` of the group at `gp` (already offset to that block) against `N`
    /// tokens to `acc`, the eight rows' sums per token, in the float order every `N`
    /// shares; with `PF`, asks for the group bytes [`PREFETCH_BYTES`] ahead as it goes.
    ///
    /// # Safety
    /// `gp` holds a group block; each `acts[t]` holds block `b` of its activation and
    /// each `terms[t]` that block's `TERMS` terms at `TERMS * b`; the CPU runs form `F`.
    unsafe fn add_block<const F: u8, const N: usize, const PF: bool>(
        gp: *const u8,
        acts: [*const u8; N],
        terms: [*const i32; N],
        b: usize,
        acc: &mut [__m256; N],
    );
}

/// The group's blocks `blocks` of one window, at `g` one after another, against `N`
/// tokens, added to `acc`: the eight rows' sums per token.
///
/// # Safety
/// `g` holds `blocks.len()` group blocks; each `acts[t]` holds the activation's blocks
/// `..blocks.end` and each `terms[t]` their terms; the CPU runs form `F`.
#[inline(always)]
unsafe fn group_tile<K: GroupKernel, const F: u8, const N: usize>(
    g: *const u8,
    acts: [*const u8; N],
    terms: [*const i32; N],
    blocks: Range<usize>,
    prefetch: bool,
    mut acc: [__m256; N],
) -> [__m256; N] {
    // Two loops, each with its kernel's prefetches fixed at compile time, so the kernel's
    // sub-block loop tests no flag.
    let start = blocks.start;
    // SAFETY (both loops): block b of the window, as the caller promises; the rest
    // forwarded from the caller.
    if prefetch {
        for b in blocks {
            let gp = unsafe { g.add((b - start) * K::GB) };
            unsafe { K::add_block::<F, N, true>(gp, acts, terms, b, &mut acc) };
        }
    } else {
        for b in blocks {
            let gp = unsafe { g.add((b - start) * K::GB) };
            unsafe { K::add_block::<F, N, false>(gp, acts, terms, b, &mut acc) };
        }
    }
    acc
}

/// Asks for the group bytes PREFETCH_BYTES past `gp`, `len` of them: decode streams the
/// groups from memory, as the row layout's matvec does. Prefetches never fault;
/// wrapping_add keeps the address defined.
#[inline(always)]
fn prefetch_ahead(gp: *const u8, len: usize) {
    let ahead = gp.wrapping_add(PREFETCH_BYTES);
    let mut off = 0;
    while off < len {
        // SAFETY: a prefetch is a hint and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(off).cast()) };
        off += 64;
    }
}

/// `acc + dot4(u, a)` (`vpdpbusd`) in form `F`; the AVX-512 form as an intrinsic, so a
/// driver compiled for AVX-512VL may keep its sums in all 32 vector registers.
#[inline(always)]
fn dpbusd<const F: u8>(acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
    if F == EVEX {
        // SAFETY: form EVEX runs only where AVX-512 VNNI and VL were detected, inlined
        // into `matmul_evex`, which enables them.
        unsafe { _mm256_dpbusd_epi32(acc, u, a) }
    } else {
        // SAFETY: the caller's driver runs only where form F's instructions exist.
        unsafe { dpbusd_acc::<F>(acc, u, a) }
    }
}

/// `acc + madd(x, y)` (`vpdpwssd`) in form `F`, as [`dpbusd`].
#[inline(always)]
fn dpwssd<const F: u8>(acc: __m256i, x: __m256i, y: __m256i) -> __m256i {
    if F == EVEX {
        // SAFETY: as in `dpbusd`.
        unsafe { _mm256_dpwssd_epi32(acc, x, y) }
    } else {
        // SAFETY: as in `dpbusd`.
        unsafe { madd_acc::<F>(acc, x, y) }
    }
}

/// Broadcast of the four activation bytes at `p`.
///
/// # Safety
/// `p` is readable for 4 bytes.
#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m256i {
    // SAFETY: forwarded from the caller.
    unsafe { _mm256_set1_epi32(p.cast::<i32>().read_unaligned()) }
}

/// Interleaved Q4_K (`FIVE` false) and Q5_K (true): the same steps, scales and mins, and
/// Q5_K's fifth bits ORed into the nibbles from a plane per sub-block.
struct KMin<const FIVE: bool>;
type Q4K = KMin<false>;
type Q5K = KMin<true>;

impl<const FIVE: bool> KMin<FIVE> {
    /// With `PF`, asks for the bytes step j of the sub-block loop reads (Q5_K's plane and
    /// levels, Q4_K's levels), [`PREFETCH_BYTES`] ahead: a step at a time, so the requests
    /// go out as evenly as the bytes are read. A whole group block asked at once, at its
    /// start, overlapped the arithmetic worse: on AMD Zen 3, `kbench`'s cold interleaved
    /// Q4_K 1,536 x 8,960 read 10.6-14.1 GB/s so and 13.8-14.4 this way, three alternated
    /// runs. Asked as eighths of the block instead, at alignments that vary from step to
    /// step, Q6_K's kernel ran three times slower, hot or cold, for a reason not found.
    #[inline(always)]
    fn prefetch_step<const PF: bool>(gp: *const u8, j: usize) {
        if PF {
            let (at, len) = if FIVE {
                (q5k_fifth(j), 160)
            } else {
                (Self::levels(j), 128)
            };
            prefetch_ahead(gp.wrapping_add(at), len);
        }
    }

    /// Where sub-block j's 128 level bytes start.
    const fn levels(j: usize) -> usize {
        if FIVE {
            q5k_fifth(j) + 32
        } else {
            OFF_LEVELS + 128 * j
        }
    }
}

impl<const FIVE: bool> GroupKernel for KMin<FIVE> {
    const BLOCK_VALUES: usize = 256;
    const GB: usize = if FIVE {
        Q5K_GROUP_BYTES
    } else {
        Q4K_GROUP_BYTES
    };
    const AB: usize = Q8_K_AB;
    const TERMS: usize = 4;
    const MAX_BLOCKS: usize = Q4K_MAX_BLOCKS;

    /// The sums of the super-block's eight 32-value sub-blocks, paired for `vpdpwssd`:
    /// term p holds sub-block 2p's sum in its low half and 2p+1's in its high. A
    /// sub-block sum is at most 32 * 128 in size, so it fits an i16.
    #[inline(always)]
    unsafe fn terms(ap: *const u8, out: &mut [i32]) {
        // SAFETY: bsums are the block's last 32 bytes; out has 4 slots.
        unsafe {
            let s16 = load256(ap.add(Q8_K_BSUMS));
            // The 16-value sums two by two: eight i32, lanes 0-3 in the low half, 4-7 high.
            let s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
            let s = _mm_packs_epi32(
                _mm256_castsi256_si128(s32),
                _mm256_extracti128_si256::<1>(s32),
            );
            _mm_storeu_si128(out.as_mut_ptr().cast(), s);
        }
    }

    #[inline(always)]
    unsafe fn add_block<const F: u8, const N: usize, const PF: bool>(
        gp: *const u8,
        acts: [*const u8; N],
        terms: [*const i32; N],
        b: usize,
        acc: &mut [__m256; N],
    ) {
        // SAFETY (every read): inside the group block, block b of an activation or its
        // terms.
        unsafe {
            let mut isum = [_mm256_setzero_si256(); N];
            if F == PLAIN {
                Self::plain_levels::<N, PF>(gp, acts, b, &mut isum);
            } else {
                // Q5_K's fifth bits land above a high nibble kept in place: it shifts.
                let in_place = N == 1 && !FIVE;
                for j in 0..8 {
                    Self::prefetch_step::<PF>(gp, j);
                    let sc =
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64(gp.add(OFF_SCALES + 8 * j).cast()));
                    let plane = Self::plane(gp, j);
                    // Two chains per token (low and high nibbles), so more sums are in
                    // flight than a `vpdpbusd`'s latency needs.
                    let mut dot_lo = [_mm256_setzero_si256(); N];
                    let mut dot_hi = [_mm256_setzero_si256(); N];
                    for h in 0..4 {
                        // A lone token (decode, bound by the vector ALUs once its bytes are
                        // in cache) takes the high nibbles in place, 16 times their value,
                        // and shifts the exact sum back once: one operation for four
                        // shifts. Only where `vpdpbusd` runs: the AVX2 pair's i16 sums
                        // would saturate.
                        let (lo, hi) = Self::quarter(gp, j, h, plane, in_place);
                        for t in 0..N {
                            let a = acts[t].add(b * Q8_K_AB + Q8_K_QS + 32 * j + 4 * h);
                            dot_lo[t] = dpbusd::<F>(dot_lo[t], lo, bcast4(a));
                            dot_hi[t] = dpbusd::<F>(dot_hi[t], hi, bcast4(a.add(16)));
                        }
                    }
                    for t in 0..N {
                        // Each i32 lane sums 16 products of at most 240 * 128: far from
                        // overflow, and a multiple of 16 when the nibbles sat in place.
                        let hi = if in_place {
                            _mm256_srai_epi32::<4>(dot_hi[t])
                        } else {
                            dot_hi[t]
                        };
                        let dot = _mm256_add_epi32(dot_lo[t], hi);
                        isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(dot, sc));
                    }
                }
            }
            let mut msum = [_mm256_setzero_si256(); N];
            for p in 0..4 {
                let mins = _mm256_cvtepu8_epi16(load128(gp.add(OFF_MINS + 16 * p)));
                for t in 0..N {
                    let pair = _mm256_set1_epi32(*terms[t].add(4 * b + p));
                    msum[t] = dpwssd::<F>(msum[t], mins, pair);
                }
            }
            let d = _mm256_cvtph_ps(load128(gp));
            let dmin = _mm256_cvtph_ps(load128(gp.add(OFF_DMIN)));
            for t in 0..N {
                // d * sum(scale * q * a) - dmin * sum(min * sub-block sum), times the
                // activation's d: the same two steps whatever N is.
                let da = _mm256_set1_ps(read_f32(acts[t].add(b * Q8_K_AB)));
                let v = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[t]), acc[t]);
                acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(msum[t]), v);
            }
        }
    }
}

/// Row r's scale byte in both i16 halves of i32 lane r, from the eight bytes at `p`
/// (each 128-bit half of the broadcast holds all eight): what `vpmaddwd` multiplies a
/// lane's two i16 sums by. `signed`: the bytes are i8 (Q6_K), else u8.
///
/// # Safety
/// `p` is readable for 8 bytes; AVX2.
#[inline(always)]
unsafe fn scale_pairs(p: *const u8, signed: bool) -> __m256i {
    // SAFETY: forwarded from the caller.
    let eight = _mm256_set1_epi64x(unsafe { p.cast::<i64>().read_unaligned() });
    // Byte r then a zero (index -128), twice, for lane r.
    let pick = _mm256_setr_epi8(
        0, -128, 0, -128, 1, -128, 1, -128, 2, -128, 2, -128, 3, -128, 3, -128, 4, -128, 4, -128,
        5, -128, 5, -128, 6, -128, 6, -128, 7, -128, 7, -128,
    );
    let low = _mm256_shuffle_epi8(eight, pick);
    if signed {
        // The byte's sign into the high byte of its i16.
        _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(low))
    } else {
        low
    }
}

/// `s + maddubs(u, a)` in i16 lanes: AVX2's pair products summed without widening, where
/// the caller bounds the sum (see [`KMin::plain_levels`]).
#[inline(always)]
fn add_pairs(s: __m256i, u: __m256i, a: __m256i) -> __m256i {
    // SAFETY: the drivers that inline this run on AVX2.
    unsafe { _mm256_add_epi16(s, _mm256_maddubs_epi16(u, a)) }
}

/// Quarter h of a K format's 32-value chunk j, `lo` and `hi` level vectors, against `N`
/// tokens by [`add_pairs`]: `lo` times the activation's values 32j + 4h.. into `lo_sum`,
/// `hi` times those 16 on into `hi_sum`, or into `lo_sum` too where one i16 sum holds
/// both (not `apart`, as the caller's bound allows).
///
/// # Safety
/// Each `acts[t]` holds block `b` of its activation; AVX2.
#[inline(always)]
unsafe fn add_quarter_pairs<const N: usize>(
    (lo, hi): (__m256i, __m256i),
    acts: [*const u8; N],
    (b, j, h): (usize, usize, usize),
    apart: bool,
    lo_sum: &mut [__m256i; N],
    hi_sum: &mut [__m256i; N],
) {
    for t in 0..N {
        // SAFETY (both reads): values 32j + 4h.. and 16 on lie inside block b.
        let a = unsafe { acts[t].add(b * Q8_K_AB + Q8_K_QS + 32 * j + 4 * h) };
        lo_sum[t] = add_pairs(lo_sum[t], lo, unsafe { bcast4(a) });
        let a_hi = unsafe { bcast4(a.add(16)) };
        if apart {
            hi_sum[t] = add_pairs(hi_sum[t], hi, a_hi);
        } else {
            lo_sum[t] = add_pairs(lo_sum[t], hi, a_hi);
        }
    }
}

impl<const FIVE: bool> KMin<FIVE> {
    /// Q5_K's fifth bits of sub-block j (zero for Q4_K).
    ///
    /// # Safety
    /// `gp` holds a group block; AVX2.
    #[inline(always)]
    unsafe fn plane(gp: *const u8, j: usize) -> __m256i {
        if FIVE {
            // SAFETY: the plane lies inside the group block.
            unsafe { load256(gp.add(q5k_fifth(j))) }
        } else {
            _mm256_setzero_si256()
        }
    }

    /// Quarter h of sub-block j's levels, low and high nibbles (the high ones in place,
    /// 16 times their value, with `in_place`), Q5_K's fifth bits ORed in from `plane`.
    ///
    /// # Safety
    /// `gp` holds a group block; AVX2.
    #[inline(always)]
    unsafe fn quarter(
        gp: *const u8,
        j: usize,
        h: usize,
        plane: __m256i,
        in_place: bool,
    ) -> (__m256i, __m256i) {
        let nibble = _mm256_set1_epi8(0x0F);
        // SAFETY: quarter h of sub-block j lies inside the group block.
        let x = unsafe { load256(gp.add(Self::levels(j) + 32 * h)) };
        let mut lo = _mm256_and_si256(x, nibble);
        let mut hi = if in_place {
            _mm256_andnot_si256(nibble, x)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(x), nibble)
        };
        if FIVE {
            // Bit h of the plane is the low nibble's, bit 4 + h the high one's.
            // SAFETY: the drivers that inline this run on AVX2.
            unsafe {
                lo = _mm256_or_si256(lo, fifth_bit(plane, h));
                hi = _mm256_or_si256(hi, fifth_bit(plane, 4 + h));
            }
        }
        (lo, hi)
    }

    /// The level sums times the sub-block scales, added to `isum`, where AVX2 runs alone:
    /// a sub-block's pair products (`vpmaddubsw`) are summed in i16 lanes and widened by a
    /// `vpmaddwd` with the eight rows' scales, in place of a widening `vpmaddwd` per
    /// product and a `vpmulld` per sub-block (decode is bound by the vector ALUs once its
    /// bytes are in cache, prefill always). A pair product is at most 2 x 15 x 128 = 3,840
    /// in size for Q4_K, so a lane's sixteen products (eight pairs) stay within 30,720 and
    /// fit an i16; Q5_K's reach 7,936, so its low and high nibbles' four pairs are summed
    /// apart and widened apart. The same exact i32 sums as the VNNI forms. `PF` as
    /// [`GroupKernel::add_block`]'s.
    ///
    /// # Safety
    /// `gp` holds a group block, each `acts[t]` block `b` of its activation; AVX2.
    #[inline(always)]
    unsafe fn plain_levels<const N: usize, const PF: bool>(
        gp: *const u8,
        acts: [*const u8; N],
        b: usize,
        isum: &mut [__m256i; N],
    ) {
        // One Q4_K token keeps two chains (low and high nibbles) so that adds overlap; a
        // tile of several keeps one a token, and its registers for the tokens.
        let apart = FIVE || N == 1;
        // SAFETY (every read): inside the group block or block b of an activation.
        unsafe {
            for j in 0..8 {
                Self::prefetch_step::<PF>(gp, j);
                let sc = scale_pairs(gp.add(OFF_SCALES + 8 * j), false);
                let plane = Self::plane(gp, j);
                let mut lo_sum = [_mm256_setzero_si256(); N];
                let mut hi_sum = [_mm256_setzero_si256(); N];
                for h in 0..4 {
                    let quarter = Self::quarter(gp, j, h, plane, false);
                    add_quarter_pairs(quarter, acts, (b, j, h), apart, &mut lo_sum, &mut hi_sum);
                }
                for t in 0..N {
                    let s = if FIVE {
                        _mm256_add_epi32(
                            _mm256_madd_epi16(lo_sum[t], sc),
                            _mm256_madd_epi16(hi_sum[t], sc),
                        )
                    } else if apart {
                        _mm256_madd_epi16(_mm256_add_epi16(lo_sum[t], hi_sum[t]), sc)
                    } else {
                        _mm256_madd_epi16(lo_sum[t], sc)
                    };
                    isum[t] = _mm256_add_epi32(isum[t], s);
                }
            }
        }
    }
}

/// Interleaved Q6_K.
struct Q6K;

impl GroupKernel for Q6K {
    const BLOCK_VALUES: usize = 256;
    const GB: usize = Q6K_GROUP_BYTES;
    const AB: usize = Q8_K_AB;
    const TERMS: usize = 0;
    const MAX_BLOCKS: usize = Q4K_MAX_BLOCKS;

    /// None: the activation's 16-value sums are read where Q8_K keeps them.
    #[inline(always)]
    unsafe fn terms(_ap: *const u8, _out: &mut [i32]) {}

    #[inline(always)]
    unsafe fn add_block<const F: u8, const N: usize, const PF: bool>(
        gp: *const u8,
        acts: [*const u8; N],
        _terms: [*const i32; N],
        b: usize,
        acc: &mut [__m256; N],
    ) {
        // SAFETY (every read): inside the group block or block b of an activation.
        unsafe {
            let scale = |s: usize| {
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(gp.add(Q6K_OFF_SCALES + 8 * s).cast()))
            };
            let mut isum = [_mm256_setzero_si256(); N];
            for j in 0..8 {
                // Branching inside the loop is not a wart: with the j loop moved into
                // `plain_levels`, as `KMin` has it, LLVM scheduled the batch tile 6 %
                // slower on Zen 3.
                if F == PLAIN {
                    Self::plain_levels::<N, PF>(gp, acts, b, j, &mut isum);
                    continue;
                }
                Self::prefetch_pair::<PF>(gp, j);
                let (sc_lo, sc_hi) = (scale(2 * j), scale(2 * j + 1));
                // Values 32j..32j+16 (sub-block 2j) and 32j+16..32j+32 (2j+1).
                let mut dot_lo = [_mm256_setzero_si256(); N];
                let mut dot_hi = [_mm256_setzero_si256(); N];
                for p in 0..2 {
                    for (q, &(lo, hi)) in Self::quarter_pair(gp, j, p).iter().enumerate() {
                        let h = 2 * p + q;
                        for t in 0..N {
                            let a = acts[t].add(b * Q8_K_AB + Q8_K_QS + 32 * j + 4 * h);
                            dot_lo[t] = dpbusd::<F>(dot_lo[t], lo, bcast4(a));
                            dot_hi[t] = dpbusd::<F>(dot_hi[t], hi, bcast4(a.add(16)));
                        }
                    }
                }
                for t in 0..N {
                    let s = _mm256_add_epi32(
                        _mm256_mullo_epi32(dot_lo[t], sc_lo),
                        _mm256_mullo_epi32(dot_hi[t], sc_hi),
                    );
                    isum[t] = _mm256_add_epi32(isum[t], s);
                }
            }
            // The levels exceed the true ones by 32: subtract 32 * sum(scale * the
            // activation's 16-value sum), two sub-blocks per `vpdpwssd`.
            let mut msum = [_mm256_setzero_si256(); N];
            for p in 0..8 {
                let pair = _mm_unpacklo_epi8(
                    _mm_loadl_epi64(gp.add(Q6K_OFF_SCALES + 16 * p).cast()),
                    _mm_loadl_epi64(gp.add(Q6K_OFF_SCALES + 16 * p + 8).cast()),
                );
                let scales = _mm256_cvtepi8_epi16(pair);
                for t in 0..N {
                    let bs = bcast4(acts[t].add(b * Q8_K_AB + Q8_K_BSUMS + 4 * p));
                    msum[t] = dpwssd::<F>(msum[t], scales, bs);
                }
            }
            let d = _mm256_cvtph_ps(load128(gp));
            for t in 0..N {
                let tot = _mm256_sub_epi32(isum[t], _mm256_slli_epi32::<5>(msum[t]));
                let da = _mm256_set1_ps(read_f32(acts[t].add(b * Q8_K_AB)));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(tot), acc[t]);
            }
        }
    }
}

impl Q6K {
    /// With `PF`, asks for pair j's 192 bytes [`PREFETCH_BYTES`] ahead: the bytes this
    /// step of the pair loop reads, as `KMin::prefetch_step`.
    #[inline(always)]
    fn prefetch_pair<const PF: bool>(gp: *const u8, j: usize) {
        if PF {
            prefetch_ahead(gp.wrapping_add(q6k_pair(j)), 192);
        }
    }

    /// Quarters 2p and 2p + 1 of pair j's levels (`pack::q6k_pair`), each as `lo`, values
    /// 32j + 4h.. of sub-block 2j, and `hi`, 16 on, of 2j + 1: the `lo`s are their `Y`
    /// vectors' low six bits; a `hi` takes its low four bits from `Z` and its top two from
    /// its `Y`'s bits 6-7, moved to 4-5 by a 16-bit shift (what crosses from the next byte
    /// lands in bits 6-7, which the mask drops).
    ///
    /// # Safety
    /// `gp` holds a Q6_K group block; AVX2.
    #[inline(always)]
    unsafe fn quarter_pair(gp: *const u8, j: usize, p: usize) -> [(__m256i, __m256i); 2] {
        // SAFETY: quarter pair p of pair j lies inside the group block.
        let (ya, yb, z) = unsafe {
            let at = gp.add(q6k_pair(j) + 96 * p);
            (load256(at), load256(at.add(32)), load256(at.add(64)))
        };
        let six = _mm256_set1_epi8(0x3F);
        let nibble = _mm256_set1_epi8(0x0F);
        let top = _mm256_set1_epi8(0x30);
        let top_of = |y: __m256i| _mm256_and_si256(_mm256_srli_epi16::<2>(y), top);
        [
            (
                _mm256_and_si256(ya, six),
                _mm256_or_si256(_mm256_and_si256(z, nibble), top_of(ya)),
            ),
            (
                _mm256_and_si256(yb, six),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(z), nibble),
                    top_of(yb),
                ),
            ),
        ]
    }

    /// Values 32j..32j+32 of the group's eight rows times their two sub-blocks' scales,
    /// added to `isum`, where AVX2 runs alone: pair products summed in i16 lanes two
    /// loads at a time and widened by a `vpmaddwd` with the scales, as
    /// [`KMin::plain_levels`]. A Q6_K pair product is at most 2 x 63 x 128 = 16,128 in
    /// size, so two of them fit an i16.
    ///
    /// # Safety
    /// `gp` holds a Q6_K group block, each `acts[t]` block `b` of its activation; AVX2.
    #[inline(always)]
    unsafe fn plain_levels<const N: usize, const PF: bool>(
        gp: *const u8,
        acts: [*const u8; N],
        b: usize,
        j: usize,
        isum: &mut [__m256i; N],
    ) {
        Self::prefetch_pair::<PF>(gp, j);
        // SAFETY (every read): inside the group block or block b of an activation.
        unsafe {
            let sc_lo = scale_pairs(gp.add(Q6K_OFF_SCALES + 16 * j), true);
            let sc_hi = scale_pairs(gp.add(Q6K_OFF_SCALES + 16 * j + 8), true);
            for p in 0..2 {
                let mut lo_sum = [_mm256_setzero_si256(); N];
                let mut hi_sum = [_mm256_setzero_si256(); N];
                for (q, &quarter) in Self::quarter_pair(gp, j, p).iter().enumerate() {
                    let h = 2 * p + q;
                    add_quarter_pairs(quarter, acts, (b, j, h), true, &mut lo_sum, &mut hi_sum);
                }
                for t in 0..N {
                    let s = _mm256_add_epi32(
                        _mm256_madd_epi16(lo_sum[t], sc_lo),
                        _mm256_madd_epi16(hi_sum[t], sc_hi),
                    );
                    isum[t] = _mm256_add_epi32(isum[t], s);
                }
            }
        }
    }
}

/// A 32-value format's group block (`pack::legacy_layout`) and how it unpacks to its
/// eight level vectors.
trait Levels8 {
    const TYPE: GgmlType;
    /// Bytes of one block of the type in ggml's layout.
    const WB: usize;

    /// The eight level vectors of the group block at `gp`: Q8_0's bytes as they lie, the
    /// nibble formats' loads split (load h gives vectors h and h + 4) with the fifth
    /// bits ORed in where the format has them.
    ///
    /// # Safety
    /// `gp` points to a readable group block.
    #[inline(always)]
    unsafe fn levels(gp: *const u8) -> [__m256i; 8] {
        let at = legacy_layout(Self::TYPE);
        if Self::TYPE == GgmlType::Q8_0 {
            // SAFETY: the levels are the block's 256 bytes from `at.levels`.
            return std::array::from_fn(|v| unsafe { load256(gp.add(at.levels + 32 * v)) });
        }
        // SAFETY: 128 bytes of nibbles at `at.levels`, 32 of fifth bits at `at.fifth`.
        let mut l = unsafe { nibble_vectors(gp.add(at.levels)) };
        if let Some(f) = at.fifth {
            let plane = unsafe { load256(gp.add(f)) };
            for (v, level) in l.iter_mut().enumerate() {
                // SAFETY: the drivers that inline this run on AVX2.
                *level = _mm256_or_si256(*level, unsafe { fifth_bit(plane, v) });
            }
        }
        l
    }
}

/// The nibble loads of Q4_0/Q4_1/Q5_0/Q5_1 at `p`: load h gives vectors h (low) and
/// h + 4 (high).
///
/// # Safety
/// `p` is readable for 128 bytes.
#[inline(always)]
unsafe fn nibble_vectors(p: *const u8) -> [__m256i; 8] {
    let nibble = _mm256_set1_epi8(0x0F);
    // SAFETY: forwarded from the caller.
    let x: [__m256i; 4] = std::array::from_fn(|h| unsafe { load256(p.add(32 * h)) });
    std::array::from_fn(|v| {
        if v < 4 {
            _mm256_and_si256(x[v], nibble)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(x[v - 4]), nibble)
        }
    })
}

struct Q4_0L;
struct Q4_1L;
struct Q5_0L;
struct Q5_1L;
struct Q8_0L;

impl Levels8 for Q4_0L {
    const TYPE: GgmlType = GgmlType::Q4_0;
    const WB: usize = 18;
}

impl Levels8 for Q4_1L {
    const TYPE: GgmlType = GgmlType::Q4_1;
    const WB: usize = 20;
}

impl Levels8 for Q5_0L {
    const TYPE: GgmlType = GgmlType::Q5_0;
    const WB: usize = 22;
}

impl Levels8 for Q5_1L {
    const TYPE: GgmlType = GgmlType::Q5_1;
    const WB: usize = 24;
}

impl Levels8 for Q8_0L {
    const TYPE: GgmlType = GgmlType::Q8_0;
    const WB: usize = 34;
}

/// Interleaved Q4_0/Q4_1/Q5_0/Q5_1/Q8_0.
struct Legacy<L>(std::marker::PhantomData<L>);

impl<L: Levels8> GroupKernel for Legacy<L> {
    const BLOCK_VALUES: usize = 32;
    const GB: usize = GROUP_ROWS * L::WB;
    const AB: usize = Q8_0_BYTES;
    const TERMS: usize = 2;
    const MAX_BLOCKS: usize = LEGACY_MAX_BLOCKS;

    /// The activation's d as f32 bits, and -OFFSET * the sum of its 32 quants (or, for
    /// the formats with a minimum, d times that sum as f32 bits: what the minimum
    /// multiplies).
    #[inline(always)]
    unsafe fn terms(ap: *const u8, out: &mut [i32]) {
        // SAFETY: a Q8_0 block is d (f16) then 32 quants.
        unsafe {
            let d = f16_to_f32(read_u16(ap));
            out[0] = d.to_bits() as i32;
            out[1] = match legacy_layout(L::TYPE).min {
                Some(_) => (d * q8_0_quant_sum(ap) as f32).to_bits() as i32,
                None => -legacy_offset(L::TYPE) * q8_0_quant_sum(ap),
            };
        }
    }

    #[inline(always)]
    unsafe fn add_block<const F: u8, const N: usize, const PF: bool>(
        gp: *const u8,
        acts: [*const u8; N],
        terms: [*const i32; N],
        b: usize,
        acc: &mut [__m256; N],
    ) {
        // A group block of these formats is 144 to 272 bytes: asked for at once.
        if PF {
            prefetch_ahead(gp, Self::GB);
        }
        // SAFETY (every read): inside the group block, block b of an activation or its
        // terms.
        unsafe {
            let lv = L::levels(gp);
            let dw = _mm256_cvtph_ps(load128(gp));
            let min = legacy_layout(L::TYPE).min;
            for t in 0..N {
                let a = acts[t].add(b * Q8_0_BYTES + 2);
                let tp = terms[t].add(2 * b);
                // Two chains, the first starting at -OFFSET * sum(a): exact, and
                // offset-free once added (a format with a minimum starts at zero).
                let mut d0 = match min {
                    Some(_) => _mm256_setzero_si256(),
                    None => _mm256_set1_epi32(*tp.add(1)),
                };
                let mut d1 = _mm256_setzero_si256();
                if F == PLAIN {
                    // AVX2 alone: pair products summed in i16 lanes, widened once per
                    // half, as `KMin::plain_levels` (a pair is at most 2 x 31 x 128 =
                    // 7,936 in size, so four fit an i16; 4-bit levels' 3,840, so eight).
                    // Never Q8_0, whose pairs saturate (`select::interleaves`).
                    debug_assert!(L::TYPE != GgmlType::Q8_0);
                    let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                    for v in 0..4 {
                        s0 = add_pairs(s0, lv[v], bcast4(a.add(4 * v)));
                        s1 = add_pairs(s1, lv[v + 4], bcast4(a.add(16 + 4 * v)));
                    }
                    let ones = _mm256_set1_epi16(1);
                    if legacy_layout(L::TYPE).fifth.is_some() {
                        d1 = _mm256_madd_epi16(s1, ones);
                    } else {
                        s0 = _mm256_add_epi16(s0, s1);
                    }
                    d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(s0, ones));
                } else {
                    for v in 0..4 {
                        d0 = dpbusd::<F>(d0, lv[v], bcast4(a.add(4 * v)));
                        d1 = dpbusd::<F>(d1, lv[v + 4], bcast4(a.add(16 + 4 * v)));
                    }
                }
                let da = _mm256_set1_ps(f32::from_bits(*tp as u32));
                let dot = _mm256_cvtepi32_ps(_mm256_add_epi32(d0, d1));
                acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, da), acc[t]);
                if let Some(m) = min {
                    // + m_w * d_a * sum(a).
                    let sa = _mm256_set1_ps(f32::from_bits(*tp.add(1) as u32));
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtph_ps(load128(gp.add(m))), sa, acc[t]);
                }
            }
        }
    }
}

/// Reads back what [`store`] wrote for a group and token (the lanes of rows past
/// `rows.end` as zero): a window's sums, which the next window adds to.
///
/// # Safety
/// As [`store`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reload(out: *const f32, first: usize, rows: &Range<usize>) -> __m256 {
    let live = (rows.end - first).min(GROUP_ROWS);
    // SAFETY: rows first..first+live are in `rows`, so their slots are in `out`.
    unsafe {
        let o = out.add(first - rows.start);
        if live == GROUP_ROWS {
            _mm256_loadu_ps(o)
        } else {
            let mut tmp = [0.0f32; GROUP_ROWS];
            std::ptr::copy_nonoverlapping(o, tmp.as_mut_ptr(), live);
            _mm256_loadu_ps(tmp.as_ptr())
        }
    }
}

/// Writes a group's result for one token: its rows that fall in `rows`.
///
/// # Safety
/// `out` is valid for `rows.len()` floats; `first` (a row of `rows`, a multiple of 8
/// from `rows.start`) is where the group starts.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store(v: __m256, out: *mut f32, first: usize, rows: &Range<usize>) {
    let live = (rows.end - first).min(GROUP_ROWS);
    // SAFETY: rows first..first+live are in `rows`, so their slots are in `out`.
    unsafe {
        let o = out.add(first - rows.start);
        if live == GROUP_ROWS {
            _mm256_storeu_ps(o, v);
        } else {
            let mut tmp = [0.0f32; GROUP_ROWS];
            _mm256_storeu_ps(tmp.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), o, live);
        }
    }
}

thread_local! {
    /// The driver's terms, one buffer per thread, zeroed once: zeroing its 32 KiB on
    /// every call cost an expert's short rows more than their dot products, and evicted
    /// L1 besides.
    static TERMS: std::cell::UnsafeCell<[i32; TERMS_LEN]> =
        const { std::cell::UnsafeCell::new([0; TERMS_LEN]) };
}

/// Matmul (and matvec, `m` = 1) of interleaved rows: token chunks that stay in L2 (their
/// per-block terms made once), then groups, then tiles of `T` tokens (and single
/// tokens at the edge). Rows of several windows are walked window by window, in the
/// order their bytes lie, each tile adding to what the same tile stored for the last
/// window: the same float steps in the same order, so the same bits whichever way a
/// row is cut or a token batched. Software prefetch runs where `allow_prefetch` and a
/// chunk has few tokens.
///
/// # Safety
/// AVX2/FMA/F16C and what form `F` needs present; `rows.start` is a multiple of 8;
/// `packed` is a whole interleaved matrix (`pack::Windows`) of rows `..rows.end` or more
/// over `nb` <= `K::MAX_BLOCKS` blocks;
/// `acts` holds `m` activations of `nb` blocks; `out` holds
/// `(m - 1) * out_stride + rows.len()` floats.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn drive<K: GroupKernel, const F: u8, const T: usize>(
    allow_prefetch: bool,
    nb: usize,
    packed: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    debug_assert!(rows.start.is_multiple_of(GROUP_ROWS) && nb <= K::MAX_BLOCKS);
    let ab = nb * K::AB;
    let gb = nb * K::GB;
    let zero = [_mm256_setzero_ps(); T];
    let (w, a, o) = (packed.as_ptr(), acts.as_ptr(), out.as_mut_ptr());
    let win = Windows::new(K::BLOCK_VALUES, nb, packed.len() / gb.max(1));
    // SAFETY: this thread's own buffer, and nothing `drive` calls drives again, so no
    // other reference to it lives meanwhile.
    let terms = unsafe { &mut *TERMS.with(|t| t.get()) };
    let per_token = K::TERMS * nb;
    let chunk = (ACT_CHUNK_BYTES / ab.max(1))
        .min(TERMS_LEN / per_token.max(1))
        .max(1);
    let groups = rows.start / GROUP_ROWS..rows.end.div_ceil(GROUP_ROWS);
    let mut t0 = 0;
    // SAFETY (pointer arithmetic, tiles and stores): tokens below m, groups below
    // rows.end / 8 rounded up, blocks below nb, all promised by the caller.
    while t0 < m {
        let t1 = (t0 + chunk).min(m);
        let act = |t: usize| unsafe { a.add(t * ab) };
        for t in t0..t1 {
            for b in 0..nb {
                let at = (t - t0) * per_token + b * K::TERMS;
                unsafe { K::terms(act(t).add(b * K::AB), &mut terms[at..at + K::TERMS]) };
            }
        }
        let term = |t: usize| unsafe { terms.as_ptr().add((t - t0) * per_token) };
        // Few tokens leave the loop bound by memory, as matvec is; many reuse each group
        // long enough for the hardware prefetcher.
        let prefetch = allow_prefetch && t1 - t0 <= 2 * T;
        for wi in 0..win.count() {
            // Group g's blocks of this window start `g * blocks.len()` blocks in (for a
            // row of one window, group after group as the rows lie).
            let blocks = win.blocks(wi);
            let base = unsafe { w.add(win.index(0, blocks.start) * K::GB) };
            let stride = blocks.len() * K::GB;
            for g in groups.clone() {
                let (gp, first) = (unsafe { base.add(g * stride) }, g * GROUP_ROWS);
                let out_t = |t: usize| unsafe { o.add(t * out_stride) };
                let mut t = t0;
                while t + T <= t1 {
                    let acc = match wi {
                        0 => zero,
                        _ => std::array::from_fn(|k| unsafe { reload(out_t(t + k), first, &rows) }),
                    };
                    let v = unsafe {
                        group_tile::<K, F, T>(
                            gp,
                            std::array::from_fn(|k| act(t + k)),
                            std::array::from_fn(|k| term(t + k)),
                            blocks.clone(),
                            prefetch,
                            acc,
                        )
                    };
                    for (k, v) in v.into_iter().enumerate() {
                        unsafe { store(v, out_t(t + k), first, &rows) };
                    }
                    t += T;
                }
                while t < t1 {
                    let acc = match wi {
                        0 => [zero[0]],
                        _ => [unsafe { reload(out_t(t), first, &rows) }],
                    };
                    let [v] = unsafe {
                        group_tile::<K, F, 1>(
                            gp,
                            [act(t)],
                            [term(t)],
                            blocks.clone(),
                            prefetch,
                            acc,
                        )
                    };
                    unsafe { store(v, out_t(t), first, &rows) };
                    t += 1;
                }
            }
        }
        t0 = t1;
    }
}

/// [`drive`] for type `w` (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0) with `T`-token tiles.
///
/// # Safety
/// As [`drive`], with `n` values a row.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn matmul_any<const F: u8, const T: usize>(
    prefetch: bool,
    w: GgmlType,
    n: usize,
    packed: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let nb = n / w.block_size();
    // SAFETY: forwarded from the caller.
    unsafe {
        match w {
            GgmlType::Q4_K => {
                drive::<Q4K, F, T>(prefetch, nb, packed, rows, acts, m, out, out_stride)
            }
            GgmlType::Q5_K => {
                drive::<Q5K, F, T>(prefetch, nb, packed, rows, acts, m, out, out_stride)
            }
            GgmlType::Q6_K => {
                drive::<Q6K, F, T>(prefetch, nb, packed, rows, acts, m, out, out_stride)
            }
            GgmlType::Q4_0 => {
                drive::<Legacy<Q4_0L>, F, T>(prefetch, nb, packed, rows, acts, m, out, out_stride)
            }
            GgmlType::Q4_1 => {
                drive::<Legacy<Q4_1L>, F, T>(prefetch, nb, packed, rows, acts, m, out, out_stride)
            }
            GgmlType::Q5_0 => {
                drive::<Legacy<Q5_0L>, F, T>(prefetch, nb, packed, rows, acts, m, out, out_stride)
            }
            GgmlType::Q5_1 => {
                drive::<Legacy<Q5_1L>, F, T>(prefetch, nb, packed, rows, acts, m, out, out_stride)
            }
            GgmlType::Q8_0 => {
                drive::<Legacy<Q8_0L>, F, T>(prefetch, nb, packed, rows, acts, m, out, out_stride)
            }
            _ => unreachable!("{w} rows are not interleaved"),
        }
    }
}

/// The interleaved matmul in form `F` (PLAIN or VEX), compiled for AVX2.
///
/// # Safety
/// As [`drive`], with `n` values a row; `F` is not EVEX.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn matmul<const F: u8>(
    prefetch: bool,
    w: GgmlType,
    n: usize,
    packed: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    debug_assert!(F != EVEX);
    // SAFETY: forwarded from the caller.
    unsafe { matmul_any::<F, T_AVX2>(prefetch, w, n, packed, rows, acts, m, out, out_stride) }
}

/// The interleaved matmul in the EVEX form, compiled for AVX-512 VNNI and VL (32 vector
/// registers, so 8-token tiles).
///
/// # Safety
/// As [`drive`], with `n` values a row, on a CPU with AVX-512 F/VL/VNNI.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub(super) unsafe fn matmul_evex(
    prefetch: bool,
    w: GgmlType,
    n: usize,
    packed: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { matmul_any::<EVEX, T_AVX512>(prefetch, w, n, packed, rows, acts, m, out, out_stride) }
}
