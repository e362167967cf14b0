use std::time::Instant;
use weft_gguf::GgmlType;
use weft_kernels::quant::{self, select};
fn main() {
    for (n, mb) in [(640usize, 170usize), (2048, 170), (640, 1), (2048, 1)] {
        let ty = GgmlType::Q8_0;
        let vals: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 255) as f32 / 127.0 - 1.0)
            .collect();
        let row = quant::quantize_row(ty, &vals);
        let rows = (mb << 20) / row.len();
        let w = row.repeat(rows);
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.01).sin()).collect();
        let mut a = vec![0u8; quant::act_bytes(ty, n)];
        quant::quantize_act(ty, &x, &mut a);
        let mut out = vec![0f32; rows];
        let reps = (2_000_000_000 / w.len()).max(3);
        for p in select::candidates(ty, select::Shape::of(1, n)).as_slice() {
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t = Instant::now();
                for _ in 0..reps {
                    quant::matvec_on(Some(*p), ty, n, &w, 0..rows, &a, &mut out);
                }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            println!(
                "Q8_0 n={n} {mb} MiB {}: {:.1} GB/s",
                p.name(),
                w.len() as f64 / best / 1e9
            );
        }
    }
}
