//! Tests of the quant module: round trips per format, hand-built blocks whose values are
//! worked out by hand (so a layout mistake cannot hide behind a round trip), and the SIMD
//! kernels against the scalar integer path and an f64 dequantized reference.

use super::select::Shape;
use super::*;
use weft_gguf::GgmlType as G;

/// xorshift64*: deterministic, no dependencies.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Roughly normal (sum of four uniforms), with a slowly varying magnitude so blocks
    /// get different scales, and the odd outlier as real weights have.
    fn values(&mut self, n: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        let mut scale = 1.0f32;
        for i in 0..n {
            if i % 64 == 0 {
                scale = 0.05 + 2.0 * (self.uniform() + 1.0);
            }
            let g = (self.uniform() + self.uniform() + self.uniform() + self.uniform()) * 0.5;
            let outlier = if self.next_u64().is_multiple_of(97) {
                4.0
            } else {
                1.0
            };
            out.push(g * scale * outlier);
        }
        out
    }
}

const ALL_WEIGHTS: [G; 11] = G::WEIGHT_TYPES;

/// Row lengths to test for a type: block multiples, including 640 for 32-value blocks
/// and odd lengths for the float types (tails).
fn sizes(ty: G) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![1, 7, 37, 256, 640, 1024],
        // 17568 = 549 blocks: more than one 512-block column chunk of the AVX2 driver,
        // and not a multiple of 8 blocks (the scale records' padding).
        32 => vec![32, 96, 256, 640, 1024, 2048, 17568],
        _ => vec![256, 1024, 2048],
    }
}

fn dequant(ty: G, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    dequantize_row(ty, bytes, &mut out);
    out
}

/// Relative RMS error bound of a format on the test distribution.
fn rms_bound(ty: G) -> f64 {
    // About 1.5x what the formats reach here (the 1% of 4x outliers inflate the block
    // scales), so a wrong rounding or a lost bit shows up while noise does not.
    match ty {
        G::F32 => 0.0,
        G::F16 => 4e-4,
        G::BF16 => 4e-3,
        G::Q8_0 => 0.015,
        // One scale per 256 values: an outlier coarsens eight times as many.
        G::Q8_K => 0.025,
        G::Q6_K => 0.035,
        G::Q5_K => 0.06,
        G::Q5_0 => 0.09,
        G::Q5_1 => 0.09,
        G::Q4_K => 0.12,
        G::Q4_0 => 0.17,
        G::Q4_1 => 0.17,
    }
}

#[test]
fn round_trip_every_type() {
    let mut rng = Rng::new(1);
    for ty in ALL_WEIGHTS.iter().copied().chain([G::Q8_K]) {
        for n in sizes(ty) {
            let x = rng.values(n);
            let q = quantize_row(ty, &x);
            assert_eq!(q.len(), n / ty.block_size() * ty.type_size());
            let y = dequant(ty, &q, n);
            let err: f64 = x
                .iter()
                .zip(&y)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            let sig: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
            let rel = (err / sig).sqrt();
            assert!(rel <= rms_bound(ty), "{ty} n={n}: relative rms error {rel}");
        }
    }
}

#[test]
fn zero_rows_stay_zero() {
    for ty in ALL_WEIGHTS.iter().copied().chain([G::Q8_K]) {
        let n = 256;
        let q = quantize_row(ty, &vec![0.0; n]);
        assert!(dequant(ty, &q, n).iter().all(|v| *v == 0.0), "{ty}");
        if ty != G::Q8_K {
            let mut act = vec![0u8; act_bytes(ty, n)];
            quantize_act(ty, &Rng::new(2).values(n), &mut act);
            assert_eq!(vec_dot(ty, n, &q, &act), 0.0, "{ty}");
        }
    }
}

#[test]
fn act_formats() {
    assert_eq!(vec_dot_type(G::Q8_0), G::Q8_0);
    assert_eq!(vec_dot_type(G::Q4_0), G::Q8_0);
    assert_eq!(vec_dot_type(G::Q5_0), G::Q8_0);
    assert_eq!(vec_dot_type(G::Q4_K), G::Q8_K);
    assert_eq!(vec_dot_type(G::Q6_K), G::Q8_K);
    assert_eq!(vec_dot_type(G::BF16), G::F32);
    assert_eq!(act_bytes(G::Q4_0, 640), 20 * 34);
    assert_eq!(act_bytes(G::Q6_K, 2048), 8 * 292);
    assert_eq!(act_bytes(G::F16, 5), 20);
}

// ---- hand-built blocks ----

#[test]
fn q4_0_known_block() {
    // d = 1.0; byte j holds value j in its low nibble and value 16+j in its high one.
    let mut b = vec![0x00, 0x3C];
    for j in 0..16u8 {
        b.push(j | ((15 - j) << 4));
    }
    let y = dequant(G::Q4_0, &b, 32);
    for j in 0..16 {
        assert_eq!(y[j], j as f32 - 8.0);
        assert_eq!(y[16 + j], (15 - j) as f32 - 8.0);
    }
}

#[test]
fn q5_0_known_block() {
    // d = 0.5; qh has bits 0 and 31 set: value 0 and value 31 get +16.
    let mut b = vec![0x00, 0x38, 0x01, 0x00, 0x00, 0x80];
    for j in 0..16u8 {
        b.push(j | (j << 4));
    }
    let y = dequant(G::Q5_0, &b, 32);
    assert_eq!(y[0], (16.0 - 16.0) * 0.5);
    assert_eq!(y[1], (1.0 - 16.0) * 0.5);
    assert_eq!(y[16], (0.0 - 16.0) * 0.5);
    assert_eq!(y[31], (15.0 + 16.0 - 16.0) * 0.5);
}

#[test]
fn q4_1_and_q5_1_known_blocks() {
    // d = 0.5 (0x3800), m = -2 (0xC000); nibble j at value j and 15 - j at value 16 + j.
    let mut q4 = vec![0x00, 0x38, 0x00, 0xC0];
    q4.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequant(G::Q4_1, &q4, 32);
    for j in 0..16 {
        assert_eq!(y[j], j as f32 * 0.5 - 2.0);
        assert_eq!(y[16 + j], (15 - j) as f32 * 0.5 - 2.0);
    }
    // Q5_1: qh bits 0 and 31 set give values 0 and 31 their fifth bit.
    let mut q5 = vec![0x00, 0x38, 0x00, 0xC0, 0x01, 0x00, 0x00, 0x80];
    q5.extend((0..16u8).map(|j| j | (j << 4)));
    let y = dequant(G::Q5_1, &q5, 32);
    assert_eq!(y[0], 16.0 * 0.5 - 2.0);
    assert_eq!(y[1], 0.5 - 2.0);
    assert_eq!(y[16], -2.0);
    assert_eq!(y[31], 31.0 * 0.5 - 2.0);
    // Quantizing back what a block holds gives the same block.
    assert_eq!(quantize_row(G::Q5_1, &y), q5);
}

#[test]
fn q8_0_known_block() {
    // d = 0.5 (0x3800); qs = -16..16.
    let mut b = vec![0x00, 0x38];
    b.extend((0..32).map(|j| (j as i8 - 16) as u8));
    let y = dequant(G::Q8_0, &b, 32);
    for (j, v) in y.iter().enumerate() {
        assert_eq!(*v, (j as f32 - 16.0) * 0.5);
    }
}

/// A Q4_K block with d = 1, dmin = 0.5, scale_j = j+1 (j<4) / 16+j (j>=4), min_j = j
/// (j<4) / 40+j (j>=4), value i = i % 16; returns (bytes, expected values).
fn q4_k_known() -> (Vec<u8>, Vec<f32>) {
    let sc: Vec<u8> = (0..8).map(|j| if j < 4 { j + 1 } else { 16 + j }).collect();
    let mn: Vec<u8> = (0..8).map(|j| if j < 4 { j } else { 40 + j }).collect();
    let mut s = [0u8; 12];
    for j in 0..4 {
        // Low 6 bits of scale/min j in bytes j / j+4; top 2 bits of scale/min j+4 on top.
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
    let mut b = vec![0x00, 0x3C, 0x00, 0x38];
    b.extend_from_slice(&s);
    let level = |i: usize| (i % 16) as u8;
    for c in 0..4 {
        for l in 0..32 {
            b.push(level(64 * c + l) | (level(64 * c + 32 + l) << 4));
        }
    }
    let expect = (0..256)
        .map(|i| sc[i / 32] as f32 * level(i) as f32 - 0.5 * mn[i / 32] as f32)
        .collect();
    (b, expect)
}

#[test]
fn q4_k_known_block() {
    let (b, expect) = q4_k_known();
    assert_eq!(b.len(), 144);
    assert_eq!(dequant(G::Q4_K, &b, 256), expect);
}

#[test]
fn q6_k_known_block() {
    // d = 1, scale_g = g - 8, level i = (7 * i) % 64 (stored +32).
    let level = |i: usize| ((7 * i) % 64) as u8;
    let mut b = vec![0u8; 210];
    for h in 0..2 {
        for l in 0..32 {
            let q = |k: usize| level(128 * h + 32 * k + l);
            b[64 * h + l] = (q(0) & 0xF) | ((q(2) & 0xF) << 4);
            b[64 * h + 32 + l] = (q(1) & 0xF) | ((q(3) & 0xF) << 4);
            b[128 + 32 * h + l] =
                (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
    for g in 0..16 {
        b[192 + g] = (g as i8 - 8) as u8;
    }
    b[208] = 0x00;
    b[209] = 0x3C;
    let y = dequant(G::Q6_K, &b, 256);
    for (i, v) in y.iter().enumerate() {
        assert_eq!(
            *v,
            ((i / 16) as f32 - 8.0) * (level(i) as f32 - 32.0),
            "value {i}"
        );
    }
}

#[test]
fn known_blocks_dot_by_hand() {
    // Q4_K block above dotted with an activation whose quants are all 1 and d = 1:
    // the result must be the plain sum of the expected values, on every path.
    let (b, expect) = q4_k_known();
    let mut act = vec![0u8; 292];
    act[0..4].copy_from_slice(&1.0f32.to_le_bytes());
    act[4..260].fill(1);
    for g in 0..16 {
        act[260 + 2 * g..262 + 2 * g].copy_from_slice(&16i16.to_le_bytes());
    }
    let want: f32 = expect.iter().sum();
    assert_eq!(scalar::vec_dot(G::Q4_K, 256, &b, &act), want);
    assert_eq!(vec_dot(G::Q4_K, 256, &b, &act), want);

    // Q8_0: weights -16..16 at d = 0.5 against quants 1 at d = 2: sum = 2*0.5*sum(q).
    let mut w = vec![0x00, 0x38];
    w.extend((0..32).map(|j| (j as i8 - 16) as u8));
    let mut a = vec![0x00, 0x40];
    a.extend([1u8; 32]);
    assert_eq!(vec_dot(G::Q8_0, 32, &w, &a), -16.0);
    assert_eq!(scalar::vec_dot(G::Q8_0, 32, &w, &a), -16.0);
}

#[test]
fn quantizers_hit_expected_levels() {
    // Q8_0: amax 127 gives d = 1, so values land on integers and .5 rounds away from 0.
    let mut x = vec![0.0f32; 32];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = -2.5;
    x[3] = 0.49;
    x[4] = -126.6;
    let q = quantize_row(G::Q8_0, &x);
    assert_eq!(&q[0..2], &[0x00, 0x3C]);
    assert_eq!(q[2] as i8, 127);
    assert_eq!(q[3] as i8, 3);
    assert_eq!(q[4] as i8, -3);
    assert_eq!(q[5] as i8, 0);
    assert_eq!(q[6] as i8, -127);

    // Q4_0: the largest-magnitude value (-8 here) maps to level 0, d = 1.
    let mut x = vec![0.0f32; 32];
    x[0] = -8.0;
    x[1] = 7.0;
    x[17] = 3.0;
    let q = quantize_row(G::Q4_0, &x);
    assert_eq!(&q[0..2], &[0x00, 0x3C]);
    assert_eq!(q[2] & 0xF, 0);
    assert_eq!(q[3] & 0xF, 15);
    assert_eq!(q[3] >> 4, 11);
    assert_eq!(q[4], 8 | (8 << 4));

    // Q8_K: scale by the signed max (+127 here, so d = -1), half-way cases to even.
    let mut x = vec![0.0f32; 256];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = 3.5;
    x[20] = -0.5;
    let q = quantize_row(G::Q8_K, &x);
    assert_eq!(f32::from_le_bytes(q[0..4].try_into().unwrap()), -1.0);
    assert_eq!(q[4] as i8, -127);
    assert_eq!(q[5] as i8, -2);
    assert_eq!(q[6] as i8, -4);
    assert_eq!(q[24] as i8, 0);
    assert_eq!(i16::from_le_bytes([q[260], q[261]]), -127 - 2 - 4);
}

// ---- SIMD against scalar ----

fn simd() -> bool {
    let ok = super::simd();
    if !ok {
        eprintln!("no SIMD kernels here: SIMD comparisons skipped");
    }
    ok
}

/// Scalar activation bytes (the reference quantizer).
fn act_scalar(w: G, x: &[f32]) -> Vec<u8> {
    let mut a = vec![0u8; act_bytes(w, x.len())];
    quantize::quantize_into(vec_dot_type(w), x, &mut a);
    a
}

#[test]
fn simd_act_quantizers_match_reference_bytes() {
    if !simd() {
        return;
    }
    let mut rng = Rng::new(3);
    for w in [G::Q8_0, G::Q4_K, G::F32] {
        for n in [256, 512, 2048] {
            let mut x = rng.values(n);
            // Exact half-way points after scaling, both signs, and a zero block.
            x[0] = 127.0;
            x[1] = 2.5;
            x[2] = -2.5;
            x[3] = -127.0;
            x[256..].iter_mut().take(256).for_each(|v| *v = 0.0);
            let want = act_scalar(w, &x);
            let mut got = vec![0u8; want.len()];
            #[cfg(target_arch = "x86_64")]
            avx2::quantize_act(vec_dot_type(w), &x, &mut got);
            assert_eq!(got, want, "{w} n={n}");
        }
    }
}

/// f64 dot of the dequantized weight row and dequantized activation.
fn reference_dot(w: G, n: usize, row: &[u8], act: &[u8]) -> (f64, f64) {
    let wf = dequant(w, row, n);
    let af = dequant(vec_dot_type(w), act, n);
    let dot = wf.iter().zip(&af).map(|(a, b)| *a as f64 * *b as f64).sum();
    let mag = wf
        .iter()
        .zip(&af)
        .map(|(a, b)| (*a as f64 * *b as f64).abs())
        .sum();
    (dot, mag)
}

fn close(got: f32, want: f64, mag: f64, what: &str) {
    let tol = 2e-5 * mag + 1e-6;
    assert!(
        (got as f64 - want).abs() <= tol,
        "{what}: got {got}, want {want} (tolerance {tol})"
    );
}

/// Rows of weights, quantized, laid end to end, starting one byte into the buffer so
/// nothing is aligned.
fn weight_matrix(rng: &mut Rng, w: G, n: usize, rows: usize) -> Vec<u8> {
    let mut buf = vec![0xAAu8];
    for _ in 0..rows {
        buf.extend(quantize_row(w, &rng.values(n)));
    }
    buf
}

#[test]
fn matvec_matches_scalar_and_reference() {
    let mut rng = Rng::new(4);
    let have_simd = simd();
    for w in ALL_WEIGHTS {
        for n in sizes(w) {
            for rows in [1usize, 3, 7] {
                let buf = weight_matrix(&mut rng, w, n, rows + 2);
                let weights = &buf[1..];
                let rb = row_bytes(w, n);
                let act = act_scalar(w, &rng.values(n));
                // Rows 1..rows+1: a range not starting at 0.
                let range = 1..rows + 1;
                let mut out = vec![f32::NAN; rows + 1];
                matvec(w, n, weights, range.clone(), &act, &mut out);
                assert!(out[rows].is_nan(), "{w}: matvec wrote past its rows");
                for (i, r) in range.clone().enumerate() {
                    let row = &weights[r * rb..(r + 1) * rb];
                    let (want, mag) = reference_dot(w, n, row, &act);
                    let what = format!("{w} n={n} rows={rows} row {r}");
                    let s = scalar::vec_dot(w, n, row, &act);
                    close(s, want, mag, &format!("{what} scalar"));
                    close(out[i], want, mag, &format!("{what} matvec"));
                    close(
                        vec_dot(w, n, row, &act),
                        s as f64,
                        mag,
                        &format!("{what} vec_dot"),
                    );
                    // Every path this CPU can take, not only the chosen one.
                    for path in select::candidates(w, Shape::of(1, n)).as_slice() {
                        assert!(have_simd);
                        let mut o = [0.0f32];
                        matvec_on(Some(*path), w, n, row, 0..1, &act, &mut o);
                        let p = path.name();
                        close(o[0], s as f64, mag, &format!("{what} {p} vs scalar"));
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_matches_scalar() {
    let mut rng = Rng::new(5);
    for w in ALL_WEIGHTS {
        // 17568 values = 549 blocks: two column chunks of the AVX2 driver.
        let ns: &[usize] = match w.block_size() {
            256 => &[512, 2048],
            32 => &[640, 17568],
            _ => &[75, 640],
        };
        for (&n, rows) in ns.iter().flat_map(|n| [1usize, 3, 7, 9].map(|r| (n, r))) {
            let buf = weight_matrix(&mut rng, w, n, rows + 1);
            let weights = &buf[1..];
            let rb = row_bytes(w, n);
            let ab = act_bytes(w, n);
            for m in [1usize, 3, 5, 8, 17] {
                let mut acts = vec![0u8; m * ab];
                for t in 0..m {
                    acts[t * ab..(t + 1) * ab].copy_from_slice(&act_scalar(w, &rng.values(n)));
                }
                let stride = rows + 3;
                let range = 1..rows + 1;
                // The chosen path, then every path this CPU can take at this shape.
                let paths = select::candidates(w, Shape::of(m, n));
                let tried = std::iter::once(None).chain(paths.as_slice().iter().map(|p| Some(*p)));
                for path in tried {
                    let mut out = vec![f32::NAN; m * stride];
                    let name = path.map_or("chosen".to_string(), |p| p.name());
                    match path {
                        None => matmul(w, n, weights, range.clone(), &acts, m, &mut out, stride),
                        Some(p) => matmul_on(
                            Some(p),
                            w,
                            n,
                            weights,
                            range.clone(),
                            &acts,
                            m,
                            &mut out,
                            stride,
                        ),
                    }
                    for t in 0..m {
                        let act = &acts[t * ab..(t + 1) * ab];
                        for (i, r) in range.clone().enumerate() {
                            let row = &weights[r * rb..(r + 1) * rb];
                            let (_, mag) = reference_dot(w, n, row, act);
                            let s = scalar::vec_dot(w, n, row, act);
                            close(
                                out[t * stride + i],
                                s as f64,
                                mag,
                                &format!("{w} {name} rows={rows} m={m} t={t} r={r}"),
                            );
                        }
                        for pad in rows..stride {
                            assert!(
                                out[t * stride + pad].is_nan(),
                                "{w} {name} m={m}: wrote into padding"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn simd_handles_extreme_q8_0_weights() {
    // -128 is not produced by the quantizer but may appear in files; the sign trick
    // must still be exact.
    let mut w = vec![0x00, 0x3C];
    w.extend((0..32).map(|j| if j % 2 == 0 { 0x80 } else { 127 }));
    let mut a = vec![0x00, 0x3C];
    a.extend((0..32).map(|j| if j % 3 == 0 { (-127i8) as u8 } else { 127 }));
    let s = scalar::vec_dot(G::Q8_0, 32, &w, &a);
    assert_eq!(vec_dot(G::Q8_0, 32, &w, &a), s);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vnni512_and_avx2_matmuls_match_scalar() {
    // The 512-bit tile is opt-in (WEFT_KERNELS_VNNI512), so it is called directly here,
    // beside the dispatch. Sizes cross its 128-block column chunk with an odd block count
    // (a half-filled last pair), and token counts its 8-token tiles; Q8_0 weights include
    // -128, which neither tile may mishandle.
    if !simd() {
        return;
    }
    let mut rng = Rng::new(11);
    for ty in [G::Q8_0, G::Q5_0, G::Q4_0] {
        for n in [32usize, 96, 4096, 8224] {
            let rows = 5;
            let mut buf = weight_matrix(&mut rng, ty, n, rows);
            if ty == G::Q8_0 {
                for (i, byte) in buf[1..].iter_mut().enumerate() {
                    if i % 34 >= 2 && i % 7 == 0 {
                        *byte = 0x80;
                    }
                }
            }
            let weights = &buf[1..];
            let rb = row_bytes(ty, n);
            let ab = act_bytes(ty, n);
            for m in [2usize, 7, 8, 11] {
                let mut acts = Vec::new();
                for _ in 0..m {
                    acts.extend(act_scalar(ty, &rng.values(n)));
                }
                let mut via_dispatch = vec![f32::NAN; m * rows];
                let mut via_vnni = vec![f32::NAN; m * rows];
                matmul(ty, n, weights, 0..rows, &acts, m, &mut via_dispatch, rows);
                // SAFETY: sizes as matmul checked them just above.
                let ran = unsafe {
                    avx2::matmul_vnni512(ty, n, weights, 0..rows, &acts, m, &mut via_vnni, rows)
                };
                for t in 0..m {
                    let act = &acts[t * ab..(t + 1) * ab];
                    for r in 0..rows {
                        let row = &weights[r * rb..(r + 1) * rb];
                        let (_, mag) = reference_dot(ty, n, row, act);
                        let s = scalar::vec_dot(ty, n, row, act) as f64;
                        let what = format!("{ty} n={n} m={m} t={t} r={r}");
                        close(
                            via_dispatch[t * rows + r],
                            s,
                            mag,
                            &format!("{what} dispatch"),
                        );
                        if ran {
                            close(via_vnni[t * rows + r], s, mag, &format!("{what} vnni512"));
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_token_sums_alike_alone_and_in_a_batch() {
    // Serving batches sequences into one step as they come; a sequence's numbers must
    // not depend on how many others share its step or where it sits in the tile.
    let mut rng = Rng::new(12);
    // The float tiles sum two rows at once and are held to a tolerance (above) instead.
    let quantized = ALL_WEIGHTS
        .into_iter()
        .filter(|w| !matches!(w, G::F32 | G::F16 | G::BF16));
    for w in quantized {
        let n = if w.block_size() == 256 { 512 } else { 640 };
        let rows = 6;
        let buf = weight_matrix(&mut rng, w, n, rows);
        let weights = &buf[1..];
        let ab = act_bytes(w, n);
        for m in [2usize, 3, 5, 8, 13] {
            let mut acts = Vec::new();
            for _ in 0..m {
                acts.extend(act_scalar(w, &rng.values(n)));
            }
            let mut batch = vec![0f32; m * rows];
            matmul(w, n, weights, 0..rows, &acts, m, &mut batch, rows);
            for t in 0..m {
                let mut alone = vec![0f32; rows];
                matvec(
                    w,
                    n,
                    weights,
                    0..rows,
                    &acts[t * ab..(t + 1) * ab],
                    &mut alone,
                );
                assert_eq!(
                    &batch[t * rows..(t + 1) * rows],
                    &alone[..],
                    "{w} m={m} t={t}"
                );
            }
        }
    }
}

#[test]
fn k_format_paths_agree_to_the_bit() {
    // Every path of a K format at batch and prefill shapes (the 512-bit VNNI tile among
    // them where the CPU has it) must give the AVX2 tile's results exactly, and a token
    // alone (matvec) the same: paths are chosen by timing, so ranks and batches may take
    // different ones. Extreme blocks (every level at its top, activations at -128 and
    // 127) check that the four-product sums never leave i16.
    if !simd() {
        return;
    }
    let mut rng = Rng::new(13);
    for w in [G::Q4_K, G::Q5_K, G::Q6_K] {
        for n in [256usize, 1024, 4352] {
            let rows = 5;
            let mut buf = weight_matrix(&mut rng, w, n, rows);
            // Row 0: every quant byte 0xFF (top levels), every scale byte at its top.
            let (quants, scales) = match w {
                G::Q4_K => (16..144, 4..16),
                G::Q5_K => (16..176, 4..16),
                _ => (0..192, 192..208),
            };
            for b in 0..n / 256 {
                let blk = &mut buf[1 + b * w.type_size()..1 + (b + 1) * w.type_size()];
                for i in quants.clone() {
                    blk[i] = 0xFF;
                }
                for i in scales.clone() {
                    // Q6_K scales are signed bytes: alternate the extremes.
                    blk[i] = if w == G::Q6_K {
                        if i % 2 == 0 {
                            0x7F
                        } else {
                            0x80
                        }
                    } else {
                        0xFF
                    };
                }
            }
            let weights = &buf[1..];
            for m in [2usize, 5, 8, 17] {
                let mut acts = Vec::new();
                for t in 0..m {
                    let mut a = act_scalar(w, &rng.values(n));
                    if t < 2 {
                        // Q8_K: f32 d, 256 quants, 16 i16 block sums, per 256 values.
                        // Token 0 all -128 and token 1 all 127: against row 0's top
                        // levels, every four-product sum sits at its bound (-32256 for
                        // Q6_K). The block sums are left as they were: the paths are
                        // held to each other here, not to a reference.
                        for b in 0..n / 256 {
                            let blk = &mut a[b * 292..(b + 1) * 292];
                            blk[4..260].fill(if t == 0 { 0x80 } else { 0x7F });
                        }
                    }
                    acts.extend(a);
                }
                same_bits_as_alone(w, n, weights, rows, &acts, m);
            }
        }
    }
}

#[test]
fn legacy_format_paths_agree_to_the_bit() {
    // The 32-value formats' paths (maddubs + madd, or one vpdpbusd in VEX or EVEX form)
    // sum the same i32 lanes, so every shape's candidates must match a token alone on the
    // AVX2 path exactly; Q8_0 weights include -128 and activations reach -128.
    if !simd() {
        return;
    }
    let mut rng = Rng::new(14);
    for w in [G::Q8_0, G::Q5_0, G::Q4_0] {
        for n in [32usize, 640, 4160] {
            let rows = 5;
            let mut buf = weight_matrix(&mut rng, w, n, rows);
            if w == G::Q8_0 {
                for (i, byte) in buf[1..].iter_mut().enumerate() {
                    if i % 34 >= 2 && i % 5 == 0 {
                        *byte = 0x80;
                    }
                }
            }
            let weights = &buf[1..];
            for m in [1usize, 2, 5, 8, 17] {
                let mut acts = Vec::new();
                for t in 0..m {
                    let mut a = act_scalar(w, &rng.values(n));
                    if t == 0 {
                        for (i, q) in a.iter_mut().enumerate() {
                            if i % 34 >= 2 && i % 3 == 0 {
                                *q = 0x80;
                            }
                        }
                    }
                    acts.extend(a);
                }
                same_bits_as_alone(w, n, weights, rows, &acts, m);
            }
        }
    }
}

/// Asserts that every candidate path of `w` at the shape of `m` tokens (but the opt-in
/// 512-bit tile of the 32-value formats, which sums in its own order) gives each token
/// exactly what a matvec of that token alone gives on the AVX2 path.
fn same_bits_as_alone(w: G, n: usize, weights: &[u8], rows: usize, acts: &[u8], m: usize) {
    let ab = act_bytes(w, n);
    let plain = select::Path {
        fused: select::Fused::Avx2,
        prefetch: true,
    };
    let mut alone = vec![0f32; m * rows];
    for t in 0..m {
        let o = &mut alone[t * rows..(t + 1) * rows];
        matvec_on(
            Some(plain),
            w,
            n,
            weights,
            0..rows,
            &acts[t * ab..(t + 1) * ab],
            o,
        );
    }
    let paths = select::candidates(w, Shape::of(m, n));
    let same_order = paths
        .as_slice()
        .iter()
        .filter(|p| p.fused != select::Fused::Avx512Vnni512);
    for path in same_order {
        let mut out = vec![f32::NAN; m * rows];
        if m == 1 {
            matvec_on(Some(*path), w, n, weights, 0..rows, acts, &mut out);
        } else {
            matmul_on(Some(*path), w, n, weights, 0..rows, acts, m, &mut out, rows);
        }
        for (i, (x, y)) in out.iter().zip(&alone).enumerate() {
            assert_eq!(
                x.to_bits(),
                y.to_bits(),
                "{w} n={n} m={m} {} value {i}: {x} vs {y} alone",
                path.name()
            );
        }
    }
}

// ---- Interleaved rows (quant::pack) ----

/// The types `quant::pack` interleaves.
const PACKED: [G; 8] = [
    G::Q4_K,
    G::Q5_K,
    G::Q6_K,
    G::Q4_0,
    G::Q4_1,
    G::Q5_0,
    G::Q5_1,
    G::Q8_0,
];

#[test]
fn interleaving_round_trips_every_row() {
    let mut rng = Rng::new(21);
    for ty in PACKED {
        let rb = |n| row_bytes(ty, n);
        // 8,960 and 4,352 values (35 and 17 blocks) lie in windows, as do 4,160 and 8,960
        // of the 32-value formats (130 and 280 blocks).
        let long = if matches!(ty, G::Q4_K | G::Q5_K | G::Q6_K) {
            4352
        } else {
            4160
        };
        for n in [256usize, 1024, long, 8960] {
            for n_rows in [1usize, 8, 13] {
                let buf = weight_matrix(&mut rng, ty, n, n_rows);
                let w = &buf[1..];
                let packed = pack_rows(ty, n, w, n_rows);
                assert_eq!(packed.len(), pack::packed_len(ty, n, n_rows));
                assert_eq!(
                    packed.len(),
                    n_rows.div_ceil(8) * 8 * rb(n)
                        + n_rows.div_ceil(8) * n / 256
                            * match ty {
                                G::Q4_K => 1184 - 8 * 144,
                                G::Q5_K => 1440 - 8 * 176,
                                _ => 0,
                            }
                );
                for r in 0..n_rows {
                    let back = pack::unpack_row(ty, n, &packed, r);
                    assert!(
                        back == w[r * rb(n)..(r + 1) * rb(n)],
                        "{ty} n={n} row {r} of {n_rows}"
                    );
                }
                // Whole groups overwrite every byte: packing into a used buffer gives
                // the same bytes as into a zeroed one.
                if n_rows % 8 == 0 {
                    let mut used = vec![0xFF; packed.len()];
                    pack::pack_into(ty, n, w, n_rows, &mut used);
                    assert!(used == packed, "{ty} n={n}: a used buffer's bytes stayed");
                }
            }
        }
    }
}

#[test]
fn windows_place_every_group_block_once_in_walking_order() {
    for (block_values, nb) in [
        (256usize, 1usize),
        (256, 8),
        (256, 9),
        (256, 17),
        (256, 35),
        (32, 280),
    ] {
        for groups in [1usize, 2, 5] {
            let win = pack::Windows::new(block_values, nb, groups);
            assert!(
                win.count() == 1 || (win.blocks(0).len() * block_values <= pack::WINDOW_VALUES),
                "nb {nb}: a window holds at most WINDOW_VALUES"
            );
            // Walking window by window, group by group, block by block visits the indices
            // 0, 1, 2, ... in turn: the walk is one forward stream covering each once.
            let mut next = 0;
            for w in 0..win.count() {
                for g in 0..groups {
                    for b in win.blocks(w) {
                        assert_eq!(win.index(g, b), next, "nb {nb} groups {groups} g {g} b {b}");
                        next += 1;
                    }
                }
            }
            assert_eq!(
                next,
                nb * groups,
                "nb {nb} groups {groups}: every block once"
            );
        }
    }
    // Rows of at most a window keep the group-major layout.
    let win = pack::Windows::new(256, 8, 3);
    assert_eq!((win.count(), win.index(2, 5)), (1, 2 * 8 + 5));
}

/// Activation bytes for weights of type `w` whose quants are all `q` (block sums, where
/// the format has them, agreeing).
fn act_constant(w: G, n: usize, q: i8) -> Vec<u8> {
    let mut a = vec![0u8; act_bytes(w, n)];
    if vec_dot_type(w) == G::Q8_0 {
        for blk in a.chunks_exact_mut(34) {
            blk[0..2].copy_from_slice(&0x2E66u16.to_le_bytes()); // f16 0.1
            blk[2..34].fill(q as u8);
        }
        return a;
    }
    for blk in a.chunks_exact_mut(292) {
        blk[0..4].copy_from_slice(&0.01f32.to_le_bytes());
        blk[4..260].fill(q as u8);
        for i in 0..16 {
            let s = 16 * q as i16;
            blk[260 + 2 * i..262 + 2 * i].copy_from_slice(&s.to_le_bytes());
        }
    }
    a
}

#[test]
fn interleaved_rows_match_scalar_and_a_token_alone() {
    // The interleaved kernels against the scalar dot of the same rows in ggml's layout,
    // for row ranges that start at any group and end inside one, with a row of extreme
    // levels and scales against activations of -128 and 127 (the i32 sums at their
    // largest). A token must give the same bits in any batch and on every VNNI form the
    // CPU has.
    if !simd() {
        return;
    }
    let mut rng = Rng::new(22);
    for w in PACKED {
        let (sizes, extreme) = match w {
            G::Q4_K => ([256usize, 1024, 4352], 4..144),
            // Q5_K: every level at 31 (fifth bits and nibbles), every scale and min at 63.
            G::Q5_K => ([256, 1024, 4352], 4..176),
            // Q6_K: every level at 63 and every scale at -128.
            G::Q6_K => ([256, 1024, 4352], 0..208),
            G::Q4_0 => ([32, 640, 4160], 2..18),
            G::Q5_0 => ([32, 640, 4160], 2..22),
            // Q4_1/Q5_1: every level at the top (the minimum and d stay as quantized).
            G::Q4_1 => ([32, 640, 4160], 4..20),
            G::Q5_1 => ([32, 640, 4160], 4..24),
            _ => ([32, 640, 4160], 2..34),
        };
        for n in sizes {
            let rows = 21;
            let rb = row_bytes(w, n);
            let mut buf = weight_matrix(&mut rng, w, n, rows);
            for blk in buf[1..1 + rb].chunks_exact_mut(w.type_size()) {
                // Top levels and scales; Q8_0's most negative weight.
                let top = match w {
                    G::Q8_0 => 0x80,
                    _ => 0xFF,
                };
                blk[extreme.clone()].fill(top);
                if w == G::Q6_K {
                    blk[192..208].fill(0x80);
                }
            }
            let weights = &buf[1..];
            let packed = pack_rows(w, n, weights, rows);
            let ab = act_bytes(w, n);
            for m in [1usize, 3, 4, 9] {
                let mut acts = Vec::new();
                for t in 0..m {
                    acts.extend(match t {
                        0 => act_constant(w, n, -128),
                        1 => act_constant(w, n, 127),
                        _ => act_scalar(w, &rng.values(n)),
                    });
                }
                for range in [0..rows, 8..rows, 0..8, 16..rows, 8..16] {
                    let stride = range.len() + 1;
                    let mut out = vec![f32::NAN; m * stride];
                    matmul_packed(w, n, &packed, range.clone(), &acts, m, &mut out, stride);
                    for t in 0..m {
                        let act = &acts[t * ab..(t + 1) * ab];
                        assert!(
                            out[t * stride + range.len()].is_nan(),
                            "wrote past the rows"
                        );
                        let mut alone = vec![0f32; range.len()];
                        matvec_packed(w, n, &packed, range.clone(), act, &mut alone);
                        for (i, r) in range.clone().enumerate() {
                            let row = &weights[r * rb..(r + 1) * rb];
                            let got = out[t * stride + i];
                            let (_, mag) = reference_dot(w, n, row, act);
                            let want = scalar::vec_dot(w, n, row, act);
                            let what = format!("{w} n={n} m={m} rows {range:?} token {t} row {r}");
                            close(got, want as f64, mag, &what);
                            assert_eq!(
                                got.to_bits(),
                                alone[i].to_bits(),
                                "{what}: batched vs alone"
                            );
                        }
                    }
                    // Every SIMD form gives the bits of the one in force; where none runs
                    // this type (Q8_0 without VNNI: the rows go back to the scalar dot),
                    // the forms must agree with the first that runs.
                    #[cfg(target_arch = "x86_64")]
                    let mut reference = crate::quant::packed_form(w).map(|_| out.clone());
                    #[cfg(target_arch = "x86_64")]
                    for fused in [
                        select::Fused::Avx2,
                        select::Fused::AvxVnni,
                        select::Fused::Avx512Vnni256,
                    ] {
                        let path = select::Path {
                            fused,
                            prefetch: false,
                        };
                        // maddubs saturates on Q8_0's levels (0..256): `interleaves`.
                        if !select::runnable(path) || !select::interleaves(fused, w) {
                            continue;
                        }
                        // With software prefetch and without: the same bits.
                        for prefetch in [false, true] {
                            let mut o = vec![f32::NAN; m * stride];
                            // SAFETY: the path runs here; lengths as matmul_packed checked
                            // them.
                            unsafe {
                                avx2::matmul_packed(
                                    fused,
                                    prefetch,
                                    w,
                                    n,
                                    &packed,
                                    range.clone(),
                                    &acts,
                                    m,
                                    &mut o,
                                    stride,
                                )
                            };
                            if reference.is_none() {
                                // The first form against the scalar dot, as `out` above.
                                for t in 0..m {
                                    let act = &acts[t * ab..(t + 1) * ab];
                                    for (i, r) in range.clone().enumerate() {
                                        let row = &weights[r * rb..(r + 1) * rb];
                                        let (_, mag) = reference_dot(w, n, row, act);
                                        let want = scalar::vec_dot(w, n, row, act);
                                        let what =
                                            format!("{w} n={n} m={m} {} row {r}", path.name());
                                        close(o[t * stride + i], want as f64, mag, &what);
                                    }
                                }
                            }
                            let want = reference.get_or_insert_with(|| o.clone());
                            for (x, y) in o.iter().zip(want.iter()) {
                                let same = x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
                                assert!(
                                    same,
                                    "{w} n={n} m={m} {} prefetch {prefetch}: {x} vs {y}",
                                    path.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn activations_round_as_ggml_rounds_them_per_weight_type() {
    let x: Vec<f32> = (0..256)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.3)
        .collect();
    let mut scratch = vec![0u8; 1024];
    let mut got = x.clone();
    round_as_activation(G::F32, &mut got, &mut scratch);
    assert_eq!(got, x, "F32 weights take f32 activations");
    for (ty, round) in [
        (
            G::F16,
            (|v| half::f16::from_f32(v).to_f32()) as fn(f32) -> f32,
        ),
        (G::BF16, |v| half::bf16::from_f32(v).to_f32()),
    ] {
        let mut got = x.clone();
        round_as_activation(ty, &mut got, &mut scratch);
        let want: Vec<f32> = x.iter().map(|&v| round(v)).collect();
        assert_eq!(got, want, "{ty}");
    }
    for ty in [G::Q8_0, G::Q4_K] {
        let mut got = x.clone();
        round_as_activation(ty, &mut got, &mut scratch);
        let mut act = vec![0u8; act_bytes(ty, x.len())];
        quantize_act(ty, &x, &mut act);
        let mut want = vec![0f32; x.len()];
        dequantize_row(vec_dot_type(ty), &act, &mut want);
        assert_eq!(got, want, "{ty}");
        assert_ne!(got, x, "{ty}: 8-bit levels round");
    }
}
