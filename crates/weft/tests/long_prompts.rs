//! Deadlines that follow the work: prompts of about 1,000 and 4,000 tokens on every cluster
//! layout equal the single node's output (a prefill of many seconds is busy, not lost), a
//! node killed or stalled during a long prefill is still named within 5 s, and a node's port
//! flooded with silent connections still lets a real coordinator in at once.

mod common;

use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use weft_gguf::GgmlType;
use weft_model::synthetic::{synthetic_model, SyntheticSpec};
use weft_model::Arch;

use common::{
    assert_same_path, greedy, ids, ok_json, real_model, run_on_peers, start_node,
    synthetic_llama_q8, Kill, GEMMA3_TOL, LAYOUTS, SYNTHETIC_TOL,
};

/// A strong cluster secret for the nodes these tests start.
const SECRET: &str = "5f0c9a1e7b3d48e2a6c1f9b0d7e4a3c28b6f1e0d9c7a5b3e2f1d0c9b8a7e6f5d";

/// A long English-like prompt: sentences drawn from a fixed word list by a seeded
/// generator, so every run and every layout sees the same text.
fn long_text(words: usize, seed: u64) -> String {
    const VOCAB: [&str; 48] = [
        "the", "river", "carried", "stones", "down", "from", "mountain", "villages", "where",
        "people", "built", "houses", "of", "wood", "and", "clay", "every", "spring", "farmers",
        "planted", "wheat", "near", "old", "bridge", "while", "children", "watched", "birds",
        "over", "quiet", "fields", "in", "evening", "light", "a", "trader", "sold", "salt", "to",
        "families", "who", "lived", "by", "market", "after", "long", "winter", "rain",
    ];
    let mut x = seed | 1;
    let mut out = String::new();
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let w = VOCAB[(x % VOCAB.len() as u64) as usize];
        if i % 12 == 0 {
            if i > 0 {
                out.push_str(". ");
            }
            let mut c = w.chars();
            if let Some(f) = c.next() {
                out.extend(f.to_uppercase());
                out.push_str(c.as_str());
            }
        } else {
            out.push(' ');
            out.push_str(w);
        }
    }
    out.push('.');
    out
}

/// Greedy continuation of `prompt` (8 tokens, top logprobs) with a context that holds it.
fn greedy_long(model: &str, prompt: &str, layout: &[&str]) -> Value {
    greedy(model, prompt, 8, &[layout, &["--ctx", "4608"]].concat())
}

/// Every layout against one node, for a prompt of about `target` tokens (±15 %).
fn every_layout_on(model: &str, what: &str, words: usize, target: usize, tol: f64) {
    let prompt = long_text(words, target as u64);
    let single = greedy_long(model, &prompt, &[]);
    let n = ids(&single, "prompt_ids").len();
    assert!(
        n * 100 >= target * 85 && n * 100 <= target * 115,
        "{what}: the prompt has {n} tokens, meant to be about {target}"
    );
    for l in LAYOUTS {
        let got = greedy_long(model, &prompt, l);
        assert_eq!(got["prompt_ids"], single["prompt_ids"], "{what} {l:?}");
        assert_same_path(
            &format!("{what} {n}-token prompt {l:?}"),
            &single,
            &got,
            tol,
        );
    }
}

#[test]
fn long_prompts_on_every_layout_match_one_node_on_a_synthetic_model() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("llama-q8-long.gguf");
    let mut w = synthetic_model(&SyntheticSpec::small(Arch::Llama, GgmlType::Q8_0));
    w.set_u32("llama.context_length", 8192);
    w.write_file(&p).unwrap();
    let m = p.to_str().unwrap();
    // The synthetic vocabulary is mostly bytes: about 5.8 tokens a word.
    every_layout_on(m, "synthetic", 172, 1000, SYNTHETIC_TOL);
    every_layout_on(m, "synthetic", 690, 4000, SYNTHETIC_TOL);
}

#[test]
fn long_prompts_on_every_layout_match_one_node_on_gemma3() {
    let Some(m) = real_model() else { return };
    let m = m.to_str().unwrap();
    every_layout_on(m, "gemma3", 880, 1000, GEMMA3_TOL);
    // After thousands of tokens the KV cache carries the flips of every earlier position:
    // measured on the ~3,800-token prompt, one node and TP=4 differed by 0.13-0.17 at the
    // 6th token, and parted at a 0.35 tie with blocked attention; within `GEMMA3_TOL`.
    every_layout_on(m, "gemma3", 3500, 4000, GEMMA3_TOL);
}

/// Starts `weft run` over two running nodes (TP=2) with a prompt whose prefill takes
/// seconds, then does `act` to node B once the prefill is under way; returns the run's
/// stderr, whether it failed, and how long after `act` it ended.
fn disturb_long_prefill(
    model: &str,
    act: impl FnOnce(&mut std::process::Child),
) -> (String, bool, Duration, String) {
    let (a, addr_a) = start_node("127.0.0.1:0", SECRET);
    let (b, addr_b) = start_node("127.0.0.1:0", SECRET);
    let mut nodes = Kill(vec![a, b]);
    let prompt = long_text(3500, 7);
    let run = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["run", "--model", model, "--prompt", &prompt, "-n", "4"])
        .args(["--temperature", "0", "--ctx", "4608", "--tp", "2"])
        .args(["--peers", &format!("{addr_a},{addr_b}"), "--secret", SECRET])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Loading takes well under a second; the 4,000-token prefill on one core per node
    // takes many seconds more.
    std::thread::sleep(Duration::from_millis(2500));
    act(&mut nodes.0[1]);
    let t = Instant::now();
    let out = run.wait_with_output().unwrap();
    let ended = t.elapsed();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    // Let a stopped node go before it is killed, so it does not linger stopped.
    let _ = Command::new("kill")
        .args(["-CONT", &nodes.0[1].id().to_string()])
        .status();
    (err, !out.status.success(), ended, addr_b)
}

#[test]
fn a_node_killed_during_a_long_prefill_is_named_within_5_s() {
    let Some(m) = real_model() else { return };
    let (err, failed, ended, addr_b) = disturb_long_prefill(m.to_str().unwrap(), |b| {
        b.kill().unwrap();
        let _ = b.wait();
    });
    assert!(failed, "the request must fail: {err}");
    assert!(err.contains(&addr_b), "the error must name {addr_b}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    // A functional bound from the issue, not a speed claim.
    assert!(
        ended < Duration::from_secs(5),
        "ended {ended:?} after the kill"
    );
}

#[test]
fn a_node_stalled_during_a_long_prefill_is_named_within_5_s() {
    let Some(m) = real_model() else { return };
    let (err, failed, ended, addr_b) = disturb_long_prefill(m.to_str().unwrap(), |b| {
        let ok = Command::new("kill")
            .args(["-STOP", &b.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    });
    assert!(failed, "the request must fail: {err}");
    assert!(err.contains(&addr_b), "the error must name {addr_b}: {err}");
    assert!(err.contains("heartbeat"), "the error must say why: {err}");
    assert!(
        ended < Duration::from_secs(5),
        "ended {ended:?} after the stall"
    );
}

#[test]
fn silent_connections_do_not_keep_a_coordinator_out() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic_llama_q8(dir.path());
    let (a, addr) = start_node("127.0.0.1:0", SECRET);
    let _nodes = Kill(vec![a]);
    // 200 connections that never say a word, held open through the run.
    let silent: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    let t = Instant::now();
    let out = run_on_peers(&model, &addr, SECRET, &[]);
    let took = t.elapsed();
    let v = ok_json(&out);
    // The coordinator's connection and setup (handshake, plan, load of a tiny model):
    // the bound, not a speed claim.
    let setup = v["setup_s"].as_f64().unwrap();
    assert!(
        setup < 1.0,
        "setup took {setup} s behind 200 silent connections"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    drop(silent);
}

#[test]
fn a_coordinator_that_falls_silent_frees_its_node() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic_llama_q8(dir.path());
    let (a, addr) = start_node("127.0.0.1:0", SECRET);
    let _nodes = Kill(vec![a]);
    // A serving coordinator holds the node's session between requests.
    let mut serve = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["serve", "--port", "0", "--model", &model, "-t", "1"])
        .args(["--peers", &addr, "--secret", SECRET])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::listening_on(&mut serve, "weft serve");
    // Stopped, its sockets stay open (no FIN), as when its host loses power.
    let pid = serve.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    std::thread::sleep(Duration::from_secs(4));
    let out = run_on_peers(&model, &addr, SECRET, &[]);
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    let _ = serve.kill();
    let _ = serve.wait();
    let v = ok_json(&out);
    assert_eq!(ids(&v, "token_ids").len(), 2);
}
