//! Download once, share over the LAN: only the coordinator holds the model; each node runs
//! in its own mount namespace with the model's directory covered by an empty tmpfs and an
//! empty weft home, so it cannot read the file and must fetch its shard's pieces from the
//! coordinator or from another node. Checked: the output equals one node's for TP=2 and
//! PP=2, each node's cache stays within 1.1x of its shard, a third node fetches from the
//! first two, a corrupted piece is fetched again, a fetch killed halfway resumes, and a
//! restarted node fetches nothing. Needs root (`unshare --mount`), as CI has.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_same_path, greedy, listening_on, Kill, SYNTHETIC_TOL};
use serde_json::Value;

const SECRET: &str = "share-test-secret-5d1c9a7e3b0f2d4c6a8e1f3b5d7c9a0e";
const PROMPT: &str = "Sharing one model over the LAN lets every machine fetch only its own part";

/// A synthetic Qwen3 (56 MB in Q8_0: several hundred 64 KiB chunks) in `dir`.
fn model(dir: &Path) -> String {
    let p = dir.join("shared-q8.gguf");
    let out = common::weft(&[
        "synth",
        p.to_str().unwrap(),
        "--arch",
        "qwen3",
        "--type",
        "Q8_0",
        "--embd",
        "1024",
        "--layers",
        "4",
        "--ff",
        "3072",
        "--heads",
        "16",
        "--heads-kv",
        "4",
        "--head-dim",
        "64",
        "--extra-vocab",
        "2000",
        "--seed",
        "7",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    p.to_str().unwrap().to_string()
}

/// An empty weft home, but for the kernel timings this machine's test runs already made
/// (they are about the CPU, not the model, and take seconds to remake).
fn empty_home(root: &Path, name: &str) -> PathBuf {
    let home = root.join(name);
    std::fs::create_dir_all(&home).unwrap();
    let default = std::env::var_os("WEFT_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/weft"));
    if let Ok(rd) = std::fs::read_dir(default.join("calibration")) {
        let to = home.join("calibration");
        std::fs::create_dir_all(&to).unwrap();
        for e in rd.flatten() {
            let _ = std::fs::copy(e.path(), to.join(e.file_name()));
        }
    }
    home
}

/// `weft node` in its own mount namespace, where `hidden` is an empty tmpfs.
fn node(home: &Path, hidden: &Path, extra: &[&str]) -> (Child, String) {
    let mut c = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(
            "mount -t tmpfs tmpfs \"$HIDE\" && exec \"$WEFT\" node --listen 127.0.0.1:0 \
             --no-mdns --threads 1 --secret \"$SECRET\" \"$@\"",
        )
        .arg("node")
        .args(extra)
        .env("HIDE", hidden)
        .env("WEFT", env!("CARGO_BIN_EXE_weft"))
        .env("SECRET", SECRET)
        .env("WEFT_HOME", home)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("unshare (util-linux) runs the node in a mount namespace");
    let addr = listening_on(&mut c, "weft node");
    (c, addr)
}

fn on_peers(model: &str, peers: &[&str], layout: &[&str], env: &[(&str, &str)]) -> Value {
    let peers = peers.join(",");
    let mut args = vec![
        "run",
        "--model",
        model,
        "--prompt",
        PROMPT,
        "-n",
        "12",
        "--temperature",
        "0",
        "--json",
        "--logprobs",
        "5",
        "--peers",
        &peers,
        "--secret",
        SECRET,
    ];
    args.extend_from_slice(layout);
    let out = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(&args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    common::ok_json(&out)
}

/// Allocated bytes under a node's shard cache (the parts are sparse files).
fn cache_bytes(home: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![home.join("shards")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                total += m.blocks() * 512;
            }
        }
    }
    total
}

fn fetched(run: &Value, i: usize) -> &Value {
    &run["fetched"][i]
}

/// Bytes node `i` got from holders other than the coordinator (the first source).
fn from_nodes(run: &Value, i: usize) -> u64 {
    fetched(run, i)["sources"]
        .as_array()
        .unwrap()
        .iter()
        .skip(1)
        .map(|s| s["bytes"].as_u64().unwrap())
        .sum()
}

fn check_cache(what: &str, run: &Value, i: usize, home: &Path, model_len: u64) {
    let f = fetched(run, i);
    let shard = f["shard_bytes"].as_u64().unwrap();
    let disk = cache_bytes(home);
    assert!(
        shard > 0 && shard < model_len * 3 / 4,
        "{what}: node {i}'s shard is {shard} of {model_len} bytes"
    );
    assert!(
        (disk as f64) <= 1.1 * shard as f64,
        "{what}: node {i}'s cache holds {disk} bytes for a shard of {shard}"
    );
}

#[test]
fn nodes_without_the_file_fetch_only_their_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    let m = model(&models);
    let model_len = std::fs::metadata(&m).unwrap().len();
    let single = greedy(&m, PROMPT, 12, &[]);
    let homes: Vec<PathBuf> = (0..5)
        .map(|i| empty_home(tmp.path(), &format!("home{i}")))
        .collect();
    let mut kill = Kill(Vec::new());
    let mut addrs = Vec::new();
    for h in &homes[..2] {
        let (c, a) = node(h, &models, &[]);
        kill.0.push(c);
        addrs.push(a);
    }
    let tp = on_peers(&m, &[&addrs[0], &addrs[1]], &["--tp", "2"], &[]);
    assert_same_path("TP=2 from fetched shards", &single, &tp, SYNTHETIC_TOL);
    for (i, h) in homes[..2].iter().enumerate() {
        check_cache("TP=2", &tp, i, h, model_len);
    }
    assert!(tp["share_sent_bytes"].as_u64().unwrap() > 0);

    // PP=2 on two fresh nodes.
    for h in &homes[2..4] {
        let (c, a) = node(h, &models, &[]);
        kill.0.push(c);
        addrs.push(a);
    }
    let pp = on_peers(&m, &[&addrs[2], &addrs[3]], &["--pp", "2"], &[]);
    assert_same_path("PP=2 from fetched shards", &single, &pp, SYNTHETIC_TOL);
    for (i, h) in homes[2..4].iter().enumerate() {
        check_cache("PP=2", &pp, i, h, model_len);
    }

    // A third node beside the first two: part of its shard comes from them.
    let (c, a) = node(&homes[4], &models, &[]);
    kill.0.push(c);
    addrs.push(a);
    let three = on_peers(&m, &[&addrs[0], &addrs[1], &addrs[4]], &["--pp", "3"], &[]);
    assert_same_path("PP=3 with a new node", &single, &three, SYNTHETIC_TOL);
    assert!(
        from_nodes(&three, 2) > 0,
        "the new node fetched nothing from the other nodes: {}",
        fetched(&three, 2)
    );
    assert!(three["share_sent_bytes"].as_u64().is_some());
}

#[test]
fn fetches_survive_corruption_a_kill_and_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    let m = model(&models);
    let single = greedy(&m, PROMPT, 12, &[]);

    // Three pieces corrupted on the way: each is refused and fetched again.
    let home = empty_home(tmp.path(), "corrupt");
    let (c, a) = node(&home, &models, &[]);
    let _k = Kill(vec![c]);
    let run = on_peers(&m, &[&a], &[], &[("WEFT_TEST_CORRUPT_PIECES", "3")]);
    assert_same_path("after corrupted pieces", &single, &run, SYNTHETIC_TOL);
    assert_eq!(
        fetched(&run, 0)["sources"][0]["bad"].as_u64(),
        Some(3),
        "{}",
        fetched(&run, 0)
    );

    // A fetch killed halfway: the node dies while pieces arrive slowly.
    let home = empty_home(tmp.path(), "resume");
    let (c, a) = node(&home, &models, &[]);
    let victim = Kill(vec![c]);
    let mut coord = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args([
            "run", "--model", &m, "--prompt", "hi", "-n", "2", "--peers", &a, "--secret", SECRET,
        ])
        .env("WEFT_TEST_SHARE_DELAY_MS", "10")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let log = std::fs::read_dir(home.join("shards"))
        .ok()
        .and_then(|mut d| d.next())
        .map(|e| e.unwrap().path().join("pieces.log"));
    let t = Instant::now();
    let logged = |log: &Option<PathBuf>| {
        let log = log.clone().or_else(|| {
            std::fs::read_dir(home.join("shards"))
                .ok()?
                .next()
                .map(|e| e.unwrap().path().join("pieces.log"))
        });
        log.and_then(|l| std::fs::read_to_string(l).ok())
            .map_or(0, |s| s.lines().count())
    };
    while logged(&log) < 100 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the fetch never got going"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(victim); // kills and reaps the node
    let _ = coord.kill();
    let _ = coord.wait();
    let kept = logged(&None);
    assert!(kept >= 100);

    // Restarted on the same home: what was verified stays, the rest is fetched.
    let (c, a) = node(&home, &models, &[]);
    let again = Kill(vec![c]);
    let run = on_peers(&m, &[&a], &[], &[]);
    assert_same_path("after a resumed fetch", &single, &run, SYNTHETIC_TOL);
    let f = fetched(&run, 0);
    let already = f["already"].as_u64().unwrap() as usize;
    assert!(
        already + 1 >= kept,
        "kept {kept} pieces but reused {already}: {f}"
    );
    assert!(f["fetched_bytes"].as_u64().unwrap() < f["wanted_bytes"].as_u64().unwrap());

    // Restarted once more: the cache holds the whole shard, nothing is fetched.
    drop(again);
    let (c, a) = node(&home, &models, &[]);
    let _k2 = Kill(vec![c]);
    let run = on_peers(&m, &[&a], &[], &[]);
    assert_same_path("from a warm cache", &single, &run, SYNTHETIC_TOL);
    let f = fetched(&run, 0);
    assert_eq!(f["fetched_bytes"].as_u64(), Some(0), "{f}");
    assert_eq!(f["already"], f["wanted"], "{f}");
}
