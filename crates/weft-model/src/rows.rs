//! Token-parallel building blocks of a forward step: per-token work (norms, activation
//! quantization, RoPE, gating) spread over the pool, and linears that share one quantized
//! input. During prefill these were serial and left the other threads spinning.

use weft_kernels::{quant, ThreadPool};

use crate::weights::Linear;

/// A raw pointer that pool tasks may share, each using a disjoint part of the buffer.
pub(crate) struct SendPtr<T>(*mut T);
// By hand: derive would demand `T: Copy`, but only the pointer is copied.
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: only used to give pool tasks disjoint slices of one buffer.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    pub(crate) fn new(p: *mut T) -> Self {
        SendPtr(p)
    }
    /// Through a method so closures capture the whole (Sync) wrapper, not the raw field.
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// Runs `f(t, row_t)` for the `m` rows of `data` (each `len` long, `stride` apart),
/// spread over the pool in contiguous groups of tokens.
pub(crate) fn for_each_row<T>(
    pool: &ThreadPool,
    data: &mut [T],
    stride: usize,
    len: usize,
    m: usize,
    f: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    if m == 0 {
        return;
    }
    assert!(len <= stride || m == 1, "rows overlap");
    assert!((m - 1) * stride + len <= data.len(), "rows past the buffer");
    let p = SendPtr::new(data.as_mut_ptr());
    pool.for_ranges(m, 1, &|r| {
        for t in r {
            // SAFETY: rows are disjoint (len <= stride) and inside `data` (checked above).
            let row = unsafe { std::slice::from_raw_parts_mut(p.get().add(t * stride), len) };
            f(t, row);
        }
    });
}

/// Runs `f(chunk)` over disjoint chunks of `data`, a multiple of `align` long.
pub(crate) fn for_each_chunk<T>(
    pool: &ThreadPool,
    data: &mut [T],
    align: usize,
    f: &(dyn Fn(std::ops::Range<usize>, &mut [T]) + Sync),
) {
    let p = SendPtr::new(data.as_mut_ptr());
    let n = data.len();
    pool.for_ranges(n, align, &|r| {
        // SAFETY: for_ranges hands out disjoint ranges within 0..n.
        let chunk = unsafe { std::slice::from_raw_parts_mut(p.get().add(r.start), r.len()) };
        f(r, chunk);
    });
}

/// Quantizes `m` rows of `x` (stride `x_stride`) into `w`'s activation layout.
pub(crate) fn quantize_input(
    pool: &ThreadPool,
    w: &Linear,
    x: &[f32],
    x_stride: usize,
    m: usize,
    acts: &mut [u8],
) {
    let ab = w.act_bytes();
    for_each_row(pool, &mut acts[..m * ab], ab, ab, m, &|t, a| {
        quant::quantize_act(w.ty, &x[t * x_stride..t * x_stride + w.n_in], a);
    });
}

/// out = W acts for `m` already-quantized rows, written `out_stride` apart.
pub(crate) fn apply(
    pool: &ThreadPool,
    w: &Linear,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
    out_stride: usize,
    tile: &mut [f32],
) {
    let ab = w.act_bytes();
    if m == 1 {
        w.matvec(pool, &acts[..ab], &mut out[..w.n_out]);
    } else {
        w.matmul(pool, &acts[..m * ab], m, out, out_stride, tile);
    }
}

/// out = W x for `m` rows of `x` (stride `x_stride`), written `out_stride` apart.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    pool: &ThreadPool,
    w: &Linear,
    x: &[f32],
    x_stride: usize,
    m: usize,
    out: &mut [f32],
    out_stride: usize,
    acts: &mut [u8],
    tile: &mut [f32],
) {
    quantize_input(pool, w, x, x_stride, m, acts);
    apply(pool, w, acts, m, out, out_stride, tile);
}

/// Several linears of the same input (Q, K and V; gate and up): the input is quantized
/// once for each run of weights that share an activation layout, not once per weight.
/// Each output is written with its weight's `n_out` as the row stride.
pub(crate) fn linears_of_one_input(
    pool: &ThreadPool,
    x: &[f32],
    x_stride: usize,
    m: usize,
    outs: &mut [(&Linear, &mut [f32])],
    acts: &mut [u8],
    tile: &mut [f32],
) {
    let mut layout = None;
    for (w, out) in outs.iter_mut() {
        let this = (quant::vec_dot_type(w.ty), w.n_in);
        if layout != Some(this) {
            quantize_input(pool, w, x, x_stride, m, acts);
            layout = Some(this);
        }
        apply(pool, w, acts, m, out, w.n_out, tile);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_visit_each_token_once() {
        let pool = ThreadPool::new(2);
        let mut data = vec![0u32; 7 * 5];
        for_each_row(&pool, &mut data, 5, 3, 7, &|t, row| {
            row.iter_mut().for_each(|v| *v += t as u32 + 1)
        });
        for t in 0..7 {
            assert_eq!(&data[t * 5..t * 5 + 3], &[t as u32 + 1; 3]);
            assert_eq!(&data[t * 5 + 3..t * 5 + 5], &[0, 0], "gap left alone");
        }
    }

    #[test]
    fn chunks_cover_the_buffer() {
        let pool = ThreadPool::new(2);
        let mut data = vec![0usize; 1001];
        for_each_chunk(&pool, &mut data, 16, &|r, c| {
            assert_eq!(r.start % 16, 0);
            for (i, v) in r.zip(c.iter_mut()) {
                *v += i;
            }
        });
        assert!(data.iter().enumerate().all(|(i, &v)| v == i));
    }
}
