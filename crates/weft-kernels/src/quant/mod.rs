//! Quantized weight formats (ggml byte layouts): quantize, dequantize, and the dot-product
//! kernels (vec_dot / matvec for decode, matmul for prefill) against activations quantized
//! to Q8_0 / Q8_K. The SIMD path is picked once at run time; a scalar path always exists.
//!
//! All functions are single-threaded and allocation-free (except `quantize_row`, which
//! returns a new buffer); callers split rows across threads.

mod blocks;
pub mod pack;
mod quantize;
mod scalar;
pub mod select;

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(test)]
mod tests;

use std::ops::Range;
use weft_gguf::GgmlType;

use select::{Path, Shape};

/// Which kernel family this process uses, decided on first use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

/// The family `select::simd` found (detected once there).
fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    if select::simd() {
        return Isa::Avx2;
    }
    Isa::Scalar
}

/// Whether a SIMD kernel family is in use (else every type takes the scalar path).
#[cfg(test)]
fn simd() -> bool {
    select::simd()
}

/// Name of the kernel family in use ("avx2", "avx2+avx512vnni" or "scalar"), for logs
/// and benchmarks.
pub fn simd_name() -> &'static str {
    match isa() {
        Isa::Scalar => "scalar",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if avx2::vnni_matmul() => "avx2+avx512vnni",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => "avx2",
    }
}

/// The byte-dot instruction the kernels use on this CPU, for `roofline`'s compute
/// ceiling: a VNNI `vpdpbusd` where one runs, else the AVX2 `vpmaddubsw` + `vpmaddwd`
/// pair. Its name and the integer operations of one iteration of [`dot_peak_run`]; None
/// where the SIMD kernels do not run.
pub fn dot_peak_instruction() -> Option<(&'static str, f64)> {
    #[cfg(target_arch = "x86_64")]
    if select::simd() {
        let name = match select::vnni_form() {
            Some(select::Fused::Avx512Vnni256) => "vpdpbusd, AVX-512 VNNI on 256 bits",
            Some(_) => "vpdpbusd, AVX-VNNI",
            None => "vpmaddubsw + vpmaddwd",
        };
        return Some((name, avx2::DOT_PEAK_OPS_PER_ITER));
    }
    None
}

/// Runs `iters` iterations of [`dot_peak_instruction`]'s instruction from registers only
/// (nothing where the SIMD kernels do not run).
pub fn dot_peak_run(iters: usize) {
    #[cfg(target_arch = "x86_64")]
    if select::simd() {
        let form = select::vnni_form().unwrap_or(select::Fused::Avx2);
        // SAFETY: AVX2, FMA and F16C are in use (select::simd) and the form's
        // instruction was detected (select::vnni_form).
        std::hint::black_box(unsafe { avx2::dot_peak_loop(form, iters) });
    }
    let _ = iters;
}

/// The activation format a weight type is dotted against: Q8_0 for Q4_0/Q5_0/Q8_0, Q8_K
/// for Q4_K/Q5_K/Q6_K (and Q8_K itself), F32 for F32/F16/BF16.
pub fn vec_dot_type(w: GgmlType) -> GgmlType {
    match w {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => GgmlType::F32,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
            GgmlType::Q8_0
        }
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q8_K => GgmlType::Q8_K,
    }
}

/// Bytes of `n` values of type `ty`; panics when `n` is not a whole number of blocks.
fn row_bytes(ty: GgmlType, n: usize) -> usize {
    let bs = ty.block_size();
    assert!(
        n.is_multiple_of(bs),
        "{ty}: row length {n} is not a multiple of the block size {bs}"
    );
    n / bs * ty.type_size()
}

/// Bytes of a quantized activation of `n` values in `vec_dot_type(w)` layout.
pub fn act_bytes(w: GgmlType, n: usize) -> usize {
    row_bytes(vec_dot_type(w), n)
}

/// Quantize an activation vector `x` (length a multiple of the block size) into `dst`
/// (`act_bytes(w, x.len())` long) for dotting with weights of type `w`.
pub fn quantize_act(w: GgmlType, x: &[f32], dst: &mut [u8]) {
    let at = vec_dot_type(w);
    let len = row_bytes(at, x.len());
    assert!(
        dst.len() >= len,
        "quantize_act: dst has {} bytes, needs {len}",
        dst.len()
    );
    let dst = &mut dst[..len];
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::quantize_act(at, x, dst),
        Isa::Scalar => quantize::quantize_into(at, x, dst),
    }
}

/// Rounds `x` in place as ggml rounds a matmul's activations for weights of type `w`:
/// to F16 or BF16 for those weights (ggml converts its input to their type), through the
/// 8-bit dot type for quantized ones, not at all for F32. `scratch` holds at least
/// `act_bytes(w, x.len())` bytes. No allocation.
pub fn round_as_activation(w: GgmlType, x: &mut [f32], scratch: &mut [u8]) {
    match w {
        GgmlType::F32 => {}
        GgmlType::F16 => x
            .iter_mut()
            .for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
        GgmlType::BF16 => x
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
        _ => {
            let act = &mut scratch[..act_bytes(w, x.len())];
            quantize_act(w, x, act);
            scalar::dequantize_row(vec_dot_type(w), act, x);
        }
    }
}

/// Dequantize one row (`dst.len()` values) of type `ty` from `src`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let len = row_bytes(ty, dst.len());
    assert!(
        src.len() >= len,
        "dequantize_row: {ty} src has {} bytes, needs {len}",
        src.len()
    );
    scalar::dequantize_row(ty, &src[..len], dst);
}

/// Quantize f32 values into type `ty` (every weight type and Q8_K) with ggml's reference
/// rounding. Used to build test models and by the GGUF writer; not fast.
pub fn quantize_row(ty: GgmlType, src: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; row_bytes(ty, src.len())];
    quantize::quantize_into(ty, src, &mut out);
    out
}

/// One dot product: a weight row (`n` values of type `w`) with an activation prepared by
/// `quantize_act(w, ..)`.
pub fn vec_dot(w: GgmlType, n: usize, row: &[u8], act: &[u8]) -> f32 {
    let rb = row_bytes(w, n);
    let ab = act_bytes(w, n);
    assert!(
        row.len() >= rb,
        "vec_dot: {w} row has {} bytes, needs {rb}",
        row.len()
    );
    assert!(
        act.len() >= ab,
        "vec_dot: activation has {} bytes, needs {ab}",
        act.len()
    );
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if avx2::supports(w) => {
            let mut out = [0.0f32];
            matvec_on(
                select::chosen(w, Shape::of(1, n)),
                w,
                n,
                row,
                0..1,
                act,
                &mut out,
            );
            out[0]
        }
        _ => scalar::vec_dot(w, n, &row[..rb], &act[..ab]),
    }
}

/// Matvec over a range of rows: `out[i] = dot(row rows.start + i, act)`. `weights` holds
/// consecutive rows of `n` values of type `w`, starting at row 0. Takes the path chosen
/// for decode on this CPU.
pub fn matvec(
    w: GgmlType,
    n: usize,
    weights: &[u8],
    rows: Range<usize>,
    act: &[u8],
    out: &mut [f32],
) {
    matvec_on(
        select::chosen(w, Shape::of(1, n)),
        w,
        n,
        weights,
        rows,
        act,
        out,
    )
}

/// [`matvec`] on a given path (one of `select::candidates(w, Shape::of(1, n))`; None, or
/// one this CPU cannot run: the scalar path), for timing and testing each candidate.
pub fn matvec_on(
    path: Option<Path>,
    w: GgmlType,
    n: usize,
    weights: &[u8],
    rows: Range<usize>,
    act: &[u8],
    out: &mut [f32],
) {
    let rb = row_bytes(w, n);
    let ab = act_bytes(w, n);
    check_rows(w, weights, rb, &rows);
    assert!(
        act.len() >= ab,
        "matvec: activation has {} bytes, needs {ab}",
        act.len()
    );
    assert!(
        out.len() >= rows.len(),
        "matvec: out has {} slots for {} rows",
        out.len(),
        rows.len()
    );
    let path = path.filter(|&p| select::runnable(p));
    match (isa(), path) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected and the path is a candidate (so the CPU
        // runs it); weights cover `rows`, act and out were checked above.
        (Isa::Avx2, Some(p)) => unsafe { avx2::matvec(p, w, n, weights, rows, act, out) },
        _ => {
            for (o, r) in out.iter_mut().zip(rows) {
                *o = scalar::vec_dot(w, n, &weights[r * rb..(r + 1) * rb], &act[..ab]);
            }
        }
    }
}

/// Matmul for prefill: `m` activations (each `act_bytes(w, n)` long, contiguous in
/// `acts`) against `rows` of the weight matrix; the result for token t and row r goes to
/// `out[t * out_stride + (r - rows.start)]`. Takes the path chosen for `m` tokens.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    w: GgmlType,
    n: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let path = select::chosen(w, Shape::of(m, n));
    matmul_on(path, w, n, weights, rows, acts, m, out, out_stride)
}

/// [`matmul`] on a given path (one of `select::candidates(w, Shape::of(m, n))`;
/// None, or one this CPU cannot run: the scalar path).
#[allow(clippy::too_many_arguments)]
pub fn matmul_on(
    path: Option<Path>,
    w: GgmlType,
    n: usize,
    weights: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let rb = row_bytes(w, n);
    let ab = act_bytes(w, n);
    check_rows(w, weights, rb, &rows);
    if !check_matmul_io("matmul", (acts, ab, m), rows.len(), (out.len(), out_stride)) {
        return;
    }
    let path = path.filter(|&p| select::runnable(p));
    match (isa(), path) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected and the path is a candidate; weights, acts
        // and out were checked above.
        (Isa::Avx2, Some(p)) => unsafe {
            avx2::matmul(p.fused, w, n, weights, rows, acts, m, out, out_stride)
        },
        _ => {
            for t in 0..m {
                let act = &acts[t * ab..(t + 1) * ab];
                for (i, r) in rows.clone().enumerate() {
                    let row = &weights[r * rb..(r + 1) * rb];
                    out[t * out_stride + i] = scalar::vec_dot(w, n, row, act);
                }
            }
        }
    }
}

/// The path interleaved rows take on this CPU: a VNNI form (256-bit, AVX-512's encoding
/// first), else AVX2's `maddubs` + `madd`; None where the SIMD kernels do not run or
/// `WEFT_KERNELS_NO_PACK` is set. Decided once per process, as the layout is: rows
/// packed at load must find their kernel later.
pub fn packed_path() -> Option<Path> {
    static PATH: std::sync::OnceLock<Option<Path>> = std::sync::OnceLock::new();
    *PATH.get_or_init(|| {
        if std::env::var_os("WEFT_KERNELS_NO_PACK").is_some_and(|v| v != "0") {
            return None;
        }
        let plain = Path {
            fused: select::Fused::Avx2,
            prefetch: false,
        };
        select::vnni_form()
            .map(|fused| Path {
                fused,
                prefetch: false,
            })
            .or_else(|| select::runnable(plain).then_some(plain))
    })
}

/// [`packed_path`] where its form runs interleaved rows of `w` (`select::interleaves`:
/// AVX2's alone does not run Q8_0's).
pub fn packed_form(w: GgmlType) -> Option<Path> {
    packed_path().filter(|p| select::interleaves(p.fused, w))
}

/// Whether weights of type `w` in rows of `n` values are best kept interleaved
/// ([`pack`]) on this CPU: Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 where a VNNI
/// form runs; Q4_K, Q6_K, Q4_0, Q4_1, Q5_0 and Q5_1 where AVX2 alone does
/// (`select::worth_interleaving`). Measured on AMD Zen 3, interleaved against ggml's rows
/// at one thread (`kbench`): Q4_K decode from cache 28-34 GB/s against 13-17 (a
/// super-block's scales and float steps serve eight rows), from memory at par; prefill
/// m=64 1.7 times as fast on Q4_K, twice as fast on Q5_0. A
/// loader that packs calls [`pack_rows`] once and then [`matvec_packed`] /
/// [`matmul_packed`].
pub fn packs(w: GgmlType, n: usize) -> bool {
    pack::packable(w, n) && packed_form(w).is_some_and(|p| select::worth_interleaving(p.fused, w))
}

/// `n_rows` rows of `n` values of type `w` (ggml's layout, consecutive) interleaved for
/// [`matmul_packed`]; `w` and `n` must pass [`pack::packable`].
pub fn pack_rows(w: GgmlType, n: usize, rows: &[u8], n_rows: usize) -> Vec<u8> {
    pack::pack(w, n, rows, n_rows)
}

/// [`pack_rows`] into memory in huge pages where the kernel gives them
/// ([`crate::pages::HugeBuf`]): what a loader keeps, as decode streams it every token.
pub fn pack_rows_huge(
    w: GgmlType,
    n: usize,
    rows: &[u8],
    n_rows: usize,
) -> std::io::Result<crate::pages::HugeBuf> {
    let mut out = crate::pages::HugeBuf::zeroed(pack::packed_len(w, n, n_rows))?;
    pack::pack_into(w, n, rows, n_rows, &mut out);
    Ok(out)
}

/// [`matvec`] on rows interleaved by [`pack_rows`] (`packed` is the whole matrix
/// [`pack_rows`] made); `rows.start` is a multiple of [`pack::GROUP_ROWS`].
pub fn matvec_packed(
    w: GgmlType,
    n: usize,
    packed: &[u8],
    rows: Range<usize>,
    act: &[u8],
    out: &mut [f32],
) {
    let len = rows.len();
    matmul_packed(w, n, packed, rows, act, 1, out, len)
}

/// [`matmul`] on rows interleaved by [`pack_rows`] (`packed` is the whole matrix
/// [`pack_rows`] made); `rows.start` is a multiple of [`pack::GROUP_ROWS`]. A token gives
/// the same bits whatever `m` is.
#[allow(clippy::too_many_arguments)]
pub fn matmul_packed(
    w: GgmlType,
    n: usize,
    packed: &[u8],
    rows: Range<usize>,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    // A prefill's token chunks prefetch only where they hold few tokens (wide rows, the
    // last chunk): a batch's situation, so they follow the batch's choice.
    let shape = match Shape::of(m, n) {
        Shape::Prefill => Shape::Batch,
        s => s,
    };
    let prefetch = select::packed_prefetch(w, shape);
    matmul_packed_on(prefetch, w, n, packed, rows, acts, m, out, out_stride)
}

/// [`matmul_packed`] with software prefetch allowed or not, whatever is in force (for
/// timing both; the bits are the same).
#[allow(clippy::too_many_arguments)]
pub fn matmul_packed_on(
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
    assert!(
        pack::packable(w, n),
        "{w} rows of {n} values are not interleaved"
    );
    assert!(
        rows.start <= rows.end && rows.start.is_multiple_of(pack::GROUP_ROWS),
        "matmul_packed: row range {rows:?} does not start a group"
    );
    // Long rows lie window-major, so the kernel needs the whole matrix to find a block.
    let groups = pack::Windows::of_packed(w, n, packed.len()).map(|win| win.groups());
    assert!(
        groups.is_some_and(|g| rows.end <= g * pack::GROUP_ROWS),
        "matmul_packed: {} packed bytes are not a whole interleaved matrix of {w} rows of \
         {n} holding rows {rows:?}",
        packed.len()
    );
    let ab = act_bytes(w, n);
    let io = ((acts, ab, m), rows.len(), (out.len(), out_stride));
    if !check_matmul_io("matmul_packed", io.0, io.1, io.2) {
        return;
    }
    match (isa(), packed_form(w)) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were detected and the path is runnable on `w`; every
        // length was checked above.
        (Isa::Avx2, Some(p)) => unsafe {
            avx2::matmul_packed(
                p.fused, prefetch, w, n, packed, rows, acts, m, out, out_stride,
            )
        },
        // Interleaved rows where no kernel reads them (packing was asked for anyway):
        // each row back in ggml's layout, then the scalar dot.
        _ => {
            for r in rows.clone() {
                let row = pack::unpack_row(w, n, packed, r);
                for t in 0..m {
                    out[t * out_stride + r - rows.start] =
                        scalar::vec_dot(w, n, &row, &acts[t * ab..(t + 1) * ab]);
                }
            }
        }
    }
}

/// Checks a matmul's activations (`m` of `ab` bytes) and output (`len` slots, rows
/// `out_stride` apart) for `rows` rows; false when there is nothing to compute.
fn check_matmul_io(
    what: &str,
    (acts, ab, m): (&[u8], usize, usize),
    rows: usize,
    (len, out_stride): (usize, usize),
) -> bool {
    assert!(
        acts.len() >= m * ab,
        "{what}: acts has {} bytes for {m} tokens of {ab}",
        acts.len()
    );
    if m == 0 || rows == 0 {
        return false;
    }
    assert!(
        m == 1 || out_stride >= rows,
        "{what}: out_stride {out_stride} < {rows} rows"
    );
    let need = (m - 1) * out_stride + rows;
    assert!(len >= need, "{what}: out has {len} slots, needs {need}");
    true
}

fn check_rows(w: GgmlType, weights: &[u8], rb: usize, rows: &Range<usize>) {
    assert!(rows.start <= rows.end, "bad row range {rows:?}");
    let need = rows.end.checked_mul(rb).expect("row range overflows");
    assert!(
        weights.len() >= need,
        "{w}: weights have {} bytes, rows {rows:?} need {need}",
        weights.len()
    );
}
