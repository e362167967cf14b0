//! Measured speed of this machine's kernels, per weight type, on the paths in force:
//! decode (a quantized matvec streaming matrices larger than the caches, rows of a common
//! width and short ones) in weight bytes per second, and prefill (a quantized matmul of
//! many tokens) in weight bytes × tokens per second. The planner turns a model's bytes of
//! each type into seconds with these figures.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use weft_gguf::GgmlType;

use crate::choose::{self, SendOut};
use crate::pages::{HugeBuf, StreamBuf};
use crate::quant::{self, select::Shape};
use crate::ThreadPool;

/// One weight type's measured rates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TypeRate {
    /// The type's GGML name ("Q4_K").
    pub ty: String,
    pub decode_bytes_per_s: f64,
    /// Decode over rows of at most `Shape::SHORT_ROW` values (Gemma 3 270M's 640), which
    /// streams slower; 0 where not measured (then `decode_bytes_per_s` stands for it).
    #[serde(default)]
    pub decode_short_bytes_per_s: f64,
    pub prefill_bytes_per_s: f64,
}

impl TypeRate {
    /// Divides every rate by `f` (a node made `f` times slower).
    pub fn slow_down(&mut self, f: f64) {
        self.decode_bytes_per_s /= f;
        self.decode_short_bytes_per_s /= f;
        self.prefill_bytes_per_s /= f;
    }

    /// The decode rate over `short` rows or rows of a common width.
    pub fn decode_rate(&self, short: bool) -> f64 {
        if short && self.decode_short_bytes_per_s > 0.0 {
            self.decode_short_bytes_per_s
        } else {
            self.decode_bytes_per_s
        }
    }
}

/// The types measured: every type weft computes with.
pub const MEASURED: [GgmlType; 11] = GgmlType::WEIGHT_TYPES;

/// Measures every type on `pool` on the paths in force: decode over `decode_bytes` of
/// weights (pick several times the last-level cache), matrix by matrix as a forward pass
/// reads them, at the common and the short row width; prefill on a cache-sized matrix.
pub fn measure(pool: &ThreadPool, decode_bytes: usize) -> Vec<TypeRate> {
    let mut stream = StreamBuf::zeroed(decode_bytes);
    let mut small = StreamBuf::zeroed((decode_bytes / 32).max(1 << 16));
    let mut rate = |ty: GgmlType, shape: Shape| {
        let buf = if shape == Shape::Prefill {
            &mut small
        } else {
            &mut stream
        };
        // None only for a buffer smaller than one row, which the sizes above rule out.
        choose::time_chosen(pool, ty, shape, (5, choose::Keep::Median), buf).unwrap_or(0.0)
    };
    MEASURED
        .iter()
        .map(|&ty| TypeRate {
            ty: ty.name().to_string(),
            decode_bytes_per_s: rate(ty, Shape::Decode),
            decode_short_bytes_per_s: rate(ty, Shape::DecodeShort),
            prefill_bytes_per_s: rate(ty, Shape::Prefill),
        })
        .collect()
}

/// The types a cached calibration is checked against: one memory-bound (Q8_0) and one
/// that also keeps the cores busy (Q4_K), so a slower memory or a slower clock both show.
pub const SPOT_CHECKED: [GgmlType; 2] = [GgmlType::Q8_0, GgmlType::Q4_K];

/// How far this machine's speed now is from `cached` (a `measure` taken earlier, maybe on
/// another host of the same CPU model): the decode rate of each `SPOT_CHECKED` type timed
/// now over `decode_bytes`, divided by the cached one; the ratio furthest from 1 is
/// returned (None: a type missing from `cached`). Well under a second, against
/// several for `measure`.
pub fn spot_check(pool: &ThreadPool, decode_bytes: usize, cached: &[TypeRate]) -> Option<f64> {
    let mut stream = StreamBuf::zeroed(decode_bytes);
    let mut worst: Option<f64> = None;
    for ty in SPOT_CHECKED {
        let then = rate_of(cached, ty)?.decode_bytes_per_s;
        let now = choose::time_chosen(
            pool,
            ty,
            Shape::Decode,
            (3, choose::Keep::Median),
            &mut stream,
        )?;
        if then <= 0.0 || !now.is_finite() {
            return None;
        }
        let ratio = now / then;
        let off = |r: f64| (r.ln()).abs();
        if worst.is_none_or(|w| off(ratio) > off(w)) {
            worst = Some(ratio);
        }
    }
    worst
}

/// Decode speed of every type while other processes may stream too: all matrices are
/// built first, then each type streams for `window` seconds and the rate is the mean
/// over it (so nodes told to measure at once overlap, and the figure includes their
/// contention for memory). `after_pass` runs after each pass with how long it took,
/// inside the timing: a slowed node spins there, so it asks the others' memory for no
/// more than a node that slow would. Prefill is not measured (0).
pub fn measure_decode_together(
    pool: &ThreadPool,
    decode_bytes: usize,
    window: f64,
    after_pass: &dyn Fn(std::time::Duration),
) -> Vec<TypeRate> {
    const N: usize = 2048;
    type Built = (GgmlType, StreamBuf, usize, Vec<u8>, Option<HugeBuf>);
    let built: Vec<Built> = MEASURED
        .iter()
        .map(|&ty| {
            let mut w = StreamBuf::zeroed(decode_bytes);
            let rows = choose::fill_matrix(ty, N, &mut w);
            let x: Vec<f32> = (0..N).map(|i| (i as f32 * 0.01).sin()).collect();
            let mut a = vec![0u8; quant::act_bytes(ty, N)];
            quant::quantize_act(ty, &x, &mut a);
            // The layout a model's dense layers run: interleaved where they are.
            let packed = quant::packs(ty, N)
                .then(|| quant::pack_rows_huge(ty, N, &w, rows).ok())
                .flatten();
            (ty, w, rows, a, packed)
        })
        .collect();
    built
        .iter()
        .map(|(ty, w, rows, act, packed)| {
            let mut out = vec![0f32; *rows];
            let t = Instant::now();
            let mut passes = 0usize;
            while passes == 0 || t.elapsed().as_secs_f64() < window {
                let pass = Instant::now();
                let p = SendOut(out.as_mut_ptr());
                // Interleaved ranges start at a group of eight rows.
                pool.for_ranges(*rows, 8, &|r| {
                    // SAFETY: for_ranges hands out disjoint row ranges of `out`.
                    let o = unsafe { std::slice::from_raw_parts_mut(p.at(r.start), r.len()) };
                    match packed.as_deref() {
                        Some(pw) => quant::matvec_packed(*ty, N, pw, r, act, o),
                        None => quant::matvec(*ty, N, w, r, act, o),
                    }
                });
                after_pass(pass.elapsed());
                passes += 1;
            }
            TypeRate {
                ty: ty.name().to_string(),
                decode_bytes_per_s: (w.len() * passes) as f64 / t.elapsed().as_secs_f64(),
                decode_short_bytes_per_s: 0.0,
                prefill_bytes_per_s: 0.0,
            }
        })
        .collect()
}

/// The rate for `ty` in `rates` (None if it was not measured).
pub fn rate_of(rates: &[TypeRate], ty: GgmlType) -> Option<&TypeRate> {
    rates.iter().find(|r| r.ty == ty.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slowed_node_is_slower_at_every_rate_and_short_rows_fall_back() {
        let mut r = TypeRate {
            ty: "Q8_0".into(),
            decode_bytes_per_s: 20e9,
            decode_short_bytes_per_s: 16e9,
            prefill_bytes_per_s: 40e9,
        };
        r.slow_down(4.0);
        assert_eq!(
            (
                r.decode_rate(false),
                r.decode_rate(true),
                r.prefill_bytes_per_s
            ),
            (5e9, 4e9, 10e9)
        );
        // A figure from a node that did not time short rows stands for both widths.
        r.decode_short_bytes_per_s = 0.0;
        assert_eq!(r.decode_rate(true), 5e9);
    }

    #[test]
    fn the_loaded_round_counts_its_pass_hook_in_the_rate() {
        // A hook that sleeps 4 ms a pass, as a slowed node spins: every type's rate can
        // be no more than one matrix per 4 ms, and the hook runs once a pass at least.
        let pool = ThreadPool::new(1);
        let bytes = 1 << 20;
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let rates = measure_decode_together(&pool, bytes, 0.01, &|took| {
            assert!(took > std::time::Duration::ZERO);
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_millis(4));
        });
        assert_eq!(rates.len(), MEASURED.len());
        assert!(calls.into_inner() >= MEASURED.len());
        for r in &rates {
            assert!(r.decode_bytes_per_s > 0.0, "{r:?}");
            assert!(r.decode_bytes_per_s <= bytes as f64 / 0.004, "{r:?}");
        }
    }

    #[test]
    fn every_type_gets_positive_rates() {
        let pool = ThreadPool::new(1);
        let rates = measure(&pool, 1 << 20);
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
            assert!(
                r.decode_short_bytes_per_s > 0.0 && r.decode_short_bytes_per_s.is_finite(),
                "{r:?}"
            );
        }
        assert!(rate_of(&rates, GgmlType::Q4_K).is_some());
    }

    #[test]
    fn a_spot_check_compares_with_the_cache() {
        let pool = ThreadPool::new(1);
        let rates = measure(&pool, 1 << 20);
        let same = spot_check(&pool, 1 << 20, &rates).unwrap();
        assert!(same > 0.0 && same.is_finite(), "{same}");
        // A cache that claims ten times today's speed reads as about a tenth.
        let mut boasted = rates.clone();
        for r in &mut boasted {
            r.slow_down(0.1);
        }
        let off = spot_check(&pool, 1 << 20, &boasted).unwrap();
        assert!((0.03..0.3).contains(&(off / same)), "{off} vs {same}");
        // A cache without the checked types cannot be checked.
        assert_eq!(spot_check(&pool, 1 << 20, &rates[..1]), None);
    }
}
