//! What serving a number of sequences costs in memory, checked before anything is
//! allocated: an oversized `--parallel` or `--ctx` is refused with both figures instead
//! of aborting on a failed allocation.

use crate::config::ModelConfig;
use crate::kv::CacheType;

/// Bytes of the KV caches (keys and values stored as `ty`) and logits rows of `slots`
/// sequences of up to `n_ctx` tokens, laid out as `KvCache::new` does: a sliding-window
/// layer holds its window plus one micro-batch (`ubatch`), a global layer the whole
/// context.
pub fn serving_bytes(
    cfg: &ModelConfig,
    slots: usize,
    (n_ctx, ubatch): (usize, usize),
    ty: CacheType,
) -> u128 {
    let n_ctx = n_ctx.min(cfg.n_ctx_train).max(1) as u128;
    let per_pos = cfg.kv_floats_per_token_layer() as u128 * ty.bytes() as u128;
    let per_slot: u128 = cfg
        .window
        .iter()
        .map(|w| {
            let cap = w.map_or(n_ctx, |w| (w as u128 + ubatch as u128).min(n_ctx));
            cap * per_pos
        })
        .sum();
    let logits = cfg.n_vocab as u128 * 4;
    slots.max(1) as u128 * (per_slot + logits)
}

/// MemAvailable from /proc/meminfo, in bytes (None where there is no such file).
pub fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&s)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Refuses `slots` × `n_ctx` when their caches need more than `available` bytes; the
/// error names both options and both figures.
pub fn check_fits(
    cfg: &ModelConfig,
    slots: usize,
    (n_ctx, ubatch): (usize, usize),
    ty: CacheType,
    available: u64,
) -> Result<(), String> {
    let need = serving_bytes(cfg, slots, (n_ctx, ubatch), ty);
    if need <= available as u128 {
        return Ok(());
    }
    let what = if slots > 1 {
        format!("--parallel {slots} × --ctx {n_ctx}")
    } else {
        format!("--ctx {n_ctx}")
    };
    Err(format!(
        "{what} needs {} of KV cache and logits; this machine has {} available",
        human_bytes(need),
        human_bytes(available as u128)
    ))
}

/// Bytes in decimal units with one decimal: "3.1 TB", "21.4 GB".
pub fn human_bytes(b: u128) -> String {
    const UNITS: [&str; 6] = ["B", "kB", "MB", "GB", "TB", "PB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Arch;
    use crate::synthetic::{synthetic_model, SyntheticSpec};
    use weft_gguf::{GgmlType, GgufFile};

    fn cfg() -> ModelConfig {
        let spec = SyntheticSpec::small(Arch::Llama, GgmlType::Q8_0);
        let bytes = synthetic_model(&spec).to_bytes();
        let f = GgufFile::from_bytes("synthetic.gguf", bytes).unwrap();
        ModelConfig::from_gguf(&f).unwrap()
    }

    #[test]
    fn bytes_follow_the_cache_layout() {
        let c = cfg();
        // 3 global layers x 2 KV heads x 64 dims x (K, V) x 4 bytes a position, half
        // that in f16.
        let per_pos = 3 * 2 * 64 * 2 * 4;
        let logits = c.n_vocab as u128 * 4;
        let f32 = CacheType::F32;
        assert_eq!(serving_bytes(&c, 1, (100, 32), f32), 100 * per_pos + logits);
        assert_eq!(
            serving_bytes(&c, 8, (100, 32), f32),
            8 * (100 * per_pos + logits)
        );
        let half = serving_bytes(&c, 8, (100, 32), CacheType::F16);
        assert_eq!(half, 8 * (100 * per_pos / 2 + logits));
        // The context is capped at the trained one (2048), as the caches are.
        assert_eq!(
            serving_bytes(&c, 1, (1 << 30, 32), f32),
            2048 * per_pos + logits
        );
    }

    #[test]
    fn too_many_slots_are_refused_with_both_figures() {
        let c = cfg();
        let f32 = CacheType::F32;
        assert!(check_fits(&c, 8, (1024, 32), f32, 21_400_000_000).is_ok());
        let e = check_fits(&c, 100_000, (1024, 32), f32, 21_400_000_000).unwrap_err();
        assert!(
            e.starts_with("--parallel 100000 × --ctx 1024 needs 314.8 GB"),
            "{e}"
        );
        assert!(e.contains("this machine has 21.4 GB available"), "{e}");
        // An f16 cache needs about half.
        let e = check_fits(&c, 100_000, (1024, 32), CacheType::F16, 21_400_000_000).unwrap_err();
        assert!(e.contains("needs 157."), "{e}");
    }

    #[test]
    fn meminfo_and_units() {
        let m = "MemTotal:       24000000 kB\nMemAvailable:   20897228 kB\n";
        assert_eq!(parse_mem_available(m), Some(20_897_228 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(3_100_000_000_000), "3.1 TB");
    }
}
