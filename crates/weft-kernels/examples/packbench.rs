//! Load-time interleaving speed: GB/s of ggml-layout bytes that `quant::pack_rows` turns
//! into the interleaved layout (what every interleaved weight pays at model load), per
//! packable type, best of 5, on as many threads as packing uses. Run with
//! `cargo run -p weft-kernels --release --example packbench`.

use std::time::Instant;

use weft_gguf::GgmlType;
use weft_kernels::quant;

fn main() {
    let (n, rows) = (2048, 8192);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
    ] {
        let bytes = rows * n / ty.block_size() * ty.type_size();
        // Packing moves bits and never reads them as numbers, so any bytes will do.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let src: Vec<u8> = (0..bytes)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let best = (0..5)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(quant::pack_rows(ty, n, &src, rows));
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min);
        println!(
            "{ty}: {:.2} GB/s ({:.1} MB, {rows} rows of {n})",
            bytes as f64 / best / 1e9,
            bytes as f64 / 1e6
        );
    }
}
