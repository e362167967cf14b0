//! Loading a model with a progress bar on stderr (hidden when stderr is not a terminal).

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use weft_model::Engine;

/// Default number of threads: the cores this process may use (its affinity mask).
pub fn default_threads() -> usize {
    weft_kernels::pool::usable_cores()
}

/// More threads than this many times the usable cores is surely a mistake.
const MAX_THREADS_PER_CORE: usize = 8;

/// The thread count to run with: `asked`, or the usable cores. Above the cores it warns
/// (every extra thread waits for a core, and the pool yields while it waits); far above
/// them it refuses, naming both numbers.
pub fn resolve_threads(asked: Option<usize>) -> Result<usize> {
    let cores = default_threads();
    let Some(n) = asked else {
        return Ok(cores);
    };
    if n == 0 {
        anyhow::bail!("--threads must be at least 1");
    }
    if n > cores * MAX_THREADS_PER_CORE {
        anyhow::bail!(
            "--threads {n} is more than {MAX_THREADS_PER_CORE} times the {cores} cores this process may use"
        );
    }
    if n > cores {
        eprintln!(
            "warning: --threads {n} is more than the {cores} cores this process may use: threads will wait for cores and decoding will be slower than with --threads {cores}"
        );
    }
    Ok(n)
}

/// Loads `path` for `n_ctx` tokens, its KV cache stored as `cache_type`; returns the
/// engine and the seconds it took.
pub fn load_engine(
    path: &Path,
    threads: usize,
    n_ctx: usize,
    cache_type: weft_model::CacheType,
) -> Result<(Engine, f64)> {
    let t0 = Instant::now();
    let bar = ProgressBar::new(1);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let mut engine = Engine::load(path, threads, n_ctx, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("loading {}", path.display()))?;
    bar.finish_and_clear();
    if cache_type != engine.model.cache_type() {
        engine.set_cache_type(cache_type);
    }
    Ok((engine, t0.elapsed().as_secs_f64()))
}
