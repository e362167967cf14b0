//! llama.cpp as the reference in tests: its tools found, a llama-server started on a
//! free port, greedy paths compared with weft's up to a near-tie, and models written by
//! `weft synth`, `llama-quantize` and `llama-gguf-split`.

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{ids, top_logprob, weft};

/// Where ../shared/tools/build-llamacpp.sh leaves its binaries; tried when
/// WEFT_LLAMACPP_DIR is unset.
pub const DEFAULT_DIR: &str = "/tmp/llama/build/bin";

/// The near-tie tolerance of the two quantized types. llama.cpp and weft quantize every
/// activation to 8 bits before a Q8_0 or K-quant matmul, and a sum taken in another order
/// flips a few of those roundings from the second layer on (a one-layer model agrees to
/// 1e-4). Measured on these two models, three prompts, each of weft's 16 greedy positions
/// fed to llama-server: the gap between weft's best token and another top-5 token moves
/// by up to 0.19 between the two for Q8_0 and 0.21 for Q4_K_M (medians 0.02-0.04), so a
/// part may come where weft's gap is that large. F32 moves by under 1e-4 and F16 by 0.012:
/// SYNTHETIC_TOL has room to spare there.
pub const QUANT_TOL: f64 = 0.25;

/// The llama.cpp tools the test runs.
pub const TOOLS: [&str; 3] = ["llama-server", "llama-quantize", "llama-gguf-split"];

/// The directory holding llama.cpp's tools, or None (and a skip message).
/// Missing is a failure where WEFT_REQUIRE_LLAMACPP=1, as `.ci/run` sets.
pub fn llamacpp() -> Option<PathBuf> {
    let dir = std::env::var_os("WEFT_LLAMACPP_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR));
    if TOOLS.iter().all(|b| dir.join(b).is_file()) {
        return Some(dir);
    }
    let why = format!(
        "no {} in {} (set WEFT_LLAMACPP_DIR, or run .ci/llamacpp.sh)",
        TOOLS.join(", "),
        dir.display()
    );
    assert!(
        std::env::var("WEFT_REQUIRE_LLAMACPP").as_deref() != Ok("1"),
        "{why} (WEFT_REQUIRE_LLAMACPP=1)"
    );
    eprintln!("skipping: {why}");
    None
}

/// A llama-server on a free local port, killed when dropped (a failed assertion too).
pub struct LlamaServer {
    child: Child,
    url: String,
    log: PathBuf,
    agent: ureq::Agent,
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl LlamaServer {
    pub fn start(bin: &Path, model: &Path) -> Self {
        Self::start_with(bin, model, "f32", &[])
    }

    /// As `start`, its KV cache's keys and values stored as `cache` ("f32" or "f16"),
    /// flash attention still off.
    pub fn start_with_cache(bin: &Path, model: &Path, cache: &str) -> Self {
        Self::start_with(bin, model, cache, &[])
    }

    /// As `start_with_cache`, with `extra` llama-server flags (`--no-repack`).
    pub fn start_with(bin: &Path, model: &Path, cache: &str, extra: &[&str]) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = model.with_extension("server.log");
        let out = File::create(&log).unwrap();
        // weft keeps its KV cache in F32 unless told: so does this server, without flash
        // attention (which wants an F16 cache). llama.cpp's default F16 cache alone moves its own
        // Q8_0 logprobs by up to 0.23 here, more than the two programs differ.
        let child = Command::new(bin.join("llama-server"))
            .arg("-m")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-t", "2", "-c", "2048", "-np", "1", "--no-warmup"])
            .args(["-ctk", cache, "-ctv", cache, "-fa", "off"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("starting llama-server");
        let mut s = LlamaServer {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(120)))
                .build()
                .into(),
        };
        s.wait_healthy(model);
        s
    }

    /// The end of the server's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let from = log.len().saturating_sub(6000);
        let from = (from..log.len())
            .find(|&i| log.is_char_boundary(i))
            .unwrap_or(0);
        log[from..].to_string()
    }

    fn wait_healthy(&mut self, model: &Path) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!(
                    "llama-server on {} exited ({st}):\n{}",
                    model.display(),
                    self.log_tail()
                );
            }
            if let Ok(r) = self.agent.get(format!("{}/health", self.url)).call() {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "llama-server on {} not healthy after 60 s:\n{}",
                model.display(),
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// llama.cpp's greedy continuation of exactly these token ids, `n` tokens.
    pub fn greedy(&self, prompt_ids: &[u64], n: usize) -> Vec<u64> {
        let body = json!({
            "prompt": prompt_ids,
            "n_predict": n,
            "temperature": 0,
            "top_k": 1,
            "return_tokens": true,
            "cache_prompt": false,
        });
        let resp = self
            .agent
            .post(format!("{}/completion", self.url))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap_or_else(|e| panic!("POST /completion: {e}\n{}", self.log_tail()));
        let status = resp.status();
        let text = resp.into_body().read_to_string().unwrap();
        assert_eq!(status, 200, "/completion: {text}\n{}", self.log_tail());
        let v: Value = serde_json::from_str(&text).unwrap();
        ids(&v, "tokens")
    }
}

/// Where weft's greedy path and llama.cpp's agree.
pub struct Agreement {
    /// Tokens equal before they part (all of them when they never do).
    pub prefix: usize,
    /// At a part: how far llama.cpp's token is behind weft's best in weft's logprobs.
    pub gap: Option<f64>,
}

/// Equal token ids, or a part where llama.cpp's token is within `tol` of the best in
/// weft's top logprobs at that position (a near-tie); anything else is an Err saying why.
pub fn compare(run: &Value, llama: &[u64], tol: f64) -> Result<Agreement, String> {
    let w = ids(run, "token_ids");
    let prefix = w.iter().zip(llama).take_while(|(a, b)| a == b).count();
    if prefix == w.len() && prefix == llama.len() {
        return Ok(Agreement { prefix, gap: None });
    }
    let paths = format!("\n weft      {w:?}\n llama.cpp {llama:?}");
    if prefix == w.len().min(llama.len()) {
        return Err(format!(
            "one stopped early after {prefix} equal tokens{paths}"
        ));
    }
    let top = &run["top_logprobs"][prefix];
    let best = top[0][1].as_f64().unwrap();
    match top_logprob(run, prefix, llama[prefix]) {
        Some(lp) if best - lp < tol => Ok(Agreement {
            prefix,
            gap: Some(best - lp),
        }),
        lp => Err(format!(
            "parts at token {prefix}: llama.cpp's {} has weft logprob {lp:?}, weft's best \
             {best} (near-tie tolerance {tol}){paths}\n weft's top logprobs there: {top}",
            llama[prefix]
        )),
    }
}

/// A model written by `weft synth` as `dir/NAME.gguf` (`dims`: its other flags).
pub fn synth(dir: &Path, name: &str, ty: &str, dims: &[&str]) -> PathBuf {
    let p = dir.join(format!("{name}.gguf"));
    let mut args = vec!["synth", p.to_str().unwrap(), "--type", ty];
    args.extend_from_slice(dims);
    let out = weft(&args);
    assert!(
        out.status.success(),
        "weft synth {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    p
}

/// `src` quantized to `ty` by llama-quantize, as `dir/NAME.gguf`.
pub fn quantize(bin: &Path, src: &Path, dir: &Path, name: &str, ty: &str) -> PathBuf {
    let p = dir.join(format!("{name}.gguf"));
    let out = Command::new(bin.join("llama-quantize"))
        .arg(src)
        .arg(&p)
        .arg(ty)
        .output()
        .expect("running llama-quantize");
    assert!(
        out.status.success(),
        "llama-quantize {} {ty}: {}{}",
        src.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    p
}

/// `src` cut by llama-gguf-split into parts of `max_tensors` tensors; the first part's path.
pub fn split(bin: &Path, src: &Path, dir: &Path, name: &str, max_tensors: usize) -> PathBuf {
    let base = dir.join(name);
    let out = Command::new(bin.join("llama-gguf-split"))
        .args(["--split", "--split-max-tensors", &max_tensors.to_string()])
        .arg(src)
        .arg(&base)
        .output()
        .expect("running llama-gguf-split");
    assert!(
        out.status.success(),
        "llama-gguf-split {}: {}{}",
        src.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let prefix = format!("{name}-00001-of-");
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .unwrap_or_else(|| panic!("llama-gguf-split wrote no {prefix}* in {}", dir.display()))
}

/// The model `weft synth` writes with `dims` in the types the comparisons cover, each with
/// its near-tie tolerance: F32 and F16 written by weft (`dir/NAME-f32.gguf`, `-f16`),
/// Q8_0 and Q4_K_M quantized from the F32 file by llama-quantize, then the llama-quantize
/// types of `more` the same way.
pub fn quant_types(
    bin: &Path,
    dir: &Path,
    name: &str,
    dims: &[&str],
    more: &[&'static str],
) -> Vec<(&'static str, PathBuf, f64)> {
    let f32 = synth(dir, &format!("{name}-f32"), "F32", dims);
    let quantized = |ty: &'static str| {
        let file = format!("{name}-{}", ty.to_lowercase());
        (ty, quantize(bin, &f32, dir, &file, ty), QUANT_TOL)
    };
    let f16 = synth(dir, &format!("{name}-f16"), "F16", dims);
    let mut files = vec![
        ("F32", f32.clone(), super::SYNTHETIC_TOL),
        ("F16", f16, super::SYNTHETIC_TOL),
        quantized("Q8_0"),
        quantized("Q4_K_M"),
    ];
    files.extend(more.iter().map(|&ty| quantized(ty)));
    files
}

/// A long prompt of `count` word pairs taken from `pairs` in turn, spaces between: the
/// llama.cpp comparisons' long case (in the synthetic vocabulary about 8 tokens a pair).
pub fn word_pairs(count: usize, pairs: &[&str]) -> String {
    (0..count)
        .map(|i| pairs[i % pairs.len()])
        .collect::<Vec<_>>()
        .join(" ")
}
