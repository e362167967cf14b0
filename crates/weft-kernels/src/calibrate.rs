//! Measured speed of this machine's kernels, per weight type: decode (a quantized matvec
//! streaming a matrix larger than the caches) in weight bytes per second, and prefill (a
//! quantized matmul of many tokens) in weight bytes × tokens per second. The planner
//! turns a model's bytes of each type into seconds with these figures.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use weft_gguf::GgmlType;

use crate::quant;
use crate::ThreadPool;

/// One weight type's measured rates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TypeRate {
    /// The type's GGML name ("Q4_K").
    pub ty: String,
    pub decode_bytes_per_s: f64,
    pub prefill_bytes_per_s: f64,
}

/// The types measured: every type weft computes with.
pub const MEASURED: [GgmlType; 9] = GgmlType::WEIGHT_TYPES;

/// Rows of `n` values of one block pattern, repeated to `bytes` (the values do not change
/// the kernels' speed; repeating one quantized block keeps set-up fast).
fn matrix(ty: GgmlType, n: usize, bytes: usize) -> (Vec<u8>, usize) {
    let vals: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 255) as f32 / 127.0 - 1.0)
        .collect();
    let row = quant::quantize_row(ty, &vals);
    let rows = (bytes / row.len()).max(1);
    let mut m = Vec::with_capacity(rows * row.len());
    for _ in 0..rows {
        m.extend_from_slice(&row);
    }
    (m, rows)
}

/// Best of `reps` timings of `f`, in seconds.
fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Measures every type on `pool`: decode over `decode_bytes` of weights (pick several
/// times the last-level cache), prefill over a quarter of that with `tokens` tokens.
pub fn measure(pool: &ThreadPool, decode_bytes: usize, tokens: usize) -> Vec<TypeRate> {
    const N: usize = 2048;
    MEASURED
        .iter()
        .map(|&ty| {
            let (w, rows) = matrix(ty, N, decode_bytes);
            let acts = {
                let x: Vec<f32> = (0..N).map(|i| (i as f32 * 0.01).sin()).collect();
                let mut a = vec![0u8; quant::act_bytes(ty, N) * tokens];
                let ab = quant::act_bytes(ty, N);
                for t in 0..tokens {
                    quant::quantize_act(ty, &x, &mut a[t * ab..(t + 1) * ab]);
                }
                a
            };
            let ab = quant::act_bytes(ty, N);
            let mut out = vec![0f32; rows * tokens.max(1)];
            let decode = best(3, || {
                let p = SendOut(out.as_mut_ptr());
                pool.for_ranges(rows, 4, &|r| {
                    // SAFETY: for_ranges hands out disjoint row ranges of `out`.
                    let o = unsafe { std::slice::from_raw_parts_mut(p.at(r.start), r.len()) };
                    quant::matvec(ty, N, &w, r, &acts[..ab], o);
                });
            });
            let prows = (rows / 4).max(1);
            let pbytes = w.len() / rows * prows;
            let prefill = best(2, || {
                let p = SendOut(out.as_mut_ptr());
                pool.for_ranges(prows, 16, &|r| {
                    // SAFETY: each range writes its own rows' region of `out`.
                    let o = unsafe {
                        std::slice::from_raw_parts_mut(p.at(r.start * tokens), r.len() * tokens)
                    };
                    quant::matmul(ty, N, &w, r.clone(), &acts, tokens, o, r.len());
                });
            });
            TypeRate {
                ty: ty.name().to_string(),
                decode_bytes_per_s: w.len() as f64 / decode,
                prefill_bytes_per_s: pbytes as f64 * tokens as f64 / prefill,
            }
        })
        .collect()
}

/// Decode speed of every type while other processes may stream too: all matrices are
/// built first, then each type streams for `window` seconds and the rate is the mean
/// over it (so nodes told to measure at once overlap, and the figure includes their
/// contention for memory). Prefill is not measured (0).
pub fn measure_decode_together(
    pool: &ThreadPool,
    decode_bytes: usize,
    window: f64,
) -> Vec<TypeRate> {
    const N: usize = 2048;
    let built: Vec<(GgmlType, Vec<u8>, usize, Vec<u8>)> = MEASURED
        .iter()
        .map(|&ty| {
            let (w, rows) = matrix(ty, N, decode_bytes);
            let x: Vec<f32> = (0..N).map(|i| (i as f32 * 0.01).sin()).collect();
            let mut a = vec![0u8; quant::act_bytes(ty, N)];
            quant::quantize_act(ty, &x, &mut a);
            (ty, w, rows, a)
        })
        .collect();
    built
        .iter()
        .map(|(ty, w, rows, act)| {
            let mut out = vec![0f32; *rows];
            let t = Instant::now();
            let mut passes = 0usize;
            while passes == 0 || t.elapsed().as_secs_f64() < window {
                let p = SendOut(out.as_mut_ptr());
                pool.for_ranges(*rows, 4, &|r| {
                    // SAFETY: for_ranges hands out disjoint row ranges of `out`.
                    let o = unsafe { std::slice::from_raw_parts_mut(p.at(r.start), r.len()) };
                    quant::matvec(*ty, N, w, r, act, o);
                });
                passes += 1;
            }
            TypeRate {
                ty: ty.name().to_string(),
                decode_bytes_per_s: (w.len() * passes) as f64 / t.elapsed().as_secs_f64(),
                prefill_bytes_per_s: 0.0,
            }
        })
        .collect()
}

#[derive(Clone, Copy)]
struct SendOut(*mut f32);
// SAFETY: used only to hand pool tasks disjoint parts of one buffer.
unsafe impl Send for SendOut {}
unsafe impl Sync for SendOut {}
impl SendOut {
    fn at(self, i: usize) -> *mut f32 {
        // SAFETY: callers stay inside the buffer.
        unsafe { self.0.add(i) }
    }
}

/// The rate for `ty` in `rates` (None if it was not measured).
pub fn rate_of(rates: &[TypeRate], ty: GgmlType) -> Option<&TypeRate> {
    rates.iter().find(|r| r.ty == ty.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_gets_positive_rates() {
        let pool = ThreadPool::new(1);
        let rates = measure(&pool, 1 << 20, 8);
        assert_eq!(rates.len(), MEASURED.len());
        for r in &rates {
            assert!(
                r.decode_bytes_per_s > 0.0 && r.decode_bytes_per_s.is_finite(),
                "{r:?}"
            );
            assert!(
                r.prefill_bytes_per_s > 0.0 && r.prefill_bytes_per_s.is_finite(),
                "{r:?}"
            );
        }
        assert!(rate_of(&rates, GgmlType::Q4_K).is_some());
    }
}
