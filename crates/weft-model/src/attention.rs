//! Causal attention of one query head over a layer's cached positions: GQA reads a
//! key and a value row per position, MLA reads the latent row as both.

use std::ops::Range;

use weft_kernels::vecops;

use crate::kv::LayerKv;

/// Where one head's key and value sit in a cache slot, as (offset, length): the key in
/// the key buffer; the value in the value buffer, or in the key buffer where the cache
/// keeps no values (MLA's latent is the value and the head of the key).
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadView {
    pub key: (usize, usize),
    pub value: (usize, usize),
}

impl HeadView {
    /// A GQA KV head of `hd` values at `off` in both buffers.
    pub fn gqa(off: usize, hd: usize) -> Self {
        HeadView {
            key: (off, hd),
            value: (off, hd),
        }
    }
}

/// Causal attention of one query head over cached positions `span`, with an online
/// softmax over blocks of positions: a block's scores sit on the stack, the output is
/// rescaled at most once a block, and the block's value rows are summed into it in one
/// pass (`axpy_rows`), so no score buffer is needed whatever the context length and long
/// prompts do not pay a read and write of the output per position.
pub(crate) fn attend(q: &[f32], kv: &LayerKv, view: HeadView, span: Range<usize>, out: &mut [f32]) {
    let ((k_off, dk), (v_off, dv)) = (view.key, view.value);
    let (values, v_stride) = kv.values();
    const BLOCK: usize = 32;
    let out = &mut out[..dv];
    out.iter_mut().for_each(|v| *v = 0.0);
    let mut max = f32::NEG_INFINITY;
    let mut sum = 0f32;
    let mut scores = [0f32; BLOCK];
    let mut rows: [&[f32]; BLOCK] = [&[]; BLOCK];
    let mut at = span.start;
    while at < span.end {
        let n = BLOCK.min(span.end - at);
        let mut block_max = f32::NEG_INFINITY;
        for j in 0..n {
            let slot = kv.slot(at + j);
            let s = slot * kv.stride + k_off;
            scores[j] = vecops::dot(&q[..dk], &kv.k[s..s + dk]);
            block_max = block_max.max(scores[j]);
            let s = slot * v_stride + v_off;
            rows[j] = &values[s..s + dv];
        }
        if block_max > max {
            let c = (max - block_max).exp();
            vecops::scale(out, c);
            sum *= c;
            max = block_max;
        }
        for p in &mut scores[..n] {
            *p = (*p - max).exp();
            sum += *p;
        }
        vecops::axpy_rows(&scores[..n], &rows[..n], out);
        at += n;
    }
    if sum > 0.0 {
        vecops::scale(out, 1.0 / sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two-pass softmax attention in f64: the plain definition `attend` must match.
    fn reference(q: &[f32], kv: &LayerKv, off: usize, hd: usize, span: Range<usize>) -> Vec<f64> {
        let row = |buf: &[f32], pos: usize| {
            let s = kv.slot(pos) * kv.stride + off;
            assert_eq!(kv.stride, kv.v_stride);
            buf[s..s + hd]
                .iter()
                .map(|&v| v as f64)
                .collect::<Vec<f64>>()
        };
        let scores: Vec<f64> = span
            .clone()
            .map(|p| {
                row(&kv.k, p)
                    .iter()
                    .zip(q)
                    .map(|(k, &q)| k * q as f64)
                    .sum()
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut out = vec![0f64; hd];
        for (p, wp) in span.zip(&w) {
            for (o, v) in out.iter_mut().zip(row(&kv.v, p)) {
                *o += wp / total * v;
            }
        }
        out
    }

    #[test]
    fn blocked_attention_matches_the_two_pass_softmax() {
        // Two KV heads of 40 values in a ring of 50 slots; spans inside one block, on its
        // edge, across several, wrapping the ring, with rising scores (a new maximum in
        // every block, so the output is rescaled) and falling ones.
        let (hd, heads, cap) = (40, 2, 50);
        let stride = hd * heads;
        let val = |i: usize, s: f32| ((i * 7919 % 113) as f32 / 113.0 - 0.5) * s;
        let mut kv = LayerKv {
            cap,
            k: (0..cap * stride).map(|i| val(i, 2.0)).collect(),
            v: (0..cap * stride).map(|i| val(i + 5, 1.0)).collect(),
            stride,
            v_stride: stride,
        };
        let q: Vec<f32> = (0..hd).map(|i| val(i + 11, 1.5)).collect();
        let mut out = vec![0f32; hd];
        for span in [0..1, 0..31, 0..32, 0..33, 3..50, 30..95, 0..50] {
            for off in [0, hd] {
                attend(&q, &kv, HeadView::gqa(off, hd), span.clone(), &mut out);
                let want = reference(&q, &kv, off, hd, span.clone());
                for (g, w) in out.iter().zip(&want) {
                    assert!(
                        (*g as f64 - w).abs() < 1e-5,
                        "{span:?} off {off}: {g} vs {w}"
                    );
                }
            }
        }
        // Scores rising along the span: each key a larger multiple of the query.
        for p in 0..cap {
            let s = kv.slot(p) * stride;
            for (k, qi) in kv.k[s..s + hd].iter_mut().zip(&q) {
                *k = qi * (p as f32 * 0.05);
            }
        }
        attend(&q, &kv, HeadView::gqa(0, hd), 0..cap, &mut out);
        let want = reference(&q, &kv, 0, hd, 0..cap);
        for (g, w) in out.iter().zip(&want) {
            assert!((*g as f64 - w).abs() < 1e-5, "rising: {g} vs {w}");
        }
    }

    #[test]
    fn latent_values_are_the_head_of_each_key() {
        // An MLA cache: keys of 6 values per slot, no value buffer; the values are each
        // key's first 4. Equal to the same cache with the values copied out.
        let (dk, dv, cap) = (6, 4, 9);
        let val = |i: usize| ((i * 37 % 17) as f32 / 17.0 - 0.5) * 2.0;
        let k: Vec<f32> = (0..cap * dk).map(val).collect();
        let latent = LayerKv {
            cap,
            k: k.clone(),
            v: Vec::new(),
            stride: dk,
            v_stride: 0,
        };
        let split = LayerKv {
            cap,
            v: (0..cap)
                .flat_map(|s| k[s * dk..s * dk + dv].to_vec())
                .collect(),
            k,
            stride: dk,
            v_stride: dv,
        };
        let q: Vec<f32> = (0..dk).map(|i| val(i + 3)).collect();
        let (mut a, mut b) = (vec![0f32; dv], vec![0f32; dv]);
        let view = HeadView {
            key: (0, dk),
            value: (0, dv),
        };
        attend(&q, &latent, view, 0..cap, &mut a);
        attend(&q, &split, view, 0..cap, &mut b);
        assert_eq!(a, b);
        assert!(a.iter().any(|&x| x != 0.0));
    }
}
