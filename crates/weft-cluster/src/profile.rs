//! What a node offers, as it measures it: memory, cores, OS and CPU, free disk, the model
//! files it holds, and its kernels' speed per weight type (measured once per CPU model and
//! thread count, then cached under the node's home directory).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use weft_kernels::calibrate::{self, TypeRate};
use weft_kernels::choose;
use weft_kernels::ThreadPool;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelFile {
    pub name: String,
    pub bytes: u64,
    /// The content's SHA-256 (hex), once the node has hashed the file (in the background
    /// from its start; cached by name, size and modification time).
    #[serde(default)]
    pub sha256: Option<String>,
}

/// The hash cache's key of a file: a changed size or modification time means rehashing.
fn hash_key(name: &str, meta: &std::fs::Metadata) -> String {
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs());
    format!("{name}|{}|{mtime}", meta.len())
}

fn read_hashes(cache: &Path) -> std::collections::BTreeMap<String, String> {
    std::fs::read(cache)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Hashes every model file under `home/models` that the cache under `home/calibration`
/// lacks, and records it (written whole to a temporary file, then renamed, so two nodes
/// of one home never leave a torn cache). Meant for a background thread at node start.
pub fn hash_models(home: &Path) {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let dir = home.join("models");
    let cache = home.join("calibration").join("model-hashes.json");
    for f in model_files(&dir, None) {
        let path = dir.join(&f.name);
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        let key = hash_key(&f.name, &meta);
        if read_hashes(&cache).contains_key(&key) {
            continue;
        }
        let Ok(mut file) = std::fs::File::open(&path) else {
            continue;
        };
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let ok = loop {
            match file.read(&mut buf) {
                Ok(0) => break true,
                Ok(n) => h.update(&buf[..n]),
                Err(_) => break false,
            }
        };
        if !ok {
            continue;
        }
        let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        let mut all = read_hashes(&cache);
        all.insert(key, hex);
        if let (Some(parent), Ok(text)) = (cache.parent(), serde_json::to_vec_pretty(&all)) {
            let _ = std::fs::create_dir_all(parent);
            let tmp = parent.join(format!("model-hashes.{}.tmp", std::process::id()));
            if std::fs::write(&tmp, text).is_ok() {
                let _ = std::fs::rename(&tmp, &cache);
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub name: String,
    pub cpu: String,
    pub os: String,
    pub arch: String,
    /// Cores this process may run on, and the compute threads it uses.
    pub cores: usize,
    pub threads: usize,
    pub memory_total: u64,
    pub memory_available: u64,
    /// `--memory-limit`, if set: what the node offers is the smaller of this and available.
    pub memory_limit: Option<u64>,
    pub disk_free: Option<u64>,
    pub models: Vec<ModelFile>,
    /// Kernel speeds per weight type, measured alone, already divided by `slowdown`.
    pub rates: Vec<TypeRate>,
    /// The same measured while every node of the survey measured too (empty: not
    /// measured); nodes sharing one machine's memory see less than alone.
    #[serde(default)]
    pub rates_loaded: Vec<TypeRate>,
    /// The test aid `weft node --slowdown F` (1: none).
    pub slowdown: f64,
}

impl NodeInfo {
    /// Bytes the node offers for a shard.
    pub fn offered_memory(&self) -> u64 {
        let avail = self.memory_available;
        self.memory_limit.map_or(avail, |l| l.min(avail))
    }

    /// The machine in brief, as a watcher (the dashboard) shows it.
    pub fn machine(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name, "os": self.os, "arch": self.arch, "cpu": self.cpu,
            "cores": self.cores, "threads": self.threads,
            "memory_total": self.memory_total, "memory_offered": self.offered_memory(),
        })
    }
}

/// A /proc/meminfo field in bytes ("MemAvailable").
pub fn meminfo(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let rest = s
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?;
    let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// The CPU model name (`model name` in /proc/cpuinfo), "unknown-cpu" where absent.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "node".into())
}

/// Free bytes of the file system holding `dir`.
fn disk_free(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we own; the path is NUL-terminated.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return None;
        }
        Some(st.f_bavail as u64 * st.f_frsize as u64)
    }
}

/// GGUF files directly under `dir` (and one level down: pulled repositories), with their
/// hashes from the cache file `hashes` where it has them.
fn model_files(dir: &Path, hashes: Option<&Path>) -> Vec<ModelFile> {
    fn visit(root: &Path, d: &Path, depth: usize, out: &mut Vec<ModelFile>) {
        let Ok(rd) = std::fs::read_dir(d) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() && depth == 0 {
                visit(root, &p, 1, out);
            } else if p.extension().is_some_and(|x| x == "gguf") {
                out.push(ModelFile {
                    name: p
                        .strip_prefix(root)
                        .unwrap_or(&p)
                        .to_string_lossy()
                        .into_owned(),
                    bytes: e.metadata().map(|m| m.len()).unwrap_or(0),
                    sha256: None,
                });
            }
        }
    }
    let mut out = Vec::new();
    visit(dir, dir, 0, &mut out);
    out.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(cache) = hashes {
        let known = read_hashes(cache);
        for f in &mut out {
            if let Ok(meta) = std::fs::metadata(dir.join(&f.name)) {
                f.sha256 = known.get(&hash_key(&f.name, &meta)).cloned();
            }
        }
    }
    out
}

/// A file-name-safe cache key for this CPU, `threads`, weft version, kernel revision and
/// the kernel switches set (`choose::switches_on`).
fn cache_key(threads: usize) -> String {
    format!(
        "{}-{threads}t-v{}-k{}{}",
        cpu_model(),
        env!("CARGO_PKG_VERSION"),
        choose::REVISION,
        choose::switches_on()
    )
    .chars()
    .map(|c| {
        if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
            c
        } else {
            '_'
        }
    })
    .collect()
}

/// Reads a JSON cache file, None when absent or unreadable (then it is measured again).
fn read_cache<T: serde::de::DeserializeOwned>(file: Option<&Path>) -> Option<T> {
    serde_json::from_slice(&std::fs::read(file?).ok()?).ok()
}

/// Writes a JSON cache file; a failed write only means measuring again next time.
fn write_cache<T: serde::Serialize>(file: Option<&Path>, value: &T) {
    if let Some(f) = file {
        if let Some(d) = f.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        if let Ok(text) = serde_json::to_vec_pretty(value) {
            let _ = std::fs::write(f, text);
        }
    }
}

/// Weights streamed to time decode, 192 MiB: several times the last-level cache of the
/// machines weft meets (a buffer only twice the cache stays partly cached and reads fast).
const CALIBRATION_BYTES: usize = 192 << 20;

/// How far (as a ratio either way) the speed measured now may stray from the cached
/// before the cache is measured again: past the noise between processes on a shared VM
/// (up to about 20 % measured), far inside the twofold moves seen between hosts.
const CACHE_TOLERANCE: f64 = 1.25;

/// The cached kernel rates for this CPU and thread count, or a fresh measurement (then
/// cached) where there is none or a spot check finds the machine's speed moved since.
/// `cache_dir` None: measure, keep nothing.
pub fn kernel_rates(threads: usize, cache_dir: Option<&Path>, fresh: bool) -> Vec<TypeRate> {
    kernel_rates_checked(threads, cache_dir, fresh, &|pool, cached| {
        calibrate::spot_check(pool, CALIBRATION_BYTES, cached)
    })
}

/// `kernel_rates` with the spot check given: it returns the speed now over the cached
/// (None: cannot tell, the cache stands).
fn kernel_rates_checked(
    threads: usize,
    cache_dir: Option<&Path>,
    fresh: bool,
    spot_check: &dyn Fn(&ThreadPool, &[TypeRate]) -> Option<f64>,
) -> Vec<TypeRate> {
    let file: Option<PathBuf> =
        cache_dir.map(|d| d.join(format!("kernels-{}.json", cache_key(threads))));
    let pool = ThreadPool::new(threads.max(1));
    if !fresh {
        if let Some(r) = read_cache::<Vec<TypeRate>>(file.as_deref())
            .filter(|r| r.len() == calibrate::MEASURED.len())
        {
            // The cache is keyed by CPU model, but a VM of one model can land on a host
            // with slower memory or clocks: a cheap spot check decides whether it holds.
            let spot = spot_check(&pool, &r);
            tracing::debug!("kernel speed now / cached: {spot:?}");
            match spot {
                Some(ratio) if !(1.0 / CACHE_TOLERANCE..=CACHE_TOLERANCE).contains(&ratio) => {
                    tracing::warn!(
                        "this machine now runs its kernels at {ratio:.2}x the cached speed: timing them again"
                    )
                }
                _ => return r,
            }
        }
    }
    let rates = calibrate::measure(&pool, CALIBRATION_BYTES);
    write_cache(file.as_deref(), &rates);
    rates
}

/// Puts in force the kernel paths measured fastest on this CPU model (one thread: a
/// path's speed is the core's), from the cache under `cache_dir` or timed now (about two
/// seconds, then cached); `fresh` times them again. Returns the report.
pub fn select_kernels(cache_dir: Option<&Path>, fresh: bool) -> choose::Report {
    let file: Option<PathBuf> =
        cache_dir.map(|d| d.join(format!("kernel-paths-{}.json", cache_key(1))));
    if !fresh {
        if let Some(r) = read_cache::<choose::Report>(file.as_deref()) {
            choose::apply(&r);
            return r;
        }
    }
    let t = std::time::Instant::now();
    let report = choose::choose(&ThreadPool::new(1), choose::Budget::STARTUP);
    tracing::info!(
        "timed the kernel paths of this CPU in {:.2} s",
        t.elapsed().as_secs_f64()
    );
    write_cache(file.as_deref(), &report);
    report
}

/// This node's profile: `home` is its weft home (models/ and the kernel cache); `fresh`
/// times the kernels again instead of reading the cache.
pub fn local_info(
    home: Option<&Path>,
    fresh: bool,
    threads: usize,
    memory_limit: Option<u64>,
    slowdown: f64,
) -> NodeInfo {
    let mut info = local_facts(home, threads, memory_limit, slowdown);
    info.rates = kernel_rates(
        threads,
        home.map(|h| h.join("calibration")).as_deref(),
        fresh,
    );
    for r in &mut info.rates {
        r.slow_down(info.slowdown);
    }
    info
}

/// This node's profile without its kernel speeds (`rates` empty): what a single-node
/// server shows of its machine, with nothing timed.
pub fn local_facts(
    home: Option<&Path>,
    threads: usize,
    memory_limit: Option<u64>,
    slowdown: f64,
) -> NodeInfo {
    let slowdown = if slowdown.is_finite() && slowdown >= 1.0 {
        slowdown
    } else {
        1.0
    };
    let models_dir = home.map(|h| h.join("models"));
    NodeInfo {
        name: hostname(),
        cpu: cpu_model(),
        os: std::env::consts::OS.into(),
        arch: std::env::consts::ARCH.into(),
        cores: weft_kernels::pool::usable_cores(),
        threads,
        memory_total: meminfo("MemTotal").unwrap_or(0),
        memory_available: meminfo("MemAvailable").unwrap_or(0),
        memory_limit,
        disk_free: home.and_then(disk_free),
        models: match (models_dir.as_deref(), home) {
            (Some(d), Some(h)) => {
                model_files(d, Some(&h.join("calibration").join("model-hashes.json")))
            }
            _ => Vec::new(),
        },
        rates: Vec::new(),
        rates_loaded: Vec::new(),
        slowdown,
    }
}

/// The kernel speeds measured now, uncached (a survey's loaded measurement, taken while
/// the other nodes measure too). A `slowdown` stretches each pass as a run's compute is
/// stretched (`stage::stretch_by`), not divided afterwards: a node slowed F times then
/// streams 1/F of the bytes a second it could, so the nodes beside it see the memory a
/// node that slow would leave them.
pub fn loaded_rates(threads: usize, slowdown: f64) -> Vec<TypeRate> {
    let pool = ThreadPool::new(threads.max(1));
    calibrate::measure_decode_together(&pool, 64 << 20, 0.1, &|took| {
        crate::stage::stretch_by(slowdown, took)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_describes_itself_and_caches_its_kernel_speeds() {
        let home = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(home.path().join("models/org--repo")).unwrap();
        std::fs::write(home.path().join("models/a.gguf"), b"1234").unwrap();
        std::fs::write(home.path().join("models/org--repo/b.gguf"), b"12").unwrap();
        std::fs::write(home.path().join("models/notes.txt"), b"x").unwrap();
        let info = local_info(Some(home.path()), false, 1, Some(1 << 30), 2.0);
        let names: Vec<(&str, u64)> = info
            .models
            .iter()
            .map(|m| (m.name.as_str(), m.bytes))
            .collect();
        assert_eq!(names, vec![("a.gguf", 4), ("org--repo/b.gguf", 2)]);
        assert!(
            info.models.iter().all(|m| m.sha256.is_none()),
            "not hashed yet"
        );
        // Cached: a second call reads the file and halves the same figures. (Checked
        // before any other call with the real spot check, which may time the machine
        // again while other tests load it.)
        let cached = std::fs::read_dir(home.path().join("calibration"))
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().starts_with("kernels-")
            })
            .count();
        assert_eq!(cached, 1);
        let dir = home.path().join("calibration");
        let holds = |_: &ThreadPool, _: &[TypeRate]| Some(1.1);
        let again = kernel_rates_checked(1, Some(&dir), false, &holds);
        for (slow, fast) in info.rates.iter().zip(&again) {
            assert!((slow.decode_bytes_per_s * 2.0 - fast.decode_bytes_per_s).abs() < 1.0);
        }
        hash_models(home.path());
        let hashed = local_info(Some(home.path()), false, 1, None, 1.0);
        // sha256("1234")
        assert_eq!(
            hashed.models[0].sha256.as_deref(),
            Some("03ac674216f3e15c761ee1a5e255f067953623c8b388b4459e13f978d7c846f4")
        );
        assert!(hashed.models[1].sha256.is_some());
        assert!(info.memory_total > 0 && info.cores >= 1);
        assert_eq!(info.offered_memory(), (1 << 30).min(info.memory_available));
        assert!(info.disk_free.is_some());
        // A machine now at half the cached speed measures again and caches that.
        let moved = |_: &ThreadPool, _: &[TypeRate]| Some(0.5);
        let remeasured = kernel_rates_checked(1, Some(&dir), false, &moved);
        assert_ne!(remeasured, again);
        assert!(same_rates(
            &kernel_rates_checked(1, Some(&dir), false, &holds),
            &remeasured
        ));
    }

    /// Equal up to JSON's last-digit rounding of floats.
    fn same_rates(a: &[TypeRate], b: &[TypeRate]) -> bool {
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * x.abs().max(y.abs());
        a.len() == b.len()
            && a.iter().zip(b).all(|(a, b)| {
                a.ty == b.ty
                    && close(a.decode_bytes_per_s, b.decode_bytes_per_s)
                    && close(a.decode_short_bytes_per_s, b.decode_short_bytes_per_s)
                    && close(a.prefill_bytes_per_s, b.prefill_bytes_per_s)
            })
    }

    #[test]
    fn a_cache_claiming_ten_times_this_machines_speed_is_measured_again() {
        let home = tempfile::tempdir().unwrap();
        let dir = home.path().join("calibration");
        let measured = kernel_rates(1, Some(&dir), false);
        let file = dir.join(format!("kernels-{}.json", cache_key(1)));
        let boasted: Vec<TypeRate> = measured
            .iter()
            .map(|r| {
                let mut r = r.clone();
                r.slow_down(0.1);
                r
            })
            .collect();
        write_cache(Some(&file), &boasted);
        let now = kernel_rates(1, Some(&dir), false);
        let q8 = |rates: &[TypeRate]| {
            calibrate::rate_of(rates, weft_gguf::GgmlType::Q8_0)
                .unwrap()
                .decode_bytes_per_s
        };
        assert!(
            q8(&now) < q8(&boasted) / 3.0,
            "{} vs {}",
            q8(&now),
            q8(&boasted)
        );
        assert!(same_rates(
            &read_cache::<Vec<TypeRate>>(Some(&file)).unwrap(),
            &now
        ));
    }
}
