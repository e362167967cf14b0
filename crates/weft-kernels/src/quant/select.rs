//! Which kernel path each weight type takes, per shape class, on this CPU: the candidate
//! paths the CPU can run, the one in use (a process-wide choice, set from a measurement
//! by `choose::choose`, a fixed guess until then), and their names for reports.
//!
//! Why measured and not guessed: the same instruction mix wins on one x86 core and loses
//! on another (Zen 4 runs 512-bit ops as two halves; its hardware prefetcher makes
//! software prefetches a loss that was a win elsewhere).

use std::sync::atomic::{AtomicU8, Ordering};

use serde::{Deserialize, Serialize};
use weft_gguf::GgmlType;

/// Shape classes, by tokens per call: one (decode: rows of more than `SHORT_ROW` values,
/// or short ones, where the hardware prefetcher behaves differently), a few (batched
/// decode), many (prefill).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Shape {
    Decode,
    DecodeShort,
    Batch,
    Prefill,
}

impl Shape {
    pub const ALL: [Shape; 4] = [
        Shape::Decode,
        Shape::DecodeShort,
        Shape::Batch,
        Shape::Prefill,
    ];
    /// Most tokens a call may have to count as `Batch`.
    pub const BATCH_MAX: usize = 16;
    /// Longest row (values) a `DecodeShort` matvec has.
    pub const SHORT_ROW: usize = 1024;

    /// The class of a call of `m` tokens over rows of `n` values.
    pub fn of(m: usize, n: usize) -> Shape {
        match m {
            0 | 1 if n <= Self::SHORT_ROW => Shape::DecodeShort,
            0 | 1 => Shape::Decode,
            2..=Self::BATCH_MAX => Shape::Batch,
            _ => Shape::Prefill,
        }
    }

    /// One token per call.
    pub fn is_decode(self) -> bool {
        matches!(self, Shape::Decode | Shape::DecodeShort)
    }

    pub fn name(self) -> &'static str {
        match self {
            Shape::Decode => "decode",
            Shape::DecodeShort => "decode-short",
            Shape::Batch => "batch",
            Shape::Prefill => "prefill",
        }
    }
}

/// How the integer products are summed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Fused {
    /// AVX2 only (`maddubs`, `madd`, `add`).
    Avx2,
    /// K formats: the scale multiply-add as one AVX-VNNI `vpdpwssd` (VEX); 32-value
    /// formats: `maddubs` and `madd` as one `vpdpbusd`. Exact integer sums in the same
    /// lanes, so the same results as `Avx2` to the bit.
    AvxVnni,
    /// The same as AVX-512 VNNI on 256-bit registers (EVEX, needs AVX512VL).
    Avx512Vnni256,
    /// 32-value formats, two tokens or more: the 512-bit `vpdpbusd` tile. It sums in
    /// another order than the AVX2 tile, so it is never one of several candidates (ranks
    /// timing alike could choose unalike and part at near-ties): it is the only path,
    /// for every process, where `WEFT_KERNELS_VNNI512=1` asks for it.
    Avx512Vnni512,
    /// K formats, two tokens or more: 512-bit `vpdpbusd` over two sub-blocks at once and
    /// the scales by `vpdpwssd`, summing the AVX2 tile's i32 lanes (same results to the
    /// bit, so one more timed candidate).
    Avx512VnniZmm,
}

/// One candidate path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Path {
    pub fused: Fused,
    /// Decode: software prefetches a few rows ahead of the stream (otherwise the hardware
    /// prefetcher alone).
    pub prefetch: bool,
}

impl Path {
    pub fn name(self) -> String {
        let f = match self.fused {
            Fused::Avx2 => "avx2",
            Fused::AvxVnni => "avx-vnni",
            Fused::Avx512Vnni256 => "avx512vnni-256",
            Fused::Avx512Vnni512 => "avx512vnni-512",
            Fused::Avx512VnniZmm => "avx512vnni-zmm",
        };
        if self.prefetch {
            format!("{f}+prefetch")
        } else {
            f.to_string()
        }
    }

    fn code(self) -> u8 {
        let f = match self.fused {
            Fused::Avx2 => 0,
            Fused::AvxVnni => 1,
            Fused::Avx512Vnni256 => 2,
            Fused::Avx512Vnni512 => 3,
            Fused::Avx512VnniZmm => 4,
        };
        1 + f * 2 + self.prefetch as u8
    }

    fn from_code(c: u8) -> Option<Path> {
        let c = c.checked_sub(1)?;
        let fused = match c / 2 {
            0 => Fused::Avx2,
            1 => Fused::AvxVnni,
            2 => Fused::Avx512Vnni256,
            3 => Fused::Avx512Vnni512,
            4 => Fused::Avx512VnniZmm,
            _ => return None,
        };
        Some(Path {
            fused,
            prefetch: c % 2 == 1,
        })
    }
}

/// Whether the SIMD kernels run here: AVX2, FMA and F16C detected once, and
/// `WEFT_KERNELS_SCALAR` (set and not "0", for comparisons and debugging) not forcing the
/// scalar path.
pub fn simd() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        if std::env::var_os("WEFT_KERNELS_SCALAR").is_some_and(|v| v != "0") {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// What the CPU offers, detected once (`WEFT_KERNELS_NO_VNNI` hides every VNNI form).
#[derive(Clone, Copy, Debug)]
struct Features {
    avx_vnni: bool,
    avx512_vnni_256: bool,
    avx512_vnni_512: bool,
    avx512_vnni_zmm: bool,
}

fn features() -> Features {
    static F: std::sync::OnceLock<Features> = std::sync::OnceLock::new();
    *F.get_or_init(|| {
        let set = |k: &str| std::env::var_os(k).is_some_and(|v| v != "0");
        let off = set("WEFT_KERNELS_NO_VNNI");
        #[cfg(target_arch = "x86_64")]
        {
            let avx512 = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni");
            Features {
                avx_vnni: !off && is_x86_feature_detected!("avxvnni"),
                avx512_vnni_256: !off && avx512 && is_x86_feature_detected!("avx512vl"),
                avx512_vnni_512: !off && avx512 && set("WEFT_KERNELS_VNNI512"),
                avx512_vnni_zmm: !off && avx512,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = off;
            Features {
                avx_vnni: false,
                avx512_vnni_256: false,
                avx512_vnni_512: false,
                avx512_vnni_zmm: false,
            }
        }
    })
}

/// Weight types with SIMD kernels on ggml's rows. Not Q8_K, an activation format, nor
/// Q4_1 and Q5_1, the fallbacks of Q4_K and Q5_K files for rows K-quants cannot hold:
/// they run interleaved where a VNNI form runs, and scalar elsewhere.
pub fn has_row_kernels(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::Q8_K | GgmlType::Q4_1 | GgmlType::Q5_1)
}

fn is_k(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

fn is_legacy(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0)
}

/// Whether this CPU can run `path` at all (its instructions are present and allowed).
pub fn runnable(path: Path) -> bool {
    let f = features();
    simd()
        && match path.fused {
            Fused::Avx2 => true,
            Fused::AvxVnni => f.avx_vnni,
            Fused::Avx512Vnni256 => f.avx512_vnni_256,
            Fused::Avx512Vnni512 => f.avx512_vnni_512,
            Fused::Avx512VnniZmm => f.avx512_vnni_zmm,
        }
}

/// Whether interleaved rows of `w` can run in form `fused`: every form but AVX2's, whose
/// `maddubs` saturates its i16 pairs on Q8_0's levels (0..256), runs every packable type.
pub fn interleaves(fused: Fused, w: GgmlType) -> bool {
    !(fused == Fused::Avx2 && w == GgmlType::Q8_0)
}

/// Whether rows of `w` are worth interleaving where `fused` is the interleaved form (given
/// it runs them, [`interleaves`]): always with a VNNI form; with AVX2's alone, not for
/// Q5_K, whose interleaved decode was slower than its row kernels on AMD Zen 3 (dense
/// 1.5 B Q5_K_M, `weft bench -n 64`, medians of five side by side: 1 thread 11.2 against
/// 12.4 tok/s, 2 threads 19.5 against 22.1) though its prefill was 30 % faster. Q6_K
/// interleaved there decoded as fast as its rows at 2 threads and 11 % faster at 1 (the
/// same model at Q4_K_M), its prefill 9 % faster; Q4_K, Q4_0 and Q5_0 were faster at
/// every shape (Q4_1 and Q5_1 have no row kernels at all).
pub fn worth_interleaving(fused: Fused, w: GgmlType) -> bool {
    fused != Fused::Avx2 || w != GgmlType::Q5_K
}

/// The 256-bit VNNI form this CPU runs, AVX-512's encoding first (it has 32 registers):
/// the form of the interleaved kernels and of `roofline`'s integer peak. None where
/// neither runs.
pub fn vnni_form() -> Option<Fused> {
    [Fused::Avx512Vnni256, Fused::AvxVnni]
        .into_iter()
        .find(|&fused| {
            runnable(Path {
                fused,
                prefetch: false,
            })
        })
}

/// A short list of paths, kept inline (the kernels consult it per call, so no heap).
#[derive(Clone, Copy, Debug)]
pub struct Paths {
    items: [Path; 8],
    len: usize,
}

impl Paths {
    fn push(&mut self, p: Path) {
        if self.len < self.items.len() {
            self.items[self.len] = p;
            self.len += 1;
        }
    }

    pub fn as_slice(&self) -> &[Path] {
        &self.items[..self.len]
    }
}

/// The paths this CPU can run for `ty` at `shape` (empty where only the scalar path
/// exists), the fixed guess first. They all give the same results to the bit (prefetches
/// and the fused forms of exact integer sums), so whichever a process picks, every rank of
/// a cluster computes alike.
pub fn candidates(ty: GgmlType, shape: Shape) -> Paths {
    let mut out = Paths {
        items: [Path {
            fused: Fused::Avx2,
            prefetch: false,
        }; 8],
        len: 0,
    };
    if !simd() || !has_row_kernels(ty) {
        return out;
    }
    let mut fused = Paths { len: 0, ..out };
    let mut add = |f: Fused| {
        let p = Path {
            fused: f,
            prefetch: false,
        };
        if runnable(p) {
            fused.push(p);
        }
    };
    let vnni512 = is_legacy(ty)
        && !shape.is_decode()
        && runnable(Path {
            fused: Fused::Avx512Vnni512,
            prefetch: false,
        });
    if vnni512 {
        // Its own order: the only candidate (see `Fused::Avx512Vnni512`).
        add(Fused::Avx512Vnni512);
    } else {
        if is_k(ty) {
            add(Fused::AvxVnni);
        }
        add(Fused::Avx2);
        if is_legacy(ty) {
            add(Fused::AvxVnni);
        }
        if is_k(ty) || is_legacy(ty) {
            add(Fused::Avx512Vnni256);
        }
        if is_k(ty) && !shape.is_decode() {
            add(Fused::Avx512VnniZmm);
        }
    }
    let prefetch: &[bool] = if shape.is_decode() {
        &[true, false]
    } else {
        &[true]
    };
    for &p in prefetch {
        for f in fused.as_slice() {
            out.push(Path {
                fused: f.fused,
                prefetch: p,
            });
        }
    }
    out
}

const TYPES: usize = GgmlType::WEIGHT_TYPES.len();
/// 0: not set, else `Path::code`.
const SHAPES: usize = Shape::ALL.len();
static CHOSEN: [[AtomicU8; SHAPES]; TYPES] =
    [const { [const { AtomicU8::new(0) }; SHAPES] }; TYPES];

/// A per-type, per-shape table's slot for `ty` at `shape`.
fn slot_in(
    table: &'static [[AtomicU8; SHAPES]; TYPES],
    ty: GgmlType,
    shape: Shape,
) -> Option<&'static AtomicU8> {
    let t = GgmlType::WEIGHT_TYPES.iter().position(|&w| w == ty)?;
    let s = Shape::ALL.iter().position(|&x| x == shape)?;
    Some(&table[t][s])
}

fn slot(ty: GgmlType, shape: Shape) -> Option<&'static AtomicU8> {
    slot_in(&CHOSEN, ty, shape)
}

/// The path `ty` takes at `shape`: the chosen one, else the first candidate.
pub fn chosen(ty: GgmlType, shape: Shape) -> Option<Path> {
    let set = slot(ty, shape).and_then(|s| Path::from_code(s.load(Ordering::Relaxed)));
    set.or_else(|| candidates(ty, shape).as_slice().first().copied())
}

/// Makes `path` the one `ty` takes at `shape`; refused (false) when this CPU cannot run it.
pub fn choose(ty: GgmlType, shape: Shape, path: Path) -> bool {
    if !candidates(ty, shape).as_slice().contains(&path) {
        return false;
    }
    match slot(ty, shape) {
        Some(s) => {
            s.store(path.code(), Ordering::Relaxed);
            true
        }
        None => false,
    }
}

/// Whether interleaved rows prefetch in software at each type and shape class: 0 not
/// set (then yes, the guess), 1 no, 2 yes. Timed like the row layout's prefetch (both
/// give the same bits): Zen 4's hardware prefetcher made it a loss that was a win on an
/// Intel core.
static PACKED_PREFETCH: [[AtomicU8; SHAPES]; TYPES] =
    [const { [const { AtomicU8::new(0) }; SHAPES] }; TYPES];

fn packed_slot(ty: GgmlType, shape: Shape) -> Option<&'static AtomicU8> {
    slot_in(&PACKED_PREFETCH, ty, shape)
}

/// Whether interleaved rows of `ty` prefetch in software at `shape` (they do only while
/// few tokens share each group, whatever this says).
pub fn packed_prefetch(ty: GgmlType, shape: Shape) -> bool {
    packed_slot(ty, shape).is_none_or(|s| s.load(Ordering::Relaxed) != 1)
}

/// Sets [`packed_prefetch`] for `ty` at `shape`.
pub fn choose_packed_prefetch(ty: GgmlType, shape: Shape, on: bool) {
    if let Some(s) = packed_slot(ty, shape) {
        s.store(1 + on as u8, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_zero_is_unset() {
        for fused in [
            Fused::Avx2,
            Fused::AvxVnni,
            Fused::Avx512Vnni256,
            Fused::Avx512Vnni512,
            Fused::Avx512VnniZmm,
        ] {
            for prefetch in [false, true] {
                let p = Path { fused, prefetch };
                assert_eq!(Path::from_code(p.code()), Some(p));
            }
        }
        assert_eq!(Path::from_code(0), None);
        assert_eq!(Path::from_code(200), None);
    }

    #[test]
    fn interleaved_prefetch_is_on_until_a_choice_turns_it_off() {
        // F32 rows never interleave, so no timed report sets this slot meanwhile.
        let (ty, shape) = (GgmlType::F32, Shape::Batch);
        assert!(packed_prefetch(ty, shape));
        choose_packed_prefetch(ty, shape, false);
        assert!(!packed_prefetch(ty, shape));
        assert!(packed_prefetch(ty, Shape::Decode), "one slot per shape");
        choose_packed_prefetch(ty, shape, true);
        assert!(packed_prefetch(ty, shape));
    }

    #[test]
    fn shapes_by_token_count() {
        assert_eq!(Shape::of(1, 2048), Shape::Decode);
        assert_eq!(Shape::of(1, 640), Shape::DecodeShort);
        assert_eq!(Shape::of(2, 640), Shape::Batch);
        assert_eq!(Shape::of(16, 4096), Shape::Batch);
        assert_eq!(Shape::of(17, 4096), Shape::Prefill);
    }

    #[test]
    fn only_runnable_paths_are_accepted() {
        let bogus = Path {
            fused: Fused::Avx512Vnni512,
            prefetch: false,
        };
        // The 512-bit tile never serves one token, nor a K format.
        assert!(!candidates(GgmlType::Q8_0, Shape::Decode)
            .as_slice()
            .contains(&bogus));
        assert!(!choose(GgmlType::Q4_K, Shape::Prefill, bogus));
        for ty in GgmlType::WEIGHT_TYPES {
            for shape in Shape::ALL {
                let c = candidates(ty, shape);
                let c = c.as_slice();
                if simd() {
                    assert_eq!(!c.is_empty(), has_row_kernels(ty), "{ty} {shape:?}");
                }
                assert_eq!(chosen(ty, shape).is_some(), !c.is_empty());
            }
        }
    }
}
