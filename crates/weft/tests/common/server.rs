//! A `weft serve` process for tests: started on a free port with an API key, driven with
//! curl, and its greedy answers compared under the near-tie rule.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

use super::GEMMA3_TOL;

pub const KEY: &str = "test-key-123";

pub struct Server {
    pub child: Child,
    pub url: String,
    /// The id the server serves its model under (the file name without `.gguf`).
    pub model_id: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// `weft serve` of `model` with `extra` flags (a 1,024-token context unless they set
    /// `--ctx`).
    pub fn start(model: &Path, extra: &[&str]) -> Server {
        let ctx: &[&str] = if extra.contains(&"--ctx") {
            &[]
        } else {
            &["--ctx", "1024"]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(["serve", "--port", "0", "--api-key", KEY])
            .args(ctx)
            .arg("--model")
            .arg(model)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting weft serve");
        let out = child.stdout.take().expect("server stdout");
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line).unwrap();
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("weft serve printed {line:?}"))
            .to_string();
        let model_id = model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Server {
            child,
            url,
            model_id,
        }
    }

    pub fn rss_kb(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        s.lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap()
    }

    pub fn curl(&self, args: &[&str]) -> (String, String) {
        let out = Command::new("curl")
            .args(["-sS", "-H", &format!("Authorization: Bearer {KEY}")])
            .args(args)
            .output()
            .expect("running curl");
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    pub fn get(&self, path: &str) -> Value {
        let (body, err) = self.curl(&[&format!("{}{path}", self.url)]);
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body} {err}"))
    }

    /// The `openai_client.py` checks in `args`' mode; its JSON line of results.
    pub fn client(&self, py: &Path, args: &[&str]) -> Value {
        self.script(py, "openai_client.py", &format!("{}/v1", self.url), args)
    }

    /// A Python client script under `tests/` run against `base` (this server's URL, or
    /// its `/v1`) with the key and the model id; its one JSON line of results.
    pub fn script(&self, py: &Path, script: &str, base: &str, args: &[&str]) -> Value {
        let out = Command::new(py)
            .arg(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests")
                    .join(script),
            )
            .arg(base)
            .args([KEY, &self.model_id])
            .args(args)
            .output()
            .expect("running a Python client");
        assert!(
            out.status.success(),
            "{script} {args:?} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

/// A Python that imports every one of `modules`: WEFT_PYTHON, the venv `.ci/run` makes,
/// or python3. Missing is a skip, or a failure where WEFT_REQUIRE_OPENAI=1 (as CI sets).
pub fn python(modules: &[&str]) -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/pyenv/bin/python");
    let candidates: Vec<PathBuf> = std::env::var_os("WEFT_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([venv, PathBuf::from("python3")])
        .collect();
    let import = format!("import {}", modules.join(", "));
    for p in candidates {
        let ok = Command::new(&p)
            .args(["-c", &import])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            return Some(p);
        }
    }
    assert!(
        std::env::var("WEFT_REQUIRE_OPENAI").as_deref() != Ok("1"),
        "no Python with {modules:?} (WEFT_REQUIRE_OPENAI=1)"
    );
    eprintln!(
        "skipping: no Python with {modules:?} (pip install {})",
        modules.join(" ")
    );
    None
}

/// The JSON answer to a POST of `body` to `path`.
pub fn post(s: &Server, path: &str, body: &Value) -> Value {
    let (out, err) = s.curl(&[
        "-H",
        "Content-Type: application/json",
        "-d",
        &body.to_string(),
        &format!("{}{path}", s.url),
    ]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"))
}

/// Greedy completion of `prompt` with the top five logprobs of each token.
pub fn complete(s: &Server, prompt: &str) -> Value {
    complete_n(s, prompt, 16)
}

/// Greedy completion of `prompt`, `n` tokens, with the top [`super::TOP_LOGPROBS`]
/// logprobs of each.
pub fn complete_n(s: &Server, prompt: &str, n: usize) -> Value {
    let body = serde_json::json!({
        "model": "gemma-3-270m-q4_k_m", "prompt": prompt, "max_tokens": n,
        "temperature": 0, "logprobs": super::TOP_LOGPROBS,
    });
    post(s, "/v1/completions", &body)
}

/// Equal tokens up to a part, and at the part each run's token within [`GEMMA3_TOL`] of
/// the best in the other's top logprobs (TP sums in another order); the cluster tests'
/// rule.
pub fn assert_same_greedy(what: &str, alone: &Value, got: &Value) {
    let lp = |v: &Value| v["choices"][0]["logprobs"].clone();
    let (a, b) = (lp(alone), lp(got));
    let (ta, tb) = (
        a["tokens"].as_array().unwrap(),
        b["tokens"].as_array().unwrap(),
    );
    assert_eq!(ta.len(), tb.len(), "{what}: {got} vs {alone}");
    if let Some(at) = (0..ta.len()).find(|&i| ta[i] != tb[i]) {
        // How far `token` is behind the best of `run`'s top logprobs at the part.
        let behind = |run: &Value, token: &Value| {
            let top = run["top_logprobs"][at].as_object()?;
            let best = top.values().filter_map(Value::as_f64).reduce(f64::max)?;
            Some(best - top.get(token.as_str()?)?.as_f64()?)
        };
        let (in_alone, in_got) = (behind(&a, &tb[at]), behind(&b, &ta[at]));
        assert!(
            in_alone.is_some_and(|g| g < GEMMA3_TOL) && in_got.is_some_and(|g| g < GEMMA3_TOL),
            "{what}: parts at token {at}, the other's token {in_alone:?} / {in_got:?} behind: \
             {got} vs {alone}"
        );
    }
}
