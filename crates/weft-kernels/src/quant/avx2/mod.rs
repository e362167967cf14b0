//! x86-64 AVX2+FMA+F16C kernels, compiled with `#[target_feature]` so a generic x86-64
//! build still gets them; entered only after run-time detection.
//!
//! Every weight format implements [`Tile`]: the dot products of R weight rows with T
//! activations. Decode (matvec) walks one row at a time: on this class of machine a
//! single sequential stream reads memory ~25% faster than several interleaved rows, and
//! the activation sits in L1 either way. Prefill (matmul) runs 1 x 4 tiles (2 x 4 for
//! floats) so each weight block is unpacked once per 4 tokens, rows outer so a row is read
//! from memory once per token chunk while the chunk's activations stay in L2.
//!
//! The 32-value formats carry an f16 scale per 32 values; converting those one at a time
//! inside the dot loop costs as much as the dot itself, so they are converted eight per
//! instruction outside it: the activation's once per call by the driver (with its block
//! sums, see legacy.rs), a row's at the start of its tile.

mod act;
mod float;
mod interleaved;
mod kquant;
mod kquant_rows;
mod kquant_zmm;
mod legacy;
mod peak;
mod tile;
mod vnni;

use std::arch::x86_64::*;
use std::ops::Range;
use weft_gguf::GgmlType;

use super::blocks::Q8_0_BYTES;
use super::select::{self, Fused, Path};
use tile::{put, q8_0_quant_sum, scales8, Tile, ACT_CHUNK_BYTES, COLS, PREFETCH_BYTES};

pub(super) use act::quantize_act;
pub(super) use peak::{run as dot_peak_loop, OPS_PER_ITER as DOT_PEAK_OPS_PER_ITER};

/// Whether some AVX-512 VNNI path is offered (the K-quant `vpdpwssd` form and 512-bit
/// tile, or the 32-value formats' 512-bit tile where `WEFT_KERNELS_VNNI512` asks for it).
pub(super) fn vnni_matmul() -> bool {
    [
        Fused::Avx512Vnni256,
        Fused::Avx512Vnni512,
        Fused::Avx512VnniZmm,
    ]
    .into_iter()
    .any(|fused| {
        select::runnable(Path {
            fused,
            prefetch: false,
        })
    })
}

/// The AVX-512 VNNI matmul of a 32-value type whatever `WEFT_KERNELS_VNNI512` says, for
/// the tests; false (nothing run) where the CPU lacks AVX-512 VNNI.
///
/// # Safety
/// As [`matmul`].
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul_vnni512(
    w: GgmlType,
    n: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) -> bool {
    let have = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni");
    let nb = n / 32;
    // SAFETY: forwarded from the caller; the features were just detected.
    unsafe {
        match w {
            _ if !have => return false,
            GgmlType::Q8_0 => {
                vnni::matmul::<legacy::Q8_0>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q5_0 => {
                vnni::matmul::<legacy::Q5_0>(nb, weights, rows, acts, m, out, out_stride)
            }
            GgmlType::Q4_0 => {
                vnni::matmul::<legacy::Q4_0>(nb, weights, rows, acts, m, out, out_stride)
            }
            _ => return false,
        }
    }
    true
}

/// Weight types with AVX2 kernels on ggml's rows (`select::has_row_kernels`).
pub(super) fn supports(w: GgmlType) -> bool {
    select::has_row_kernels(w)
}

/// f32 activation scales the matmul driver keeps for a token chunk.
const ACT_SCALES: usize = 8192;

/// The f16 scales of `count` consecutive blocks as f32 into `out` (count rounded up to
/// 8 long), the padding zero.
///
/// # Safety
/// As [`scales8`]; `out.len()` is a multiple of 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn convert_scales(p: *const u8, stride: usize, count: usize, out: &mut [f32]) {
    for (i, o) in out.chunks_exact_mut(8).enumerate() {
        // SAFETY: forwarded; o has 8 floats.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), scales8(p, stride, 8 * i, count)) };
    }
}

/// Sums of the 32 quants of each of `count` Q8_0 blocks, as f32; the rest of `out` is
/// zeroed.
///
/// # Safety
/// `p` holds `count` readable Q8_0 blocks, count <= out.len().
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_sums(p: *const u8, count: usize, out: &mut [f32]) {
    for (b, o) in out.iter_mut().enumerate().take(count) {
        // SAFETY: block b < count.
        *o = unsafe { q8_0_quant_sum(p.add(b * Q8_0_BYTES)) } as f32;
    }
    out[count..].fill(0.0);
}

/// The driver-made record of one activation span: scales, then (if `K::SUMS`) sums.
///
/// # Safety
/// `p` holds `cl` readable activation blocks; `out` is `record_len::<K>(cl)` long.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn act_record<K: Tile>(p: *const u8, cl: usize, out: &mut [f32]) {
    let cp = cl.div_ceil(8) * 8;
    // SAFETY: forwarded from the caller.
    unsafe {
        convert_scales(p, K::AB, cl, &mut out[..cp]);
        if K::SUMS {
            block_sums(p, cl, &mut out[cp..2 * cp]);
        }
    }
}

/// Floats of an activation record for `cl` blocks.
fn record_len<K: Tile>(cl: usize) -> usize {
    cl.div_ceil(8) * 8 * if K::SUMS { 2 } else { 1 }
}

/// Matvec, one row at a time.
///
/// # Safety
/// AVX2/FMA/F16C present; `weights` holds `rows.end` rows of `nb * K::WB` bytes; `act`
/// holds `nb * K::AB` bytes; `out.len() >= rows.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn matvec_with<K: Tile>(
    nb: usize,
    weights: &[u8],
    rows: Range<usize>,
    act: &[u8],
    out: &mut [f32],
    prefetch: bool,
) {
    let rb = nb * K::WB;
    let (w, a) = (weights.as_ptr(), act.as_ptr());
    if nb == 0 {
        out[..rows.len()].fill(0.0);
        return;
    }
    let cols = if K::SCALES { COLS } else { nb };
    let mut asc = [0.0f32; 2 * COLS];
    let mut c0 = 0;
    // SAFETY (pointer arithmetic and tile calls): rows are below rows.end and blocks
    // below nb, both checked by the caller against the slice lengths.
    while c0 < nb {
        let cl = cols.min(nb - c0);
        let ap = unsafe { a.add(c0 * K::AB) };
        if K::SCALES {
            unsafe { act_record::<K>(ap, cl, &mut asc[..record_len::<K>(cl)]) };
        }
        for (o, r) in rows.clone().enumerate() {
            let rp = unsafe { w.add(r * rb + c0 * K::WB) };
            // With `prefetch`, ask for the bytes PREFETCH_BYTES ahead of this row, a
            // row's worth per row, so the stream keeps enough misses in flight. Measured
            // on the Q8_0 output head of one Intel machine: 11-14 GB/s without, 16-18
            // with; on AMD Zen 4 the hardware prefetcher alone is faster, hence a
            // measured choice. Prefetches never fault, so running past the end of the
            // matrix is harmless; wrapping_add keeps the address computation defined.
            let mut off = 0;
            while prefetch && off < cl * K::WB {
                _mm_prefetch::<_MM_HINT_T0>(rp.wrapping_add(PREFETCH_BYTES + off).cast());
                off += 64;
            }
            let v = unsafe { K::tile::<1, 1>([rp], [ap], cl, [asc.as_ptr()]) };
            put(out, o, v[0][0], c0 == 0);
        }
        c0 += cl;
    }
}

/// Matmul with R x T tiles on AVX2 (see [`matmul_tiles`]).
///
/// # Safety
/// As [`matmul_tiles`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn matmul_with<K: Tile, const R: usize, const T: usize>(
    nb: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { matmul_tiles::<K, R, T>(nb, weights, rows, acts, m, out, out_stride) }
}

/// The same driver compiled for AVX-512 VNNI, so 512-bit tiles inline into it.
///
/// # Safety
/// As [`matmul_tiles`], on a CPU with AVX-512 F/BW/VNNI.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn matmul_with_zmm<K: Tile, const R: usize, const T: usize>(
    nb: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { matmul_tiles::<K, R, T>(nb, weights, rows, acts, m, out, out_stride) }
}

/// Matmul with R x T tiles (and R x 1, 1 x T, 1 x 1 at the edges): column chunks, then
/// token chunks, then rows, then tokens. Always inlined into a driver compiled for the
/// tile's instruction set.
///
/// # Safety
/// As `matvec_with`, plus `acts` holds `m` activations and `out` is large enough for
/// `(m - 1) * out_stride + rows.len()` values; the CPU runs `K`'s instructions.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn matmul_tiles<K: Tile, const R: usize, const T: usize>(
    nb: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let (rb, ab) = (nb * K::WB, nb * K::AB);
    let (w, a) = (weights.as_ptr(), acts.as_ptr());
    if nb == 0 {
        for t in 0..m {
            out[t * out_stride..t * out_stride + rows.len()].fill(0.0);
        }
        return;
    }
    let cols = if K::SCALES { COLS } else { nb };
    let mut asc = [0.0f32; ACT_SCALES];
    let mut c0 = 0;
    // SAFETY (pointer arithmetic and tile calls): every row index is below rows.end,
    // every token below m and every block below nb, all checked by the caller.
    while c0 < nb {
        let cl = cols.min(nb - c0);
        let first = c0 == 0;
        let rec = record_len::<K>(cl);
        let mut chunk = (ACT_CHUNK_BYTES / (cl * K::AB)).max(T);
        if K::SCALES {
            chunk = chunk.min(ACT_SCALES / rec);
        }
        let chunk = (chunk / T * T).max(1);
        let mut t0 = 0;
        while t0 < m {
            let t1 = (t0 + chunk).min(m);
            let act = |t: usize| unsafe { a.add(t * ab + c0 * K::AB) };
            if K::SCALES {
                for t in t0..t1 {
                    let o = (t - t0) * rec;
                    unsafe { act_record::<K>(act(t), cl, &mut asc[o..o + rec]) };
                }
            }
            let asp = |t: usize| unsafe { asc.as_ptr().add((t - t0) * rec) };
            let mut r = rows.start;
            while r < rows.end {
                let i = r - rows.start;
                let group = if r + R <= rows.end { R } else { 1 };
                let row = |k: usize| unsafe { w.add((r + k) * rb + c0 * K::WB) };
                // Few tokens (batched decode) leave the loop bound by memory, as matvec
                // is: prefetch the rows ahead the same way. Many tokens reuse each row
                // long enough for the hardware prefetcher.
                if t1 - t0 <= 2 * T {
                    for k in 0..group {
                        let rp = row(k);
                        let mut off = 0;
                        while off < cl * K::WB {
                            _mm_prefetch::<_MM_HINT_T0>(
                                rp.wrapping_add(PREFETCH_BYTES + off).cast(),
                            );
                            off += 64;
                        }
                    }
                }
                let mut t = t0;
                if group == R {
                    let p: [*const u8; R] = std::array::from_fn(row);
                    while t + T <= t1 {
                        let res = unsafe {
                            K::tile::<R, T>(
                                p,
                                std::array::from_fn(|k| act(t + k)),
                                cl,
                                std::array::from_fn(|k| asp(t + k)),
                            )
                        };
                        for (ri, v) in res.iter().enumerate() {
                            for (ti, x) in v.iter().enumerate() {
                                put(out, (t + ti) * out_stride + i + ri, *x, first);
                            }
                        }
                        t += T;
                    }
                    while t + 2 <= t1 {
                        let res = unsafe {
                            K::tile::<R, 2>(p, [act(t), act(t + 1)], cl, [asp(t), asp(t + 1)])
                        };
                        for (ri, v) in res.iter().enumerate() {
                            for (ti, x) in v.iter().enumerate() {
                                put(out, (t + ti) * out_stride + i + ri, *x, first);
                            }
                        }
                        t += 2;
                    }
                    while t < t1 {
                        let res = unsafe { K::tile::<R, 1>(p, [act(t)], cl, [asp(t)]) };
                        for (ri, v) in res.iter().enumerate() {
                            put(out, t * out_stride + i + ri, v[0], first);
                        }
                        t += 1;
                    }
                } else {
                    let p = [row(0)];
                    while t + T <= t1 {
                        let res = unsafe {
                            K::tile::<1, T>(
                                p,
                                std::array::from_fn(|k| act(t + k)),
                                cl,
                                std::array::from_fn(|k| asp(t + k)),
                            )
                        };
                        for (ti, x) in res[0].iter().enumerate() {
                            put(out, (t + ti) * out_stride + i, *x, first);
                        }
                        t += T;
                    }
                    while t + 2 <= t1 {
                        let res = unsafe {
                            K::tile::<1, 2>(p, [act(t), act(t + 1)], cl, [asp(t), asp(t + 1)])
                        };
                        for (ti, x) in res[0].iter().enumerate() {
                            put(out, (t + ti) * out_stride + i, *x, first);
                        }
                        t += 2;
                    }
                    while t < t1 {
                        let res = unsafe { K::tile::<1, 1>(p, [act(t)], cl, [asp(t)]) };
                        put(out, t * out_stride + i, res[0][0], first);
                        t += 1;
                    }
                }
                r += group;
            }
            t0 = t1;
        }
        c0 += cl;
    }
}

/// AVX2 matvec for every weight type but Q8_K, on `path`.
///
/// # Safety
/// AVX2/FMA/F16C present, and what `path` needs (`select::runnable`);
/// lengths as checked by `quant::matvec`.
pub(super) unsafe fn matvec(
    path: Path,
    w: GgmlType,
    n: usize,
    weights: &[u8],
    rows: Range<usize>,
    act: &[u8],
    out: &mut [f32],
) {
    let nb = n / w.block_size();
    let pf = path.prefetch;
    use kquant::{EVEX, PLAIN, VEX};
    use Fused::{Avx512Vnni256 as E, AvxVnni as V};
    // SAFETY: forwarded from the caller.
    unsafe {
        match (w, path.fused) {
            (GgmlType::F32, _) => matvec_with::<float::F32>(nb, weights, rows, act, out, pf),
            (GgmlType::F16, _) => matvec_with::<float::F16>(nb, weights, rows, act, out, pf),
            (GgmlType::BF16, _) => matvec_with::<float::Bf16>(nb, weights, rows, act, out, pf),
            (GgmlType::Q4_0, V) => matvec_with::<legacy::Offset<legacy::Q4Levels, VEX>>(
                nb, weights, rows, act, out, pf,
            ),
            (GgmlType::Q4_0, E) => matvec_with::<legacy::Offset<legacy::Q4Levels, EVEX>>(
                nb, weights, rows, act, out, pf,
            ),
            (GgmlType::Q4_0, _) => matvec_with::<legacy::Q4_0>(nb, weights, rows, act, out, pf),
            (GgmlType::Q5_0, V) => matvec_with::<legacy::Offset<legacy::Q5Levels, VEX>>(
                nb, weights, rows, act, out, pf,
            ),
            (GgmlType::Q5_0, E) => matvec_with::<legacy::Offset<legacy::Q5Levels, EVEX>>(
                nb, weights, rows, act, out, pf,
            ),
            (GgmlType::Q5_0, _) => matvec_with::<legacy::Q5_0>(nb, weights, rows, act, out, pf),
            (GgmlType::Q8_0, V) => {
                matvec_with::<legacy::Q8_0Of<VEX>>(nb, weights, rows, act, out, pf)
            }
            (GgmlType::Q8_0, E) => {
                matvec_with::<legacy::Q8_0Of<EVEX>>(nb, weights, rows, act, out, pf)
            }
            (GgmlType::Q8_0, _) => matvec_with::<legacy::Q8_0>(nb, weights, rows, act, out, pf),
            (GgmlType::Q4_K, V) => matvec_with::<kquant::Q4K<VEX>>(nb, weights, rows, act, out, pf),
            (GgmlType::Q4_K, E) => {
                matvec_with::<kquant::Q4K<EVEX>>(nb, weights, rows, act, out, pf)
            }
            (GgmlType::Q4_K, _) => {
                matvec_with::<kquant::Q4K<PLAIN>>(nb, weights, rows, act, out, pf)
            }
            (GgmlType::Q5_K, V) => matvec_with::<kquant::Q5K<VEX>>(nb, weights, rows, act, out, pf),
            (GgmlType::Q5_K, E) => {
                matvec_with::<kquant::Q5K<EVEX>>(nb, weights, rows, act, out, pf)
            }
            (GgmlType::Q5_K, _) => {
                matvec_with::<kquant::Q5K<PLAIN>>(nb, weights, rows, act, out, pf)
            }
            (GgmlType::Q6_K, V) => matvec_with::<kquant::Q6K<VEX>>(nb, weights, rows, act, out, pf),
            (GgmlType::Q6_K, E) => {
                matvec_with::<kquant::Q6K<EVEX>>(nb, weights, rows, act, out, pf)
            }
            (GgmlType::Q6_K, _) => {
                matvec_with::<kquant::Q6K<PLAIN>>(nb, weights, rows, act, out, pf)
            }
            (GgmlType::Q8_K | GgmlType::Q4_1 | GgmlType::Q5_1, _) => {
                unreachable!("{w} rows take the scalar path")
            }
        }
    }
}

/// AVX2 matmul for every weight type but Q8_K, summing as `fused` says.
///
/// # Safety
/// AVX2/FMA/F16C present, and what `fused` needs (`select::runnable`);
/// lengths as checked by `quant::matmul`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul(
    fused: Fused,
    w: GgmlType,
    n: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let nb = n / w.block_size();
    use kquant::{EVEX, PLAIN, VEX};
    use Fused::{Avx512Vnni256 as E, Avx512Vnni512 as Z, Avx512VnniZmm as K, AvxVnni as V};
    macro_rules! tiled {
        ($k:ty, $r:literal) => {
            tiled!($k, $r, 4)
        };
        ($k:ty, $r:literal, $t:literal) => {
            matmul_with::<$k, $r, $t>(nb, weights, rows, acts, m, out, out_stride)
        };
    }
    macro_rules! zmm {
        ($k:ty) => {
            matmul_with_zmm::<$k, 1, 8>(nb, weights, rows, acts, m, out, out_stride)
        };
    }
    // SAFETY: forwarded from the caller; the 32-value formats' 512-bit tile is taken
    // only for two tokens or more (the K formats' takes any count, edges included).
    unsafe {
        match (w, fused) {
            (GgmlType::F32, _) => tiled!(float::F32, 2),
            (GgmlType::F16, _) => tiled!(float::F16, 2),
            (GgmlType::BF16, _) => tiled!(float::Bf16, 2),
            (GgmlType::Q4_0, Z) if m >= 2 => {
                vnni::matmul::<legacy::Q4_0>(nb, weights, rows, acts, m, out, out_stride)
            }
            (GgmlType::Q4_0, V) => tiled!(legacy::Offset<legacy::Q4Levels, VEX>, 1),
            (GgmlType::Q4_0, E) => tiled!(legacy::Offset<legacy::Q4Levels, EVEX>, 1),
            (GgmlType::Q4_0, _) => tiled!(legacy::Q4_0, 1),
            (GgmlType::Q5_0, Z) if m >= 2 => {
                vnni::matmul::<legacy::Q5_0>(nb, weights, rows, acts, m, out, out_stride)
            }
            (GgmlType::Q5_0, V) => tiled!(legacy::Offset<legacy::Q5Levels, VEX>, 1),
            (GgmlType::Q5_0, E) => tiled!(legacy::Offset<legacy::Q5Levels, EVEX>, 1),
            // One accumulator per token: eight tokens fit AVX2's sixteen registers and
            // unpack the row's blocks half as often (Zen 3: 6-7 % on Q5_0 and Q8_0; Q4_0's
            // cheap nibbles gained nothing).
            (GgmlType::Q5_0, _) => tiled!(legacy::Q5_0, 1, 8),
            (GgmlType::Q8_0, Z) if m >= 2 => {
                vnni::matmul::<legacy::Q8_0>(nb, weights, rows, acts, m, out, out_stride)
            }
            (GgmlType::Q8_0, V) => tiled!(legacy::Q8_0Of<VEX>, 1),
            (GgmlType::Q8_0, E) => tiled!(legacy::Q8_0Of<EVEX>, 1),
            (GgmlType::Q8_0, _) => tiled!(legacy::Q8_0, 1, 8),
            (GgmlType::Q4_K, K) => zmm!(kquant_zmm::Q4KZ),
            (GgmlType::Q4_K, V) => tiled!(kquant::Q4K<VEX>, 1),
            (GgmlType::Q4_K, E) => tiled!(kquant::Q4K<EVEX>, 1),
            (GgmlType::Q4_K, _) if nb <= kquant_rows::MAX_BLOCKS => {
                kquant_rows::matmul::<kquant_rows::KMin<kquant::Q4K<PLAIN>>>(
                    nb, weights, rows, acts, m, out, out_stride,
                )
            }
            (GgmlType::Q4_K, _) => tiled!(kquant::Q4K<PLAIN>, 1),
            (GgmlType::Q5_K, K) => zmm!(kquant_zmm::Q5KZ),
            (GgmlType::Q5_K, V) => tiled!(kquant::Q5K<VEX>, 1),
            (GgmlType::Q5_K, E) => tiled!(kquant::Q5K<EVEX>, 1),
            (GgmlType::Q5_K, _) if nb <= kquant_rows::MAX_BLOCKS => {
                kquant_rows::matmul::<kquant_rows::KMin<kquant::Q5K<PLAIN>>>(
                    nb, weights, rows, acts, m, out, out_stride,
                )
            }
            (GgmlType::Q5_K, _) => tiled!(kquant::Q5K<PLAIN>, 1),
            (GgmlType::Q6_K, K) => zmm!(kquant_zmm::Q6KZ),
            (GgmlType::Q6_K, V) => tiled!(kquant::Q6K<VEX>, 1),
            (GgmlType::Q6_K, E) => tiled!(kquant::Q6K<EVEX>, 1),
            (GgmlType::Q6_K, _) if nb <= kquant_rows::MAX_BLOCKS => {
                kquant_rows::matmul::<kquant_rows::Q6K>(nb, weights, rows, acts, m, out, out_stride)
            }
            (GgmlType::Q6_K, _) => tiled!(kquant::Q6K<PLAIN>, 1),
            (GgmlType::Q8_K | GgmlType::Q4_1 | GgmlType::Q5_1, _) => {
                unreachable!("{w} rows take the scalar path")
            }
        }
    }
}

/// Matmul (and matvec, `m` = 1) of rows interleaved by `quant::pack`, summing as `fused`
/// says (every form gives the same bits: the sums are exact integers), with software
/// prefetch where `prefetch` allows it.
///
/// # Safety
/// AVX2/FMA/F16C present, and what `fused` needs; `w` passes `pack::packable`,
/// `rows.start` is a multiple of 8, lengths as checked by `quant::matmul_packed`.
/// `Fused::Avx2` (maddubs) is exact on every type but Q8_0, whose levels reach 255 and
/// saturate its i16 pairs: Q8_0 takes a VNNI form only.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul_packed(
    fused: Fused,
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
    use kquant::{PLAIN, VEX};
    debug_assert!(select::interleaves(fused, w));
    // SAFETY: forwarded from the caller.
    unsafe {
        match fused {
            Fused::AvxVnni => {
                interleaved::matmul::<VEX>(prefetch, w, n, packed, rows, acts, m, out, out_stride)
            }
            Fused::Avx2 => {
                interleaved::matmul::<PLAIN>(prefetch, w, n, packed, rows, acts, m, out, out_stride)
            }
            Fused::Avx512Vnni256 => {
                interleaved::matmul_evex(prefetch, w, n, packed, rows, acts, m, out, out_stride)
            }
            _ => unreachable!("interleaved rows run on AVX2, AVX-VNNI or AVX-512 VNNI (256)"),
        }
    }
}
