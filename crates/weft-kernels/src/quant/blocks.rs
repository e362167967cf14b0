//! Byte layouts of the ggml block formats (offsets, sizes) and the little readers shared by
//! the scalar and SIMD code. Everything is read unaligned: rows come straight from an mmap.

use half::{bf16, f16};
use weft_gguf::GgmlType;

/// Values per block of the 32-wide formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
pub const QK: usize = 32;
/// Values per super-block of the K formats (Q4_K, Q5_K, Q6_K, Q8_K).
pub const QK_K: usize = 256;

// Block layouts (all little-endian, blocks packed without padding):
//   Q4_0  18 B: f16 d; u8 qs[16]
//   Q4_1  20 B: f16 d; f16 m; u8 qs[16]
//   Q5_0  22 B: f16 d; u8 qh[4]; u8 qs[16]
//   Q5_1  24 B: f16 d; f16 m; u8 qh[4]; u8 qs[16]
//   Q8_0  34 B: f16 d; i8 qs[32]
//   Q4_K 144 B: f16 d; f16 dmin; u8 scales[12]; u8 qs[128]
//   Q5_K 176 B: f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]
//   Q6_K 210 B: u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d
//   Q8_K 292 B: f32 d; i8 qs[256]; i16 bsums[16]
pub const Q8_0_BYTES: usize = 34;
pub const Q8_K_BYTES: usize = 292;
// Field offsets.
pub const Q5_K_QH: usize = 16;
pub const Q5_K_QS: usize = 48;
pub const Q6_K_QH: usize = 128;
pub const Q6_K_SCALES: usize = 192;
pub const Q6_K_D: usize = 208;
pub const Q8_K_QS: usize = 4;
pub const Q8_K_BSUMS: usize = 260;

/// Where a 32-value nibble block (Q4_0/Q4_1/Q5_0/Q5_1) keeps its fifth bits (Q5_0/Q5_1,
/// 4 bytes) and its 16 bytes of nibbles: after `d` (2 bytes) and the minimum (2,
/// Q4_1/Q5_1).
pub fn ggml_legacy(w: GgmlType) -> (Option<usize>, usize) {
    let base = if matches!(w, GgmlType::Q4_1 | GgmlType::Q5_1) {
        4
    } else {
        2
    };
    match w {
        GgmlType::Q5_0 | GgmlType::Q5_1 => (Some(base), base + 4),
        _ => (None, base),
    }
}

#[inline]
pub fn read_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

#[inline]
pub fn read_f16(b: &[u8], off: usize) -> f32 {
    f16::from_bits(read_u16(b, off)).to_f32()
}

#[inline]
pub fn read_bf16(b: &[u8], off: usize) -> f32 {
    bf16::from_bits(read_u16(b, off)).to_f32()
}

#[inline]
pub fn read_f32(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline]
pub fn read_i16(b: &[u8], off: usize) -> i16 {
    i16::from_le_bytes([b[off], b[off + 1]])
}

#[inline]
pub fn write_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block, from its
/// 12 packed scale bytes: sub-blocks 0..4 keep their low 6 bits in bytes j and j+4, 4..8
/// split theirs between a nibble of byte j+4 and the top two bits of bytes j-4 and j.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}
