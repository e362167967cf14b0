//! Kernels chosen by measurement: for each weight type and shape class, time every path
//! the running CPU offers (`quant::select::candidates`) side by side, keep the fastest,
//! and report each against the machine's ceilings (`roofline`). The report is what a
//! cache stores per CPU model, and `apply` puts a stored one back in force.
//!
//! Where a type's rows are interleaved at load (`quant::packs`), that layout is timed in
//! the same rounds and reported beside the row layout's paths. It is the one models run,
//! so it is what `time_chosen` (the planner's speeds) measures. Whether to interleave is
//! not a timed choice: it changes the float order of a row's sum, and a choice that timing
//! noise could flip would let two processes on one machine part at near-ties. Whether
//! interleaved rows prefetch in software is (the bits are the same): on an Intel core it
//! paid, on Zen 4 it cost a fifth of decode's speed.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use weft_gguf::GgmlType;

use crate::choose_tiles::{time_tiles, TilesChoice};
use crate::grid;
use crate::pages::StreamBuf;
use crate::quant::select::{self, Path, Shape};
use crate::quant::{self};
use crate::{roofline, ThreadPool};

/// Bumped whenever a kernel changes, so timings cached under an older one are retaken.
pub const REVISION: u32 = 21;

/// The environment switches that change which candidates a CPU offers: a report timed
/// under one setting must not be put in force under another (the cache keys by them).
pub const SWITCHES: [&str; 5] = [
    "WEFT_KERNELS_SCALAR",
    "WEFT_KERNELS_NO_VNNI",
    "WEFT_KERNELS_VNNI512",
    "WEFT_KERNELS_NO_PACK",
    "WEFT_KERNELS_NO_AVX512",
];

/// The switches set now (and not "0"), as `-NAME` suffixes without the common prefix:
/// empty where none is.
pub fn switches_on() -> String {
    SWITCHES
        .iter()
        .filter(|k| std::env::var_os(k).is_some_and(|v| v != "0"))
        .map(|k| format!("-{}", k.trim_start_matches("WEFT_KERNELS_")))
        .collect()
}

/// Values per weight row in the timed matrices: a common hidden size, and a short one for
/// `Shape::DecodeShort` (Gemma 3 270M's 640, or 512 where blocks hold 256 values).
fn width_of(ty: GgmlType, shape: Shape) -> usize {
    match shape {
        Shape::DecodeShort if 640 % ty.block_size() == 0 => 640,
        Shape::DecodeShort => 512,
        _ => 2048,
    }
}

/// One candidate's measured speed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timed {
    pub path: Path,
    /// Weight bytes streamed per second (bytes x tokens / time for matmuls).
    pub bytes_per_s: f64,
    /// Arithmetic: 2 x weights x tokens per second.
    pub ops_per_s: f64,
}

/// The candidates of one weight type at one shape class, and the one kept.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// GGML type name ("Q4_K").
    pub ty: String,
    pub shape: Shape,
    /// Tokens per call in the timing.
    pub tokens: usize,
    pub timed: Vec<Timed>,
    /// The path kept on ggml's rows (None: the type has none but the scalar one, and is
    /// timed for its interleaved layout only).
    pub chosen: Option<Path>,
    /// The interleaved layout's timings, where the type is interleaved on this CPU: its
    /// `path` is the VNNI form it runs, with software prefetch or without (both are timed
    /// where few tokens share a group). Then the layout, not `chosen`, serves dense
    /// layers, with the prefetch of `interleaved_chosen`.
    #[serde(default)]
    pub interleaved: Vec<Timed>,
    #[serde(default)]
    pub interleaved_chosen: Option<Path>,
}

/// Everything measured: the ceilings and every choice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub threads: usize,
    /// Read bandwidth of one stream per thread, bytes/s.
    pub bandwidth_bytes_per_s: f64,
    /// Peak integer dot-product rate of the byte-dot instruction the kernels use here
    /// (see `roofline`).
    pub peak_int8_ops_per_s: Option<f64>,
    pub choices: Vec<Choice>,
    /// Attention's tile sets, timed (None: no SIMD tiles here, or a report from before
    /// they were timed).
    #[serde(default)]
    pub attention: Option<TilesChoice>,
}

/// How to time: the matrix sizes and rounds.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Bytes of the decode and batch matrices: several times the last-level cache.
    pub stream_bytes: usize,
    /// Bytes of the prefill matrix.
    pub prefill_bytes: usize,
    /// Rounds over the candidates (alternating, so drift hits all alike); best kept.
    pub rounds: usize,
}

impl Budget {
    /// What start-up uses: about a second on a 2-core machine of 2024.
    pub const STARTUP: Budget = Budget {
        stream_bytes: 80 << 20,
        prefill_bytes: 2 << 20,
        rounds: 3,
    };
    /// For unit tests: tiny, only checks the mechanics.
    pub const TINY: Budget = Budget {
        stream_bytes: 1 << 20,
        prefill_bytes: 256 << 10,
        rounds: 1,
    };
}

/// Tokens per call timed for each shape class.
pub fn tokens_of(shape: Shape) -> usize {
    match shape {
        Shape::Decode | Shape::DecodeShort => 1,
        Shape::Batch => 8,
        Shape::Prefill => 64,
    }
}

/// Fills `buf` with whole copies of one quantized row of `ty` (the values do not change
/// a kernel's speed) and returns the row count; the buffer is reused across types so its
/// pages are faulted in once.
pub(crate) fn fill_matrix(ty: GgmlType, n: usize, buf: &mut [u8]) -> usize {
    let vals: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 255) as f32 / 127.0 - 1.0)
        .collect();
    let row = quant::quantize_row(ty, &vals);
    let mut rows = 0;
    for chunk in buf.chunks_exact_mut(row.len()) {
        chunk.copy_from_slice(&row);
        rows += 1;
    }
    rows
}

/// `m` quantized activations of `n` values for `ty`.
fn activations(ty: GgmlType, n: usize, m: usize) -> Vec<u8> {
    let ab = quant::act_bytes(ty, n);
    let mut a = vec![0u8; ab * m];
    for t in 0..m {
        let x: Vec<f32> = (0..n).map(|i| ((i + 13 * t) as f32 * 0.01).sin()).collect();
        quant::quantize_act(ty, &x, &mut a[t * ab..(t + 1) * ab]);
    }
    a
}

/// An output buffer's pointer, handed to pool tasks that each write their own part.
#[derive(Clone, Copy)]
pub(crate) struct SendOut(pub(crate) *mut f32);
// SAFETY: used only to hand pool tasks disjoint parts of one buffer.
unsafe impl Send for SendOut {}
unsafe impl Sync for SendOut {}
impl SendOut {
    /// The pointer `i` values on (a method, so closures capture the whole `Sync` value).
    pub(crate) fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Relative margin by which a candidate must beat the first (the fixed guess) to replace it.
pub const NOISE: f64 = 0.03;

/// Bytes of one matrix in the timed pass: a model's layer matrix, not one long stream,
/// so the timing includes what a real forward pass pays at every matrix (the hardware
/// prefetcher starting over, handing the rows to the pool).
const MATRIX_BYTES: usize = 1 << 20;

/// What one timing runs: a path on rows in ggml's layout (None: the scalar one), or the
/// interleaved layout (the same rows packed), with software prefetch allowed or not.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Variant {
    Rows(Option<Path>),
    Interleaved { prefetch: bool },
}

/// Seconds of one pass of `variant` over the whole buffer (`w` in ggml's layout, `packed`
/// the same rows interleaved where the variant needs them), matrix by matrix, with `m`
/// tokens on `pool`.
#[allow(clippy::too_many_arguments)]
fn time_once(
    pool: &ThreadPool,
    (ty, n): (GgmlType, usize),
    variant: Variant,
    (w, packed): (&[u8], &[u8]),
    rows: usize,
    acts: &[u8],
    m: usize,
    out: &mut [f32],
) -> f64 {
    let p = SendOut(out.as_mut_ptr());
    // Whole groups of 16 rows a matrix, so interleaved ranges start at a group.
    let rb = n / ty.block_size() * ty.type_size();
    let per_matrix = (MATRIX_BYTES / rb).clamp(16, rows.max(16)) / 16 * 16;
    let t = Instant::now();
    let mut first = 0;
    while first < rows {
        let end = (first + per_matrix).min(rows);
        pool.for_ranges(end - first, 16, &|r| {
            let r = first + r.start..first + r.end;
            // SAFETY: for_ranges hands out disjoint row ranges; each writes its own
            // `m x r.len()` region of `out`, which holds rows x m values.
            let o = unsafe { std::slice::from_raw_parts_mut(p.at(r.start * m), r.len() * m) };
            let stride = r.len();
            match variant {
                Variant::Rows(path) if m == 1 => quant::matvec_on(path, ty, n, w, r, acts, o),
                Variant::Rows(path) => quant::matmul_on(path, ty, n, w, r, acts, m, o, stride),
                Variant::Interleaved { prefetch } => {
                    quant::matmul_packed_on(prefetch, ty, n, packed, r, acts, m, o, stride);
                }
            }
        });
        first = end;
    }
    t.elapsed().as_secs_f64()
}

/// Which of a path's timings a figure keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// The fastest: for ranking paths, where what matters is what each can do.
    Best,
    /// The median: for predicting speed, which the machine's typical moment sets (on a
    /// shared machine the best timing is an optimistic outlier).
    Median,
}

/// Times `variants` for `ty` at `shape` side by side on `buf` (its size sets the
/// matrix's: pick several times the last-level cache for the streaming shapes) for
/// `rounds` rounds; (weight bytes x tokens, ops) per second of each, counting the bytes
/// of ggml's layout for every variant.
fn time_each(
    pool: &ThreadPool,
    ty: GgmlType,
    shape: Shape,
    variants: &[Variant],
    (rounds, keep): (usize, Keep),
    buf: &mut [u8],
) -> Vec<(f64, f64)> {
    let m = tokens_of(shape);
    let n = width_of(ty, shape);
    let rb = n / ty.block_size() * ty.type_size();
    let mut rows = fill_matrix(ty, n, buf);
    let Some(&first) = variants.first().filter(|_| rows > 0) else {
        return Vec::new();
    };
    // The matrix repeats one row, so its interleaved form repeats one group: packed
    // once and copied (exactly a matrix's layout where its rows are one window, as every
    // timed width is). Timing only that layout, it takes `buf` itself (no second copy
    // of a buffer sized to outgrow the caches); else a buffer of its own.
    let interleaved = variants
        .iter()
        .find(|v| matches!(v, Variant::Interleaved { .. }));
    let group = match interleaved {
        Some(_) => quant::pack_rows(ty, n, &buf[..rows.min(8) * rb], rows.min(8)),
        None => Vec::new(),
    };
    let rows_layout = variants.iter().any(|v| matches!(v, Variant::Rows(_)));
    let mut own = StreamBuf::Heap(Vec::new());
    if !group.is_empty() {
        let groups = if rows_layout {
            rows.div_ceil(8)
        } else {
            buf.len() / group.len()
        };
        if groups == 0 {
            return Vec::new();
        }
        let dst: &mut [u8] = if rows_layout {
            own = StreamBuf::zeroed(groups * group.len());
            &mut own
        } else {
            rows = groups * 8;
            &mut buf[..groups * group.len()]
        };
        for chunk in dst.chunks_exact_mut(group.len()) {
            chunk.copy_from_slice(&group);
        }
    }
    let (w, packed): (&[u8], &[u8]) = match (rows_layout, group.is_empty()) {
        (true, _) => (&buf[..rows * rb], &own),
        (false, false) => (&[], &buf[..rows.div_ceil(8) * group.len()]),
        (false, true) => (&buf[..rows * rb], &[]),
    };
    let acts = activations(ty, n, m);
    let mut out = vec![0f32; rows * m];
    let mut times = vec![Vec::new(); variants.len()];
    let bufs = (w, packed);
    // One untimed pass first: page faults and cold caches belong to no candidate.
    time_once(pool, (ty, n), first, bufs, rows, &acts, m, &mut out);
    if let Some(&v) = interleaved.filter(|&&v| v != first) {
        time_once(pool, (ty, n), v, bufs, rows, &acts, m, &mut out);
    }
    for _ in 0..rounds.max(1) {
        for (i, &v) in variants.iter().enumerate() {
            times[i].push(time_once(pool, (ty, n), v, bufs, rows, &acts, m, &mut out));
        }
    }
    let weights = (rows * n) as f64;
    times
        .iter_mut()
        .map(|t| {
            t.sort_by(f64::total_cmp);
            let s = match keep {
                Keep::Best => t[0],
                Keep::Median => t[t.len() / 2],
            };
            ((rows * rb * m) as f64 / s, 2.0 * weights * m as f64 / s)
        })
        .collect()
}

/// Weight bytes x tokens per second of what a dense layer of `ty` runs at `shape`: the
/// interleaved layout where `ty` is interleaved on this CPU, else the path in force (the
/// scalar one where no SIMD path exists), timed on `buf` as the candidates are. A MoE
/// model's routed experts are interleaved alike (where their widths are whole groups).
pub fn time_chosen(
    pool: &ThreadPool,
    ty: GgmlType,
    shape: Shape,
    (rounds, keep): (usize, Keep),
    buf: &mut [u8],
) -> Option<f64> {
    let variant = if quant::packs(ty, width_of(ty, shape)) {
        Variant::Interleaved {
            prefetch: select::packed_prefetch(ty, shape),
        }
    } else {
        Variant::Rows(select::chosen(ty, shape))
    };
    let timed = time_each(pool, ty, shape, &[variant], (rounds, keep), buf);
    timed.first().map(|&(bytes_per_s, _)| bytes_per_s)
}

/// Times every candidate of `ty` at `shape` on `buf` and returns the choice (not applied).
pub fn time_candidates(
    pool: &ThreadPool,
    ty: GgmlType,
    shape: Shape,
    rounds: usize,
    buf: &mut [u8],
) -> Option<Choice> {
    let paths = select::candidates(ty, shape);
    let paths = paths.as_slice();
    let m = tokens_of(shape);
    let mut variants: Vec<Variant> = paths.iter().map(|&p| Variant::Rows(Some(p))).collect();
    let packed_path = quant::packed_path().filter(|_| quant::packs(ty, width_of(ty, shape)));
    // Interleaved rows prefetch only while few tokens share a group: at one token and a
    // batch both are timed, the guess (prefetch) first. A prefill's chunks of few tokens
    // follow the batch's choice (`quant::matmul_packed`), so prefill is timed once.
    let packed: Vec<Path> = packed_path.map_or(Vec::new(), |p| {
        let tries: &[bool] = match shape {
            Shape::Prefill => &[true],
            _ => &[true, false],
        };
        tries
            .iter()
            .map(|&prefetch| Path { prefetch, ..p })
            .collect()
    });
    variants.extend(packed.iter().map(|p| Variant::Interleaved {
        prefetch: p.prefetch,
    }));
    let mut timed: Vec<Timed> = time_each(pool, ty, shape, &variants, (rounds, Keep::Best), buf)
        .into_iter()
        .zip(paths.iter().chain(&packed))
        .map(|((bytes_per_s, ops_per_s), &path)| Timed {
            path,
            bytes_per_s,
            ops_per_s,
        })
        .collect();
    if timed.is_empty() {
        return None;
    }
    let interleaved = timed.split_off(paths.len().min(timed.len()));
    Some(Choice {
        ty: ty.name().to_string(),
        shape,
        tokens: m,
        chosen: fastest_or_guess(&timed),
        timed,
        interleaved_chosen: fastest_or_guess(&interleaved),
        interleaved,
    })
}

/// The path of `timed` to keep (`keep::fastest_unless_noise` by bytes per second).
fn fastest_or_guess(timed: &[Timed]) -> Option<Path> {
    crate::keep::fastest_unless_noise(timed, |t| t.bytes_per_s, NOISE).map(|t| t.path)
}

/// Measures the ceilings and every type at every shape class on `pool`, and puts the
/// fastest paths in force.
pub fn choose(pool: &ThreadPool, b: Budget) -> Report {
    let mut choices = Vec::new();
    let mut stream = StreamBuf::zeroed(b.stream_bytes);
    let mut small = StreamBuf::zeroed(b.prefill_bytes);
    for ty in GgmlType::WEIGHT_TYPES {
        for shape in Shape::ALL {
            let buf = if shape == Shape::Prefill {
                &mut small
            } else {
                &mut stream
            };
            if let Some(c) = time_candidates(pool, ty, shape, b.rounds, buf) {
                choices.push(c);
            }
        }
    }
    drop(stream);
    let report = Report {
        threads: pool.n_threads(),
        bandwidth_bytes_per_s: roofline::read_bandwidth(pool, b.stream_bytes, b.rounds.max(2)),
        peak_int8_ops_per_s: roofline::peak_int8_ops(pool),
        choices,
        attention: time_tiles(b.rounds, NOISE),
    };
    apply(&report);
    report
}

/// Puts a report's choices in force; returns how many weight-type choices were taken (a
/// path this CPU cannot run, from a stale or foreign report, is skipped, as is a tile set
/// it does not offer).
pub fn apply(report: &Report) -> usize {
    if let Some(a) = &report.attention {
        grid::choose(a.chosen);
    }
    report
        .choices
        .iter()
        .filter(|c| {
            let Some(&t) = GgmlType::WEIGHT_TYPES.iter().find(|t| t.name() == c.ty) else {
                return false;
            };
            if let Some(p) = c.interleaved_chosen {
                select::choose_packed_prefetch(t, c.shape, p.prefetch);
            }
            match c.chosen {
                Some(p) => select::choose(t, c.shape, p),
                None => c.interleaved_chosen.is_some(),
            }
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_and_shape_gets_a_runnable_choice() {
        let pool = ThreadPool::new(1);
        let r = choose(&pool, Budget::TINY);
        assert!(r.bandwidth_bytes_per_s > 0.0);
        for ty in GgmlType::WEIGHT_TYPES {
            for shape in Shape::ALL {
                let cands = select::candidates(ty, shape);
                let c = r
                    .choices
                    .iter()
                    .find(|c| c.ty == ty.name() && c.shape == shape);
                match c {
                    None => assert!(
                        cands.as_slice().is_empty() && !quant::packs(ty, width_of(ty, shape)),
                        "{ty} {shape:?}"
                    ),
                    Some(c) => {
                        assert_eq!(c.timed.len(), cands.as_slice().len());
                        // Types with no row path are there for their interleaved layout.
                        assert_eq!(c.chosen.is_none(), cands.as_slice().is_empty());
                        assert!(c.chosen.is_none_or(|p| cands.as_slice().contains(&p)));
                        let best = c.timed.iter().map(|t| t.bytes_per_s).fold(0.0, f64::max);
                        let rate = |p: Path| {
                            c.timed
                                .iter()
                                .find(|t| t.path == p)
                                .map_or(0.0, |t| t.bytes_per_s)
                        };
                        // The fastest, or the guess when nothing beats it by NOISE.
                        if let (Some(chosen), Some(guess)) = (c.chosen, c.timed.first()) {
                            let guess = guess.path;
                            assert!(
                                rate(chosen) == best
                                    || (chosen == guess && best <= rate(guess) * (1.0 + NOISE)),
                                "{c:?}"
                            );
                        }
                        assert!(c.timed.iter().all(|t| t.ops_per_s > 0.0));
                        // The interleaved layout is timed exactly where it is used.
                        let n = width_of(ty, shape);
                        let packs = quant::packs(ty, n);
                        assert_eq!(c.interleaved_chosen.is_some(), packs, "{ty} {shape:?}");
                        // Prefetch and not where few tokens share a group, else only
                        // the first.
                        let tries = match (packs, shape) {
                            (false, _) => 0,
                            (true, Shape::Prefill) => 1,
                            (true, _) => 2,
                        };
                        assert_eq!(c.interleaved.len(), tries, "{ty} {shape:?}");
                        assert!(c.interleaved.iter().all(|t| t.ops_per_s > 0.0));
                        if let Some(p) = c.interleaved_chosen {
                            assert!(c.interleaved.iter().any(|t| t.path == p));
                            assert_eq!(select::packed_prefetch(ty, shape), p.prefetch);
                        }
                        assert_eq!(select::chosen(ty, shape), c.chosen);
                    }
                }
            }
        }
        // A stored report applies again; a foreign type name is skipped.
        let Some(first) = r.choices.first() else {
            return; // scalar only: nothing to choose
        };
        let mut stale = r.clone();
        stale.choices.push(Choice {
            ty: "Q9_Z".into(),
            ..first.clone()
        });
        assert_eq!(apply(&stale), r.choices.len());
        // The tile set timed fastest is the one attention runs.
        assert_eq!(r.attention.map(|a| a.chosen), grid::chosen());
    }
}
