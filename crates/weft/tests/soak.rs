//! A soak over loopback: 64 clients stream completions at once, with prompts from 10 to
//! about 3,000 tokens, and a share of them hang up mid-stream, for a bounded time, against
//! one node and against a two-node cluster. Every stream must end complete (or be the one
//! its client cancelled), none may hang, and the processes' resident memory must come back
//! to its idle level. `WEFT_SOAK_SECS` sets how long new requests are sent (default 20 s; those running
//! then finish); the figures
//! (requests, p50/p99 time to first token, RSS before and after) are printed.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::real_model;
use common::server::{Server, KEY};

const CLIENTS: usize = 64;
/// Words a prompt may have: "word N" pairs tokenize to about 1.1 tokens a word.
const MAX_WORDS: usize = 2_600;
/// Longer than any request can take: past it a stream is hung.
const STALL: Duration = Duration::from_secs(180);

const WORDS: [&str; 16] = [
    "river", "north", "stone", "mill", "garden", "light", "winter", "letter", "market", "bridge",
    "forest", "music", "harbor", "engine", "candle", "window",
];

fn prompt(rng: &mut StdRng) -> String {
    // Mostly short, some long: one prompt in eight is 1,000 words or more.
    let words = if rng.gen_ratio(1, 8) {
        rng.gen_range(1_000..MAX_WORDS)
    } else {
        rng.gen_range(10..410)
    };
    (0..words)
        .map(|_| WORDS[rng.gen_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

/// How one streamed request went.
enum Outcome {
    /// Ended with `data: [DONE]`; time to the first token chunk.
    Complete(Duration),
    /// The client hung up after the first chunk, as planned.
    Cancelled,
    Failed(String),
}

/// Streams one completion over a raw socket; hangs up after the first chunk if `hang_up`.
fn stream_once(addr: &str, prompt: &str, max_tokens: u64, hang_up: bool) -> Outcome {
    let body = serde_json::json!({
        "model": "gemma-3-270m-q4_k_m", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.8, "seed": max_tokens, "stream": true,
    })
    .to_string();
    let started = Instant::now();
    let mut s = match TcpStream::connect(addr) {
        Ok(s) => s,
        Err(e) => return Outcome::Failed(format!("connect: {e}")),
    };
    let _ = s.set_read_timeout(Some(STALL));
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if let Err(e) = s.write_all(req.as_bytes()) {
        return Outcome::Failed(format!("send: {e}"));
    }
    let mut r = BufReader::new(s);
    let mut status = String::new();
    if let Err(e) = r.read_line(&mut status) {
        return Outcome::Failed(format!("status line: {e}"));
    }
    if !status.starts_with("HTTP/1.1 200") {
        let mut rest = String::new();
        let _ = r.read_to_string(&mut rest);
        return Outcome::Failed(format!("{} {rest}", status.trim()));
    }
    let mut first = None;
    let mut line = String::new();
    loop {
        line.clear();
        match r.read_line(&mut line) {
            Ok(0) => return Outcome::Failed("the stream closed before [DONE]".into()),
            Ok(_) => {}
            Err(e) => return Outcome::Failed(format!("no data for {STALL:?}: {e}")),
        }
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return Outcome::Complete(first.unwrap_or_else(|| started.elapsed()));
        }
        if data.contains("\"error\"") {
            return Outcome::Failed(data.to_string());
        }
        if first.is_none() {
            first = Some(started.elapsed());
            if hang_up {
                return Outcome::Cancelled;
            }
        }
    }
}

/// Resident memory of `pid` and its children (the local nodes), kB.
fn rss_tree_kb(pid: u32) -> u64 {
    let one = |p: &str| -> u64 {
        std::fs::read_to_string(format!("/proc/{p}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse().ok())
            })
            .unwrap_or(0)
    };
    one(&pid.to_string()) + common::child_pids(pid).iter().map(|c| one(c)).sum::<u64>()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// One soak at a time: each takes both cores.
static SERIAL: Mutex<()> = Mutex::new(());

/// Runs the soak against a server started with `layout`.
fn soak(what: &str, layout: &[&str]) {
    let Some(model) = real_model() else {
        return;
    };
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let secs: u64 = std::env::var("WEFT_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let mut args = vec!["--parallel", "8", "--ctx", "4096"];
    args.extend_from_slice(layout);
    let s = Server::start(&model, &args);
    let addr = s.url.trim_start_matches("http://").to_string();
    let pid = s.child.id();
    // Warm up: every slot runs a long prompt once, so the caches' pages are resident.
    std::thread::scope(|sc| {
        for i in 0..8 {
            let addr = &addr;
            sc.spawn(move || {
                let p = format!("{i} {}", "river ".repeat(3_000));
                match stream_once(addr, &p, 4, false) {
                    Outcome::Complete(_) => {}
                    Outcome::Cancelled => unreachable!(),
                    Outcome::Failed(e) => panic!("{what}: warm-up failed: {e}"),
                }
            });
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    let idle = rss_tree_kb(pid);

    let stop_at = Instant::now() + Duration::from_secs(secs);
    let ttfts = Mutex::new(Vec::new());
    let (cancelled, failures) = (Mutex::new(0usize), Mutex::new(Vec::new()));
    let failed = AtomicBool::new(false);
    let started = Instant::now();
    std::thread::scope(|sc| {
        for c in 0..CLIENTS as u64 {
            let (addr, ttfts, cancelled, failures, failed) =
                (&addr, &ttfts, &cancelled, &failures, &failed);
            sc.spawn(move || {
                // Each client's requests are the same from run to run.
                let mut rng = StdRng::seed_from_u64(c);
                while Instant::now() < stop_at && !failed.load(Ordering::Relaxed) {
                    let p = prompt(&mut rng);
                    let n = rng.gen_range(1..=32);
                    // One request in five hangs up after its first token.
                    let hang_up = rng.gen_ratio(1, 5);
                    match stream_once(addr, &p, n, hang_up) {
                        Outcome::Complete(t) => ttfts.lock().unwrap().push(t),
                        Outcome::Cancelled => *cancelled.lock().unwrap() += 1,
                        Outcome::Failed(e) => {
                            failures.lock().unwrap().push(e);
                            failed.store(true, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    let elapsed = started.elapsed();
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{what}: {failures:?}");
    // Idle again: nothing running or queued, and memory back to its level.
    let deadline = Instant::now() + Duration::from_secs(30);
    let live = loop {
        let live = s.get("/v1/cluster")["live"].clone();
        if live["active_sequences"] == 0 && live["queued_requests"] == 0 {
            break live;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: never idle again: {live}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_tree_kb(pid);
    let mut t = ttfts.into_inner().unwrap();
    t.sort();
    let cancelled = cancelled.into_inner().unwrap();
    eprintln!(
        "soak {what}: {CLIENTS} clients for {:.0} s: {} streams complete, {cancelled} hung up \
         by their clients; time to first token p50 {:.2} s, p99 {:.2} s; RSS {} MiB idle, \
         {} MiB after; server counters {live}",
        elapsed.as_secs_f64(),
        t.len(),
        percentile(&t, 0.5).as_secs_f64(),
        percentile(&t, 0.99).as_secs_f64(),
        idle / 1024,
        after / 1024,
    );
    assert!(!t.is_empty(), "{what}: no stream completed");
    assert_eq!(live["failed"], 0, "{what}: {live}");
    assert!(
        after <= idle + idle / 20 + 16 * 1024,
        "{what}: RSS grew from {idle} kB idle to {after} kB after the soak"
    );
    // The server still answers a plain request.
    assert!(matches!(
        stream_once(&addr, "Once upon a time", 4, false),
        Outcome::Complete(_)
    ));
}

#[test]
fn soak_one_node() {
    soak("one node", &[]);
}

#[test]
fn soak_two_node_cluster() {
    soak("two nodes, TP=2", &["--nodes", "2", "--tp", "2"]);
}
