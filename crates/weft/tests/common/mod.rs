//! Helpers the weft binary's integration tests share.
// Each test file compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

use serde_json::Value;

pub mod guard;
pub mod llamacpp;
pub mod order_tie;
pub mod server;

/// How far one token's logprob moves on Gemma 3 270M when only the summation order
/// changes: its activations have large outliers, so another order flips a few 8-bit
/// activation roundings per layer, and the model carries each flip on. Measured by
/// scaling every matmul output by 1 +- 5e-8 to 3e-7 (one f32 rounding) in ten patterns,
/// on eight prompts of 16 greedy tokens: a token's logprob on an equal prefix moved by up
/// to 0.28, a part's other token fell up to 0.28 behind the best (and once below the top
/// five), and the perplexity of ppl-sample.txt went from 5.756 to 5.760-5.780; a served
/// request on TP=2 against one node, with Q4_K and Q5_0 rows interleaved on AMD Zen 3,
/// moved by 0.35. A part within this of the best is a near-tie, not a bug: a wrong kernel
/// or shard moves logprobs by whole nats.
pub const GEMMA3_TOL: f64 = 0.6;

/// Top logprobs the comparisons ask for: at a flat position (the best near -2.8) the
/// other run's token may lie sixth, yet within [`GEMMA3_TOL`].
pub const TOP_LOGPROBS: usize = 20;

/// The JSON a successful weft command printed on stdout.
pub fn ok_json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "weft failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// The real model where `weft pull` puts it, or None (and a skip message) when absent.
pub fn real_model() -> Option<PathBuf> {
    let home = std::env::var_os("WEFT_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/weft")
        });
    let p = home.join("models/gemma-3-270m-q4_k_m.gguf");
    if p.exists() {
        return Some(p);
    }
    eprintln!("skipping: {} is not present (run `weft pull`)", p.display());
    None
}

pub fn weft(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(args)
        .output()
        .expect("running weft")
}

pub fn ids(v: &Value, key: &str) -> Vec<u64> {
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Greedy generation with top logprobs, on one node or with `layout` flags.
pub fn greedy(model: &str, prompt: &str, n: usize, layout: &[&str]) -> Value {
    let n = n.to_string();
    let top = TOP_LOGPROBS.to_string();
    let mut args = vec![
        "run",
        "--model",
        model,
        "--prompt",
        prompt,
        "-n",
        &n,
        "--temperature",
        "0",
        "--json",
        "--logprobs",
        &top,
    ];
    args.extend_from_slice(layout);
    ok_json(&weft(&args))
}

/// How far one token's logprob may move when only the summation order changes, on a
/// synthetic model (small activations: the 8-bit activation rounding rarely flips).
/// Measured: 0.107 between one node and EP=3 (2,1,1) on the Q8_0 model of
/// moe_cluster.rs, the first token of the long prompt, once prefill took the AVX2 tile
/// instead of the AVX-512 VNNI one (a different rounding path, same greedy path after
/// the tie); 0.181 between one node and TP=2 on deepseek2 Q8_0 in moe_cluster.rs, the
/// fifth token of the long prompt, once attention summed its blocks in another order
/// (the same greedy path after the tie on one side: 0.017 behind); a bug moves logprobs
/// by whole nats. Below `llamacpp::QUANT_TOL`, which tells the two apart.
pub const SYNTHETIC_TOL: f64 = 0.2;

/// The logprob of `id` in the `top_logprobs` entry `i` of a run, if it made the top list.
pub fn top_logprob(run: &Value, i: usize, id: u64) -> Option<f64> {
    run["top_logprobs"][i]
        .as_array()?
        .iter()
        .find(|t| t[0].as_u64() == Some(id))
        .and_then(|t| t[1].as_f64())
}

/// The cluster's greedy path must equal the single node's up to a part, with each token's
/// logprob within `tol` of the single node's; where they part, each run's choice must be
/// within `tol` of the best in the other's logprobs (a near-tie, not a wrong shard).
pub fn assert_same_path(what: &str, single: &Value, got: &Value, tol: f64) {
    let (a, b) = (ids(single, "token_ids"), ids(got, "token_ids"));
    let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    for i in 0..same {
        let (x, y) = (top_logprob(single, i, a[i]), top_logprob(got, i, b[i]));
        assert!(
            matches!((x, y), (Some(x), Some(y)) if (x - y).abs() < tol),
            "{what}: token {i} ({}) has logprob {x:?} on one node but {y:?}",
            a[i]
        );
    }
    if same < a.len().min(b.len()) {
        let best = |run: &Value| run["top_logprobs"][same][0][1].as_f64().unwrap();
        let in_single = top_logprob(single, same, b[same]).map(|lp| best(single) - lp);
        let in_got = top_logprob(got, same, a[same]).map(|lp| best(got) - lp);
        assert!(
            in_single.is_some_and(|g| g < tol) && in_got.is_some_and(|g| g < tol),
            "{what}: parts at {same}; the cluster's token is {in_single:?} behind in the \
             single node's logprobs, the single node's {in_got:?} behind in the cluster's\n \
             one {a:?}\n got {b:?}"
        );
    } else {
        assert_eq!(
            a.len(),
            b.len(),
            "{what}: lengths differ\n one {a:?}\n got {b:?}"
        );
    }
}

/// The layouts every cluster test covers.
pub const LAYOUTS: [&[&str]; 5] = [
    &["--nodes", "2", "--tp", "2"],
    &["--nodes", "4", "--tp", "4"],
    &["--nodes", "2", "--pp", "2"],
    &["--nodes", "3", "--pp", "3"],
    &["--nodes", "4", "--tp", "2", "--pp", "2"],
];

/// The `--models-dir` test nodes get: the temporary directory, where tests write their
/// synthetic models, and the weft home's models/ for the real one.
pub fn test_model_dirs() -> String {
    let home = std::env::var_os("WEFT_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/weft")
        });
    format!(
        "{},{}",
        std::env::temp_dir().display(),
        home.join("models").display()
    )
}

/// A `weft node` on `listen`, with the address it printed.
pub fn start_node(listen: &str, secret: &str) -> (Child, String) {
    start_node_with(listen, secret, &[])
}

/// A `weft node` on `listen` with `extra` flags, with the address it printed.
pub fn start_node_with(listen: &str, secret: &str, extra: &[&str]) -> (Child, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args([
            "node",
            "--listen",
            listen,
            "--secret",
            secret,
            "--threads",
            "1",
            "--models-dir",
            &test_model_dirs(),
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = listening_on(&mut c, "weft node");
    (c, addr)
}

/// The address a `weft node` or `weft serve` child printed as its first line.
pub fn listening_on(c: &mut Child, what: &str) -> String {
    let mut line = String::new();
    BufReader::new(c.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    line.trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("{what} printed {line:?}"))
        .to_string()
}

/// A small synthetic Llama model in Q8_0 written under `dir`; returns its path.
pub fn synthetic_llama_q8(dir: &std::path::Path) -> String {
    let p = dir.join("llama-q8.gguf");
    weft_model::synthetic::synthetic_model(&weft_model::synthetic::SyntheticSpec::small(
        weft_model::Arch::Llama,
        weft_gguf::GgmlType::Q8_0,
    ))
    .write_file(&p)
    .unwrap();
    p.to_str().unwrap().to_string()
}

/// The pids of `pid`'s child processes, whichever of its threads started them (`weft
/// serve` starts its local nodes on the thread that forms the cluster).
pub fn child_pids(pid: u32) -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| c.split_whitespace().map(String::from).collect::<Vec<_>>())
        .collect()
}

/// Child processes killed when dropped.
pub struct Kill(pub Vec<Child>);
impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Two greedy tokens of `model` over running nodes `peers` (JSON on stdout), with
/// `extra` flags.
pub fn run_on_peers(model: &str, peers: &str, secret: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "run",
        "--model",
        model,
        "--prompt",
        "hi",
        "-n",
        "2",
        "--temperature",
        "0",
        "--json",
        "--peers",
        peers,
        "--secret",
        secret,
    ];
    args.extend_from_slice(extra);
    weft(&args)
}
