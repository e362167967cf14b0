//! Causal attention of one query head over a layer's cached positions: GQA reads a
//! key and a value row per position, MLA reads the latent row as both.

use std::ops::Range;

use weft_kernels::grid::{self, Cached};
use weft_kernels::{vecops, ThreadPool};

use crate::kv::{CacheRows, KvCache, LayerKv};
use crate::rows::SendPtr;

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

/// Most queries one `attend_group` call takes: its per-query state lives on the stack.
pub(crate) const GROUP_MAX: usize = 64;

/// Positions a block of cached rows spans. Blocks are cut at multiples of `BLOCK` of
/// the absolute position, so a query's arithmetic is the same whatever other queries
/// share its pass: a batched token gives the same bits as the token alone.
const BLOCK: usize = 32;

/// How many blocks ahead the cached rows are asked for. Value rows are summed a slice of
/// every row at a time, a pattern the hardware prefetchers do not follow, and one core
/// keeps too few misses in flight to hide the memory's latency: decode at long context
/// waited on it (at 4,096 tokens, 2 threads: 18.7 tok/s without, 21-23 with).
const PREFETCH_BLOCKS: usize = 4;

/// One query head of one token: its query vector, the cached positions it attends to,
/// and where its output goes (`view.value.1` values).
pub(crate) struct Query<'a> {
    pub q: &'a [f32],
    pub span: Range<usize>,
    pub out: &'a mut [f32],
}

impl Query<'_> {
    fn empty() -> Self {
        Query {
            q: &[],
            span: 0..0,
            out: &mut [],
        }
    }
}

/// Causal attention of one query head over cached positions `span` (a group of one).
#[cfg(test)]
pub(crate) fn attend(q: &[f32], kv: &LayerKv, view: HeadView, span: Range<usize>, out: &mut [f32]) {
    attend_group(&mut [Query { q, span, out }], kv, view);
}

/// Causal attention of up to `GROUP_MAX` queries that read the same KV head: the query
/// heads of a GQA group (or all heads of MLA's latent) for a run of tokens. Each block
/// of cached key and value rows is read from memory once for the whole group and stays
/// in cache while every query uses it; one query at a time, a long context streamed its
/// cache once per query head (decode at 4,096 tokens of context fell to 0.7x
/// llama.cpp). Per query, an online softmax over the blocks: the group's scores of a
/// block are one grid on the stack (`dot_grid`, several queries a key load), each output
/// is rescaled at most once a block, and the block's value rows are summed into the
/// group's outputs in one pass (`axpy_grid`, several outputs a value load). The tiles
/// took MLA prefill of 512 tokens after 4,096 from 50 to 80 tok/s (2 threads, Zen 4):
/// a query at a time, scores loaded two vectors an FMA and waited on the loads.
pub(crate) fn attend_group(queries: &mut [Query<'_>], kv: &LayerKv, view: HeadView) {
    let (values, v_stride) = kv.values();
    match (&kv.k, values) {
        (CacheRows::F32(k), CacheRows::F32(v)) => attend_in(queries, kv, k, (v, v_stride), view),
        (CacheRows::F16(k), CacheRows::F16(v)) => attend_in(queries, kv, k, (v, v_stride), view),
        // `KvCache::new` gives a layer's keys and values one type.
        _ => unreachable!("a layer's keys and values differ in type"),
    }
}

/// `attend_group` over keys `k` and values in the cache's stored type.
fn attend_in<T: Cached>(
    queries: &mut [Query<'_>],
    kv: &LayerKv,
    k: &[T],
    (values, v_stride): (&[T], usize),
    view: HeadView,
) {
    assert!(queries.len() <= GROUP_MAX, "{} queries", queries.len());
    let ((k_off, dk), (v_off, dv)) = (view.key, view.value);
    let mut max = [f32::NEG_INFINITY; GROUP_MAX];
    let mut sum = [0f32; GROUP_MAX];
    let (mut lo, mut hi) = (usize::MAX, 0);
    for qy in queries.iter_mut() {
        qy.out[..dv].iter_mut().for_each(|v| *v = 0.0);
        if !qy.span.is_empty() {
            lo = lo.min(qy.span.start);
            hi = hi.max(qy.span.end);
        }
    }
    let mut scores = [[0f32; BLOCK]; GROUP_MAX];
    let mut keys: [&[T]; BLOCK] = [&[]; BLOCK];
    let mut rows: [&[T]; BLOCK] = [&[]; BLOCK];
    let mut at = lo;
    while at < hi {
        let end = ((at / BLOCK + 1) * BLOCK).min(hi);
        for (j, pos) in (at..end).enumerate() {
            let slot = kv.slot(pos);
            let s = slot * kv.stride + k_off;
            keys[j] = &k[s..s + dk];
            let s = slot * v_stride + v_off;
            rows[j] = &values[s..s + dv];
        }
        // Rows a few blocks ahead, while this one is worked on.
        let ahead = end + BLOCK * PREFETCH_BLOCKS;
        for pos in ahead..(ahead + BLOCK).min(hi) {
            let slot = kv.slot(pos);
            let s = slot * kv.stride + k_off;
            vecops::prefetch(&k[s..s + dk]);
            let s = slot * v_stride + v_off;
            vecops::prefetch(&values[s..s + dv]);
        }
        // Every query's scores first, then every query's sum of value rows: each phase
        // keeps one block of keys, or of values, in cache for the whole group (in L1
        // for rows of up to 128 values). The scores come as one grid over the rows any
        // query of the group reads (`first..last`), its rows indexed from `first`.
        let mut active = [0usize; GROUP_MAX];
        let (mut n, mut first, mut last) = (0, end, at);
        {
            let mut qs: [&[f32]; GROUP_MAX] = [&[]; GROUP_MAX];
            for (i, qy) in queries.iter().enumerate() {
                let (a, b) = (qy.span.start.max(at), qy.span.end.min(end));
                if a < b {
                    (active[n], qs[n]) = (i, &qy.q[..dk]);
                    n += 1;
                    (first, last) = (first.min(a), last.max(b));
                }
            }
            if n > 0 {
                grid::dot_grid(
                    &qs[..n],
                    &keys[first - at..last - at],
                    scores.as_flattened_mut(),
                    BLOCK,
                );
            }
        }
        for (&i, row) in active[..n].iter().zip(&mut scores) {
            let qy = &mut queries[i];
            let (a, b) = (qy.span.start.max(at), qy.span.end.min(end));
            let block = &mut row[a - first..b - first];
            let block_max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let out = &mut qy.out[..dv];
            if block_max > max[i] {
                let c = (max[i] - block_max).exp();
                vecops::scale(out, c);
                sum[i] *= c;
                max[i] = block_max;
            }
            sum[i] += vecops::exp_shifted(block, max[i]);
            // Rows of the grid this query does not read weigh nothing.
            row[..a - first].fill(0.0);
            row[b - first..last - first].fill(0.0);
        }
        if n > 0 {
            let mut outs: [&mut [f32]; GROUP_MAX] = std::array::from_fn(|_| Default::default());
            let mut k = 0;
            for (i, qy) in queries.iter_mut().enumerate() {
                if k < n && active[k] == i {
                    outs[k] = &mut qy.out[..dv];
                    k += 1;
                }
            }
            grid::axpy_grid(
                scores.as_flattened(),
                BLOCK,
                &rows[first - at..last - at],
                &mut outs[..n],
            );
        }
        at = end;
    }
    for (i, qy) in queries.iter_mut().enumerate() {
        if sum[i] > 0.0 {
            vecops::scale(&mut qy.out[..dv], 1.0 / sum[i]);
        }
    }
}

/// How a shard's query heads share its KV heads: local query head `h` attends with local
/// KV head `(h + skew) / group` (`skew`: the shard's first head's place in its group).
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadGroups {
    pub heads: usize,
    pub group: usize,
    pub skew: usize,
}

impl HeadGroups {
    fn kv_heads(&self) -> usize {
        (self.heads + self.skew).div_ceil(self.group)
    }

    /// Local query heads that read local KV head `r`.
    fn of(&self, r: usize) -> Range<usize> {
        let lo = (r * self.group).saturating_sub(self.skew);
        let hi = ((r + 1) * self.group - self.skew).min(self.heads);
        lo..hi
    }
}

/// A micro-batch's rows as attention sees them: each row's position and cache, and the
/// layer's sliding window.
pub(crate) struct BatchRows<'a> {
    pub pos: &'a [usize],
    pub seq: &'a [usize],
    pub caches: &'a [KvCache],
    pub layer: usize,
    pub window: Option<usize>,
}

/// A buffer of per-(row, head) vectors: row `t`, head `h` starts at `t * row + h * head`.
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    pub row: usize,
    pub head: usize,
}

/// Attention of every (row, local query head) of a micro-batch: `q` holds the queries,
/// `out` receives the outputs, KV head `r` is read through `view(r)`. Tasks take one
/// KV head, a part of its query heads and a run of rows, so each reads the cache rows
/// once for up to `GROUP_MAX` queries; the query heads are split across tasks only
/// where there are fewer tasks than threads (a decode step).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_rows(
    pool: &ThreadPool,
    rows: &BatchRows<'_>,
    heads: HeadGroups,
    view: &(dyn Fn(usize) -> HeadView + Sync),
    q: &[f32],
    q_at: Strided,
    out: &mut [f32],
    out_at: Strided,
) {
    let m = rows.pos.len();
    let nkv = heads.kv_heads();
    let group = heads.group.max(1);
    let mut parts = group.div_ceil(GROUP_MAX);
    let mut per_part = group.div_ceil(parts);
    let per_task_rows = (GROUP_MAX / per_part).max(1);
    let row_runs = m.div_ceil(per_task_rows);
    let threads = pool.n_threads();
    if row_runs * nkv * parts < threads {
        parts = threads.div_ceil(row_runs * nkv).clamp(parts, group);
        per_part = group.div_ceil(parts);
    }
    let out_len = out.len();
    let out_ptr = SendPtr::new(out.as_mut_ptr());
    pool.run(row_runs * nkv * parts, &|task| {
        let part = task % parts;
        let r = task / parts % nkv;
        // The last rows first: in a prompt they attend to the most positions.
        let run = row_runs - 1 - task / (parts * nkv);
        let hs = heads.of(r);
        let hs = (hs.start + part * per_part).min(hs.end)
            ..(hs.start + (part + 1) * per_part).min(hs.end);
        let head = view(r);
        let (dk, dv) = (head.key.1, head.value.1);
        let mut t = run * per_task_rows;
        let last = ((run + 1) * per_task_rows).min(m);
        while t < last && !hs.is_empty() {
            // A group reads one cache: the rows of one sequence.
            let seq = rows.seq[t];
            let mut queries: [Query<'_>; GROUP_MAX] = std::array::from_fn(|_| Query::empty());
            let mut n = 0;
            while t < last && rows.seq[t] == seq {
                let pos = rows.pos[t];
                let first = rows.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                for h in hs.clone() {
                    let o = t * out_at.row + h * out_at.head;
                    assert!(o + dv <= out_len);
                    let qo = t * q_at.row + h * q_at.head;
                    queries[n] = Query {
                        q: &q[qo..qo + dk],
                        span: first..pos + 1,
                        // SAFETY: each (row, head) is one task's, and its `dv` values
                        // lie inside `out` (checked above) apart from every other's.
                        out: unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(o), dv) },
                    };
                    n += 1;
                }
                t += 1;
            }
            attend_group(
                &mut queries[..n],
                &rows.caches[seq].layers[rows.layer],
                head,
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two-pass softmax attention in f64: the plain definition `attend` must match.
    fn reference(q: &[f32], kv: &LayerKv, off: usize, hd: usize, span: Range<usize>) -> Vec<f64> {
        let row = |buf: &CacheRows, pos: usize| {
            let s = kv.slot(pos) * kv.stride + off;
            assert_eq!(kv.stride, kv.v_stride);
            (s..s + hd).map(|i| buf.get(i) as f64).collect::<Vec<f64>>()
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
            k: CacheRows::F32((0..cap * stride).map(|i| val(i, 2.0)).collect()),
            v: CacheRows::F32((0..cap * stride).map(|i| val(i + 5, 1.0)).collect()),
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
            let CacheRows::F32(keys) = &mut kv.k else {
                unreachable!("an f32 cache")
            };
            for (k, qi) in keys[s..s + hd].iter_mut().zip(&q) {
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
    fn an_f16_cache_is_the_f32_cache_of_its_rounded_values() {
        // The same rows stored as f16, and as f32 holding the f16-rounded values: the
        // same bits out, for GQA rows and for an MLA latent read as keys and values,
        // over spans inside a block, across blocks and wrapping the ring; and near the
        // unrounded cache, as f16's 11-bit mantissa allows.
        use half::f16;
        let (hd, heads, cap) = (40, 2, 50);
        let exact = cache(hd, heads, cap, 3);
        let rounded = |r: &CacheRows| -> (CacheRows, CacheRows) {
            let v: Vec<f16> = (0..r.len()).map(|i| f16::from_f32(r.get(i))).collect();
            let w: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
            (CacheRows::F16(v), CacheRows::F32(w))
        };
        let ((k16, k32), (v16, v32)) = (rounded(&exact.k), rounded(&exact.v));
        let layer = |k, v, v_stride| LayerKv {
            cap,
            k,
            v,
            stride: hd * heads,
            v_stride,
        };
        let half = layer(k16, v16, hd * heads);
        let widened = layer(k32, v32, hd * heads);
        let q: Vec<f32> = (0..hd)
            .map(|i| ((i * 37 % 17) as f32 / 17.0 - 0.5) * 1.5)
            .collect();
        let (mut a, mut b, mut c) = (vec![0f32; hd], vec![0f32; hd], vec![0f32; hd]);
        for span in [0..1, 0..31, 0..33, 3..50, 30..95] {
            for off in [0, hd] {
                let view = HeadView::gqa(off, hd);
                attend(&q, &half, view, span.clone(), &mut a);
                attend(&q, &widened, view, span.clone(), &mut b);
                attend(&q, &exact, view, span.clone(), &mut c);
                assert_eq!(a, b, "{span:?} off {off}");
                for (x, y) in a.iter().zip(&c) {
                    assert!((x - y).abs() < 2e-3, "{span:?} off {off}: {x} vs {y}");
                }
            }
        }
        // MLA: the latent rows are the keys and, their first values, the values.
        let (dk, dv) = (2 * hd, hd);
        let (l16, l32) = rounded(&exact.k);
        let latent = |k| LayerKv {
            cap,
            k,
            v: CacheRows::F32(Vec::new()),
            stride: dk,
            v_stride: 0,
        };
        let view = HeadView {
            key: (0, dk),
            value: (0, dv),
        };
        let q: Vec<f32> = (0..dk).map(|i| (i * 29 % 13) as f32 / 13.0 - 0.5).collect();
        let (mut a, mut b) = (vec![0f32; dv], vec![0f32; dv]);
        let half = LayerKv {
            v: CacheRows::F16(Vec::new()),
            ..latent(l16)
        };
        attend(&q, &half, view, 0..cap, &mut a);
        attend(&q, &latent(l32), view, 0..cap, &mut b);
        assert_eq!(a, b);
        assert!(a.iter().any(|&x| x != 0.0));
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
            k: CacheRows::F32(k.clone()),
            v: CacheRows::F32(Vec::new()),
            stride: dk,
            v_stride: 0,
        };
        let split = LayerKv {
            cap,
            v: CacheRows::F32(
                (0..cap)
                    .flat_map(|s| k[s * dk..s * dk + dv].to_vec())
                    .collect(),
            ),
            k: CacheRows::F32(k),
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

    /// A cache of `heads` KV heads of `hd` values in a ring of `cap` slots.
    fn cache(hd: usize, heads: usize, cap: usize, seed: usize) -> LayerKv {
        let stride = hd * heads;
        let val = |i: usize, s: f32| (((i + seed) * 7919 % 113) as f32 / 113.0 - 0.5) * s;
        LayerKv {
            cap,
            k: CacheRows::F32((0..cap * stride).map(|i| val(i, 2.0)).collect()),
            v: CacheRows::F32((0..cap * stride).map(|i| val(i + 5, 1.0)).collect()),
            stride,
            v_stride: stride,
        }
    }

    #[test]
    fn a_query_gets_the_same_bits_in_a_group_as_alone() {
        // Seven queries of one KV head with spans that start and end in different
        // blocks, one empty, one wrapping the ring: grouped or alone, the same bits.
        for hd in [40, 128] {
            let kv = cache(hd, 2, 70, hd);
            let spans = [0..1, 0..17, 3..48, 30..95, 5..5, 16..32, 60..70];
            let qs: Vec<Vec<f32>> = (0..spans.len())
                .map(|i| {
                    (0..hd)
                        .map(|j| ((i * 31 + j * 7) % 19) as f32 / 19.0 - 0.5)
                        .collect()
                })
                .collect();
            let mut alone = vec![vec![0f32; hd]; spans.len()];
            for ((q, span), out) in qs.iter().zip(&spans).zip(&mut alone) {
                attend(q, &kv, HeadView::gqa(hd, hd), span.clone(), out);
            }
            let mut grouped = vec![vec![1f32; hd]; spans.len()];
            let mut group: Vec<Query> = qs
                .iter()
                .zip(&spans)
                .zip(&mut grouped)
                .map(|((q, span), out)| Query {
                    q,
                    span: span.clone(),
                    out,
                })
                .collect();
            attend_group(&mut group, &kv, HeadView::gqa(hd, hd));
            assert_eq!(grouped, alone, "hd {hd}");
            assert!(
                alone[4].iter().all(|&v| v == 0.0),
                "an empty span gives zeros"
            );
            let want = reference(&qs[3], &kv, hd, hd, spans[3].clone());
            for (g, w) in alone[3].iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 1e-5, "{g} vs {w}");
            }
        }
    }

    #[test]
    fn batched_rows_match_each_row_and_head_alone() {
        // Two sequences; six local query heads in groups of three, the shard starting
        // one head into a group (three local KV heads); global and sliding layers; one
        // thread and three (where decode splits a group's heads across tasks).
        let (hd, group, skew, nh): (usize, usize, usize, usize) = (32, 3, 1, 6);
        let kv_heads = (nh + skew).div_ceil(group);
        let caches: Vec<KvCache> = (0..2)
            .map(|s| KvCache {
                layers: vec![cache(hd, kv_heads, 40, s * 3)],
                pos: 0,
                n_ctx: 40,
            })
            .collect();
        let heads = HeadGroups {
            heads: nh,
            group,
            skew,
        };
        let view = |r: usize| HeadView::gqa(r * hd, hd);
        let q_at = Strided {
            row: nh * hd,
            head: hd,
        };
        for (pos, seq) in [
            (vec![20usize], vec![1usize]),
            (vec![3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], vec![0; 12]),
            (vec![7, 8, 9, 30, 31], vec![0, 0, 0, 1, 1]),
        ] {
            let m = pos.len();
            let q: Vec<f32> = (0..m * nh * hd)
                .map(|i| ((i * 13) % 29) as f32 / 29.0 - 0.5)
                .collect();
            for window in [None, Some(5)] {
                let mut want = vec![0f32; m * nh * hd];
                for t in 0..m {
                    let first = window.map_or(0, |w: usize| (pos[t] + 1).saturating_sub(w));
                    for h in 0..nh {
                        let at = t * nh * hd + h * hd;
                        attend(
                            &q[at..at + hd],
                            &caches[seq[t]].layers[0],
                            view((h + skew) / group),
                            first..pos[t] + 1,
                            &mut want[at..at + hd],
                        );
                    }
                }
                for threads in [1, 3] {
                    let pool = ThreadPool::new(threads);
                    let rows = BatchRows {
                        pos: &pos,
                        seq: &seq,
                        caches: &caches,
                        layer: 0,
                        window,
                    };
                    let mut got = vec![f32::NAN; m * nh * hd];
                    attend_rows(&pool, &rows, heads, &view, &q, q_at, &mut got, q_at);
                    assert_eq!(
                        got, want,
                        "rows {pos:?}, window {window:?}, {threads} threads"
                    );
                }
            }
        }
    }

    #[test]
    fn more_heads_than_a_group_holds_are_split_and_match_each_head_alone() {
        // MLA as DeepSeek V3 runs it on one node: 128 heads read one latent (a group
        // past GROUP_MAX, cut into parts), 72-value keys whose first 64 are the values;
        // decode and a run of prompt rows, one thread and two.
        let (dk, dv, nh, cap) = (72, 64, 128, 48);
        let val = |i: usize| ((i * 7919 % 113) as f32 / 113.0 - 0.5) * 2.0;
        let caches = vec![KvCache {
            layers: vec![LayerKv {
                cap,
                k: CacheRows::F32((0..cap * dk).map(val).collect()),
                v: CacheRows::F32(Vec::new()),
                stride: dk,
                v_stride: 0,
            }],
            pos: 0,
            n_ctx: cap,
        }];
        let view = |_: usize| HeadView {
            key: (0, dk),
            value: (0, dv),
        };
        let heads = HeadGroups {
            heads: nh,
            group: nh,
            skew: 0,
        };
        let (q_at, out_at) = (
            Strided {
                row: nh * dk,
                head: dk,
            },
            Strided {
                row: nh * dv,
                head: dv,
            },
        );
        for pos in [vec![40usize], vec![30, 31, 32, 33, 34]] {
            let m = pos.len();
            let seq = vec![0; m];
            let q: Vec<f32> = (0..m * nh * dk).map(|i| val(i * 3 + 1)).collect();
            let mut want = vec![0f32; m * nh * dv];
            for (t, &p) in pos.iter().enumerate() {
                for h in 0..nh {
                    let (qa, oa) = (t * nh * dk + h * dk, t * nh * dv + h * dv);
                    attend(
                        &q[qa..qa + dk],
                        &caches[0].layers[0],
                        view(0),
                        0..p + 1,
                        &mut want[oa..oa + dv],
                    );
                }
            }
            for threads in [1, 2] {
                let rows = BatchRows {
                    pos: &pos,
                    seq: &seq,
                    caches: &caches,
                    layer: 0,
                    window: None,
                };
                let mut got = vec![f32::NAN; m * nh * dv];
                attend_rows(
                    &ThreadPool::new(threads),
                    &rows,
                    heads,
                    &view,
                    &q,
                    q_at,
                    &mut got,
                    out_at,
                );
                assert_eq!(got, want, "rows {pos:?}, {threads} threads");
            }
        }
    }
}
