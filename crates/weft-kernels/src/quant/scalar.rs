//! Portable scalar kernels: dequantization of every format, and the integer dot products
//! of each weight format against its quantized activation (the same arithmetic ggml's
//! generic code does). This is the fallback on CPUs without AVX2 and the reference the
//! SIMD kernels are tested against.

use super::blocks::*;
use weft_gguf::GgmlType;

/// Dequantize `dst.len()` values of type `ty` from `src`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let blocks = src.chunks_exact(ts).zip(dst.chunks_exact_mut(bs));
    match ty {
        GgmlType::F32 => blocks.for_each(|(x, y)| y[0] = read_f32(x, 0)),
        GgmlType::F16 => blocks.for_each(|(x, y)| y[0] = read_f16(x, 0)),
        GgmlType::BF16 => blocks.for_each(|(x, y)| y[0] = read_bf16(x, 0)),
        GgmlType::Q4_0 | GgmlType::Q5_0 => blocks.for_each(|(x, y)| deq_offset(ty, x, y)),
        GgmlType::Q4_1 | GgmlType::Q5_1 => blocks.for_each(|(x, y)| deq_min(ty, x, y)),
        GgmlType::Q8_0 => blocks.for_each(|(x, y)| deq_q8_0(x, y)),
        GgmlType::Q4_K => blocks.for_each(|(x, y)| deq_q4_k(x, y)),
        GgmlType::Q5_K => blocks.for_each(|(x, y)| deq_q5_k(x, y)),
        GgmlType::Q6_K => blocks.for_each(|(x, y)| deq_q6_k(x, y)),
        GgmlType::Q8_K => blocks.for_each(|(x, y)| deq_q8_k(x, y)),
    }
}

/// The 32 unsigned levels of a nibble block (Q4_0/Q4_1/Q5_0/Q5_1, `blocks::ggml_legacy`):
/// low nibbles are values 0..16, high ones 16..32, and bit j of qh (Q5_0/Q5_1) is value
/// j's fifth bit.
#[inline]
pub(super) fn nibble_levels(ty: GgmlType, x: &[u8]) -> [u8; 32] {
    let (qh_at, qs) = ggml_legacy(ty);
    let qh = qh_at.map_or(0, |o| {
        u32::from_le_bytes([x[o], x[o + 1], x[o + 2], x[o + 3]])
    });
    std::array::from_fn(|j| {
        let b = x[qs + (j & 15)];
        let nib = if j < 16 { b & 0xF } else { b >> 4 };
        nib | ((((qh >> j) & 1) as u8) << 4)
    })
}

/// The 32 signed levels of a Q4_0 (levels less 8) or Q5_0 (less 16) block.
#[inline]
fn offset_levels(ty: GgmlType, x: &[u8]) -> [i8; 32] {
    let offset = if ty == GgmlType::Q4_0 { 8 } else { 16 };
    nibble_levels(ty, x).map(|q| q as i8 - offset)
}

/// Q4_K/Q5_K value i (0..256) of a super-block: chunk i/64 holds 32 bytes whose low
/// nibbles are its first 32 values and high nibbles the next 32.
#[inline]
fn nibble_k(qs: &[u8], i: usize) -> u8 {
    let b = qs[32 * (i / 64) + (i % 32)];
    if i % 64 < 32 {
        b & 0xF
    } else {
        b >> 4
    }
}

/// Q6_K value i (0..256), unsigned 0..64 (the format subtracts 32).
#[inline]
pub(super) fn level_q6_k(x: &[u8], i: usize) -> u8 {
    let (h, r) = (i / 128, i % 128);
    let (quarter, l) = (r / 32, r % 32);
    let ql = x[64 * h + l + 32 * (quarter & 1)];
    let lo = if quarter < 2 { ql & 0xF } else { ql >> 4 };
    let hi = (x[Q6_K_QH + 32 * h + l] >> (2 * quarter)) & 3;
    lo | (hi << 4)
}

#[inline]
fn level_q5_k(x: &[u8], i: usize) -> u8 {
    let hbit = (x[Q5_K_QH + i % 32] >> (i / 32)) & 1;
    nibble_k(&x[Q5_K_QS..], i) | (hbit << 4)
}

/// Q4_0/Q5_0: d * signed level.
fn deq_offset(ty: GgmlType, x: &[u8], y: &mut [f32]) {
    let d = read_f16(x, 0);
    for (o, q) in y.iter_mut().zip(offset_levels(ty, x)) {
        *o = q as f32 * d;
    }
}

/// Q4_1/Q5_1: d * level + m.
fn deq_min(ty: GgmlType, x: &[u8], y: &mut [f32]) {
    let (d, m) = (read_f16(x, 0), read_f16(x, 2));
    for (o, q) in y.iter_mut().zip(nibble_levels(ty, x)) {
        *o = q as f32 * d + m;
    }
}

fn deq_q8_0(x: &[u8], y: &mut [f32]) {
    let d = read_f16(x, 0);
    for (o, &q) in y.iter_mut().zip(&x[2..34]) {
        *o = q as i8 as f32 * d;
    }
}

fn deq_q4_k(x: &[u8], y: &mut [f32]) {
    let (d, dmin) = (read_f16(x, 0), read_f16(x, 2));
    for (i, o) in y.iter_mut().enumerate() {
        let (sc, m) = scale_min_k4(i / 32, &x[4..16]);
        *o = d * sc as f32 * nibble_k(&x[16..], i) as f32 - dmin * m as f32;
    }
}

fn deq_q5_k(x: &[u8], y: &mut [f32]) {
    let (d, dmin) = (read_f16(x, 0), read_f16(x, 2));
    for (i, o) in y.iter_mut().enumerate() {
        let (sc, m) = scale_min_k4(i / 32, &x[4..16]);
        *o = d * sc as f32 * level_q5_k(x, i) as f32 - dmin * m as f32;
    }
}

fn deq_q6_k(x: &[u8], y: &mut [f32]) {
    let d = read_f16(x, Q6_K_D);
    for (i, o) in y.iter_mut().enumerate() {
        let sc = x[Q6_K_SCALES + i / 16] as i8;
        *o = d * sc as f32 * (level_q6_k(x, i) as i32 - 32) as f32;
    }
}

fn deq_q8_k(x: &[u8], y: &mut [f32]) {
    let d = read_f32(x, 0);
    for (o, &q) in y.iter_mut().zip(&x[Q8_K_QS..Q8_K_QS + QK_K]) {
        *o = q as i8 as f32 * d;
    }
}

/// Dot product of one weight row of `n` values with an activation in
/// `vec_dot_type(ty)` layout, integer arithmetic per block as in ggml.
pub fn vec_dot(ty: GgmlType, n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = n / ty.block_size();
    let ts = ty.type_size();
    let wblk = |b: usize| &row[b * ts..(b + 1) * ts];
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let read = match ty {
                GgmlType::F32 => read_f32,
                GgmlType::F16 => read_f16,
                _ => read_bf16,
            };
            (0..n)
                .map(|i| read(row, i * ts) * read_f32(act, 4 * i))
                .sum()
        }
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
            let mut sum = 0.0f32;
            for b in 0..nb {
                let (w, a) = (wblk(b), &act[b * Q8_0_BYTES..(b + 1) * Q8_0_BYTES]);
                let q: [i8; 32] = match ty {
                    GgmlType::Q8_0 => std::array::from_fn(|j| w[2 + j] as i8),
                    _ => offset_levels(ty, w),
                };
                let isum: i32 = (0..32).map(|j| q[j] as i32 * a[2 + j] as i8 as i32).sum();
                sum += read_f16(w, 0) * read_f16(a, 0) * isum as f32;
            }
            sum
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            // ggml's order: d_w * d_a * sum(q * a) + m * s_a, s_a = d_a * sum(a) (ggml
            // keeps s_a in its Q8_1 activation, rounded to f16; weft sums the Q8_0
            // quants, the same ones, and keeps s_a in f32).
            let mut sum = 0.0f32;
            for b in 0..nb {
                let (w, a) = (wblk(b), &act[b * Q8_0_BYTES..(b + 1) * Q8_0_BYTES]);
                let q = nibble_levels(ty, w);
                let isum: i32 = (0..32).map(|j| q[j] as i32 * a[2 + j] as i8 as i32).sum();
                let asum: i32 = (0..32).map(|j| a[2 + j] as i8 as i32).sum();
                let da = read_f16(a, 0);
                sum += read_f16(w, 0) * da * isum as f32 + read_f16(w, 2) * (da * asum as f32);
            }
            sum
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let mut sum = 0.0f32;
            for b in 0..nb {
                let (w, a) = (wblk(b), &act[b * Q8_K_BYTES..(b + 1) * Q8_K_BYTES]);
                let (mut isum, mut msum) = (0i32, 0i32);
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(j, &w[4..16]);
                    let s: i32 = (32 * j..32 * j + 32)
                        .map(|i| {
                            let q = if ty == GgmlType::Q4_K {
                                nibble_k(&w[16..], i)
                            } else {
                                level_q5_k(w, i)
                            };
                            q as i32 * a[Q8_K_QS + i] as i8 as i32
                        })
                        .sum();
                    isum += sc as i32 * s;
                    let bs = read_i16(a, Q8_K_BSUMS + 4 * j) as i32
                        + read_i16(a, Q8_K_BSUMS + 4 * j + 2) as i32;
                    msum += m as i32 * bs;
                }
                let da = read_f32(a, 0);
                sum += read_f16(w, 0) * da * isum as f32 - read_f16(w, 2) * da * msum as f32;
            }
            sum
        }
        GgmlType::Q6_K => {
            let mut sum = 0.0f32;
            for b in 0..nb {
                let (w, a) = (wblk(b), &act[b * Q8_K_BYTES..(b + 1) * Q8_K_BYTES]);
                let mut isum = 0i32;
                for g in 0..16 {
                    let s: i32 = (16 * g..16 * g + 16)
                        .map(|i| (level_q6_k(w, i) as i32 - 32) * a[Q8_K_QS + i] as i8 as i32)
                        .sum();
                    isum += (w[Q6_K_SCALES + g] as i8) as i32 * s;
                }
                sum += read_f16(w, Q6_K_D) * read_f32(a, 0) * isum as f32;
            }
            sum
        }
        GgmlType::Q8_K => {
            let mut sum = 0.0f32;
            for b in 0..nb {
                let (w, a) = (wblk(b), &act[b * Q8_K_BYTES..(b + 1) * Q8_K_BYTES]);
                let isum: i32 = (0..QK_K)
                    .map(|i| w[Q8_K_QS + i] as i8 as i32 * a[Q8_K_QS + i] as i8 as i32)
                    .sum();
                sum += read_f32(w, 0) * read_f32(a, 0) * isum as f32;
            }
            sum
        }
    }
}
