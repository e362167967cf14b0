//! `weft pull OWNER/REPO:QUANT` against a local server that speaks the hub's tree and
//! resolve endpoints (this machine cannot reach the real hub): every part of a split
//! model fetched, a cut transfer resumed with Range, HF_TOKEN sent, the result runs; a
//! wrong checksum refused and nothing kept; a missing quantization named beside the
//! ones that exist.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use serde_json::json;
use sha2::{Digest, Sha256};
use weft_gguf::GgmlType;
use weft_model::synthetic::{synthetic_model, SyntheticSpec};
use weft_model::Arch;

use common::{ids, ok_json};

const REPO: &str = "acme/tiny-GGUF";
const TOKEN: &str = "hf_test_token_123";

/// One request the fake hub saw: path, Range header, Authorization header.
type Seen = (String, Option<String>, Option<String>);

/// What the fake hub serves: repository path → bytes, and the sha256 it claims.
struct Hub {
    files: Vec<(String, Vec<u8>, String)>,
    log: Mutex<Vec<Seen>>,
    /// Files whose first download is cut halfway.
    cut_once: Mutex<Vec<String>>,
}

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn respond(hub: &Hub, mut s: TcpStream) {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut first = String::new();
    if r.read_line(&mut first).is_err() {
        return;
    }
    let mut headers = HashMap::new();
    loop {
        let mut l = String::new();
        if r.read_line(&mut l).unwrap_or(0) == 0 || l == "\r\n" {
            break;
        }
        if let Some((k, v)) = l.trim_end().split_once(':') {
            headers.insert(k.to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let path = first.split_whitespace().nth(1).unwrap_or("").to_string();
    hub.log.lock().unwrap().push((
        path.clone(),
        headers.get("range").cloned(),
        headers.get("authorization").cloned(),
    ));
    let send = |s: &mut TcpStream, status: &str, extra: &str, body: &[u8], len: usize| {
        let _ = write!(
            s,
            "HTTP/1.1 {status}\r\nContent-Length: {len}\r\nConnection: close\r\n{extra}\r\n"
        );
        let _ = s.write_all(body);
    };
    if path == format!("/api/models/{REPO}/tree/main?recursive=true") {
        let mut list: Vec<_> = hub
            .files
            .iter()
            .map(|(p, b, h)| {
                json!({"type": "file", "path": p, "size": 134,
                "lfs": {"oid": h, "size": b.len(), "pointerSize": 134}})
            })
            .collect();
        list.push(json!({"type": "file", "path": "README.md", "size": 5}));
        list.push(json!({"type": "directory", "path": "Q4_K_M", "size": 0}));
        let body = serde_json::to_vec(&list).unwrap();
        return send(
            &mut s,
            "200 OK",
            "Content-Type: application/json\r\n",
            &body,
            body.len(),
        );
    }
    let prefix = format!("/{REPO}/resolve/main/");
    let Some((_, bytes, _)) = path
        .strip_prefix(&prefix)
        .and_then(|p| hub.files.iter().find(|(name, _, _)| name == p))
    else {
        return send(&mut s, "404 Not Found", "", b"", 0);
    };
    let from = headers
        .get("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok());
    let cut = {
        let mut c = hub.cut_once.lock().unwrap();
        let name = path.strip_prefix(&prefix).unwrap_or("").to_string();
        let hit = c.contains(&name);
        c.retain(|x| *x != name);
        hit
    };
    match from {
        Some(f) if f < bytes.len() => {
            let extra = format!(
                "Content-Range: bytes {f}-{}/{}\r\n",
                bytes.len() - 1,
                bytes.len()
            );
            send(
                &mut s,
                "206 Partial Content",
                &extra,
                &bytes[f..],
                bytes.len() - f,
            )
        }
        _ if cut => {
            // Promise the whole file, send half, hang up: a dropped connection.
            send(&mut s, "200 OK", "", &bytes[..bytes.len() / 2], bytes.len())
        }
        _ => send(&mut s, "200 OK", "", bytes, bytes.len()),
    }
}

/// Starts the fake hub; returns its endpoint and state.
fn start_hub(files: Vec<(String, Vec<u8>, String)>, cut: Vec<String>) -> (String, Arc<Hub>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", l.local_addr().unwrap());
    let hub = Arc::new(Hub {
        files,
        log: Mutex::new(Vec::new()),
        cut_once: Mutex::new(cut),
    });
    let h = hub.clone();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let h = h.clone();
            std::thread::spawn(move || respond(&h, s));
        }
    });
    (endpoint, hub)
}

fn pull(endpoint: &str, home: &Path, spec: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["pull", spec])
        .env("HF_ENDPOINT", endpoint)
        .env("HF_TOKEN", TOKEN)
        .env("WEFT_HOME", home)
        .output()
        .unwrap()
}

fn run_tokens(model: &str) -> Vec<u64> {
    let out = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["run", "--model", model, "--prompt", "the cat", "-n", "8"])
        .args(["--temperature", "0", "--json", "-t", "1"])
        .output()
        .unwrap();
    ids(&ok_json(&out), "token_ids")
}

#[test]
fn a_split_quantization_is_pulled_resumed_verified_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec::small(Arch::Llama, GgmlType::Q4_K);
    let whole = dir.path().join("whole.gguf");
    synthetic_model(&spec).write_file(&whole).unwrap();
    let parts: Vec<Vec<u8>> = synthetic_model(&spec)
        .split(9)
        .iter()
        .map(|p| p.to_bytes())
        .collect();
    let n = parts.len();
    assert!(n >= 2);
    let mut files: Vec<(String, Vec<u8>, String)> = parts
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            let h = sha(&b);
            (
                format!("Q4_K_M/tiny-Q4_K_M-{:05}-of-{n:05}.gguf", i + 1),
                b,
                h,
            )
        })
        .collect();
    let q8 = std::fs::read(&whole).unwrap();
    files.push(("tiny-Q8_0.gguf".into(), q8.clone(), sha(&q8)));
    // A file whose listed checksum is wrong.
    files.push(("tiny-Q5_0.gguf".into(), q8.clone(), sha(b"something else")));
    let first = files[0].0.clone();
    let (endpoint, hub) = start_hub(files, vec![first.clone()]);
    let home = dir.path().join("home");

    let out = pull(&endpoint, &home, &format!("{REPO}:Q4_K_M"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let got = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let want = home.join("models/acme--tiny-GGUF").join(&first);
    assert_eq!(Path::new(&got), want);
    for i in 1..=n {
        let p = home
            .join("models/acme--tiny-GGUF/Q4_K_M")
            .join(format!("tiny-Q4_K_M-{i:05}-of-{n:05}.gguf"));
        assert!(p.exists(), "{} missing", p.display());
        assert!(!Path::new(&format!("{}.part", p.display())).exists());
    }
    {
        let log = hub.log.lock().unwrap();
        let resumed = log.iter().any(|(p, range, _)| {
            p.ends_with(&first)
                && range
                    .as_deref()
                    .and_then(|r| r.strip_prefix("bytes="))
                    .is_some_and(|r| r != "0-")
        });
        assert!(resumed, "no Range request resumed the cut file: {log:?}");
        assert!(
            log.iter()
                .all(|(_, _, a)| a.as_deref() == Some(&format!("Bearer {TOKEN}"))),
            "HF_TOKEN not sent: {log:?}"
        );
    }
    // The pulled split model runs as the uncut one.
    assert_eq!(run_tokens(&got), run_tokens(whole.to_str().unwrap()));
    // Pulling again finds the files verified and fetches nothing.
    let before = hub.log.lock().unwrap().len();
    assert!(pull(&endpoint, &home, &format!("{REPO}:q4_k_m"))
        .status
        .success());
    assert_eq!(
        hub.log.lock().unwrap().len(),
        before + 1,
        "only the listing again"
    );

    // A wrong checksum: refused, named, and nothing kept.
    let out = pull(&endpoint, &home, &format!("{REPO}:Q5_0"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("sha256") && err.contains("tiny-Q5_0.gguf"),
        "{err}"
    );
    let bad = home.join("models/acme--tiny-GGUF/tiny-Q5_0.gguf");
    assert!(!bad.exists() && !Path::new(&format!("{}.part", bad.display())).exists());

    // A quantization the repository lacks: named beside those it has.
    let out = pull(&endpoint, &home, &format!("{REPO}:Q3_K_S"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Q3_K_S") && err.contains("Q4_K_M, Q5_0, Q8_0"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");

    // A malformed spec and an unknown repository are errors, not panics.
    let out = pull(&endpoint, &home, "no-slash");
    assert!(!out.status.success());
    let out = pull(&endpoint, &home, "acme/other:Q4_K_M");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("404"), "{err}");
}
