//! `weft pull OWNER/REPO[:QUANT]`: every file of that quantization from a Hugging Face–
//! compatible hub (`HF_ENDPOINT`, `HF_TOKEN`) into the models directory, with a progress
//! bar; the work (listing, choice, resumable verified download) is weft-hub's.

use std::path::PathBuf;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use weft_hub::{pick_files, HubClient, RepoSpec};

use crate::paths::models_dir;

/// Fetches `spec`'s files; prints the path to pass as `--model` (the first part).
pub fn pull(spec: &str) -> Result<PathBuf> {
    let spec: RepoSpec = spec.parse()?;
    let client = HubClient::from_env();
    let files = client.list(&spec.repo)?;
    let picked = pick_files(&files, spec.quant.as_deref(), &spec.repo)?;
    let dir = models_dir();
    let mut first = None;
    for (i, f) in picked.iter().enumerate() {
        let dest = HubClient::local_path(&dir, &spec.repo, f)?;
        let bar = ProgressBar::new(f.size);
        bar.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_message(format!("[{}/{}] {}", i + 1, picked.len(), f.path));
        client.download(&spec.repo, f, &dest, &mut |done, _| bar.set_position(done))?;
        bar.finish_and_clear();
        eprintln!("{} verified (sha256)", dest.display());
        first.get_or_insert(dest);
    }
    let first = first.ok_or_else(|| anyhow::anyhow!("nothing was picked"))?;
    outln!("{}", first.display())?;
    Ok(first)
}
