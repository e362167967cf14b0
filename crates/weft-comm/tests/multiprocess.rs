//! Ranks as child processes over real sockets and shared memory: every collective with
//! exact results for 2 to 8 ranks, a rank killed or stalled mid-collective, a wrong secret,
//! a wrong protocol version and garbage bytes on a rank's port.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

mod rank_script;

/// The child side: this same test binary, started with the rank's arguments in the
/// environment, runs the rank and exits; in the parent this test does nothing.
#[test]
fn rank_child() {
    if let Ok(raw) = std::env::var(rank_script::RANK_ARGS_ENV) {
        rank_script::main_from_env(&raw);
    }
}

/// Addresses for `n` ranks to bind, on ports below the kernel's ephemeral range: a port
/// the kernel handed out for `:0` and this function let go could be taken, before the
/// rank binds it, by an outgoing connection of a test running meanwhile (a rank then
/// never joins, and the group fails to form instead of testing what it should). Each
/// port is bindable when picked; the picks start at a place spread by process, time and
/// call, so tests running at once pick apart.
fn free_addrs(n: usize) -> Vec<String> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    const FIRST: u64 = 10_000;
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(32_768);
    if ephemeral < FIRST + 1_000 {
        // No room below it: the kernel's own pick.
        let ls: Vec<TcpListener> = (0..n)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        return ls
            .iter()
            .map(|l| l.local_addr().unwrap().to_string())
            .collect();
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u64);
    let mut at = u64::from(std::process::id()) * 7_919
        + nanos
        + CALLS.fetch_add(1, Ordering::Relaxed) * 104_729;
    let mut held = Vec::new();
    while held.len() < n {
        let port = FIRST + at % (ephemeral - FIRST);
        at += 7_919;
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port as u16)) {
            held.push(l);
        }
    }
    held.iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect()
}

fn spawn(rank: usize, addrs: &[String], extra: &[&str]) -> Child {
    let mut args = vec![
        "--rank".to_string(),
        rank.to_string(),
        "--addrs".into(),
        addrs.join(","),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "rank_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(rank_script::RANK_ARGS_ENV, args.join("\u{1f}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a child; returns its JSON line, stderr and exit status.
fn finish(c: Child) -> (Value, String, Option<i32>) {
    let out = c.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let line = stdout
        .lines()
        .find_map(|l| l.split_once(rank_script::REPORT_PREFIX).map(|(_, r)| r))
        .unwrap_or("null");
    let v: Value = serde_json::from_str(line).unwrap_or(Value::Null);
    (v, stderr, out.status.code())
}

fn run_group(n: usize, extra: &[&str]) -> Vec<(Value, String, Option<i32>)> {
    let addrs = free_addrs(n);
    let kids: Vec<Child> = (0..n).map(|r| spawn(r, &addrs, extra)).collect();
    kids.into_iter().map(finish).collect()
}

#[test]
fn every_collective_is_exact_over_tcp() {
    for n in [2, 3, 5, 8] {
        for (r, (v, err, code)) in run_group(n, &["--transport", "tcp"])
            .into_iter()
            .enumerate()
        {
            assert_eq!(v["ok"], true, "{n} ranks, rank {r}: {v} {err}");
            assert_eq!(code, Some(0));
            assert!(
                v["transports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|t| t == "tcp"),
                "{v}"
            );
        }
    }
}

#[test]
fn every_collective_is_exact_over_shared_memory() {
    for n in [2, 4, 8] {
        for (r, (v, err, code)) in run_group(n, &["--transport", "shm"])
            .into_iter()
            .enumerate()
        {
            assert_eq!(v["ok"], true, "{n} ranks, rank {r}: {v} {err}");
            assert_eq!(code, Some(0));
            assert!(
                v["transports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|t| t == "shm"),
                "{v}"
            );
        }
    }
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("weft-"))
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "ring files left behind: {left:?}");
}

fn check_loss(script: &str, transport: &str, n: usize, victim: usize) {
    let timeout_ms = 1500u64;
    let addrs = free_addrs(n);
    let t = timeout_ms.to_string();
    let v = victim.to_string();
    let extra = [
        "--script",
        script,
        "--victim",
        &v,
        "--after",
        "20",
        "--timeout-ms",
        &t,
        "--transport",
        transport,
    ];
    let kids: Vec<Child> = (0..n).map(|r| spawn(r, &addrs, &extra)).collect();
    let mut kids: Vec<Option<Child>> = kids.into_iter().map(Some).collect();
    if script == "stall" {
        // The stalled rank sleeps; collect the others, then kill it.
        let mut staller = kids[victim].take().unwrap();
        let results: Vec<_> = kids.into_iter().flatten().map(finish).collect();
        staller.kill().unwrap();
        let _ = staller.wait();
        assert_results(
            script,
            transport,
            &results,
            victim,
            &addrs[victim],
            timeout_ms,
        );
    } else {
        let results: Vec<_> = kids
            .into_iter()
            .enumerate()
            .filter_map(|(r, c)| c.map(|c| (r, finish(c))))
            .filter(|(r, _)| *r != victim)
            .map(|(_, x)| x)
            .collect();
        assert_results(
            script,
            transport,
            &results,
            victim,
            &addrs[victim],
            timeout_ms,
        );
    }
}

fn assert_results(
    script: &str,
    transport: &str,
    results: &[(Value, String, Option<i32>)],
    victim: usize,
    addr: &str,
    timeout_ms: u64,
) {
    assert!(!results.is_empty());
    for (v, err, _) in results {
        if v["rank"].as_u64() == Some(victim as u64) {
            continue;
        }
        let what = format!("{script} over {transport}: {v} {err}");
        assert_eq!(v["lost"].as_u64(), Some(victim as u64), "{what}");
        let msg = v["error"].as_str().unwrap();
        assert!(
            msg.contains(&format!("rank {victim}")) && msg.contains(addr),
            "{what}"
        );
        // The deadline is a functional bound (twice the timeout), not a speed claim.
        assert!(
            v["waited_ms"].as_f64().unwrap() < 2.0 * timeout_ms as f64 + 500.0,
            "{what}"
        );
    }
}

#[test]
fn a_killed_rank_is_named_by_every_other_rank() {
    check_loss("die", "tcp", 3, 1);
    check_loss("die", "shm", 4, 2);
}

#[test]
fn a_stalled_rank_is_named_by_every_other_rank() {
    check_loss("stall", "tcp", 3, 2);
    check_loss("stall", "shm", 3, 0);
}

#[test]
fn a_wrong_secret_is_refused() {
    let addrs = free_addrs(2);
    let (right, wrong) = (
        weft_comm::secret::random_secret(),
        weft_comm::secret::random_secret(),
    );
    let a = spawn(0, &addrs, &["--secret", &right, "--timeout-ms", "500"]);
    let b = spawn(1, &addrs, &["--secret", &wrong, "--timeout-ms", "500"]);
    let (vb, _, cb) = finish(b);
    assert_eq!(cb, Some(2), "{vb}");
    assert!(vb["error"].as_str().unwrap().contains("secret"), "{vb}");
    // Read rank 0's log until it says why it refused (it then waits for a rank 1 that
    // never comes, until its connect timeout ends it).
    let mut a = a;
    let mut ea = String::new();
    let mut lines = BufReader::new(a.stderr.take().unwrap()).lines();
    while let Some(Ok(l)) = lines.next() {
        ea.push_str(&l);
        ea.push('\n');
        if l.contains("refused") {
            break;
        }
    }
    let _ = a.kill();
    let _ = a.wait();
    assert!(
        ea.contains("secret"),
        "rank 0 must log why it refused: {ea}"
    );
}

/// Sends `bytes` to a rank's port the way a stranger would, and reads until it hangs up.
fn poke(addr: &str, bytes: &[u8]) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(bytes);
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
}

#[test]
fn wrong_version_and_garbage_are_refused_and_the_group_still_forms() {
    let addrs = free_addrs(2);
    let a = spawn(0, &addrs, &[]);
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..50 {
        if TcpStream::connect(&addrs[0]).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    poke(&addrs[0], b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0");
    let mut hello = weft_comm::handshake::Hello::new(1, 2);
    hello.version = 99;
    poke(&addrs[0], &hello.encode());
    let b = spawn(1, &addrs, &[]);
    let (vb, eb, _) = finish(b);
    let (va, ea, _) = finish(a);
    assert_eq!(va["ok"], true, "{va} {ea}");
    assert_eq!(vb["ok"], true, "{vb} {eb}");
    assert!(
        ea.contains("not the weft protocol"),
        "garbage must be logged: {ea}"
    );
    assert!(
        ea.contains("version 99"),
        "the wrong version must be logged: {ea}"
    );
}
