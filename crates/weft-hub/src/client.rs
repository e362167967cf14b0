//! The hub's HTTP side: list a repository (tree API, LFS sha256 per file) and download a
//! file with Range resumption into `NAME.part`, kept under its name only once verified.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Times a cut transfer is resumed within one download before giving up.
const ATTEMPTS: usize = 5;
const CHUNK: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("{0}")]
    Spec(String),
    #[error("{url}: {detail}")]
    Http { url: String, detail: String },
    #[error("{0} holds no GGUF file")]
    NoGguf(String),
    #[error("{repo} has no {quant} GGUF; it has: {}", if available.is_empty() { "none".to_string() } else { available.join(", ") })]
    NoQuant {
        repo: String,
        quant: String,
        available: Vec<String>,
    },
    #[error("{path}: sha256 is {got}, the hub says {want}; the download was not kept")]
    Checksum {
        path: String,
        got: String,
        want: String,
    },
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
}

/// One file of a repository as the hub lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubFile {
    pub path: String,
    pub size: u64,
    /// From the LFS pointer; None for a file kept outside LFS.
    pub sha256: Option<String>,
}

#[derive(Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: u64,
    lfs: Option<Lfs>,
}

#[derive(Deserialize)]
struct Lfs {
    oid: String,
    size: u64,
}

pub struct HubClient {
    endpoint: String,
    token: Option<String>,
    agent: ureq::Agent,
}

/// Percent-encodes a repository path for a URL (keeps `/`).
fn encode_path(p: &str) -> String {
    let mut out = String::with_capacity(p.len());
    for b in p.bytes() {
        if b.is_ascii_alphanumeric() || b"-_./~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> HubError + '_ {
    move |error| HubError::Io {
        path: path.to_path_buf(),
        error,
    }
}

impl HubClient {
    /// A client for `endpoint` (e.g. `https://huggingface.co`), sending `token` if any.
    pub fn new(endpoint: &str, token: Option<String>) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(15)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .build()
            .into();
        HubClient {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token: token.filter(|t| !t.trim().is_empty()),
            agent,
        }
    }

    /// The client the environment asks for: `HF_ENDPOINT` (default the Hugging Face Hub)
    /// and `HF_TOKEN`.
    pub fn from_env() -> Self {
        let endpoint =
            std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into());
        Self::new(&endpoint, std::env::var("HF_TOKEN").ok())
    }

    fn get(
        &self,
        url: &str,
        range_from: u64,
    ) -> Result<ureq::http::Response<ureq::Body>, HubError> {
        let mut req = self.agent.get(url);
        if let Some(t) = &self.token {
            req = req.header("Authorization", format!("Bearer {t}"));
        }
        if range_from > 0 {
            req = req.header("Range", format!("bytes={range_from}-"));
        }
        req.call().map_err(|e| HubError::Http {
            url: url.to_string(),
            detail: e.to_string(),
        })
    }

    /// The resolve URL of `path` in `repo` at its main revision.
    pub fn file_url(&self, repo: &str, path: &str) -> String {
        format!(
            "{}/{repo}/resolve/main/{}",
            self.endpoint,
            encode_path(path)
        )
    }

    /// Bytes `range` of the file at `url`, by an HTTP Range request; the answer must be
    /// exactly those bytes (206 with the range asked, or 200 for a range of the whole).
    pub fn get_range(&self, url: &str, range: std::ops::Range<u64>) -> Result<Vec<u8>, HubError> {
        let http = |detail: String| HubError::Http {
            url: url.to_string(),
            detail,
        };
        if range.is_empty() {
            return Ok(Vec::new());
        }
        let mut req = self.agent.get(url);
        if let Some(t) = &self.token {
            req = req.header("Authorization", format!("Bearer {t}"));
        }
        let req = req.header("Range", format!("bytes={}-{}", range.start, range.end - 1));
        let resp = req.call().map_err(|e| http(e.to_string()))?;
        let status = resp.status().as_u16();
        let want = (range.end - range.start) as usize;
        let body = resp
            .into_body()
            .with_config()
            .limit(want as u64 + 1)
            .read_to_vec()
            .map_err(|e| http(format!("reading bytes {range:?}: {e}")))?;
        match status {
            206 if body.len() == want => Ok(body),
            200 if range.start == 0 && body.len() == want => Ok(body),
            206 | 200 => Err(http(format!(
                "asked for bytes {range:?} ({want}), got {} (HTTP {status})",
                body.len()
            ))),
            401 | 403 => Err(http(format!("HTTP {status}: not allowed (HF_TOKEN)"))),
            s => Err(http(format!("HTTP {s} for bytes {range:?}"))),
        }
    }

    /// Reads the whole file at `url` through `sink`, `size` bytes; returns its sha256.
    pub fn stream(
        &self,
        url: &str,
        size: u64,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<String, HubError> {
        let http = |detail: String| HubError::Http {
            url: url.to_string(),
            detail,
        };
        let resp = self.get(url, 0)?;
        match resp.status().as_u16() {
            200 => {}
            401 | 403 => return Err(http("not allowed (HF_TOKEN)".into())),
            s => return Err(http(format!("HTTP {s}"))),
        }
        let mut body = resp.into_body().into_reader();
        let mut h = Sha256::new();
        let mut buf = vec![0u8; CHUNK];
        let mut done = 0u64;
        while done < size {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n.min((size - done) as usize),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(http(format!("cut at byte {done}: {e}"))),
            };
            h.update(&buf[..n]);
            sink(&buf[..n]);
            done += n as u64;
        }
        if done < size {
            return Err(http(format!("cut at byte {done} of {size}")));
        }
        Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Every file of `repo` at its main revision.
    pub fn list(&self, repo: &str) -> Result<Vec<HubFile>, HubError> {
        let url = format!(
            "{}/api/models/{repo}/tree/main?recursive=true",
            self.endpoint
        );
        let resp = self.get(&url, 0)?;
        let status = resp.status().as_u16();
        let http = |detail: String| HubError::Http {
            url: url.clone(),
            detail,
        };
        let body = resp
            .into_body()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .map_err(|e| http(format!("reading the listing: {e}")))?;
        match status {
            200 => {}
            401 | 403 => {
                return Err(http(format!(
                    "HTTP {status}: not allowed (set HF_TOKEN for a gated or private repository)"
                )))
            }
            404 => return Err(http(format!("HTTP 404: no repository {repo}"))),
            s => {
                return Err(http(format!(
                    "HTTP {s}: {}",
                    body.chars().take(200).collect::<String>()
                )))
            }
        }
        let entries: Vec<TreeEntry> =
            serde_json::from_str(&body).map_err(|e| http(format!("malformed listing: {e}")))?;
        Ok(entries
            .into_iter()
            .filter(|e| e.kind == "file")
            .map(|e| HubFile {
                size: e.lfs.as_ref().map(|l| l.size).unwrap_or(e.size),
                sha256: e.lfs.map(|l| l.oid.to_ascii_lowercase()),
                path: e.path,
            })
            .collect())
    }

    /// Where `file` of `repo` lands under `dir` (its repository path, checked to stay inside).
    pub fn local_path(dir: &Path, repo: &str, file: &HubFile) -> Result<PathBuf, HubError> {
        let rel = Path::new(&file.path);
        if file.path.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(HubError::Spec(format!(
                "{repo} lists a file at {:?}, which is not a plain relative path",
                file.path
            )));
        }
        Ok(dir.join(repo.replace('/', "--")).join(rel))
    }

    /// Downloads `file` of `repo` to `dest`, resuming a `.part` left by an earlier try and
    /// any transfer cut on the way; keeps it only if its sha256 matches the hub's.
    /// `progress(done, total)` is called as bytes arrive.
    pub fn download(
        &self,
        repo: &str,
        file: &HubFile,
        dest: &Path,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), HubError> {
        let want = file.sha256.clone().ok_or_else(|| {
            HubError::Spec(format!(
                "{repo}: the hub gives no sha256 for {} (not an LFS file), so it cannot be verified",
                file.path
            ))
        })?;
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent).map_err(io(parent))?;
        }
        if dest.exists() && sha256_file(dest)? == want {
            progress(file.size, file.size);
            return Ok(());
        }
        let part = PathBuf::from(format!("{}.part", dest.display()));
        let url = format!(
            "{}/{repo}/resolve/main/{}",
            self.endpoint,
            encode_path(&file.path)
        );
        let mut last_error = None;
        for attempt in 0..ATTEMPTS {
            let have = fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
            if have >= file.size {
                break;
            }
            if attempt > 0 {
                tracing::warn!("{}: resuming at byte {have} of {}", file.path, file.size);
            }
            match self.fetch_into(&url, &part, have, file.size, progress) {
                Ok(()) => {}
                Err(e @ HubError::Http { .. }) if matches!(&e, HubError::Http { detail, .. } if detail.starts_with("cut")) =>
                {
                    last_error = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        let have = fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        if have != file.size {
            return Err(last_error.unwrap_or_else(|| HubError::Http {
                url,
                detail: format!("{have} of {} bytes after {ATTEMPTS} tries", file.size),
            }));
        }
        let got = sha256_file(&part)?;
        if got != want {
            let _ = fs::remove_file(&part);
            return Err(HubError::Checksum {
                path: file.path.clone(),
                got,
                want,
            });
        }
        fs::rename(&part, dest).map_err(io(dest))
    }

    /// One request from byte `have`: appends on 206, starts over on 200.
    fn fetch_into(
        &self,
        url: &str,
        part: &Path,
        have: u64,
        size: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), HubError> {
        let resp = self.get(url, have)?;
        let status = resp.status().as_u16();
        let http = |detail: String| HubError::Http {
            url: url.to_string(),
            detail,
        };
        let mut done = match status {
            206 => have,
            200 => 0,
            401 | 403 => return Err(http(format!("HTTP {status}: not allowed (HF_TOKEN)"))),
            s => return Err(http(format!("HTTP {s}"))),
        };
        let mut out = OpenOptions::new()
            .create(true)
            .write(true)
            .append(done > 0)
            .truncate(done == 0)
            .open(part)
            .map_err(io(part))?;
        let mut body = resp.into_body().into_reader();
        let mut buf = vec![0u8; CHUNK];
        while done < size {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(http(format!("cut at byte {done}: {e}"))),
            };
            let n = n.min((size - done) as usize);
            out.write_all(&buf[..n]).map_err(io(part))?;
            done += n as u64;
            progress(done, size);
        }
        out.flush().map_err(io(part))?;
        if done < size {
            return Err(http(format!("cut at byte {done} of {size}")));
        }
        Ok(())
    }
}

/// The sha256 of a file, as lower-case hex.
pub fn sha256_file(p: &Path) -> Result<String, HubError> {
    let mut f = File::open(p).map_err(io(p))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = f.read(&mut buf).map_err(io(p))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
