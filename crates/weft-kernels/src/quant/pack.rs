//! The interleaved weight layouts: Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 rows
//! repacked at load, eight to a group, so the VNNI kernels hold one row per i32 lane.
//!
//! In ggml's layout a row's 256-value super-block is one block; a SIMD dot product runs
//! along it and must fold its lanes at the end, and every token re-reads the row's
//! scales. Interleaved, lane r of a 256-bit register is row r of the group and holds four
//! consecutive values of it, so one `vpdpbusd` against an activation's four bytes
//! broadcast is 8 rows x 4 values, nothing is folded, and a sub-block's scales and a
//! super-block's float steps serve all eight rows at once (llama.cpp repacks Q4_K the
//! same way for its x86 and Arm paths; this layout is weft's own, sized for the kernel in
//! `avx2/interleaved.rs`).
//!
//! One super-block of a group, [`Q4K_GROUP_BYTES`] bytes (2.8 % more than the eight
//! blocks it replaces):
//!
//! | offset | bytes | what |
//! |---|---|---|
//! | 0 | 16 | `d` of rows 0..8, f16 |
//! | 16 | 16 | `dmin` of rows 0..8, f16 |
//! | 32 | 64 | scale of sub-block j, row r at `32 + 8j + r`, u8 (6 bits) |
//! | 96 | 64 | min of sub-block 2p+e, row r at `96 + 16p + 2r + e`, u8 (6 bits) |
//! | 160 | 1024 | levels: sub-block j, quarter h (`160 + 128j + 32h`): byte `4r + i` holds value `32j + 4h + i` of row r in its low nibble and value `32j + 16 + 4h + i` in its high one |
//!
//! Q5_K, [`Q5K_GROUP_BYTES`] bytes (2.3 % more than eight blocks of 176): the first 160
//! bytes as Q4_K's, then per sub-block j 160 bytes at [`q5k_fifth`]`(j)`: a 32-byte plane
//! of fifth bits (bit h of byte `4r + i` is that of value `32j + 4h + i` of row r, bit
//! 4 + h that of value `32j + 16 + 4h + i`: the low and high nibbles of load h), then the
//! 128 level bytes as Q4_K's: each sub-block in one piece, so decode reads the group as
//! one forward stream.
//!
//! Q6_K keeps its size (1680 bytes, eight blocks of 210): `d` of the eight rows (f16, 16
//! bytes at 0); the sixteen 16-value sub-blocks' scales, sub-block s of row r at
//! `16 + 8s + r` (i8); then per sub-block pair j (values 32j..32j+32) 192 bytes at
//! `144 + 192j`: the top two bits of the levels (64 bytes): bits 2v..2v+2 of byte
//! `4r + i` hold those of value `32j + 4v + i` of row r (v < 4), and of the next 32 bytes
//! the same for v = 4..8; then their low four bits as Q4_K's (128 bytes at `+ 64`,
//! quarter h at `+ 64 + 32h`).
//!
//! The 32-value formats keep their size too: one 32-value block of a group is the eight
//! rows' f16 `d` (16 bytes), for Q4_1/Q5_1 their f16 minimums (16 bytes), and then their
//! levels as unsigned bytes, value `4v + i` of row r at byte `32v + 4r + i` of a level
//! vector v (0..8):
//! - Q8_0: the eight level vectors as bytes, each level plus 128 (272 bytes);
//! - Q4_0 and Q4_1: four 32-byte nibble loads, load h holding vector h in its low nibbles
//!   and vector h + 4 in its high ones (144 and 160 bytes);
//! - Q5_0 and Q5_1: a 32-byte plane of fifth bits (bit v of byte `4r + i` is that of
//!   vector v), then the nibbles as Q4_0 (176 and 192 bytes).
//!
//! Rows past the end of the matrix (the last group's padding) are all zero, so they sum
//! to zero and are never written out.
//!
//! Where the group blocks lie ([`Windows`]): a row of at most [`WINDOW_VALUES`] values is
//! one window, and the matrix is group after group, each group's blocks in order. A longer
//! row is cut into windows of equal blocks (the last may be shorter), and the matrix is
//! window after window, each holding every group's blocks of that window. Decode walks
//! the matrix window by window, so it still reads one forward stream, while the
//! activation it dots with (2 KiB of a window rather than 10 KiB of a 8,960-value row)
//! stays in L1 beside it: on a Zen 4 core, rows of 8,960 values streamed 15-27 % slower
//! than rows of 1,792 of the same bytes.

use weft_gguf::GgmlType;

use super::blocks::{ggml_legacy, scale_min_k4, Q6_K_D, Q6_K_QH, Q6_K_SCALES};

/// Rows in one interleaved group.
pub const GROUP_ROWS: usize = 8;
/// The most values of a row one window holds (eight K-quant blocks, 64 of the 32-value
/// formats): its activation, about 2 KiB, stays in L1 while a window is streamed.
pub const WINDOW_VALUES: usize = 2048;

/// Where an interleaved matrix's group blocks lie: windows of a row's blocks, window-major
/// (see the module's notes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Windows {
    /// Blocks in a row.
    nb: usize,
    /// Blocks in a window (all but the last, which may hold fewer).
    len: usize,
    /// Groups in the matrix.
    groups: usize,
}

impl Windows {
    /// The windows of `groups` groups of rows of `nb` blocks of `block_values` values.
    pub fn new(block_values: usize, nb: usize, groups: usize) -> Self {
        let most = (WINDOW_VALUES / block_values).max(1);
        let count = nb.div_ceil(most).max(1);
        Windows {
            nb,
            len: nb.div_ceil(count).max(1),
            groups,
        }
    }

    /// The windows of `n_rows` rows of `n` values of type `w`.
    pub fn of(w: GgmlType, n: usize, n_rows: usize) -> Self {
        Self::new(
            w.block_size(),
            n / w.block_size(),
            n_rows.div_ceil(GROUP_ROWS),
        )
    }

    /// The windows of an interleaved matrix of `packed_bytes` bytes: None where that is
    /// not a whole number of groups.
    pub fn of_packed(w: GgmlType, n: usize, packed_bytes: usize) -> Option<Self> {
        let group = (n / w.block_size()) * group_block_bytes(w);
        (group > 0 && packed_bytes.is_multiple_of(group))
            .then(|| Self::new(w.block_size(), n / w.block_size(), packed_bytes / group))
    }

    /// Groups in the matrix.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// How many windows a row has.
    pub fn count(&self) -> usize {
        self.nb.div_ceil(self.len).max(1)
    }

    /// The blocks of window `w`.
    pub fn blocks(&self, w: usize) -> std::ops::Range<usize> {
        (w * self.len).min(self.nb)..((w + 1) * self.len).min(self.nb)
    }

    /// Where group `g`'s block `b` lies, in group blocks from the matrix's start; the
    /// blocks of one window follow each other.
    pub fn index(&self, g: usize, b: usize) -> usize {
        let r = self.blocks(b / self.len);
        self.groups * r.start + g * r.len() + (b - r.start)
    }

    /// The group and block at index `i` (the inverse of [`Self::index`]).
    fn at(&self, i: usize) -> (usize, usize) {
        let w = (i / (self.groups * self.len).max(1)).min(self.count() - 1);
        let r = self.blocks(w);
        let rem = i - self.groups * r.start;
        (rem / r.len(), r.start + rem % r.len())
    }
}
/// Bytes of one super-block of eight interleaved Q4_K rows.
pub const Q4K_GROUP_BYTES: usize = 1184;
/// The most super-blocks a row may have to be interleaved (524,288 values, far above any
/// model's widest layer): the kernel keeps a token chunk's sub-block sums on its stack.
pub const Q4K_MAX_BLOCKS: usize = 2048;
/// Bytes of one super-block of eight interleaved Q5_K rows.
pub const Q5K_GROUP_BYTES: usize = OFF_LEVELS + 8 * 160;

/// Where a Q5_K group's sub-block j starts: its plane of fifth bits (32 bytes), then its
/// levels as Q4_K's (128 bytes at `+ 32`).
pub(super) const fn q5k_fifth(j: usize) -> usize {
    OFF_LEVELS + 160 * j
}
const _: () = assert!(q5k_fifth(7) + 160 == Q5K_GROUP_BYTES);

/// Bytes of one super-block of eight interleaved Q6_K rows, and offsets inside it.
pub const Q6K_GROUP_BYTES: usize = 1680;
pub(super) const Q6K_OFF_SCALES: usize = 16;
const Q6K_OFF_PAIRS: usize = 144;

/// Where a Q6_K group's sub-block pair j (values 32j..32j+32 of each row) starts: 192
/// bytes in one piece, in the order the kernels read them, so decode reads the group as
/// one forward stream (with the top bits in a plane of their own after all the low bits,
/// a Zen 4 core streamed it at a third of its bandwidth).
///
/// The pair holds two quarter pairs of 96 bytes, quarters 2p and 2p + 1 at `96 * p`; a
/// quarter h is values 4h..4h+4 of sub-block 2j (`lo`) and 16 on, of 2j + 1 (`hi`), row r
/// at bytes 4r..4r+4 of each 32-byte vector. Three vectors per quarter pair (a, b):
/// - `Y_a` (`+ 0`): a's `lo` level, all six bits, and the top two of a's `hi` in bits 6-7;
/// - `Y_b` (`+ 32`): the same for b;
/// - `Z` (`+ 64`): the low four bits of a's `hi` level, then of b's, in the high nibble.
///
/// So the four level vectors of a quarter pair cost 11 operations (a mask each for the
/// `lo`s; the `hi`s joined from `Z`'s nibble and `Y`'s top bits), against 17 with the low
/// nibbles of both in one vector and the top bits of four quarters in two more, as ggml
/// keeps them.
pub(super) const fn q6k_pair(j: usize) -> usize {
    Q6K_OFF_PAIRS + 192 * j
}
const _: () = assert!(q6k_pair(7) + 192 == Q6K_GROUP_BYTES);
/// Bytes of one Q6_K block in ggml's layout.
const Q6K_BLOCK: usize = 210;
/// Bytes of one Q4_K and one Q5_K block in ggml's layout.
const Q4K_BLOCK: usize = 144;
const Q5K_BLOCK: usize = 176;

/// Offsets inside a group's super-block (see the table above).
pub(super) const OFF_DMIN: usize = 16;
pub(super) const OFF_SCALES: usize = 32;
pub(super) const OFF_MINS: usize = 96;
pub(super) const OFF_LEVELS: usize = 160;

/// Whether rows of `n` Q4_K values can be interleaved.
fn q4k_packable(n: usize) -> bool {
    n.is_multiple_of(256) && n > 0 && n / 256 <= Q4K_MAX_BLOCKS
}

/// The most blocks a row of a 32-value format may have to be interleaved (131,072
/// values): the kernel keeps a token chunk's per-block terms on its stack.
pub const LEGACY_MAX_BLOCKS: usize = 4096;

/// What the stored unsigned levels of a 32-value format exceed the true ones by (Q4_1
/// and Q5_1 store theirs as they are and add a minimum instead).
pub fn legacy_offset(w: GgmlType) -> i32 {
    match w {
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        GgmlType::Q4_1 | GgmlType::Q5_1 => 0,
        _ => 128,
    }
}

/// Where a 32-value format's parts lie in one block of a group: after the eight rows'
/// `d` (16 bytes), their minimums (Q4_1/Q5_1, f16), a plane of fifth bits (Q5_0/Q5_1),
/// then the levels.
#[derive(Clone, Copy, Debug)]
pub(super) struct LegacyLayout {
    pub min: Option<usize>,
    pub fifth: Option<usize>,
    pub levels: usize,
}

pub(super) const fn legacy_layout(w: GgmlType) -> LegacyLayout {
    let (min, fifth) = match w {
        GgmlType::Q4_1 => (true, false),
        GgmlType::Q5_0 => (false, true),
        GgmlType::Q5_1 => (true, true),
        _ => (false, false),
    };
    let fifth_at = if min { 32 } else { 16 };
    LegacyLayout {
        min: if min { Some(16) } else { None },
        fifth: if fifth { Some(fifth_at) } else { None },
        levels: fifth_at + if fifth { 32 } else { 0 },
    }
}

/// Whether rows of `n` values of type `w` can be interleaved.
pub fn packable(w: GgmlType, n: usize) -> bool {
    match w {
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => q4k_packable(n),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
            n.is_multiple_of(32) && n > 0 && n / 32 <= LEGACY_MAX_BLOCKS
        }
        _ => false,
    }
}

/// Bytes of one block of eight interleaved rows of type `w` (eight times ggml's block).
pub fn group_block_bytes(w: GgmlType) -> usize {
    match w {
        GgmlType::Q4_K => Q4K_GROUP_BYTES,
        GgmlType::Q5_K => Q5K_GROUP_BYTES,
        GgmlType::Q6_K => Q6K_GROUP_BYTES,
        _ => GROUP_ROWS * w.type_size(),
    }
}

/// Bytes of `n_rows` rows of `n` values of type `w` once interleaved (the rows rounded
/// up to a whole group).
pub fn packed_len(w: GgmlType, n: usize, n_rows: usize) -> usize {
    n_rows.div_ceil(GROUP_ROWS) * (n / w.block_size()) * group_block_bytes(w)
}

/// Interleaves `n_rows` rows of `n` values of type `w` (ggml's layout, consecutive in
/// `rows`). Group g's block b sits at `Windows::of(w, n, n_rows).index(g, b) *
/// group_block_bytes(w)`.
///
/// # Panics
/// If `!packable(w, n)` or `rows` is shorter than `n_rows` rows.
pub fn pack(w: GgmlType, n: usize, rows: &[u8], n_rows: usize) -> Vec<u8> {
    let mut out = vec![0u8; packed_len(w, n, n_rows)];
    pack_into(w, n, rows, n_rows, &mut out);
    out
}

/// [`pack`] into `out`, which holds [`packed_len`] zeroed bytes (the padding rows stay
/// zero): the loader packs into memory of its choosing.
///
/// # Panics
/// As [`pack`], or if `out` is not [`packed_len`] bytes.
pub fn pack_into(w: GgmlType, n: usize, rows: &[u8], n_rows: usize, out: &mut [u8]) {
    assert!(
        packable(w, n),
        "{w} rows of {n} values cannot be interleaved"
    );
    let (wb, gb) = (w.type_size(), group_block_bytes(w));
    let nb = n / w.block_size();
    assert!(
        rows.len() >= n_rows * nb * wb,
        "pack: {} bytes for {n_rows} {w} rows of {n}",
        rows.len()
    );
    assert_eq!(
        out.len(),
        packed_len(w, n, n_rows),
        "pack: {n_rows} {w} rows of {n} take {} bytes",
        packed_len(w, n, n_rows)
    );
    let windows = Windows::of(w, n, n_rows);
    for_each_group_block(out, gb, |gi, o| {
        let (g, b) = windows.at(gi);
        for r in 0..GROUP_ROWS {
            let row = g * GROUP_ROWS + r;
            if row >= n_rows {
                break;
            }
            let block = &rows[(row * nb + b) * wb..][..wb];
            match w {
                GgmlType::Q4_K => place_q4k(o, r, block),
                GgmlType::Q5_K => place_q5k(o, r, block),
                GgmlType::Q6_K => place_q6k(o, r, block),
                _ => place_legacy(w, o, r, block),
            }
        }
    });
}

/// Puts a 32-value block (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) as row r of its group block `o`.
fn place_legacy(w: GgmlType, o: &mut [u8], r: usize, block: &[u8]) {
    let at = legacy_layout(w);
    o[2 * r..2 * r + 2].copy_from_slice(&block[0..2]);
    if let Some(m) = at.min {
        o[m + 2 * r..m + 2 * r + 2].copy_from_slice(&block[2..4]);
    }
    // The offset makes every stored level ggml's own unsigned one, so each 4-byte run
    // is a copy of ggml's bytes (Q8_0's with the sign bit flipped): packing at load
    // runs at copy speed, not value by value.
    if w == GgmlType::Q8_0 {
        for v in 0..8 {
            let src: [u8; 4] = std::array::from_fn(|i| block[2 + 4 * v + i] ^ 0x80);
            o[at.levels + 32 * v + 4 * r..][..4].copy_from_slice(&src);
        }
        return;
    }
    // The nibble formats: byte j of qs holds value j in its low nibble and j + 16 in its
    // high one, which is the nibble pair load h wants for j = 4h + i.
    let (qh_at, qs_at) = ggml_legacy(w);
    let qs = &block[qs_at..][..16];
    for h in 0..4 {
        o[at.levels + 32 * h + 4 * r..][..4].copy_from_slice(&qs[4 * h..4 * h + 4]);
    }
    if let (Some(f), Some(qh_at)) = (at.fifth, qh_at) {
        // Fifth bits: bit v of byte i is value 4v + i's, bit 4v + i of qh.
        let qh = u32::from_le_bytes(std::array::from_fn(|k| block[qh_at + k]));
        for i in 0..4 {
            o[f + 4 * r + i] =
                (0..8).fold(0u8, |acc, v| acc | ((((qh >> (4 * v + i)) & 1) as u8) << v));
        }
    }
}

/// Row r's low four bits of 32 consecutive levels `q` into the four 32-byte nibble loads
/// at `dst`: load h holds values 4h..4h+4 in its low nibbles, 16+4h.. in its high ones.
fn put_nibble_pairs(dst: &mut [u8], r: usize, q: &[u8]) {
    for h in 0..4 {
        for i in 0..4 {
            let (lo, hi) = (q[4 * h + i] & 0x0F, q[16 + 4 * h + i] & 0x0F);
            dst[32 * h + 4 * r + i] = lo | (hi << 4);
        }
    }
}

/// Runs `f(index, block)` on every `gb`-byte group block of `out`, on as many threads as
/// the machine has when the matrix is large (packing is a copy at load, and a model's
/// worth of it on one core would add seconds to every start).
fn for_each_group_block(out: &mut [u8], gb: usize, f: impl Fn(usize, &mut [u8]) + Sync) {
    const MIN_PER_THREAD: usize = 4 << 20;
    let blocks = out.len() / gb;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(out.len() / MIN_PER_THREAD)
        .max(1);
    let per = blocks.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (c, part) in out.chunks_mut(per * gb).enumerate() {
            let f = &f;
            let mut run = move || {
                for (i, o) in part.chunks_exact_mut(gb).enumerate() {
                    f(c * per + i, o);
                }
            };
            if threads == 1 {
                run();
            } else {
                s.spawn(run);
            }
        }
    });
}

/// The windows of a whole interleaved matrix.
///
/// # Panics
/// If `packed` is not a whole number of groups.
fn windows_of_packed(w: GgmlType, n: usize, packed: &[u8]) -> Windows {
    Windows::of_packed(w, n, packed.len()).unwrap_or_else(|| {
        panic!(
            "{} bytes are not whole groups of interleaved {w} rows of {n}",
            packed.len()
        )
    })
}

/// Row `row` of an interleaved matrix back in ggml's layout (for tests and for the
/// scalar fallback); `packed` is the whole matrix.
pub fn unpack_row(w: GgmlType, n: usize, packed: &[u8], row: usize) -> Vec<u8> {
    match w {
        GgmlType::Q4_K | GgmlType::Q5_K => return unpack_kmin_row(w, n, packed, row),
        GgmlType::Q6_K => return unpack_q6k_row(n, packed, row),
        _ => {}
    }
    let (wb, gb) = (w.type_size(), group_block_bytes(w));
    let nb = n / 32;
    let (g, r) = (row / GROUP_ROWS, row % GROUP_ROWS);
    let windows = windows_of_packed(w, n, packed);
    let at = legacy_layout(w);
    let (qh_at, qs_at) = ggml_legacy(w);
    let mut out = vec![0u8; nb * wb];
    for (b, block) in out.chunks_exact_mut(wb).enumerate() {
        let o = &packed[windows.index(g, b) * gb..][..gb];
        block[0..2].copy_from_slice(&o[2 * r..2 * r + 2]);
        if let Some(m) = at.min {
            block[2..4].copy_from_slice(&o[m + 2 * r..m + 2 * r + 2]);
        }
        for k in 0..32 {
            let (v, i) = (k / 4, k % 4);
            if w == GgmlType::Q8_0 {
                block[2 + k] = o[at.levels + 32 * v + 4 * r + i] ^ 0x80;
                continue;
            }
            let byte = o[at.levels + 32 * (v % 4) + 4 * r + i];
            let nib = if v < 4 { byte & 0x0F } else { byte >> 4 };
            block[qs_at + k % 16] |= if k < 16 { nib } else { nib << 4 };
            if let (Some(f), Some(qh_at)) = (at.fifth, qh_at) {
                if (o[f + 4 * r + i] >> v) & 1 != 0 {
                    block[qh_at + k / 8] |= 1 << (k % 8);
                }
            }
        }
    }
    out
}

/// Puts the steps, scales and mins of a Q4_K or Q5_K super-block (the same first 16
/// bytes) as row r of its group super-block `o`.
fn place_kmin_header(o: &mut [u8], r: usize, block: &[u8]) {
    o[2 * r..2 * r + 2].copy_from_slice(&block[0..2]);
    o[OFF_DMIN + 2 * r..OFF_DMIN + 2 * r + 2].copy_from_slice(&block[2..4]);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &block[4..16]);
        o[OFF_SCALES + 8 * j + r] = sc;
        o[OFF_MINS + 16 * (j / 2) + 2 * r + j % 2] = m;
    }
}

/// Puts a Q4_K super-block as row r of its group super-block `o`.
fn place_q4k(o: &mut [u8], r: usize, block: &[u8]) {
    place_kmin_header(o, r, block);
    // Sub-block j is the low (even j) or high nibbles of 32 bytes of qs.
    let qs = &block[16..Q4K_BLOCK];
    for j in 0..8 {
        let (src, shift) = (&qs[32 * (j / 2)..][..32], 4 * (j % 2));
        let q: [u8; 32] = std::array::from_fn(|w| src[w] >> shift);
        put_nibble_pairs(&mut o[OFF_LEVELS + 128 * j..], r, &q);
    }
}

/// Puts a Q5_K super-block (d, dmin, 12 bytes of scales, 32 of fifth bits, 128 of
/// nibbles) as row r of its group super-block `o`.
fn place_q5k(o: &mut [u8], r: usize, block: &[u8]) {
    place_kmin_header(o, r, block);
    let (qh, qs) = (&block[16..48], &block[48..Q5K_BLOCK]);
    for j in 0..8 {
        // As Q4_K's nibbles; value w's fifth bit is bit j of qh[w].
        let (src, shift) = (&qs[32 * (j / 2)..][..32], 4 * (j % 2));
        let q: [u8; 32] = std::array::from_fn(|w| src[w] >> shift);
        put_nibble_pairs(&mut o[q5k_fifth(j) + 32..], r, &q);
        let fifth = |w: usize| (qh[w] >> j) & 1;
        for i in 0..4 {
            o[q5k_fifth(j) + 4 * r + i] = (0..4).fold(0u8, |acc, h| {
                acc | (fifth(4 * h + i) << h) | (fifth(16 + 4 * h + i) << (4 + h))
            });
        }
    }
}

/// Row `row` of interleaved Q4_K or Q5_K rows back in ggml's layout.
fn unpack_kmin_row(w: GgmlType, n: usize, packed: &[u8], row: usize) -> Vec<u8> {
    let nb = n / 256;
    let (g, r) = (row / GROUP_ROWS, row % GROUP_ROWS);
    let five = w == GgmlType::Q5_K;
    let (wb, gb) = (w.type_size(), group_block_bytes(w));
    let windows = windows_of_packed(w, n, packed);
    let mut out = vec![0u8; nb * wb];
    for (b, block) in out.chunks_exact_mut(wb).enumerate() {
        let o = &packed[windows.index(g, b) * gb..][..gb];
        block[0..2].copy_from_slice(&o[2 * r..2 * r + 2]);
        block[2..4].copy_from_slice(&o[OFF_DMIN + 2 * r..OFF_DMIN + 2 * r + 2]);
        let sc: [u8; 8] = std::array::from_fn(|j| o[OFF_SCALES + 8 * j + r]);
        let mn: [u8; 8] = std::array::from_fn(|j| o[OFF_MINS + 16 * (j / 2) + 2 * r + j % 2]);
        // The inverse of scale_min_k4: low six bits of j < 4 in bytes j / j+4, the rest
        // split over the low nibbles of bytes 8..12 and the top bits of bytes 0..8.
        for j in 0..4 {
            block[4 + j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
            block[8 + j] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
            block[12 + j] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
        }
        // Q5_K's nibbles follow its 32 bytes of fifth bits.
        let qs = if five { 48 } else { 16 };
        for k in 0..256 {
            let (j, w) = (k / 32, k % 32);
            let (h, high) = (w % 16 / 4, w >= 16);
            let levels = if five {
                q5k_fifth(j) + 32
            } else {
                OFF_LEVELS + 128 * j
            };
            let byte = o[levels + 32 * h + 4 * r + w % 4];
            let q = if high { byte >> 4 } else { byte & 0x0F };
            let (c, v) = (k / 64, k % 64);
            block[qs + 32 * c + v % 32] |= if v < 32 { q } else { q << 4 };
            if five {
                let plane = o[q5k_fifth(j) + 4 * r + w % 4];
                let bit = (plane >> (h + 4 * usize::from(high))) & 1;
                block[16 + w] |= bit << j;
            }
        }
    }
    out
}

/// Where value k (0..256) of row r sits in a Q6_K group's super-block (`q6k_pair`): the
/// byte and shift of its low four bits, and of its top two.
fn q6k_place(r: usize, k: usize) -> ((usize, u8), (usize, u8)) {
    let (j, w) = (k / 32, k % 32);
    let (hi, h, i) = (w >= 16, w % 16 / 4, w % 4);
    let quarters = q6k_pair(j) + 96 * (h / 2) + 4 * r + i;
    let y = quarters + 32 * (h % 2);
    if hi {
        ((quarters + 64, 4 * (h % 2) as u8), (y, 6))
    } else {
        ((y, 0), (y, 4))
    }
}

/// Puts a Q6_K super-block as row r of its group super-block `o`.
fn place_q6k(o: &mut [u8], r: usize, block: &[u8]) {
    o[2 * r..2 * r + 2].copy_from_slice(&block[Q6_K_D..Q6_K_D + 2]);
    for s in 0..16 {
        o[Q6K_OFF_SCALES + 8 * s + r] = block[Q6_K_SCALES + s];
    }
    // The 256 levels in ggml's order: per half of 128, low nibbles of ql's first and
    // second 32 bytes, then their high nibbles, each with its two bits of qh.
    let mut q = [0u8; 256];
    for half in 0..2 {
        let (ql, qh) = (
            &block[64 * half..][..64],
            &block[Q6_K_QH + 32 * half..][..32],
        );
        let out = &mut q[128 * half..][..128];
        for l in 0..32 {
            let (a, b, h) = (ql[l], ql[32 + l], qh[l]);
            out[l] = (a & 0xF) | ((h & 3) << 4);
            out[32 + l] = (b & 0xF) | (((h >> 2) & 3) << 4);
            out[64 + l] = (a >> 4) | (((h >> 4) & 3) << 4);
            out[96 + l] = (b >> 4) | ((h >> 6) << 4);
        }
    }
    // Row r's bytes are ORed together from its levels' bits: cleared first, so a buffer
    // packed into before is overwritten, as the other formats' whole bytes are.
    for v in 0..8 * 6 {
        o[q6k_pair(0) + 32 * v + 4 * r..][..4].fill(0);
    }
    for (k, &level) in q.iter().enumerate() {
        let ((lo, ls), (hi, hs)) = q6k_place(r, k);
        o[lo] |= (level & 0x0F) << ls;
        o[hi] |= (level >> 4) << hs;
    }
}

/// Row `row` of interleaved Q6_K rows back in ggml's layout.
fn unpack_q6k_row(n: usize, packed: &[u8], row: usize) -> Vec<u8> {
    let nb = n / 256;
    let (g, r) = (row / GROUP_ROWS, row % GROUP_ROWS);
    let windows = windows_of_packed(GgmlType::Q6_K, n, packed);
    let mut out = vec![0u8; nb * Q6K_BLOCK];
    for (b, block) in out.chunks_exact_mut(Q6K_BLOCK).enumerate() {
        let o = &packed[windows.index(g, b) * Q6K_GROUP_BYTES..][..Q6K_GROUP_BYTES];
        block[Q6_K_D..Q6_K_D + 2].copy_from_slice(&o[2 * r..2 * r + 2]);
        for s in 0..16 {
            block[Q6_K_SCALES + s] = o[Q6K_OFF_SCALES + 8 * s + r];
        }
        for k in 0..256 {
            let ((lo, ls), (hi, hs)) = q6k_place(r, k);
            let q = ((o[lo] >> ls) & 0x0F) | (((o[hi] >> hs) & 3) << 4);
            // ggml's layout: halves of 128 values; in each, value l + 32 * quarter takes
            // ql[l (+32 for odd quarters)]'s low or high nibble and qh[l]'s bits
            // 2 * quarter.
            let (half, rest) = (k / 128, k % 128);
            let (quarter, l) = (rest / 32, rest % 32);
            let ql = 64 * half + l + 32 * (quarter % 2);
            block[ql] |= if quarter < 2 {
                q & 0x0F
            } else {
                (q & 0x0F) << 4
            };
            block[128 + 32 * half + l] |= (q >> 4) << (2 * quarter);
        }
    }
    out
}
