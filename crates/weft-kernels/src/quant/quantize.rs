//! Reference quantizers: f32 -> each block format, following ggml's `quantize_row_*_ref`
//! step by step (same scale search, same rounding functions, same operation order) so
//! that files we write match what llama.cpp would produce. Speed is not a goal here.

use super::blocks::*;
use half::{bf16, f16};
use weft_gguf::GgmlType;

/// ggml's `nearest_int`: round half to even (it adds 1.5*2^23 and reads the mantissa).
#[inline]
fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// Quantize `src` (a whole number of blocks) into `dst` (exactly the encoded size).
pub fn quantize_into(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    let bs = ty.block_size();
    assert!(
        src.len().is_multiple_of(bs),
        "{ty}: {} values is not a whole number of blocks",
        src.len()
    );
    assert_eq!(
        dst.len(),
        src.len() / bs * ty.type_size(),
        "{ty}: wrong destination size"
    );
    let blocks = src
        .chunks_exact(bs)
        .zip(dst.chunks_exact_mut(ty.type_size()));
    match ty {
        GgmlType::F32 => blocks.for_each(|(x, y)| y.copy_from_slice(&x[0].to_le_bytes())),
        GgmlType::F16 => {
            blocks.for_each(|(x, y)| y.copy_from_slice(&f16::from_f32(x[0]).to_le_bytes()))
        }
        GgmlType::BF16 => {
            blocks.for_each(|(x, y)| y.copy_from_slice(&bf16::from_f32(x[0]).to_le_bytes()))
        }
        GgmlType::Q4_0 => blocks.for_each(|(x, y)| q4_0(x, y)),
        GgmlType::Q5_0 => blocks.for_each(|(x, y)| q5_0(x, y)),
        GgmlType::Q4_1 => blocks.for_each(|(x, y)| q_min::<4>(x, y)),
        GgmlType::Q5_1 => blocks.for_each(|(x, y)| q_min::<5>(x, y)),
        GgmlType::Q8_0 => blocks.for_each(|(x, y)| q8_0(x, y)),
        GgmlType::Q4_K => blocks.for_each(|(x, y)| q4_k(x, y)),
        GgmlType::Q5_K => blocks.for_each(|(x, y)| q5_k(x, y)),
        GgmlType::Q6_K => blocks.for_each(|(x, y)| q6_k(x, y)),
        GgmlType::Q8_K => blocks.for_each(|(x, y)| q8_k(x, y)),
    }
}

/// The value of largest magnitude, keeping its sign (the first one on ties), and that
/// magnitude: the 4/5/6-bit symmetric formats map it to the most negative level.
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

fn q4_0(x: &[f32], y: &mut [u8]) {
    let (max, _) = signed_absmax(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    write_f16(y, 0, d);
    for j in 0..QK / 2 {
        // `as u8` truncates like ggml's (int8_t) cast; the +8.5 makes it round.
        let x0 = ((x[j] * id + 8.5) as u8).min(15);
        let x1 = ((x[j + QK / 2] * id + 8.5) as u8).min(15);
        y[2 + j] = x0 | (x1 << 4);
    }
}

fn q5_0(x: &[f32], y: &mut [u8]) {
    let (max, _) = signed_absmax(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    write_f16(y, 0, d);
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        let x0 = ((x[j] * id + 16.5) as u8).min(31);
        let x1 = ((x[j + QK / 2] * id + 16.5) as u8).min(31);
        y[6 + j] = (x0 & 0xF) | ((x1 & 0xF) << 4);
        qh |= (((x0 & 0x10) >> 4) as u32) << j;
        qh |= (((x1 & 0x10) >> 4) as u32) << (j + QK / 2);
    }
    y[2..6].copy_from_slice(&qh.to_le_bytes());
}

/// Q4_1 (`BITS` 4) and Q5_1 (5): d and the block's minimum, levels rounded from it.
fn q_min<const BITS: u32>(x: &[f32], y: &mut [u8]) {
    let min = x.iter().fold(f32::MAX, |m, &v| if v < m { v } else { m });
    let max = x.iter().fold(-f32::MAX, |m, &v| if v > m { v } else { m });
    let d = (max - min) / ((1 << BITS) - 1) as f32;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    write_f16(y, 0, d);
    write_f16(y, 2, min);
    let ty = if BITS == 5 {
        GgmlType::Q5_1
    } else {
        GgmlType::Q4_1
    };
    let (qh_at, qs) = ggml_legacy(ty);
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        let (x0, x1) = ((x[j] - min) * id, (x[j + QK / 2] - min) * id);
        // Q4_1 casts through int8_t and caps at 15; Q5_1 casts to uint8_t.
        let (q0, q1) = if BITS == 4 {
            (
                ((x0 + 0.5) as i8 as u8).min(15),
                ((x1 + 0.5) as i8 as u8).min(15),
            )
        } else {
            ((x0 + 0.5) as u8, (x1 + 0.5) as u8)
        };
        y[qs + j] = (q0 & 0xF) | ((q1 & 0xF) << 4);
        qh |= (((q0 & 0x10) >> 4) as u32) << j;
        qh |= (((q1 & 0x10) >> 4) as u32) << (j + QK / 2);
    }
    if let Some(o) = qh_at {
        y[o..o + 4].copy_from_slice(&qh.to_le_bytes());
    }
}

pub fn q8_0(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    write_f16(y, 0, d);
    for j in 0..QK {
        // roundf: half away from zero, which is what f32::round does.
        y[2 + j] = (x[j] * id).round() as i8 as u8;
    }
}

pub fn q8_k(x: &[f32], y: &mut [u8]) {
    let (max, amax) = signed_absmax(x);
    y.fill(0);
    if amax == 0.0 {
        return;
    }
    let iscale = -127.0 / max;
    for j in 0..QK_K {
        y[Q8_K_QS + j] = nearest_int(iscale * x[j]).min(127) as i8 as u8;
    }
    for g in 0..QK_K / 16 {
        let s: i32 = (0..16).map(|i| y[Q8_K_QS + 16 * g + i] as i8 as i32).sum();
        y[Q8_K_BSUMS + 2 * g..Q8_K_BSUMS + 2 * g + 2].copy_from_slice(&(s as i16).to_le_bytes());
    }
    y[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

/// ggml's `make_qkx2_quants`: fit x ~ scale*L - min with L in 0..=nmax by trying
/// `nstep+1` scales around nmax/(max-min) and keeping the weighted least-squares best.
/// Returns (scale, min) with min >= 0 meaning x ~ scale*L - min.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_mad = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_mad += weights[i] * (diff * diff);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut mad = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                mad += weights[i] * (diff * diff);
            }
            if mad < best_mad {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_mad = mad;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with rmse_type 1 and no importance weights (the only use,
/// Q6_K): symmetric levels -nmax..nmax-1, weighted by x^2, scale searched over 19 tries.
/// Writes L offset by +nmax and returns the scale.
fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < 1e-30 {
        l_out.fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let fit = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = level(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let mut iscale = -nmaxf / max;
    let (sumlx, suml2) = fit(iscale);
    for (o, &v) in l_out.iter_mut().zip(x) {
        *o = (level(iscale, v) + nmax) as i8;
    }
    let mut scale = sumlx / suml2;
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmaxf + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in l_out.iter_mut().zip(x) {
                *o = (level(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Per-sub-block weights of the K quantizers without an importance matrix: rms + |x|.
fn kq_weights(x: &[f32]) -> [f32; 32] {
    let sum_x2: f32 = x.iter().fold(0.0, |s, v| s + v * v);
    let av_x = (sum_x2 / 32.0).sqrt();
    std::array::from_fn(|l| av_x + x[l].abs())
}

/// Shared body of Q4_K and Q5_K: eight 32-value sub-blocks with 6-bit scales and mins.
/// Returns the per-value levels (0..=nmax) and writes d, dmin and the 12 scale bytes.
fn kq_scales_mins(x: &[f32], y: &mut [u8], nmax: i32, rmin: f32, nstep: i32) -> [u8; QK_K] {
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let w = kq_weights(xs);
        let (s, m) = make_qkx2_quants(
            nmax,
            xs,
            &w,
            &mut levels[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut y[4..16];
    for j in 0..8 {
        // ggml stores nearest_int into a uint8_t before clamping; keep that truncation.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    write_f16(y, 0, max_scale / 63.0);
    write_f16(y, 2, max_min / 63.0);
    // Requantize against the scales as stored (fp16 d times 6-bit level).
    let d_all = read_f16(y, 0);
    let m_all = read_f16(y, 2);
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &y[4..16]);
        let d = d_all * s as f32;
        if d == 0.0 {
            continue;
        }
        let dm = m_all * m as f32;
        for i in 0..32 {
            levels[32 * j + i] = nearest_int((x[32 * j + i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    levels
}

fn q4_k(x: &[f32], y: &mut [u8]) {
    y.fill(0);
    let l = kq_scales_mins(x, y, 15, -1.0, 20);
    let qs = &mut y[16..144];
    for c in 0..4 {
        for i in 0..32 {
            qs[32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
        }
    }
}

fn q5_k(x: &[f32], y: &mut [u8]) {
    y.fill(0);
    let l = kq_scales_mins(x, y, 31, -0.5, 15);
    for c in 0..4 {
        for i in 0..32 {
            let (l1, l2) = (l[64 * c + i], l[64 * c + 32 + i]);
            y[Q5_K_QS + 32 * c + i] = (l1 & 0xF) | ((l2 & 0xF) << 4);
            y[Q5_K_QH + i] |= ((l1 >> 4) << (2 * c)) | ((l2 >> 4) << (2 * c + 1));
        }
    }
}

fn q6_k(x: &[f32], y: &mut [u8]) {
    y.fill(0);
    let mut levels = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for ib in 0..16 {
        let s = make_qx_quants(
            32,
            &x[16 * ib..16 * ib + 16],
            &mut levels[16 * ib..16 * ib + 16],
        );
        scales[ib] = s;
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale == 0.0 {
        return;
    }
    let iscale = -128.0 / max_scale;
    write_f16(y, Q6_K_D, 1.0 / iscale);
    for ib in 0..16 {
        y[Q6_K_SCALES + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
    }
    let d_all = read_f16(y, Q6_K_D);
    for j in 0..16 {
        let d = d_all * (y[Q6_K_SCALES + j] as i8) as f32;
        if d == 0.0 {
            continue;
        }
        for i in 0..16 {
            levels[16 * j + i] = (nearest_int(x[16 * j + i] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    let l = |i: usize| levels[i] as u8;
    for h in 0..2 {
        for i in 0..32 {
            let b = 128 * h + i;
            y[64 * h + i] = (l(b) & 0xF) | ((l(b + 64) & 0xF) << 4);
            y[64 * h + 32 + i] = (l(b + 32) & 0xF) | ((l(b + 96) & 0xF) << 4);
            y[Q6_K_QH + 32 * h + i] = (l(b) >> 4)
                | ((l(b + 32) >> 4) << 2)
                | ((l(b + 64) >> 4) << 4)
                | ((l(b + 96) >> 4) << 6);
        }
    }
}
