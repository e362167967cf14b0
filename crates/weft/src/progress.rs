//! Loading a model with a progress bar on stderr (hidden when stderr is not a terminal).

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use weft_model::Engine;

/// Default number of threads: the machine's cores.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Loads `path` for `n_ctx` tokens; returns the engine and the seconds it took.
pub fn load_engine(path: &Path, threads: usize, n_ctx: usize) -> Result<(Engine, f64)> {
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
    let engine = Engine::load(path, threads, n_ctx, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("loading {}", path.display()))?;
    bar.finish_and_clear();
    Ok((engine, t0.elapsed().as_secs_f64()))
}
