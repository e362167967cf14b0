//! One rank of a test group, as a child process: the multi-process tests start their own
//! test binary again with `RANK_ARGS_ENV` set; that child runs a script of collectives,
//! checks every result exactly and prints one JSON line after `REPORT_PREFIX` (or the
//! error it got, naming the peer). The rank lives in the test, not in a binary of the
//! crate, so that `cargo run` in the workspace has one binary to pick: `weft`.

use std::time::{Duration, Instant};

use clap::Parser;
use weft_comm::{Group, GroupOptions, TransportKind, Wire};

#[derive(Parser)]
struct Args {
    #[arg(long)]
    rank: usize,
    /// Comma-separated listen addresses of every rank, in rank order.
    #[arg(long, value_delimiter = ',')]
    addrs: Vec<String>,
    /// A fixed secret is fine for a test binary on loopback; it still clears the 128-bit floor.
    #[arg(
        long,
        default_value = "weft-comm-rank-test-secret-not-for-real-clusters"
    )]
    secret: String,
    #[arg(long, default_value = "tcp")]
    transport: TransportKind,
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
    /// all | die | stall
    #[arg(long, default_value = "all")]
    script: String,
    /// For die/stall: the rank that dies or stalls, and after how many all-reduces.
    #[arg(long, default_value_t = 1)]
    victim: usize,
    #[arg(long, default_value_t = 5)]
    after: usize,
}

/// The environment variable that carries a child rank's arguments (unit-separated).
pub const RANK_ARGS_ENV: &str = "WEFT_COMM_TEST_RANK_ARGS";
/// What starts the report line, so the test harness's own output can be told apart.
pub const REPORT_PREFIX: &str = "RANK-REPORT ";

/// Runs one rank with the arguments in `RANK_ARGS_ENV`, then exits the process.
pub fn main_from_env(raw: &str) -> ! {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
    let a = Args::parse_from(std::iter::once("rank").chain(raw.split('\u{1f}')));
    let opts = GroupOptions {
        secret: a.secret.clone().into_bytes(),
        transport: a.transport,
        timeout: Duration::from_millis(a.timeout_ms),
        connect_timeout: Duration::from_secs(20),
        ..GroupOptions::default()
    };
    let mut g = match Group::connect(a.rank, &a.addrs, opts) {
        Ok(g) => g,
        Err(e) => {
            println!(
                "{REPORT_PREFIX}{}",
                serde_json::json!({"rank": a.rank, "error": e.to_string()})
            );
            std::process::exit(2);
        }
    };
    let out = match a.script.as_str() {
        "all" => run_all(&mut g),
        "die" | "stall" => run_until_lost(&mut g, &a),
        s => Err(format!("unknown script {s}")),
    };
    match out {
        Ok(v) => {
            println!("{REPORT_PREFIX}{v}");
            std::process::exit(0);
        }
        Err(e) => {
            println!(
                "{REPORT_PREFIX}{}",
                serde_json::json!({"rank": a.rank, "error": e})
            );
            std::process::exit(1);
        }
    }
}

/// Exactly representable values (multiples of 1/4 below 32), so every sum is exact in any
/// order and in f16 too.
fn value(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 97) as f32 * 0.25
}

fn run_all(g: &mut Group) -> Result<serde_json::Value, String> {
    let (me, n) = (g.rank(), g.size());
    let mut checks = 0;
    let e = |what: &str, x: weft_comm::CommError| format!("{what}: {x}");
    // Sizes on both sides of the segment size and of the ring threshold.
    for len in [1usize, 7, 640, 1000, 20_000, 70_001, 300_000] {
        for wire in [Wire::F32, Wire::F16, Wire::Bf16] {
            if wire != Wire::F32 && len > 20_000 {
                continue;
            }
            let mut buf: Vec<f32> = (0..len).map(|i| value(me, i)).collect();
            g.all_reduce_sum_as(&mut buf, wire)
                .map_err(|x| e("all_reduce", x))?;
            for (i, v) in buf.iter().enumerate() {
                let want: f32 = (0..n).map(|r| value(r, i)).sum();
                if *v != want {
                    return Err(format!(
                        "all_reduce {wire:?} len {len}: [{i}] = {v}, want {want}"
                    ));
                }
            }
            checks += 1;
        }
    }
    for base in [0usize, 3, 5000, 40_000] {
        let counts: Vec<usize> = (0..n).map(|r| base + r * 3).collect();
        let local: Vec<f32> = (0..counts[me]).map(|i| value(me, i)).collect();
        let mut out = vec![-1f32; counts.iter().sum()];
        g.all_gather(&local, &counts, &mut out)
            .map_err(|x| e("all_gather", x))?;
        let mut k = 0;
        for (r, &c) in counts.iter().enumerate() {
            for i in 0..c {
                if out[k] != value(r, i) {
                    return Err(format!("all_gather base {base}: rank {r}'s [{i}] wrong"));
                }
                k += 1;
            }
        }
        checks += 1;
    }
    for len in [0usize, 5, 100_000] {
        let root = n - 1;
        let mut buf: Vec<u8> = if me == root {
            (0..len).map(|i| (i % 253) as u8).collect()
        } else {
            vec![0; len]
        };
        g.broadcast(root, &mut buf).map_err(|x| e("broadcast", x))?;
        if buf.iter().enumerate().any(|(i, &b)| b != (i % 253) as u8) {
            return Err(format!("broadcast of {len} bytes wrong"));
        }
        checks += 1;
    }
    // A pipeline hand-off around the ring: send to the next rank, receive from the previous.
    for len in [1usize, 3000, 200_000] {
        let to = (me + 1) % n;
        let from = (me + n - 1) % n;
        let msg: Vec<u8> = (0..len).map(|i| ((i + me) % 251) as u8).collect();
        let mut got = vec![0u8; len];
        if me % 2 == 0 {
            g.send(to, &msg).map_err(|x| e("send", x))?;
            g.recv(from, &mut got).map_err(|x| e("recv", x))?;
        } else {
            g.recv(from, &mut got).map_err(|x| e("recv", x))?;
            g.send(to, &msg).map_err(|x| e("send", x))?;
        }
        if got
            .iter()
            .enumerate()
            .any(|(i, &b)| b != ((i + from) % 251) as u8)
        {
            return Err(format!("send/recv of {len} bytes wrong"));
        }
        checks += 1;
    }
    g.barrier().map_err(|x| e("barrier", x))?;
    checks += 1;
    let k = 4;
    let local: Vec<(u32, f32)> = (0..k)
        .map(|i| ((me * 100 + i) as u32, (me * 7 + i * 3) as f32))
        .collect();
    let mut top = Vec::new();
    g.merge_top_k(&local, k, &mut top)
        .map_err(|x| e("merge_top_k", x))?;
    let mut all: Vec<(u32, f32)> = (0..n)
        .flat_map(|r| (0..k).map(move |i| ((r * 100 + i) as u32, (r * 7 + i * 3) as f32)))
        .collect();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    all.truncate(k);
    if top != all {
        return Err(format!("merge_top_k gave {top:?}, want {all:?}"));
    }
    checks += 1;
    let m = g.probe_links(20, 1 << 20).map_err(|x| e("probe", x))?;
    for i in 0..n {
        for j in 0..n {
            if i != j && !(m.rtt_us[i][j] > 0.0 && m.bandwidth_gb_s[i][j] > 0.0) {
                return Err(format!("probe {i}->{j} gave no figures"));
            }
        }
    }
    checks += 1;
    let transports: Vec<&str> = (0..n)
        .filter_map(|r| g.link_info(r))
        .map(|(_, k)| k)
        .collect();
    Ok(serde_json::json!({"rank": me, "ok": true, "checks": checks, "transports": transports}))
}

/// All-reduces until the group loses a peer; the victim dies (exits) or stalls (sleeps).
fn run_until_lost(g: &mut Group, a: &Args) -> Result<serde_json::Value, String> {
    let me = g.rank();
    let mut buf = vec![1f32; 640];
    for i in 0.. {
        if me == a.victim && i == a.after {
            if a.script == "die" {
                std::process::exit(3);
            }
            std::thread::sleep(Duration::from_secs(3600));
        }
        let t = Instant::now();
        if let Err(e) = g.all_reduce_sum(&mut buf) {
            return Ok(serde_json::json!({
                "rank": me,
                "lost": e.lost_rank(),
                "error": e.to_string(),
                "waited_ms": t.elapsed().as_secs_f64() * 1e3,
                "iterations": i,
            }));
        }
        buf.fill(1.0);
    }
    unreachable!()
}
