//! A node lost while `weft serve` streams: the cluster forms again from the nodes that
//! answer (a spare, or the lost one once it is restarted), every running sequence's cache
//! is rebuilt, and the requests complete with the same greedy text as an uninterrupted
//! run; `/v1/cluster` reports the loss and the pause. With nothing to resume on within
//! `--resume-wait`, the requests fail with a 503 naming the node.

mod common;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use common::server::{assert_same_greedy, complete_n, Server};
use common::{real_model, start_node, start_node_with, Kill};

/// Each test's own cluster secret: tests run at once, and nodes of one cluster find each
/// other (member lists, mDNS), so a re-plan must not find another test's nodes.
fn secret(test: &str) -> String {
    format!("weft-resume-test-secret-0123456789-{test}")
}

const PROMPTS: [&str; 8] = [
    "Once upon a time",
    "The capital of France is",
    "In the beginning",
    "The best way to learn a language is",
    "Water boils at",
    "My favourite recipe is",
    "The history of Rome",
    "A good night's sleep",
];

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A streamed greedy completion, its chunks gathered into the shape of a whole answer
/// (`choices[0].logprobs` tokens and top logprobs, `usage.completion_tokens`), or the
/// error event it ended with.
fn stream_n(s: &Server, prompt: &str, n: usize) -> Value {
    let body = serde_json::json!({
        "model": "gemma-3-270m-q4_k_m", "prompt": prompt, "max_tokens": n,
        "temperature": 0, "logprobs": 5, "stream": true,
    });
    let (out, err) = s.curl(&[
        "-N",
        "-H",
        "Content-Type: application/json",
        "-d",
        &body.to_string(),
        &format!("{}/v1/completions", s.url),
    ]);
    assert!(
        out.ends_with("data: [DONE]\n\n"),
        "the stream did not end: {out} {err}"
    );
    let (mut tokens, mut tops) = (Vec::new(), Vec::new());
    for frame in out.trim_end().split("\n\n") {
        let data = frame.strip_prefix("data: ").unwrap_or(frame);
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
        if !v["error"].is_null() {
            return v;
        }
        let lp = &v["choices"][0]["logprobs"];
        if let (Some(t), Some(p)) = (lp["tokens"].as_array(), lp["top_logprobs"].as_array()) {
            tokens.extend(t.iter().cloned());
            tops.extend(p.iter().cloned());
        }
    }
    serde_json::json!({
        "choices": [{"logprobs": {"tokens": tokens, "top_logprobs": tops}}],
        "usage": {"completion_tokens": tokens.len()},
    })
}

/// A prompt of about 700 tokens: a long prefill to rebuild.
fn long_prompt() -> String {
    (0..60)
        .map(|i| format!("Chapter {i}: the river turned north past the old mill."))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `n` requests of `tokens` tokens at once (prompts in turn, one of them long), streamed
/// or whole; `during` runs on this thread meanwhile.
fn concurrently(s: &Server, n: usize, tokens: usize, during: impl FnOnce()) -> Vec<Value> {
    let long = long_prompt();
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let prompt = if i == 3 {
                    long.clone()
                } else {
                    PROMPTS[i % PROMPTS.len()].to_string()
                };
                sc.spawn(move || {
                    if n > 1 && i % 2 == 0 {
                        stream_n(s, &prompt, tokens)
                    } else {
                        complete_n(s, &prompt, tokens)
                    }
                })
            })
            .collect();
        during();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Waits until the server has generated `more` tokens beyond what it had.
fn wait_for_tokens(s: &Server, more: u64) {
    let base = s.get("/v1/cluster")["live"]["generated_tokens"]
        .as_u64()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let now = s.get("/v1/cluster")["live"]["generated_tokens"]
            .as_u64()
            .unwrap();
        if now >= base + more {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the server generated fewer than {more} tokens in 120 s");
}

/// Two running nodes of cluster `secret`, killed when dropped, their addresses, and
/// `--peers` for them.
fn two_nodes(secret: &str) -> (Kill, [String; 2], String) {
    let (a, addr_a) = start_node("127.0.0.1:0", secret);
    let (b, addr_b) = start_node("127.0.0.1:0", secret);
    let peers = format!("{addr_a},{addr_b}");
    (Kill(vec![a, b]), [addr_a, addr_b], peers)
}

/// Every answer complete, with the uninterrupted answer's token count and greedy path.
fn assert_all_same(what: &str, alone: &[Value], got: &[Value]) {
    for (i, (a, g)) in alone.iter().zip(got).enumerate() {
        assert!(g["error"].is_null(), "{what}, request {i} failed: {g}");
        assert_eq!(
            g["usage"]["completion_tokens"], a["usage"]["completion_tokens"],
            "{what}, request {i}: {g}"
        );
        assert_same_greedy(&format!("{what}, request {i}"), a, g);
    }
}

/// The one resume `/v1/cluster` reports, checked to name `lost`.
fn the_resume(s: &Server, lost: &str) -> Value {
    let info = s.get("/v1/cluster");
    let r = info["resumes"]
        .as_array()
        .unwrap_or_else(|| panic!("{info}"));
    assert_eq!(r.len(), 1, "{info}");
    let e = r[0].clone();
    assert_eq!(e["resumed"], true, "{e}");
    assert!(e["lost"].to_string().contains(lost), "lost {lost}: {e}");
    assert!(
        !e["nodes"].to_string().contains(lost) || e["attempts"].as_u64() > Some(1),
        "resumed on the dead node: {e}"
    );
    e
}

/// Kills a used node of `layout` over three running nodes while `streams` requests run,
/// and checks they finish as an uninterrupted run does, on the spare.
fn lose_a_node_with_a_spare(test: &str, layout: &[&str], streams: usize) {
    let Some(model) = real_model() else {
        return;
    };
    let secret = secret(test);
    let mut kids = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let (c, a) = start_node("127.0.0.1:0", &secret);
        kids.push(c);
        addrs.push(a);
    }
    let mut nodes = Kill(kids);
    let peers = addrs.join(",");
    let mut args = vec!["--peers", &peers, "--secret", &secret, "--parallel", "8"];
    args.extend_from_slice(layout);
    let s = Server::start(&model, &args);
    let what = format!("{layout:?}, {streams} streams");
    let tokens = 96;
    let alone = concurrently(&s, streams, tokens, || {});
    let mut killed_at = 0;
    let got = concurrently(&s, streams, tokens, || {
        // Late enough that every stream has tokens to rebuild.
        wait_for_tokens(&s, 24 * streams as u64);
        // The second node is in use in both layouts; the third is the spare.
        nodes.0[1].kill().unwrap();
        killed_at = unix_ms();
        let _ = nodes.0[1].wait();
    });
    assert_all_same(&what, &alone, &got);
    let e = the_resume(&s, &addrs[1]);
    assert!(
        e["nodes"].to_string().contains(&addrs[2]),
        "the spare took no part: {e}"
    );
    assert_eq!(e["sequences"].as_u64(), Some(streams as u64), "{e}");
    let resumed_at = e["at_unix_ms"].as_u64().unwrap() + e["pause_ms"].as_u64().unwrap();
    eprintln!(
        "{what}: from the kill to the resumed step {} ms ({} sequences, {} tokens replayed)",
        resumed_at.saturating_sub(killed_at),
        e["sequences"],
        e["replayed_tokens"]
    );
}

#[test]
fn tp2_of_three_nodes_loses_one_mid_stream_and_resumes_on_the_spare() {
    lose_a_node_with_a_spare("tp2", &["--tp", "2", "--pp", "1"], 1);
}

#[test]
fn pp2_of_three_nodes_loses_one_mid_stream_and_resumes_on_the_spare() {
    lose_a_node_with_a_spare("pp2", &["--tp", "1", "--pp", "2"], 1);
}

#[test]
fn eight_streams_survive_a_lost_node() {
    lose_a_node_with_a_spare("eight", &["--tp", "2", "--pp", "1"], 8);
}

#[test]
fn streams_wait_for_a_restarted_node_and_without_one_fail_naming_it() {
    let Some(model) = real_model() else {
        return;
    };
    let secret = secret("restart");
    let (mut nodes, [_, addr_b], peers) = two_nodes(&secret);
    let layout = [
        "--peers",
        &peers,
        "--secret",
        &secret,
        "--tp",
        "2",
        "--pp",
        "1",
        "--parallel",
        "4",
    ];
    let s = Server::start(&model, &layout);
    let alone = concurrently(&s, 2, 64, || {});
    // TP=2 needs both: the streams wait until B is back on its address.
    let got = concurrently(&s, 2, 64, || {
        wait_for_tokens(&s, 16);
        nodes.0[1].kill().unwrap();
        let _ = nodes.0[1].wait();
        std::thread::sleep(Duration::from_millis(1500));
        nodes.0[1] = start_node(&addr_b, &secret).0;
    });
    assert_all_same("restarted", &alone, &got);
    let e = the_resume(&s, &addr_b);
    assert!(e["attempts"].as_u64().unwrap() > 1, "{e}");
    assert!(e["pause_ms"].as_u64().unwrap() >= 1000, "{e}");
    drop(s);

    // With no wait, losing B for good fails the running request with a 503 naming it.
    let mut args = layout.to_vec();
    args.extend_from_slice(&["--resume-wait", "0"]);
    let s = Server::start(&model, &args);
    let got = concurrently(&s, 1, 400, || {
        wait_for_tokens(&s, 16);
        nodes.0[1].kill().unwrap();
        let _ = nodes.0[1].wait();
    });
    let msg = got[0]["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(&addr_b),
        "the error names no lost node: {}",
        got[0]
    );
    let info = s.get("/v1/cluster");
    assert_eq!(info["resumes"][0]["resumed"], false, "{info}");
}

#[test]
fn a_node_that_joined_since_takes_the_lost_ones_place() {
    let Some(model) = real_model() else {
        return;
    };
    let secret = secret("join");
    let (mut nodes, [addr_a, addr_b], peers) = two_nodes(&secret);
    let s = Server::start(
        &model,
        &[
            "--peers", &peers, "--secret", &secret, "--tp", "2", "--pp", "1",
        ],
    );
    let alone = concurrently(&s, 1, 64, || {});
    // C is not in --peers: it joins A's member list after the server started.
    let (c, addr_c) = start_node_with("127.0.0.1:0", &secret, &["--join", &addr_a, "--no-mdns"]);
    nodes.0.push(c);
    let got = concurrently(&s, 1, 64, || {
        wait_for_tokens(&s, 16);
        nodes.0[1].kill().unwrap();
        let _ = nodes.0[1].wait();
    });
    assert_all_same("joined", &alone, &got);
    let e = the_resume(&s, &addr_b);
    assert!(
        e["nodes"].to_string().contains(&addr_c),
        "C took no part: {e}"
    );
}
