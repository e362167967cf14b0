//! The weft binary when things go wrong: a reader that closes stdout early, a full disk,
//! a model whose weights produce NaN (under `run` and under `serve`, where only that
//! request may fail), a batcher thread that dies, and options that used to do the wrong
//! thing silently (blank API keys, too many slots, a directory as the model).

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use weft_gguf::GgmlType;
use weft_model::synthetic::{synthetic_model, SyntheticSpec};
use weft_model::Arch;

use common::{listening_on, real_model};

/// The id of "g" in the synthetic vocabulary, which tokenizes these prompts letter by
/// letter: "the dog sat" holds it, "hello world" and what greedy generates from it do not.
const G: u32 = 303;

fn weft() -> Command {
    Command::new(env!("CARGO_BIN_EXE_weft"))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A failed run's stderr, after checking it failed cleanly (exit 1, no panic).
fn clean_failure(out: &Output) -> String {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "expected exit 1: {err}");
    assert!(!err.contains("panicked"), "weft panicked: {err}");
    err
}

/// A synthetic Llama (its own output matrix, F16 keeps NaN) whose "g" embedding is NaN.
fn nan_model(dir: &Path) -> PathBuf {
    let mut spec = SyntheticSpec::small(Arch::Llama, GgmlType::F16);
    spec.nan_tokens = vec![G];
    let p = dir.join("nan-dog.gguf");
    synthetic_model(&spec).write_file(&p).unwrap();
    p
}

fn plain_model(dir: &Path) -> PathBuf {
    let p = dir.join("plain.gguf");
    synthetic_model(&SyntheticSpec::small(Arch::Llama, GgmlType::Q8_0))
        .write_file(&p)
        .unwrap();
    p
}

fn run_args<'a>(model: &'a str, prompt: &'a str, temp: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--model",
        model,
        "--prompt",
        prompt,
        "-n",
        "8",
        "--temperature",
        temp,
        "--json",
        // One thread: a pool spinning on a shared, busy machine only slows tests down.
        "-t",
        "1",
    ]
}

// ---- A: stdout closed early or full ----

/// Spawns weft with stdout piped, reads `n` bytes (0: none), closes the pipe, waits.
fn close_early(args: &[&str], n: usize) -> (Option<i32>, String) {
    let mut child = weft()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    if n > 0 {
        let mut buf = vec![0u8; n];
        out.read_exact(&mut buf).unwrap();
    }
    drop(out);
    let o = child.wait_with_output().unwrap();
    (o.status.code(), stderr(&o))
}

#[test]
fn a_reader_that_closes_early_ends_weft_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let m = plain_model(dir.path());
    let m = m.to_str().unwrap();
    // Closed before weft writes anything, and after one line: both are a normal end.
    for n in [0, 10] {
        let (code, err) = close_early(&["inspect", m, "--tensors"], n);
        assert_eq!(code, Some(0), "inspect, read {n}: {err}");
        assert!(!err.contains("panicked") && err.is_empty(), "{err}");
    }
    // Streamed text: the first write after the reader went away fails.
    let args = [
        "run",
        "--model",
        m,
        "--prompt",
        "hello world",
        "-n",
        "100",
        "--temperature",
        "0.8",
        "--min-p",
        "0",
        "-t",
        "1",
    ];
    for n in [0, 3] {
        let (code, err) = close_early(&args, n);
        assert_eq!(code, Some(0), "run, read {n}: {err}");
        assert!(!err.contains("panicked") && !err.contains("error"), "{err}");
    }
}

#[test]
fn a_full_disk_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let m = plain_model(dir.path());
    let m = m.to_str().unwrap();
    let runs: [&[&str]; 3] = [
        &["inspect", m, "--tensors"],
        &[
            "run", "--model", m, "--prompt", "hello", "-n", "4", "-t", "1",
        ],
        &run_args(m, "hello", "0"),
    ];
    for args in runs {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = weft().args(args).stdout(full).output().unwrap();
        let err = clean_failure(&out);
        assert!(
            err.contains("error: writing to standard output: No space left on device"),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "one line: {err}");
    }
}

// ---- B: non-finite numbers ----

#[test]
fn nan_logits_fail_run_cleanly_and_other_prompts_still_work() {
    let dir = tempfile::tempdir().unwrap();
    let m = nan_model(dir.path());
    let m = m.to_str().unwrap();
    for temp in ["0", "0.8"] {
        let out = weft()
            .args(run_args(m, "the dog sat", temp))
            .output()
            .unwrap();
        let err = clean_failure(&out);
        assert!(
            err.contains("the model produced non-finite logits (NaN) at token position"),
            "temperature {temp}: {err}"
        );
        assert!(
            out.stdout.is_empty(),
            "nothing printed for a failed --json run"
        );
        let out = weft()
            .args(run_args(m, "hello world", temp))
            .output()
            .unwrap();
        let v = common::ok_json(&out);
        assert!(!v["token_ids"].as_array().unwrap().is_empty(), "{v}");
    }
    // Without --json too: no empty "success".
    let out = weft()
        .args([
            "run",
            "--model",
            m,
            "-p",
            "a dog",
            "-n",
            "4",
            "--temperature",
            "0",
        ])
        .output()
        .unwrap();
    assert!(clean_failure(&out).contains("NaN"));
}

#[test]
fn nan_hyper_parameters_are_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    for (key, v) in [
        ("llama.attention.layer_norm_rms_epsilon", f32::NAN),
        ("llama.rope.freq_base", f32::INFINITY),
        ("llama.attention.layer_norm_rms_epsilon", -1e-6),
    ] {
        let mut w = synthetic_model(&SyntheticSpec::small(Arch::Llama, GgmlType::Q8_0));
        w.set_f32(key, v);
        let p = dir.path().join("bad-hparam.gguf");
        w.write_file(&p).unwrap();
        let out = weft()
            .args(run_args(p.to_str().unwrap(), "hello", "0"))
            .output()
            .unwrap();
        let err = clean_failure(&out);
        assert!(
            err.contains(key) && err.contains("bad-hparam.gguf") && err.contains("finite"),
            "{key}={v}: {err}"
        );
    }
}

#[test]
fn inspect_check_names_tensors_holding_nan() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = SyntheticSpec::small(Arch::Llama, GgmlType::Q8_0);
    spec.nan_tensors = vec!["blk.1.ffn_norm.weight".into()];
    let bad = dir.path().join("nan-norm.gguf");
    synthetic_model(&spec).write_file(&bad).unwrap();
    let out = weft()
        .args(["inspect", bad.to_str().unwrap(), "--check"])
        .output()
        .unwrap();
    let err = clean_failure(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("blk.1.ffn_norm.weight: 256 NaN, 0 infinite of 256 values"),
        "{text}"
    );
    assert!(
        err.contains("1 of ") && err.contains("blk.1.ffn_norm.weight"),
        "{err}"
    );
    // A clean model passes, also with --all (every quantized tensor dequantized).
    let good = plain_model(dir.path());
    for extra in [&[][..], &["--all"][..]] {
        let out = weft()
            .args(["inspect", good.to_str().unwrap(), "--check"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(String::from_utf8_lossy(&out.stdout).contains("all values finite"));
    }
}

#[test]
fn an_unknown_tensor_type_id_is_a_clean_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = synthetic_model(&SyntheticSpec::small(Arch::Llama, GgmlType::Q8_0)).to_bytes();
    // Tensor info: name, n_dims (u32), dims (u64 each), type (u32).
    let name = b"output_norm.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let ty = at + 4 + 8 * n_dims;
    bytes[ty..ty + 4].copy_from_slice(&1234u32.to_le_bytes());
    let p = dir.path().join("bad-type.gguf");
    std::fs::write(&p, bytes).unwrap();
    let out = weft()
        .args(["inspect", p.to_str().unwrap()])
        .output()
        .unwrap();
    let err = clean_failure(&out);
    assert!(
        err.contains("bad-type.gguf")
            && err.contains("tensor 'output_norm.weight': unknown tensor type id 1234"),
        "{err}"
    );
}

/// A `weft serve` process on a free port, killed when dropped.
struct Server {
    child: Child,
    url: String,
    model: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(model: &Path, env: &[(&str, &str)]) -> Server {
        let mut child = weft()
            .args([
                "serve",
                "--port",
                "0",
                "--ctx",
                "256",
                "--parallel",
                "2",
                "-t",
                "1",
            ])
            .arg("--model")
            .arg(model)
            .envs(env.iter().copied())
            .env_remove("WEFT_API_KEY")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let url = listening_on(&mut child, "weft serve");
        let model = model.file_stem().unwrap().to_string_lossy().into_owned();
        Server { child, url, model }
    }

    /// (HTTP status, body) of a request; `body` makes it a POST.
    fn request(&self, path: &str, body: Option<&Value>) -> (u16, String) {
        let mut c = Command::new("curl");
        c.args(["-sS", "-w", "\n%{http_code}"]);
        if let Some(b) = body {
            c.args(["-H", "Content-Type: application/json", "-d", &b.to_string()]);
        }
        let out = c.arg(format!("{}{path}", self.url)).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    fn complete(&self, prompt: &str) -> (u16, Value) {
        let body = serde_json::json!({
            "model": self.model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        });
        let (code, text) = self.request("/v1/completions", Some(&body));
        (code, serde_json::from_str(&text).unwrap_or(Value::Null))
    }
}

#[test]
fn under_serve_nan_logits_fail_only_that_request() {
    let dir = tempfile::tempdir().unwrap();
    let s = Server::start(&nan_model(dir.path()), &[]);
    let (code, v) = s.complete("hello world");
    assert_eq!(code, 200, "{v}");
    let (code, v) = s.complete("the dog sat on the mat");
    assert_eq!(code, 500, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("non-finite logits (NaN)"), "{v}");
    assert_eq!(v["error"]["code"], "non_finite_logits", "{v}");
    // The engine goes on: the next request on the same server is answered with text.
    let (code, v) = s.complete("hello world");
    assert_eq!(code, 200, "{v}");
    assert!(!v["choices"][0]["text"].as_str().unwrap().is_empty(), "{v}");
    let (code, h) = s.request("/health", None);
    let h: Value = serde_json::from_str(&h).unwrap();
    assert_eq!(code, 200, "{h}");
    assert_eq!(h["status"], "ok");
    assert_eq!(h["live"]["active_sequences"], 0, "{h}");
    assert_eq!(h["live"]["failed"], 1, "{h}");
}

#[test]
fn a_dead_batcher_makes_health_503_and_the_server_exit_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start(
        &plain_model(dir.path()),
        &[("WEFT_TEST_PANIC_ON_PROMPT", "kaboom")],
    );
    let (code, v) = s.complete("hello world");
    assert_eq!(code, 200, "before the panic: {v}");
    let (code, v) = s.complete("the kaboom prompt");
    assert_eq!(code, 503, "{v}");
    let (code, h) = s.request("/health", None);
    assert_eq!(code, 503, "{h}");
    let h: Value = serde_json::from_str(&h).unwrap();
    assert_eq!(h["status"], "engine stopped", "{h}");
    assert!(h["reason"].as_str().unwrap().contains("kaboom"), "{h}");
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "server still running"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status.code(), Some(1), "exit status {status}");
    let mut err = String::new();
    s.child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(
        err.contains("error: the inference engine stopped: WEFT_TEST_PANIC_ON_PROMPT"),
        "{err}"
    );
}

// ---- C: options that used to do the wrong thing ----

#[test]
fn blank_api_keys_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = plain_model(dir.path());
    let m = m.to_str().unwrap();
    for (flag, env, want) in [
        (Some(""), None, "--api-key is empty"),
        (Some("   "), None, "--api-key is blank"),
        (None, Some(""), "WEFT_API_KEY is empty"),
        (None, Some(" \t"), "WEFT_API_KEY is blank"),
    ] {
        let mut c = weft();
        c.args(["serve", "--port", "0", "--model", m]);
        c.env_remove("WEFT_API_KEY");
        if let Some(f) = flag {
            c.args(["--api-key", f]);
        }
        if let Some(e) = env {
            c.env("WEFT_API_KEY", e);
        }
        let err = clean_failure(&c.output().unwrap());
        assert!(err.contains(want), "{flag:?} {env:?}: {err}");
    }
}

#[test]
fn slots_beyond_memory_are_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let m = plain_model(dir.path());
    let m = m.to_str().unwrap();
    let t0 = Instant::now();
    let out = weft()
        .args(["serve", "--port", "0", "--model", m])
        .args(["--parallel", "100000000", "--ctx", "2048"])
        .output()
        .unwrap();
    let err = clean_failure(&out);
    assert!(
        err.contains("--parallel 100000000 × --ctx 2048 needs ")
            && err.contains(" of KV cache and logits; this machine has ")
            && err.contains(" available"),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
    // The same check guards --nodes, before any node starts.
    let out = weft()
        .args(["serve", "--port", "0", "--model", m, "--nodes", "2"])
        .args(["--parallel", "100000000"])
        .output()
        .unwrap();
    assert!(clean_failure(&out).contains("--parallel 100000000 × --ctx 4096 needs "));
}

#[test]
fn a_directory_as_the_model_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    for args in [
        vec!["inspect", d],
        vec!["run", "--model", d, "-p", "hi"],
        vec!["serve", "--port", "0", "--model", d],
    ] {
        let err = clean_failure(&weft().args(&args).output().unwrap());
        assert!(
            err.contains(&format!("{d}: is a directory")),
            "{args:?}: {err}"
        );
        assert!(!err.contains("No such device"), "{err}");
    }
}

#[test]
fn the_real_model_stops_quietly_when_its_reader_does() {
    let Some(m) = real_model() else { return };
    let m = m.to_str().unwrap();
    let (code, err) = close_early(&["inspect", m, "--tensors"], 100);
    assert_eq!(code, Some(0), "{err}");
    let args = [
        "run",
        "--model",
        m,
        "-p",
        "Once upon a time",
        "-n",
        "64",
        "-t",
        "2",
    ];
    let (code, err) = close_early(&args, 5);
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// (HTTP status, JSON body) of a POST of raw `body` bytes with `content_type`.
fn post_raw(s: &Server, path: &str, content_type: &str, body: &[u8]) -> (u16, Value) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("body");
    std::fs::write(&file, body).unwrap();
    let out = Command::new("curl")
        .args(["-sS", "-w", "\n%{http_code}", "-H"])
        .arg(format!("Content-Type: {content_type}"))
        .arg("--data-binary")
        .arg(format!("@{}", file.display()))
        .arg(format!("{}{path}", s.url))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    (code.trim().parse().unwrap_or(0), json)
}

#[test]
fn bodies_too_large_not_json_or_with_trailing_bytes_get_json_errors() {
    let dir = tempfile::tempdir().unwrap();
    let s = Server::start(&plain_model(dir.path()), &[]);
    let ok = serde_json::json!({"model": s.model, "prompt": "hi", "max_tokens": 2}).to_string();
    let (code, v) = post_raw(&s, "/v1/completions", "application/json", ok.as_bytes());
    assert_eq!(code, 200, "{v}");
    // Past the limit: 413, shaped as every other error.
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(5 << 20));
    let (code, v) = post_raw(&s, "/v1/completions", "application/json", big.as_bytes());
    assert_eq!(code, 413, "{v}");
    assert_eq!(v["error"]["code"], "request_too_large", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("4194304"),
        "{v}"
    );
    // Bytes after the JSON value.
    let trailing = format!("{ok} {{}}");
    let (code, v) = post_raw(
        &s,
        "/v1/completions",
        "application/json",
        trailing.as_bytes(),
    );
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("after the JSON"),
        "{v}"
    );
    // Not declared JSON.
    let (code, v) = post_raw(&s, "/v1/chat/completions", "text/plain", ok.as_bytes());
    assert_eq!(code, 415, "{v}");
    assert_eq!(v["error"]["code"], "unsupported_media_type", "{v}");
    let (code, v) = post_raw(
        &s,
        "/v1/completions",
        "application/json; charset=utf-8",
        ok.as_bytes(),
    );
    assert_eq!(code, 200, "{v}");
    // The server still answers after all of that.
    assert_eq!(s.complete("hi").0, 200);
}

#[test]
fn a_chat_without_max_tokens_gets_the_servers_cap() {
    let dir = tempfile::tempdir().unwrap();
    let s = serve_with(dir.path(), &["--default-max-tokens", "3"]);
    let body = serde_json::json!({
        "model": s.model, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}],
    });
    let (code, text) = s.request("/v1/chat/completions", Some(&body));
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
}

/// `weft serve` with `extra` flags on the plain synthetic model.
fn serve_with(dir: &Path, extra: &[&str]) -> Server {
    let model = plain_model(dir);
    let child = weft()
        .args(["serve", "--port", "0", "--ctx", "256", "-t", "1"])
        .args(extra)
        .arg("--model")
        .arg(&model)
        .env_remove("WEFT_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut s = Server {
        child,
        url: String::new(),
        model: model.file_stem().unwrap().to_string_lossy().into_owned(),
    };
    s.url = listening_on(&mut s.child, "weft serve");
    s
}

/// Whether the server closed `c` within `secs`: reads (and drops whatever it sent) until
/// the end of the stream, or until the time is up.
fn closed_within(c: &mut std::net::TcpStream, secs: u64) -> bool {
    use std::io::Read;
    let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let mut b = [0u8; 1024];
    while let Some(left) = end.checked_duration_since(std::time::Instant::now()) {
        c.set_read_timeout(Some(left.max(std::time::Duration::from_millis(1))))
            .unwrap();
        match c.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
    false
}

#[test]
fn idle_connections_are_capped_and_closed_and_health_still_answers() {
    let dir = tempfile::tempdir().unwrap();
    let s = serve_with(
        dir.path(),
        &["--max-connections", "4", "--header-timeout", "1"],
    );
    let addr = s.url.trim_start_matches("http://").to_string();
    // Four silent connections fill the cap.
    let mut idle: Vec<std::net::TcpStream> = (0..4)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(200));
    // At the cap /health still answers 200, and a request gets a JSON 503 at once.
    let (code, body) = s.request("/health", None);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("at_connection_limit"), "{body}");
    let (code, v) = s.complete("hi");
    assert_eq!(code, 503, "{v}");
    assert_eq!(v["error"]["code"], "too_many_connections", "{v}");
    // The silent ones are closed by the header deadline, which frees the slots.
    for c in &mut idle {
        assert!(closed_within(c, 10), "a silent connection stayed open");
    }
    let (code, v) = s.complete("hi");
    assert_eq!(code, 200, "{v}");
    // A kept-alive connection that goes quiet after a request is closed as well.
    use std::io::Write;
    let mut c = std::net::TcpStream::connect(&addr).unwrap();
    write!(c, "GET /health HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    assert!(
        closed_within(&mut c, 10) || {
            // The first read may return the response: then the close follows.
            closed_within(&mut c, 10)
        }
    );
}
