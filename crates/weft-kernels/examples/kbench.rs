//! Single-thread benchmark of the quant kernels on the shapes of Gemma 3 270M Q4_K_M:
//! matvec (decode) in GB/s of weight bytes and ns/row, matmul with 64 tokens (prefill) in
//! GFLOP/s-equivalent (2 * n * rows * m / time). Run with
//! `cargo run -p weft-kernels --release --example kbench [-- --quick]`.
//!
//! "hot" repeats one matrix (cache resident when small); "cold" cycles through copies
//! totalling more than L3, as decode does walking all layers; "dram" is the 178 MB head,
//! once in ordinary 4 KiB pages and once in 2 MiB pages (madvise(MADV_HUGEPAGE)).

use std::hint::black_box;
use std::time::Instant;
use weft_gguf::GgmlType;
use weft_kernels::quant;

/// Deterministic pseudo-random values (xorshift64*), roughly normal.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| self.uniform() + self.uniform() + self.uniform())
            .collect()
    }
}

/// A rows x n weight matrix: `distinct` really quantized rows, repeated to fill it (the
/// kernels' speed does not depend on the values; quantizing 168M values would).
fn matrix(rng: &mut Rng, ty: GgmlType, n: usize, rows: usize, distinct: usize) -> Vec<u8> {
    let rb = n / ty.block_size() * ty.type_size();
    let seed: Vec<u8> = (0..distinct.min(rows))
        .flat_map(|_| quant::quantize_row(ty, &rng.values(n)))
        .collect();
    let mut out = Vec::with_capacity(rows * rb);
    while out.len() < rows * rb {
        let take = (rows * rb - out.len()).min(seed.len());
        out.extend_from_slice(&seed[..take]);
    }
    out
}

/// Median seconds of `reps` runs of `f`.
fn median_secs(reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm up (page faults, caches)
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}

/// Plain read bandwidth of one thread over `bytes` (`roofline::read_bandwidth`, in the
/// pages the loaded weights get), for scale.
fn read_bandwidth(bytes: usize) -> f64 {
    weft_kernels::roofline::read_bandwidth(&weft_kernels::ThreadPool::new(1), bytes, 5) / 1e9
}

fn bench_matvec(rng: &mut Rng, ty: GgmlType, n: usize, rows: usize, reps: usize) {
    let rb = n / ty.block_size() * ty.type_size();
    let first = matrix(rng, ty, n, rows, 512);
    let mut act = vec![0u8; quant::act_bytes(ty, n)];
    quant::quantize_act(ty, &rng.values(n), &mut act);
    let mut out = vec![0.0f32; rows];
    let report = |what: &str, secs: f64| {
        println!(
            "matvec {:<5} n={:<5} rows={:<7} {what:<5} {:8.1} us  {:6.2} GB/s  {:7.2} ns/row",
            ty.name(),
            n,
            rows,
            secs * 1e6,
            (rows * rb) as f64 / secs / 1e9,
            secs * 1e9 / rows as f64
        );
    };
    let mut run = |w: &[u8]| {
        quant::matvec(ty, n, w, 0..rows, &act, &mut out);
        black_box(&out);
    };
    if rows * rb > 64 << 20 {
        report("dram", median_secs(reps, || run(&first)));
        let mut huge = weft_kernels::pages::HugeBuf::zeroed(first.len()).expect("mmap");
        huge.copy_from_slice(&first);
        let got = std::fs::read_to_string("/proc/self/smaps_rollup")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("AnonHugePages:"))
                    .map(|l| l.split_whitespace().nth(1).unwrap_or("?").to_string())
            })
            .unwrap_or_else(|| "?".into());
        println!(
            "  (2 MiB pages in use: {got} kB of {} kB)",
            huge.len() / 1024
        );
        report("huge", median_secs(reps, || run(&huge)));
        return;
    }
    report("hot", median_secs(reps, || run(&first)));
    let copies = ((96 << 20) / (rows * rb)).max(2);
    let mats: Vec<Vec<u8>> = (0..copies).map(|_| first.clone()).collect();
    let mut i = 0;
    let cold = median_secs(reps.max(copies), || {
        i = (i + 1) % copies;
        run(&mats[i]);
    });
    report("cold", cold);
    if quant::packs(ty, n) {
        let packed: Vec<Vec<u8>> = mats
            .iter()
            .map(|m| quant::pack_rows(ty, n, m, rows))
            .collect();
        let hot = median_secs(reps, || {
            quant::matvec_packed(ty, n, &packed[0], 0..rows, &act, &mut out);
            black_box(&out);
        });
        report("hot-interleaved", hot);
        // Cold, with software prefetch and without (the choice `weft bench --kernels`
        // times; the bits are the same).
        for (prefetch, what) in [(true, "cold-interleaved"), (false, "cold-interleaved-nopf")] {
            let mut i = 0;
            let cold = median_secs(reps.max(copies), || {
                i = (i + 1) % copies;
                quant::matmul_packed_on(
                    prefetch,
                    ty,
                    n,
                    &packed[i],
                    0..rows,
                    &act,
                    1,
                    &mut out,
                    rows,
                );
                black_box(&out);
            });
            report(what, cold);
        }
    }
}

fn bench_matmul(rng: &mut Rng, ty: GgmlType, n: usize, rows: usize, m: usize, reps: usize) {
    let w = matrix(rng, ty, n, rows, rows);
    let ab = quant::act_bytes(ty, n);
    let mut acts = vec![0u8; m * ab];
    for t in 0..m {
        quant::quantize_act(ty, &rng.values(n), &mut acts[t * ab..(t + 1) * ab]);
    }
    let mut out = vec![0.0f32; m * rows];
    let secs = median_secs(reps, || {
        quant::matmul(ty, n, &w, 0..rows, &acts, m, &mut out, rows);
        black_box(&out);
    });
    let flops = 2.0 * (n * rows * m) as f64;
    let line = |layout: &str, secs: f64| {
        println!(
            "matmul {:<5} n={:<5} rows={:<7} m={m:<3} {layout:<11} {:8.1} us  {:6.1} GFLOP/s  ({:.2} ns per row x token)",
            ty.name(),
            n,
            rows,
            secs * 1e6,
            flops / secs / 1e9,
            secs * 1e9 / (rows * m) as f64
        )
    };
    line("rows", secs);
    if quant::packs(ty, n) {
        let packed = quant::pack_rows(ty, n, &w, rows);
        let secs = median_secs(reps, || {
            quant::matmul_packed(ty, n, &packed, 0..rows, &acts, m, &mut out, rows);
            black_box(&out);
        });
        line("interleaved", secs);
    }
}

/// Decode's access pattern on a dense 1.3 B Q4_K_M stack (Qwen3-shaped: 28 layers of
/// q, k, v, o, gate, up, down at embedding 1536 and FFN 8960, Q6_K for v and down):
/// every layer's matrices interleaved (in 2 MiB pages, as a loader keeps them), one
/// matvec each in model order. Per round, GB/s of
/// weight bytes with the interleaved prefetch off and on, beside a plain read of 512 MiB;
/// then each shape alone over its 28 copies, and long rows against short rows of the
/// same bytes (8,960 values against five matrices of 1,792), so a model's decode can be
/// studied without the model.
fn bench_layers(rng: &mut Rng, rounds: usize) {
    use GgmlType::*;
    let (e, f) = (1536, 8960);
    let shapes = [
        (Q4_K, e, e),
        (Q4_K, e, 256),
        (Q6_K, e, 256),
        (Q4_K, e, e),
        (Q4_K, e, f),
        (Q4_K, e, f),
        (Q6_K, f, e),
    ];
    let packed = |rng: &mut Rng, (ty, n, rows): (GgmlType, usize, usize)| {
        quant::pack_rows(ty, n, &matrix(rng, ty, n, rows, 64), rows)
    };
    let act = |rng: &mut Rng, ty: GgmlType, n: usize| {
        let mut a = vec![0u8; quant::act_bytes(ty, n)];
        quant::quantize_act(ty, &rng.values(n), &mut a);
        a
    };
    let seeds: Vec<Vec<u8>> = shapes.iter().map(|&s| packed(rng, s)).collect();
    // In the pages a loader packs into (`pages::HugeBuf`), one buffer a matrix as there.
    let huge = |m: &Vec<u8>| {
        let mut h = weft_kernels::pages::HugeBuf::zeroed(m.len()).expect("mmap");
        h.copy_from_slice(m);
        h
    };
    let layers: Vec<Vec<_>> = (0..28).map(|_| seeds.iter().map(huge).collect()).collect();
    let bytes: usize = seeds.iter().map(Vec::len).sum::<usize>() * layers.len();
    let acts: Vec<Vec<u8>> = shapes.iter().map(|&(ty, n, _)| act(rng, ty, n)).collect();
    let mut out = vec![0.0f32; f];
    let mut matvec =
        |prefetch: bool, (ty, n, rows): (GgmlType, usize, usize), w: &[u8], a: &[u8]| {
            quant::matmul_packed_on(prefetch, ty, n, w, 0..rows, a, 1, &mut out, rows);
            black_box(&out);
        };
    let gbs = |bytes: usize, secs: f64| bytes as f64 / secs / 1e9;
    println!(
        "layers: {:.1} MB of interleaved weights a pass",
        bytes as f64 / 1e6
    );
    for round in 0..rounds {
        let bw = read_bandwidth(512 << 20);
        let mut pass = |prefetch: bool| {
            median_secs(5, || {
                for layer in &layers {
                    for (i, &shape) in shapes.iter().enumerate() {
                        matvec(prefetch, shape, &layer[i], &acts[i]);
                    }
                }
            })
        };
        let (off, on) = (gbs(bytes, pass(false)), gbs(bytes, pass(true)));
        println!(
            "round {round}: read {bw:.2} GB/s | no prefetch {off:.2} GB/s ({:.0} %) | prefetch {on:.2} GB/s ({:.0} %)",
            100.0 * off / bw,
            100.0 * on / bw,
        );
    }
    for (i, &shape) in shapes.iter().enumerate() {
        let secs = median_secs(5, || {
            for layer in &layers {
                matvec(false, shape, &layer[i], &acts[i]);
            }
        });
        let (ty, n, rows) = shape;
        let b = seeds[i].len() * layers.len();
        println!(
            "  {} n={n} rows={rows}, 28 copies: {:.2} GB/s",
            ty.name(),
            gbs(b, secs)
        );
    }
    for ty in [Q4_K, Q6_K] {
        for (n, copies) in [(f, 28), (f / 5, 5 * 28)] {
            let shape = (ty, n, e);
            let one = packed(rng, shape);
            let mats: Vec<Vec<u8>> = (0..copies).map(|_| one.clone()).collect();
            let a = act(rng, ty, n);
            let secs = median_secs(5, || {
                for w in &mats {
                    matvec(false, shape, w, &a);
                }
            });
            println!(
                "  {} n={n} rows={e}, {copies} copies: {:.2} GB/s",
                ty.name(),
                gbs(one.len() * copies, secs)
            );
        }
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    if std::env::args().any(|a| a == "--layers") {
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        bench_layers(&mut rng, 3);
        return;
    }
    let reps = if quick { 5 } else { 21 };
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    println!("kernels: {}   single thread", quant::simd_name());
    println!(
        "plain read bandwidth (256 MiB): {:.2} GB/s",
        read_bandwidth(256 << 20)
    );
    use GgmlType::*;
    let shapes = [
        (Q4_K, 1536, 8960),
        (Q4_K, 8960, 1536),
        (Q5_0, 640, 2048),
        (Q4_K, 2048, 640),
        (Q6_K, 2048, 640),
        (Q4_K, 1024, 640),
    ];
    bench_matvec(&mut rng, Q8_0, 640, 262_144, if quick { 3 } else { 11 });
    for (ty, n, rows) in shapes {
        bench_matvec(&mut rng, ty, n, rows, reps * 5);
    }
    for (ty, n, rows) in shapes {
        bench_matmul(&mut rng, ty, n, rows, 64, reps);
    }
    // The rest of the formats, for completeness (same n x rows as the FFN down shape).
    if !quick {
        for ty in [Q8_0, Q4_0, Q5_K, F16, BF16, F32] {
            let n = 2048;
            bench_matvec(&mut rng, ty, n, 640, reps * 5);
            bench_matmul(&mut rng, ty, n, 640, 64, reps);
        }
    }
}
