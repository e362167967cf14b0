//! Temporary: runs one kernel in a loop for perf.
use weft_gguf::GgmlType;
use weft_kernels::quant;
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let ty = GgmlType::ALL.into_iter().find(|t| t.name() == a[1]).unwrap();
    let (n, rows, m, iters): (usize, usize, usize, usize) = (a[2].parse().unwrap(), a[3].parse().unwrap(), a[4].parse().unwrap(), a[5].parse().unwrap());
    let mut s = 1u64;
    let mut v = |k: usize| -> Vec<f32> { (0..k).map(|_| { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 40) as f32 / 8388608.0 - 1.0 }).collect() };
    let row: Vec<u8> = (0..rows.min(256)).flat_map(|_| quant::quantize_row(ty, &v(n))).collect();
    let rb = quant::quantize_row(ty, &v(n)).len();
    let mut w = Vec::with_capacity(rows * rb);
    while w.len() < rows * rb { let k = (rows * rb - w.len()).min(row.len()); w.extend_from_slice(&row[..k]); }
    let ab = quant::act_bytes(ty, n);
    let mut acts = vec![0u8; m * ab];
    for t in 0..m { quant::quantize_act(ty, &v(n), &mut acts[t * ab..(t + 1) * ab]); }
    let mut out = vec![0f32; m * rows];
    let t0 = std::time::Instant::now();
    for _ in 0..iters {
        if m == 1 { quant::matvec(ty, n, &w, 0..rows, &acts, &mut out); } else { quant::matmul(ty, n, &w, 0..rows, &acts, m, &mut out, rows); }
        std::hint::black_box(&out);
    }
    let e = t0.elapsed().as_secs_f64() / iters as f64;
    println!("{} n={n} rows={rows} m={m}: {:.1} us/iter, {:.2} GB/s, {:.1} ns per row-token", ty.name(), e * 1e6, (rows * rb) as f64 / e / 1e9, e * 1e9 / (rows * m) as f64);
}
