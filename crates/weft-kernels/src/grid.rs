//! Attention's grids: a block's scores for a group of queries that read the same cached
//! rows, and its value rows summed into the group's outputs, in register tiles. Apart
//! from `vecops` because the tiles are compiled once per instruction set.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// A cached row's value type: f32, or f16 (half the memory and the bytes read; widened
/// to f32 exactly on load, so a score or sum over f16 rows is the same bits as over the
/// same rows widened first).
pub trait Cached: Copy + Send + Sync + 'static {
    /// Loads widen from f16 (`vcvtph2ps`) rather than read f32.
    const HALF: bool;
    fn to_f32(self) -> f32;
}

impl Cached for f32 {
    const HALF: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Cached for half::f16 {
    const HALF: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// The instruction sets the tiles are compiled for. AVX-512VL's 32 vector registers (the
/// same 256-bit operations, registers ymm16-31 too) hold larger tiles than AVX2's 16, so
/// each load feeds more FMAs: MLA prefill of 512 after 4,096 tokens went 80 -> 111 tok/s
/// on Zen 4 (2 threads). Both give the same bits, so which runs is a timed choice
/// (`choose`, cached per CPU model); `WEFT_KERNELS_NO_AVX512` keeps the AVX2 tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TileSet {
    Avx512,
    Avx2,
}

impl TileSet {
    pub fn name(self) -> &'static str {
        match self {
            TileSet::Avx512 => "avx512vl 6x4",
            TileSet::Avx2 => "avx2 4x3",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Simd {
    Tiles(TileSet),
    None,
}

/// Whether this CPU runs the AVX-512VL tiles (switch or not).
fn has_avx512vl() -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::vecops::has_avx2() {
        return is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl");
    }
    false
}

/// The tile sets this CPU runs, the default first (the larger tiles where the registers
/// are there, unless switched off); empty where no SIMD tiles run. Detected once.
pub fn candidates() -> &'static [TileSet] {
    static SETS: OnceLock<Vec<TileSet>> = OnceLock::new();
    SETS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if crate::vecops::has_avx2() && is_x86_feature_detected!("f16c") {
            let off = std::env::var_os("WEFT_KERNELS_NO_AVX512").is_some_and(|v| v != "0");
            return match has_avx512vl() && !off {
                true => vec![TileSet::Avx512, TileSet::Avx2],
                false => vec![TileSet::Avx2],
            };
        }
        Vec::new()
    })
}

/// The set in force: 0 until one is chosen (then the first candidate runs), else
/// `1 + index` in `[Avx512, Avx2]`.
static CHOSEN: AtomicU8 = AtomicU8::new(0);

/// Puts `set` in force; false (and nothing changes) where this CPU does not offer it.
pub fn choose(set: TileSet) -> bool {
    if !candidates().contains(&set) {
        return false;
    }
    let code = match set {
        TileSet::Avx512 => 1,
        TileSet::Avx2 => 2,
    };
    CHOSEN.store(code, Ordering::Relaxed);
    true
}

/// The set attention runs now (None: no SIMD tiles on this CPU).
pub fn chosen() -> Option<TileSet> {
    match CHOSEN.load(Ordering::Relaxed) {
        1 => Some(TileSet::Avx512),
        2 => Some(TileSet::Avx2),
        _ => candidates().first().copied(),
    }
}

fn simd() -> Simd {
    chosen().map_or(Simd::None, Simd::Tiles)
}

/// out[i · stride + j] = queries[i] · rows[j]: a block of attention scores for a group of
/// queries that read the same cached rows. A pair's arithmetic does not depend on what
/// else is in the grid, so a query's scores are the same bits in any group.
pub fn dot_grid<T: Cached>(queries: &[&[f32]], rows: &[&[T]], out: &mut [f32], stride: usize) {
    dot_grid_with(simd(), queries, rows, out, stride);
}

/// `dot_grid` on the tiles of `set` (a candidate of this CPU): for timing them.
pub fn dot_grid_on<T: Cached>(
    set: TileSet,
    queries: &[&[f32]],
    rows: &[&[T]],
    out: &mut [f32],
    stride: usize,
) {
    assert!(candidates().contains(&set), "{set:?} does not run here");
    dot_grid_with(Simd::Tiles(set), queries, rows, out, stride);
}

#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn dot_grid_with<T: Cached>(
    s: Simd,
    queries: &[&[f32]],
    rows: &[&[T]],
    out: &mut [f32],
    stride: usize,
) {
    if queries.is_empty() || rows.is_empty() {
        return;
    }
    let n = queries[0].len();
    assert!(queries.iter().all(|q| q.len() == n));
    assert!(rows.iter().all(|r| r.len() == n));
    assert!(stride >= rows.len());
    assert!(out.len() >= (queries.len() - 1) * stride + rows.len());
    #[cfg(target_arch = "x86_64")]
    match s {
        // SAFETY: the instruction set was detected at run time (`candidates`); the
        // lengths are checked above.
        Simd::Tiles(TileSet::Avx512) => {
            return unsafe { avx512::dot_grid(queries, rows, out, stride) }
        }
        Simd::Tiles(TileSet::Avx2) => return unsafe { avx2::dot_grid(queries, rows, out, stride) },
        Simd::None => {}
    }
    for (i, q) in queries.iter().enumerate() {
        for (o, r) in out[i * stride..].iter_mut().zip(rows) {
            *o = dot_widened(q, r);
        }
    }
}

/// `vecops::dot_scalar` over a row of any `Cached` type, each value widened as read.
fn dot_widened<T: Cached>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += a[c * 8 + j] * b[c * 8 + j].to_f32();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i].to_f32();
    }
    s
}

/// ys[i][e] += Σ_j w[i · stride + j] · rows[j][e]: a block of value rows summed into a
/// group of outputs. Each element takes its rows in order, one fused multiply-add each
/// (`axpy_fused`), so an output is the same bits in any group and on any instruction set
/// (a weight of zero leaves it as it was).
pub fn axpy_grid<T: Cached>(w: &[f32], stride: usize, rows: &[&[T]], ys: &mut [&mut [f32]]) {
    axpy_grid_with(simd(), w, stride, rows, ys);
}

/// `axpy_grid` on the tiles of `set` (a candidate of this CPU): for timing them.
pub fn axpy_grid_on<T: Cached>(
    set: TileSet,
    w: &[f32],
    stride: usize,
    rows: &[&[T]],
    ys: &mut [&mut [f32]],
) {
    assert!(candidates().contains(&set), "{set:?} does not run here");
    axpy_grid_with(Simd::Tiles(set), w, stride, rows, ys);
}

#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn axpy_grid_with<T: Cached>(
    s: Simd,
    w: &[f32],
    stride: usize,
    rows: &[&[T]],
    ys: &mut [&mut [f32]],
) {
    if ys.is_empty() || rows.is_empty() {
        return;
    }
    let n = ys[0].len();
    assert!(ys.iter().all(|y| y.len() == n));
    assert!(rows.iter().all(|r| r.len() == n));
    assert!(stride >= rows.len());
    assert!(w.len() >= (ys.len() - 1) * stride + rows.len());
    #[cfg(target_arch = "x86_64")]
    match s {
        // SAFETY: as in `dot_grid_with`.
        Simd::Tiles(TileSet::Avx512) => return unsafe { avx512::axpy_grid(w, stride, rows, ys) },
        Simd::Tiles(TileSet::Avx2) => return unsafe { avx2::axpy_grid(w, stride, rows, ys) },
        Simd::None => {}
    }
    for (i, y) in ys.iter_mut().enumerate() {
        axpy_fused(&w[i * stride..i * stride + rows.len()], rows, y);
    }
}

/// y[e] += Σ_j w[j] · rows[j][e], one element at a time, each row one fused multiply-add
/// in order: what every tile of `axpy_grid` computes per element, so its reference and
/// its fallback where no SIMD runs (`mul_add` is one instruction on FMA hardware).
pub fn axpy_fused<T: Cached>(w: &[f32], rows: &[&[T]], y: &mut [f32]) {
    for (e, ye) in y.iter_mut().enumerate() {
        for (&wj, r) in w.iter().zip(rows) {
            *ye = wj.mul_add(r[e].to_f32(), *ye);
        }
    }
}

/// The tile kernels for one instruction set: `$grid_q` queries by `$grid_r` rows a score
/// tile; value tiles of 4, 3, 2 and 1 outputs by `$sum_v` vectors each. A tile keeps
/// about three quarters of the registers as accumulators and the rest for the loads.
#[cfg(target_arch = "x86_64")]
macro_rules! grid_kernels {
    ($name:ident, $features:literal, $grid_q:literal, $grid_r:literal, $sum_v:expr) => {
        pub(crate) mod $name {
            use std::arch::x86_64::*;

            use super::Cached;

            const GRID_QUERIES: usize = $grid_q;
            const GRID_ROWS: usize = $grid_r;

            /// Eight values of a cached row from `p`, widened where they are f16.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn load<T: Cached>(p: *const T) -> __m256 {
                if T::HALF {
                    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
                } else {
                    _mm256_loadu_ps(p.cast())
                }
            }

            /// `dot_grid` in tiles of `GRID_QUERIES` by `GRID_ROWS`, smaller tiles at the edges.
            /// Every query and row is `n` long and `out` holds the grid (checked by the caller).
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn dot_grid<T: Cached>(
                queries: &[&[f32]],
                rows: &[&[T]],
                out: &mut [f32],
                stride: usize,
            ) {
                let n = queries[0].len();
                let po = out.as_mut_ptr();
                for (qi, qs) in queries.chunks(GRID_QUERIES).enumerate() {
                    let mut q = [std::ptr::null(); GRID_QUERIES];
                    for (p, s) in q.iter_mut().zip(qs) {
                        *p = s.as_ptr();
                    }
                    for (ri, rs) in rows.chunks(GRID_ROWS).enumerate() {
                        let mut k = [std::ptr::null(); GRID_ROWS];
                        for (p, s) in k.iter_mut().zip(rs) {
                            *p = s.as_ptr();
                        }
                        let o = po.add(qi * GRID_QUERIES * stride + ri * GRID_ROWS);
                        // Shapes past this set's tile are never asked for.
                        match (qs.len(), rs.len()) {
                            (6, 4) => grid_tile::<T, 6, 4>(&q, &k, n, o, stride),
                            (6, 3) => grid_tile::<T, 6, 3>(&q, &k, n, o, stride),
                            (6, 2) => grid_tile::<T, 6, 2>(&q, &k, n, o, stride),
                            (6, _) => grid_tile::<T, 6, 1>(&q, &k, n, o, stride),
                            (5, 4) => grid_tile::<T, 5, 4>(&q, &k, n, o, stride),
                            (5, 3) => grid_tile::<T, 5, 3>(&q, &k, n, o, stride),
                            (5, 2) => grid_tile::<T, 5, 2>(&q, &k, n, o, stride),
                            (5, _) => grid_tile::<T, 5, 1>(&q, &k, n, o, stride),
                            (4, 4) => grid_tile::<T, 4, 4>(&q, &k, n, o, stride),
                            (4, 3) => grid_tile::<T, 4, 3>(&q, &k, n, o, stride),
                            (4, 2) => grid_tile::<T, 4, 2>(&q, &k, n, o, stride),
                            (4, _) => grid_tile::<T, 4, 1>(&q, &k, n, o, stride),
                            (3, 4) => grid_tile::<T, 3, 4>(&q, &k, n, o, stride),
                            (3, 3) => grid_tile::<T, 3, 3>(&q, &k, n, o, stride),
                            (3, 2) => grid_tile::<T, 3, 2>(&q, &k, n, o, stride),
                            (3, _) => grid_tile::<T, 3, 1>(&q, &k, n, o, stride),
                            (2, 4) => grid_tile::<T, 2, 4>(&q, &k, n, o, stride),
                            (2, 3) => grid_tile::<T, 2, 3>(&q, &k, n, o, stride),
                            (2, 2) => grid_tile::<T, 2, 2>(&q, &k, n, o, stride),
                            (2, _) => grid_tile::<T, 2, 1>(&q, &k, n, o, stride),
                            (_, 4) => grid_tile::<T, 1, 4>(&q, &k, n, o, stride),
                            (_, 3) => grid_tile::<T, 1, 3>(&q, &k, n, o, stride),
                            (_, 2) => grid_tile::<T, 1, 2>(&q, &k, n, o, stride),
                            (_, _) => grid_tile::<T, 1, 1>(&q, &k, n, o, stride),
                        }
                    }
                }
            }

            /// One tile: `Q` queries by `R` rows, one accumulator a pair over the vectors front
            /// to back, then the pair's own horizontal sum and scalar tail, the same for every
            /// tile shape.
            // A tile's indices address its accumulators, rows and outputs together.
            #[allow(clippy::needless_range_loop)]
            #[target_feature(enable = $features)]
            unsafe fn grid_tile<T: Cached, const Q: usize, const R: usize>(
                q: &[*const f32],
                k: &[*const T],
                n: usize,
                out: *mut f32,
                stride: usize,
            ) {
                let mut acc = [[_mm256_setzero_ps(); R]; Q];
                let mut kv = [_mm256_setzero_ps(); R];
                let mut i = 0;
                while i + 8 <= n {
                    for r in 0..R {
                        kv[r] = load(k[r].add(i));
                    }
                    for a in 0..Q {
                        let qv = _mm256_loadu_ps(q[a].add(i));
                        for r in 0..R {
                            acc[a][r] = _mm256_fmadd_ps(qv, kv[r], acc[a][r]);
                        }
                    }
                    i += 8;
                }
                for a in 0..Q {
                    for r in 0..R {
                        let mut s = hsum(acc[a][r]);
                        for t in i..n {
                            s += *q[a].add(t) * (*k[r].add(t)).to_f32();
                        }
                        *out.add(a * stride + r) = s;
                    }
                }
            }

            const SUM_QUERIES: usize = 4;

            /// `axpy_grid` in tiles of up to 4 outputs, a strip of vectors at a time along the
            /// row, and the elements past the last vector one at a time, fused as well.
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn axpy_grid<T: Cached>(
                w: &[f32],
                stride: usize,
                rows: &[&[T]],
                ys: &mut [&mut [f32]],
            ) {
                let n = ys[0].len();
                let pw = w.as_ptr();
                for (yi, yt) in ys.chunks_mut(SUM_QUERIES).enumerate() {
                    let mut y = [std::ptr::null_mut(); SUM_QUERIES];
                    for (p, s) in y.iter_mut().zip(yt.iter_mut()) {
                        *p = s.as_mut_ptr();
                    }
                    let wt = pw.add(yi * SUM_QUERIES * stride);
                    let e = match yt.len() {
                        4 => sum_strip::<T, 4, { $sum_v[0] }>(&y, wt, stride, rows, n),
                        3 => sum_strip::<T, 3, { $sum_v[1] }>(&y, wt, stride, rows, n),
                        2 => sum_strip::<T, 2, { $sum_v[2] }>(&y, wt, stride, rows, n),
                        _ => sum_strip::<T, 1, { $sum_v[3] }>(&y, wt, stride, rows, n),
                    };
                    for (a, &py) in y[..yt.len()].iter().enumerate() {
                        for t in e..n {
                            for (j, r) in rows.iter().enumerate() {
                                *py.add(t) =
                                    (*wt.add(a * stride + j)).mul_add(r[t].to_f32(), *py.add(t));
                            }
                        }
                    }
                }
            }

            /// `Q` outputs along the row in tiles of `V` vectors, the rest in tiles of 4, 2 and 1
            /// (a head of 128 by 2 outputs: 6, 6, 4); returns where the whole vectors end.
            #[target_feature(enable = $features)]
            unsafe fn sum_strip<T: Cached, const Q: usize, const V: usize>(
                y: &[*mut f32],
                w: *const f32,
                stride: usize,
                rows: &[&[T]],
                n: usize,
            ) -> usize {
                let mut e = 0;
                while e + 8 * V <= n {
                    sum_tile::<T, Q, V>(y, w, stride, rows, e);
                    e += 8 * V;
                }
                if V > 4 && e + 32 <= n {
                    sum_tile::<T, Q, 4>(y, w, stride, rows, e);
                    e += 32;
                }
                if V > 2 && e + 16 <= n {
                    sum_tile::<T, Q, 2>(y, w, stride, rows, e);
                    e += 16;
                }
                while e + 8 <= n {
                    sum_tile::<T, Q, 1>(y, w, stride, rows, e);
                    e += 8;
                }
                e
            }

            /// One tile: `Q` outputs by `V` vectors from element `e`, every row in order.
            // A tile's indices address its accumulators, rows and outputs together.
            #[allow(clippy::needless_range_loop)]
            #[target_feature(enable = $features)]
            unsafe fn sum_tile<T: Cached, const Q: usize, const V: usize>(
                y: &[*mut f32],
                w: *const f32,
                stride: usize,
                rows: &[&[T]],
                e: usize,
            ) {
                let mut acc = [[_mm256_setzero_ps(); V]; Q];
                for a in 0..Q {
                    for v in 0..V {
                        acc[a][v] = _mm256_loadu_ps(y[a].add(e + 8 * v));
                    }
                }
                let mut wa = [_mm256_setzero_ps(); Q];
                for (j, r) in rows.iter().enumerate() {
                    let pr = r.as_ptr().add(e);
                    for a in 0..Q {
                        wa[a] = _mm256_broadcast_ss(&*w.add(a * stride + j));
                    }
                    for v in 0..V {
                        let rv = load(pr.add(8 * v));
                        for a in 0..Q {
                            acc[a][v] = _mm256_fmadd_ps(wa[a], rv, acc[a][v]);
                        }
                    }
                }
                for a in 0..Q {
                    for v in 0..V {
                        _mm256_storeu_ps(y[a].add(e + 8 * v), acc[a][v]);
                    }
                }
            }

            /// The sum of 8 lanes: halves, then pairs, then the last two.
            #[target_feature(enable = $features)]
            unsafe fn hsum(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
            }
        }
    };
}

// AVX2: 12 accumulators in 16 registers; a score step loads 7 vectors for 12 FMAs,
// where a dot at a time loaded 2 for each (scores at long context waited on the loads).
#[cfg(target_arch = "x86_64")]
grid_kernels!(avx2, "avx2,fma,f16c", 4, 3, [3, 4, 6, 8]);
// AVX-512VL: 24 accumulators in 32 registers; a score step loads 10 vectors for 24 FMAs.
#[cfg(target_arch = "x86_64")]
grid_kernels!(
    avx512,
    "avx2,fma,f16c,avx512f,avx512vl",
    6,
    4,
    [6, 8, 12, 16]
);

#[cfg(test)]
mod tests {
    use super::*;

    fn varied(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 7919 % 113) as f32 / 113.0 - 0.5) * 2.0)
            .collect()
    }

    #[test]
    fn a_score_grid_gives_each_pair_the_same_bits_as_alone() {
        // Grids of 0 to 9 queries by 0 to 8 rows (every tile shape and edge), widths
        // with and without a scalar tail: each score near the exact dot, and the same
        // bits as that pair's grid of one, or as a grid cut at another query or row.
        for n in [5, 8, 13, 128, 576] {
            let qs: Vec<Vec<f32>> = (0..9).map(|i| varied(n, i * 31)).collect();
            let rs: Vec<Vec<f32>> = (0..8).map(|j| varied(n, j * 17 + 3)).collect();
            let q: Vec<&[f32]> = qs.iter().map(|v| &v[..]).collect();
            let r: Vec<&[f32]> = rs.iter().map(|v| &v[..]).collect();
            for (nq, nr) in [(0, 3), (3, 0), (1, 1), (9, 8), (5, 7), (4, 3), (2, 2)] {
                let stride = nr + 2;
                let mut grid = vec![f32::NAN; nq * stride];
                dot_grid(&q[..nq], &r[..nr], &mut grid, stride);
                for i in 0..nq {
                    for j in 0..nr {
                        let got = grid[i * stride + j];
                        let exact: f64 = q[i]
                            .iter()
                            .zip(r[j])
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum();
                        assert!(
                            (got as f64 - exact).abs() < 1e-4,
                            "n {n} ({i},{j}): {got} vs {exact}"
                        );
                        let mut alone = [0f32];
                        dot_grid(&q[i..=i], &r[j..=j], &mut alone, 1);
                        assert_eq!(got.to_bits(), alone[0].to_bits(), "n {n} ({i},{j}) alone");
                        // Pair (i, j) is the first of a grid from query i and row j.
                        let mut cut = vec![0f32; (nq - i) * nr];
                        dot_grid(&q[i..nq], &r[j..nr], &mut cut, nr);
                        assert_eq!(got.to_bits(), cut[0].to_bits(), "n {n} ({i},{j}) cut");
                    }
                }
            }
        }
    }

    #[test]
    fn a_value_grid_gives_each_output_the_bits_of_fused_rows_in_order() {
        // 0 to 6 outputs (tiles of 4, 3, 2 and 1), rows of widths that leave partial
        // strips and a scalar tail; some weights zero, as rows a query does not read.
        for n in [3, 8, 13, 40, 128, 200, 576] {
            let rs: Vec<Vec<f32>> = (0..7).map(|j| varied(n, j * 5 + 1)).collect();
            let r: Vec<&[f32]> = rs.iter().map(|v| &v[..]).collect();
            for (ny, nr) in [(0, 4), (1, 0), (1, 7), (2, 5), (3, 7), (4, 6), (6, 7)] {
                let stride = nr + 1;
                let w: Vec<f32> = (0..ny * stride)
                    .map(|k| {
                        if k % 3 == 1 {
                            0.0
                        } else {
                            (k % 7) as f32 * 0.25 - 0.75
                        }
                    })
                    .collect();
                let mut ys: Vec<Vec<f32>> = (0..ny).map(|i| varied(n, i + 40)).collect();
                let mut want = ys.clone();
                for (i, y) in want.iter_mut().enumerate() {
                    axpy_fused(&w[i * stride..i * stride + nr], &r[..nr], y);
                }
                let mut refs: Vec<&mut [f32]> = ys.iter_mut().map(|v| &mut v[..]).collect();
                axpy_grid(&w, stride, &r[..nr], &mut refs);
                for (i, (got, want)) in ys.iter().zip(&want).enumerate() {
                    let (g, w): (Vec<u32>, Vec<u32>) = (
                        got.iter().map(|v| v.to_bits()).collect(),
                        want.iter().map(|v| v.to_bits()).collect(),
                    );
                    assert_eq!(g, w, "n {n}, {ny} outputs by {nr} rows, output {i}");
                }
            }
        }
    }

    #[test]
    fn f16_rows_give_the_bits_of_the_same_rows_widened() {
        // Scores and value sums over f16 rows against f32 rows holding the same values,
        // on every tile set this CPU runs and on the fallback: equal to the bit.
        use half::f16;
        for n in [13, 128, 576] {
            let qs: Vec<Vec<f32>> = (0..11).map(|i| varied(n, i * 31)).collect();
            let r16: Vec<Vec<f16>> = (0..9)
                .map(|j| {
                    varied(n, j * 17 + 3)
                        .into_iter()
                        .map(f16::from_f32)
                        .collect()
                })
                .collect();
            let r32: Vec<Vec<f32>> = r16
                .iter()
                .map(|r| r.iter().map(|v| v.to_f32()).collect())
                .collect();
            let q: Vec<&[f32]> = qs.iter().map(|v| &v[..]).collect();
            let (a16, a32): (Vec<&[f16]>, Vec<&[f32]>) = (
                r16.iter().map(|v| &v[..]).collect(),
                r32.iter().map(|v| &v[..]).collect(),
            );
            let sets = candidates().iter().map(|&t| Simd::Tiles(t));
            for s in sets.chain([Simd::None]) {
                let (mut g16, mut g32) = (vec![0f32; 11 * 9], vec![1f32; 11 * 9]);
                dot_grid_with(s, &q, &a16, &mut g16, 9);
                dot_grid_with(s, &q, &a32, &mut g32, 9);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&g16), bits(&g32), "{s:?} n {n} scores");
                let mut y16: Vec<Vec<f32>> = (0..11).map(|i| varied(n, i + 9)).collect();
                let mut y32 = y16.clone();
                let mut o16: Vec<&mut [f32]> = y16.iter_mut().map(|v| &mut v[..]).collect();
                let mut o32: Vec<&mut [f32]> = y32.iter_mut().map(|v| &mut v[..]).collect();
                axpy_grid_with(s, &g32, 9, &a16, &mut o16);
                axpy_grid_with(s, &g32, 9, &a32, &mut o32);
                for (x, y) in y16.iter().zip(&y32) {
                    assert_eq!(bits(x), bits(y), "{s:?} n {n} sums");
                }
            }
            // The entry points, on the tile set in force.
            for nq in [3, 11] {
                let (mut g16, mut g32) = (vec![0f32; nq * 9], vec![1f32; nq * 9]);
                dot_grid(&q[..nq], &a16, &mut g16, 9);
                dot_grid(&q[..nq], &a32, &mut g32, 9);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&g16), bits(&g32), "{nq} queries, n {n} scores");
                let mut y16: Vec<Vec<f32>> = (0..nq).map(|i| varied(n, i + 9)).collect();
                let mut y32 = y16.clone();
                let mut o16: Vec<&mut [f32]> = y16.iter_mut().map(|v| &mut v[..]).collect();
                let mut o32: Vec<&mut [f32]> = y32.iter_mut().map(|v| &mut v[..]).collect();
                axpy_grid(&g32, 9, &a16, &mut o16);
                axpy_grid(&g32, 9, &a32, &mut o32);
                assert_eq!(y16, y32, "{nq} outputs, n {n} sums");
            }
        }
    }

    #[test]
    fn both_instruction_sets_give_the_same_bits() {
        // The AVX-512VL tiles (6 by 4 scores, wider value strips) against the AVX2 ones
        // (4 by 3) on grids that hit every edge of both; skipped where the CPU lacks
        // AVX-512VL (then only the AVX2 tiles run, and the tests above cover them).
        #[cfg(target_arch = "x86_64")]
        if has_avx512vl() {
            for n in [13, 128, 576] {
                let qs: Vec<Vec<f32>> = (0..17).map(|i| varied(n, i * 31)).collect();
                let rs: Vec<Vec<f32>> = (0..32).map(|j| varied(n, j * 17 + 3)).collect();
                let q: Vec<&[f32]> = qs.iter().map(|v| &v[..]).collect();
                let r: Vec<&[f32]> = rs.iter().map(|v| &v[..]).collect();
                for (nq, nr) in [(17, 32), (5, 7), (11, 30), (1, 1)] {
                    let (mut a, mut b) = (vec![0f32; nq * 32], vec![1f32; nq * 32]);
                    // SAFETY: both instruction sets were detected; the grid fits.
                    unsafe {
                        avx2::dot_grid(&q[..nq], &r[..nr], &mut a, 32);
                        avx512::dot_grid(&q[..nq], &r[..nr], &mut b, 32);
                    }
                    for i in 0..nq {
                        for j in 0..nr {
                            let (x, y) = (a[i * 32 + j], b[i * 32 + j]);
                            assert_eq!(x.to_bits(), y.to_bits(), "n {n} ({i},{j})");
                        }
                    }
                    let w: Vec<f32> = (0..nq * 32).map(|k| (k % 5) as f32 * 0.5 - 1.0).collect();
                    let mut ya: Vec<Vec<f32>> = (0..nq).map(|i| varied(n, i + 9)).collect();
                    let mut yb = ya.clone();
                    let mut ra: Vec<&mut [f32]> = ya.iter_mut().map(|v| &mut v[..]).collect();
                    let mut rb: Vec<&mut [f32]> = yb.iter_mut().map(|v| &mut v[..]).collect();
                    // SAFETY: as above.
                    unsafe {
                        avx2::axpy_grid(&w, 32, &r[..nr], &mut ra);
                        avx512::axpy_grid(&w, 32, &r[..nr], &mut rb);
                    }
                    assert_eq!(ya, yb, "n {n}, {nq} outputs by {nr} rows");
                }
            }
        }
    }
}
