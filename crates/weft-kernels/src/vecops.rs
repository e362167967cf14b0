//! f32 vector primitives (dot, axpy, attention's grids of scores and of value sums,
//! scale) with a run-time AVX2 path: attention and norms run on these, and the binary
//! is not built with target-cpu=native.

use std::sync::OnceLock;

pub(crate) fn has_avx2() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Σ a[i]·b[i].
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { avx2::dot(a, b) };
    }
    dot_scalar(a, b)
}

pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// y[i] += alpha · x[i].
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { avx2::axpy(alpha, x, y) };
    }
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// y[i] += Σ_j w[j] · rows[j][i]: attention's weighted sum of value rows, one block of
/// positions at a time. Each chunk of `y` stays in registers across the rows, so `y` is
/// read and written once per block instead of once per row as `axpy` would.
pub fn axpy_rows(w: &[f32], rows: &[&[f32]], y: &mut [f32]) {
    assert_eq!(w.len(), rows.len());
    assert!(rows.iter().all(|r| r.len() == y.len()));
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time; every row is y.len() long.
        return unsafe { avx2::axpy_rows(w, rows, y) };
    }
    for (&a, r) in w.iter().zip(rows) {
        for (yi, xi) in y.iter_mut().zip(r.iter()) {
            *yi += a * xi;
        }
    }
}

/// out[i · stride + j] = queries[i] · rows[j]: a block of attention scores for a group of
/// queries that read the same cached rows. A pair's arithmetic does not depend on what
/// else is in the grid, so a query's scores are the same bits in any group.
pub fn dot_grid(queries: &[&[f32]], rows: &[&[f32]], out: &mut [f32], stride: usize) {
    if queries.is_empty() || rows.is_empty() {
        return;
    }
    let n = queries[0].len();
    assert!(queries.iter().all(|q| q.len() == n));
    assert!(rows.iter().all(|r| r.len() == n));
    assert!(stride >= rows.len());
    assert!(out.len() >= (queries.len() - 1) * stride + rows.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time; the lengths are checked above.
        return unsafe { avx2::dot_grid(queries, rows, out, stride) };
    }
    for (i, q) in queries.iter().enumerate() {
        for (o, r) in out[i * stride..].iter_mut().zip(rows) {
            *o = dot_scalar(q, r);
        }
    }
}

/// ys[i][e] += Σ_j w[i · stride + j] · rows[j][e]: a block of value rows summed into a
/// group of outputs. Each element takes its rows in order, one fused multiply-add each,
/// as `axpy_rows` does, so an output is the same bits in any group (a weight of zero
/// leaves it as it was).
pub fn axpy_grid(w: &[f32], stride: usize, rows: &[&[f32]], ys: &mut [&mut [f32]]) {
    if ys.is_empty() || rows.is_empty() {
        return;
    }
    let n = ys[0].len();
    assert!(ys.iter().all(|y| y.len() == n));
    assert!(rows.iter().all(|r| r.len() == n));
    assert!(stride >= rows.len());
    assert!(w.len() >= (ys.len() - 1) * stride + rows.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time; the lengths are checked above.
        return unsafe { avx2::axpy_grid(w, stride, rows, ys) };
    }
    for (i, y) in ys.iter_mut().enumerate() {
        axpy_rows(&w[i * stride..i * stride + rows.len()], rows, y);
    }
}

/// s[i] = e^(s[i] - max), returning Σ s[i]: a block of attention scores made weights.
pub fn exp_shifted(s: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { avx2::exp_shifted(s, max) };
    }
    exp_shifted_onto(s, max, 0.0)
}

/// `exp_shifted` one value at a time, its sum added onto `sum` (the AVX2 path's tail).
fn exp_shifted_onto(s: &mut [f32], max: f32, mut sum: f32) -> f32 {
    for v in s {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum
}

/// Asks for every cache line of `x` ahead of its use: attention's next block of cached
/// rows, whose strided rows the hardware prefetchers do not follow.
#[inline]
pub fn prefetch(x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in x.chunks(16) {
        // SAFETY: a prefetch is a hint; the address is inside `x`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// x[i] *= alpha.
pub fn scale(x: &mut [f32], alpha: f32) {
    for v in x {
        *v *= alpha;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// e^x for 8 lanes, Cephes' expf polynomial (about 1 ulp on the range that matters).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.3)),
            _mm256_set1_ps(88.3),
        );
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        // r = x - n ln2, with ln2 split in two so the product is exact.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let r2 = _mm256_mul_ps(r, r);
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
        let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        _mm256_mul_ps(y, pow2n)
    }

    /// Queries a score tile holds: with `GRID_ROWS` rows, 12 accumulators and the tile's
    /// rows fill the 16 registers; each step loads 7 vectors for 12 FMAs, where a dot at a
    /// time loaded 2 for each (scores at long context were bound by the loads).
    const GRID_QUERIES: usize = 4;
    const GRID_ROWS: usize = 3;

    /// `dot_grid` in tiles of 4 queries by 3 rows, smaller tiles at the edges. Every
    /// query and row is `n` long and `out` holds the grid (checked by the caller).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_grid(queries: &[&[f32]], rows: &[&[f32]], out: &mut [f32], stride: usize) {
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
                match (qs.len(), rs.len()) {
                    (4, 3) => grid_tile::<4, 3>(&q, &k, n, o, stride),
                    (4, 2) => grid_tile::<4, 2>(&q, &k, n, o, stride),
                    (4, _) => grid_tile::<4, 1>(&q, &k, n, o, stride),
                    (3, 3) => grid_tile::<3, 3>(&q, &k, n, o, stride),
                    (3, 2) => grid_tile::<3, 2>(&q, &k, n, o, stride),
                    (3, _) => grid_tile::<3, 1>(&q, &k, n, o, stride),
                    (2, 3) => grid_tile::<2, 3>(&q, &k, n, o, stride),
                    (2, 2) => grid_tile::<2, 2>(&q, &k, n, o, stride),
                    (2, _) => grid_tile::<2, 1>(&q, &k, n, o, stride),
                    (_, 3) => grid_tile::<1, 3>(&q, &k, n, o, stride),
                    (_, 2) => grid_tile::<1, 2>(&q, &k, n, o, stride),
                    _ => grid_tile::<1, 1>(&q, &k, n, o, stride),
                }
            }
        }
    }

    /// One tile: `Q` queries by `R` rows, one accumulator a pair over the vectors front
    /// to back, then the pair's own horizontal sum and scalar tail, the same for every
    /// tile shape.
    // A tile's indices address its accumulators, rows and outputs together.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn grid_tile<const Q: usize, const R: usize>(
        q: &[*const f32],
        k: &[*const f32],
        n: usize,
        out: *mut f32,
        stride: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); R]; Q];
        let mut kv = [_mm256_setzero_ps(); R];
        let mut i = 0;
        while i + 8 <= n {
            for r in 0..R {
                kv[r] = _mm256_loadu_ps(k[r].add(i));
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
                    s += *q[a].add(t) * *k[r].add(t);
                }
                *out.add(a * stride + r) = s;
            }
        }
    }

    /// Outputs a value tile holds at most. A tile keeps about 12 accumulators: 4 outputs
    /// by 3 vectors, 3 by 4, 2 by 6, or 1 by 8 (as `axpy_rows`); each row then costs a
    /// load a vector and a broadcast an output for 12 FMAs, where an output at a time
    /// loaded a vector for each FMA.
    const SUM_QUERIES: usize = 4;

    /// `axpy_grid` in tiles of up to 4 outputs, a strip of vectors at a time along the
    /// row, and the elements past the last vector one at a time as `axpy_rows` does.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_grid(w: &[f32], stride: usize, rows: &[&[f32]], ys: &mut [&mut [f32]]) {
        let n = ys[0].len();
        let pw = w.as_ptr();
        for (yi, yt) in ys.chunks_mut(SUM_QUERIES).enumerate() {
            let mut y = [std::ptr::null_mut(); SUM_QUERIES];
            for (p, s) in y.iter_mut().zip(yt.iter_mut()) {
                *p = s.as_mut_ptr();
            }
            let wt = pw.add(yi * SUM_QUERIES * stride);
            let e = match yt.len() {
                4 => sum_strip::<4, 3>(&y, wt, stride, rows, n),
                3 => sum_strip::<3, 4>(&y, wt, stride, rows, n),
                2 => sum_strip::<2, 6>(&y, wt, stride, rows, n),
                _ => sum_strip::<1, 8>(&y, wt, stride, rows, n),
            };
            for (a, &py) in y[..yt.len()].iter().enumerate() {
                for t in e..n {
                    for (j, r) in rows.iter().enumerate() {
                        *py.add(t) += *wt.add(a * stride + j) * r[t];
                    }
                }
            }
        }
    }

    /// `Q` outputs along the row in tiles of `V` vectors, the rest in tiles of 4, 2 and 1
    /// (a head of 128 by 2 outputs: 6, 6, 4); returns where the whole vectors end.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sum_strip<const Q: usize, const V: usize>(
        y: &[*mut f32],
        w: *const f32,
        stride: usize,
        rows: &[&[f32]],
        n: usize,
    ) -> usize {
        let mut e = 0;
        while e + 8 * V <= n {
            sum_tile::<Q, V>(y, w, stride, rows, e);
            e += 8 * V;
        }
        if V > 4 && e + 32 <= n {
            sum_tile::<Q, 4>(y, w, stride, rows, e);
            e += 32;
        }
        if V > 2 && e + 16 <= n {
            sum_tile::<Q, 2>(y, w, stride, rows, e);
            e += 16;
        }
        while e + 8 <= n {
            sum_tile::<Q, 1>(y, w, stride, rows, e);
            e += 8;
        }
        e
    }

    /// One tile: `Q` outputs by `V` vectors from element `e`, every row in order.
    // A tile's indices address its accumulators, rows and outputs together.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sum_tile<const Q: usize, const V: usize>(
        y: &[*mut f32],
        w: *const f32,
        stride: usize,
        rows: &[&[f32]],
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
                let rv = _mm256_loadu_ps(pr.add(8 * v));
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
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// s[i] = e^(s[i] - max), returning their sum.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted(s: &mut [f32], max: f32) -> f32 {
        let n = s.len();
        let p = s.as_mut_ptr();
        let m = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m));
            _mm256_storeu_ps(p.add(i), e);
            acc = _mm256_add_ps(acc, e);
            i += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        super::exp_shifted_onto(&mut s[i..], max, lanes.iter().sum())
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8)),
                _mm256_loadu_ps(pb.add(i + 8)),
                acc1,
            );
            i += 16;
        }
        while i + 8 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            i += 8;
        }
        let acc = _mm256_add_ps(acc0, acc1);
        let lo = _mm256_castps256_ps128(acc);
        let hi = _mm256_extractf128_ps(acc, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        let mut r = _mm_cvtss_f32(s);
        while i < n {
            r += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        r
    }

    /// `rows` must each be `y.len()` long (checked by the caller).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_rows(w: &[f32], rows: &[&[f32]], y: &mut [f32]) {
        let n = y.len();
        let py = y.as_mut_ptr();
        let mut i = 0;
        // Eight accumulators a row: eight independent FMA chains keep both FMA units
        // busy, where four waited out the FMA latency (attention's value rows, 128 wide).
        while i + 64 <= n {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(py.add(i + 8 * k));
            }
            for (&wj, r) in w.iter().zip(rows) {
                let (va, pr) = (_mm256_set1_ps(wj), r.as_ptr().add(i));
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(va, _mm256_loadu_ps(pr.add(8 * k)), *a);
                }
            }
            for (k, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(py.add(i + 8 * k), *a);
            }
            i += 64;
        }
        while i + 32 <= n {
            let mut a0 = _mm256_loadu_ps(py.add(i));
            let mut a1 = _mm256_loadu_ps(py.add(i + 8));
            let mut a2 = _mm256_loadu_ps(py.add(i + 16));
            let mut a3 = _mm256_loadu_ps(py.add(i + 24));
            for (&wj, r) in w.iter().zip(rows) {
                let (va, pr) = (_mm256_set1_ps(wj), r.as_ptr().add(i));
                a0 = _mm256_fmadd_ps(va, _mm256_loadu_ps(pr), a0);
                a1 = _mm256_fmadd_ps(va, _mm256_loadu_ps(pr.add(8)), a1);
                a2 = _mm256_fmadd_ps(va, _mm256_loadu_ps(pr.add(16)), a2);
                a3 = _mm256_fmadd_ps(va, _mm256_loadu_ps(pr.add(24)), a3);
            }
            _mm256_storeu_ps(py.add(i), a0);
            _mm256_storeu_ps(py.add(i + 8), a1);
            _mm256_storeu_ps(py.add(i + 16), a2);
            _mm256_storeu_ps(py.add(i + 24), a3);
            i += 32;
        }
        while i + 8 <= n {
            let mut a0 = _mm256_loadu_ps(py.add(i));
            for (&wj, r) in w.iter().zip(rows) {
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(wj), _mm256_loadu_ps(r.as_ptr().add(i)), a0);
            }
            _mm256_storeu_ps(py.add(i), a0);
            i += 8;
        }
        while i < n {
            for (&wj, r) in w.iter().zip(rows) {
                *py.add(i) += wj * r[i];
            }
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let va = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            let r = _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
            _mm256_storeu_ps(py.add(i), r);
            i += 8;
        }
        while i < n {
            *py.add(i) += alpha * *px.add(i);
            i += 1;
        }
    }
}

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
    fn a_value_grid_gives_each_output_the_bits_of_axpy_rows() {
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
                    axpy_rows(&w[i * stride..i * stride + nr], &r[..nr], y);
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
    fn simd_matches_scalar() {
        for n in [1, 7, 8, 15, 16, 33, 256, 1000] {
            let a: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25)
                .collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.5).collect();
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - exact).abs() < 1e-3, "n={n}");
            let mut y = b.clone();
            axpy(2.0, &a, &mut y);
            for i in 0..n {
                assert!((y[i] - (b[i] + 2.0 * a[i])).abs() < 1e-6);
            }
            // Weights from scores: e^(s - max) and their sum.
            let mut w = a.clone();
            let max = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let total = exp_shifted(&mut w, max);
            let mut want_total = 0f64;
            for (got, s) in w.iter().zip(&a) {
                let want = ((*s - max) as f64).exp();
                want_total += want;
                assert!(
                    (*got as f64 - want).abs() < 1e-6 * want.max(1.0),
                    "{got} vs {want}"
                );
            }
            assert!(
                (total as f64 - want_total).abs() < 1e-5 * want_total,
                "n={n}"
            );
            // Rows against the one-row-at-a-time sum, for 0, 1 and several rows.
            let rows: Vec<Vec<f32>> = (0..5)
                .map(|r| a.iter().map(|v| v * (r as f32 - 1.5)).collect())
                .collect();
            let w = [0.5f32, -1.0, 0.25, 2.0, 0.125];
            for k in [0, 1, 5] {
                let refs: Vec<&[f32]> = rows[..k].iter().map(|r| &r[..]).collect();
                let mut got = b.clone();
                axpy_rows(&w[..k], &refs, &mut got);
                let mut want = b.clone();
                for (j, r) in rows[..k].iter().enumerate() {
                    for i in 0..n {
                        want[i] += w[j] * r[i];
                    }
                }
                for i in 0..n {
                    assert!((got[i] - want[i]).abs() < 1e-5, "n={n} k={k} i={i}");
                }
            }
        }
    }
}
