//! Download once, share over the LAN: only the coordinator holds the model; each node runs
//! in its own mount namespace with the model's directory covered by an empty tmpfs and an
//! empty weft home, so it cannot read the file and must fetch its shard's pieces from the
//! coordinator or from another node. Checked: the output equals one node's for TP=2 and
//! PP=2, each node's cache stays within 1.1x of its shard, a third node fetches from the
//! first two, a corrupted piece is fetched again, a fetch killed halfway resumes, and a
//! restarted node fetches nothing. Needs root (`unshare --mount`), as CI has.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

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
    // Nodes that hold the file: the coordinator never hashes it, since it builds the
    // manifest only when a node asks for one.
    let coordinator = empty_home(tmp.path(), "coordinator");
    let coordinator_env = [("WEFT_HOME", coordinator.to_str().unwrap())];
    let manifests = || std::fs::read_dir(coordinator.join("manifests")).map_or(0, |d| d.count());
    {
        let (c1, a1) = common::start_node("127.0.0.1:0", SECRET);
        let (c2, a2) = common::start_node("127.0.0.1:0", SECRET);
        let _k = Kill(vec![c1, c2]);
        let own = on_peers(&m, &[&a1, &a2], &["--tp", "2"], &coordinator_env);
        assert_same_path(
            "TP=2 on the nodes' own copies",
            &single,
            &own,
            SYNTHETIC_TOL,
        );
        assert_eq!(own["share_sent_bytes"].as_u64(), Some(0), "{own}");
        assert_eq!(
            manifests(),
            0,
            "the coordinator hashed a file no node needed"
        );
    }

    let mut kill = Kill(Vec::new());
    let mut addrs = Vec::new();
    for h in &homes[..2] {
        let (c, a) = node(h, &models, &[]);
        kill.0.push(c);
        addrs.push(a);
    }
    let tp = on_peers(
        &m,
        &[&addrs[0], &addrs[1]],
        &["--tp", "2"],
        &coordinator_env,
    );
    assert_same_path("TP=2 from fetched shards", &single, &tp, SYNTHETIC_TOL);
    // The first node to lack the file made the coordinator hash it, once.
    assert_eq!(manifests(), 1);
    for (i, h) in homes[..2].iter().enumerate() {
        check_cache("TP=2", &tp, i, h, model_len);
    }
    assert!(tp["share_sent_bytes"].as_u64().unwrap() > 0);
    // `weft cluster status` shows what each node caches.
    let status = common::ok_json(&common::weft(&[
        "cluster",
        "status",
        "--peers",
        &addrs[0],
        "--no-mdns",
        "--wait",
        "2",
        "--secret",
        SECRET,
        "--json",
    ]));
    let member = status["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["addr"] == addrs[0].as_str())
        .unwrap_or_else(|| panic!("{status}"));
    let cached = &member["shard_cache"][0];
    assert_eq!(cached["model"], "shared-q8.gguf", "{status}");
    assert_eq!(
        cached["disk_bytes"].as_u64(),
        Some(cache_bytes(&homes[0])),
        "{status}"
    );

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

/// A hub that lists `files` (path, bytes) with their sha256 and answers resolve requests,
/// whole or with `Range: bytes=A-B`; it logs each request's path and range.
struct FakeHub {
    files: Vec<(String, Vec<u8>)>,
    log: Mutex<Vec<(String, Option<String>)>>,
}

const REPO: &str = "acme/shared-GGUF";

fn answer(hub: &FakeHub, mut s: TcpStream) {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut first = String::new();
    let mut range = None;
    if r.read_line(&mut first).is_err() {
        return;
    }
    loop {
        let mut l = String::new();
        if r.read_line(&mut l).unwrap_or(0) == 0 || l == "\r\n" {
            break;
        }
        if let Some((k, v)) = l.trim_end().split_once(':') {
            if k.eq_ignore_ascii_case("range") {
                range = Some(v.trim().to_string());
            }
        }
    }
    let path = first.split_whitespace().nth(1).unwrap_or("").to_string();
    hub.log.lock().unwrap().push((path.clone(), range.clone()));
    let mut send = |status: &str, extra: &str, body: &[u8]| {
        let _ = write!(
            s,
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
            body.len()
        );
        let _ = s.write_all(body);
    };
    if path == format!("/api/models/{REPO}/tree/main?recursive=true") {
        let list: Vec<Value> = hub
            .files
            .iter()
            .map(|(p, b)| {
                let h: String = Sha256::digest(b)
                    .iter()
                    .map(|x| format!("{x:02x}"))
                    .collect();
                serde_json::json!({"type": "file", "path": p, "size": 134,
                    "lfs": {"oid": h, "size": b.len(), "pointerSize": 134}})
            })
            .collect();
        return send("200 OK", "", &serde_json::to_vec(&list).unwrap());
    }
    let prefix = format!("/{REPO}/resolve/main/");
    let Some((_, bytes)) = path
        .strip_prefix(&prefix)
        .and_then(|p| hub.files.iter().find(|(n, _)| n == p))
    else {
        return send("404 Not Found", "", b"");
    };
    let asked = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .and_then(|(a, b)| Some((a.parse::<usize>().ok()?, b.parse::<usize>().ok()?)));
    match asked {
        Some((a, b)) if a <= b && b < bytes.len() => send(
            "206 Partial Content",
            &format!("Content-Range: bytes {a}-{b}/{}\r\n", bytes.len()),
            &bytes[a..=b],
        ),
        Some(_) => send("416 Range Not Satisfiable", "", b""),
        None => send("200 OK", "", bytes),
    }
}

#[test]
fn nodes_fetch_their_shards_straight_from_a_hub() {
    let tmp = tempfile::tempdir().unwrap();
    // A split model (two parts), held only by the hub.
    let mut spec = weft_model::synthetic::SyntheticSpec::small(
        weft_model::Arch::Qwen3,
        weft_gguf::GgmlType::Q8_0,
    );
    (spec.n_embd, spec.n_layer, spec.n_ff, spec.n_extra_vocab) = (512, 4, 1536, 1000);
    let whole = tmp.path().join("whole.gguf");
    let model = weft_model::synthetic::synthetic_model(&spec);
    model.write_file(&whole).unwrap();
    let single = greedy(whole.to_str().unwrap(), PROMPT, 12, &[]);
    std::fs::remove_file(&whole).unwrap();
    let parts: Vec<Vec<u8>> = model.split(20).iter().map(|p| p.to_bytes()).collect();
    let n = parts.len();
    assert!(n >= 2);
    let total: usize = parts.iter().map(Vec::len).sum();
    let hub = Arc::new(FakeHub {
        files: parts
            .into_iter()
            .enumerate()
            .map(|(i, b)| (format!("shared-Q8_0-{:05}-of-{n:05}.gguf", i + 1), b))
            .collect(),
        log: Mutex::new(Vec::new()),
    });
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", l.local_addr().unwrap());
    let h = hub.clone();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let h = h.clone();
            std::thread::spawn(move || answer(&h, s));
        }
    });
    let homes: Vec<PathBuf> = (0..3)
        .map(|i| empty_home(tmp.path(), &format!("h{i}")))
        .collect();
    let unused = tmp.path().join("models-unused");
    std::fs::create_dir_all(&unused).unwrap();
    let mut kill = Kill(Vec::new());
    let mut addrs = Vec::new();
    for h in &homes[1..] {
        let (c, a) = node(h, &unused, &[]);
        kill.0.push(c);
        addrs.push(a);
    }
    let spec = format!("{REPO}:Q8_0");
    let env = [
        ("HF_ENDPOINT", endpoint.as_str()),
        ("WEFT_HOME", homes[0].to_str().unwrap()),
    ];
    let run = on_peers(&spec, &[&addrs[0], &addrs[1]], &["--tp", "2"], &env);
    assert_same_path("TP=2 from the hub", &single, &run, SYNTHETIC_TOL);
    let mut hub_pieces = 0;
    for i in 0..2 {
        let f = fetched(&run, i);
        let (from_hub, pieces) = f["sources"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["name"].as_str().unwrap().starts_with(&endpoint))
            .fold((0, 0), |(b, p), s| {
                (
                    b + s["bytes"].as_u64().unwrap(),
                    p + s["pieces"].as_u64().unwrap(),
                )
            });
        assert!(from_hub > 0, "node {i} fetched nothing from the hub: {f}");
        hub_pieces += pieces;
        assert!(
            cache_bytes(&homes[1 + i]) < total as u64,
            "node {i} holds the whole model"
        );
    }
    // The nodes asked for ranges; no machine kept the whole model.
    let log = hub.log.lock().unwrap();
    let ranged = log
        .iter()
        .filter(|(p, r)| {
            p.contains("/resolve/")
                && r.as_deref()
                    .is_some_and(|r| r.contains('-') && !r.ends_with('-'))
        })
        .count() as u64;
    assert!(ranged > 0, "no Range request reached the hub");
    // Runs of consecutive chunks went as one request each.
    assert!(
        ranged * 2 < hub_pieces,
        "{ranged} Range requests for {hub_pieces} pieces"
    );
    assert!(
        cache_bytes(&homes[0]) < total as u64 / 2,
        "the coordinator kept more than headers"
    );
    drop(log);
    // Run again: the manifest and the headers are cached, the nodes' shards too: the
    // hub is not read whole a second time.
    let before = hub
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, r)| p.contains("/resolve/") && r.is_none())
        .count();
    let again = on_peers(&spec, &[&addrs[0], &addrs[1]], &["--tp", "2"], &env);
    assert_same_path("TP=2 from the hub, again", &single, &again, SYNTHETIC_TOL);
    let after = hub
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, r)| p.contains("/resolve/") && r.is_none())
        .count();
    assert_eq!(before, after, "the hub's files were streamed whole again");
    // (A node that kept its loaded shard from the last session reports no fetch at all.)
    for i in 0..2 {
        let f = fetched(&again, i);
        assert!(
            f.is_null() || f["fetched_bytes"] == 0,
            "node {i} fetched again: {f}"
        );
    }
}
