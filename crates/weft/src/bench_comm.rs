//! `weft bench comm`: starts N local ranks as processes and measures all-reduce latency
//! (median, p99), raw ping-pong over the same transport, and bandwidth of large messages.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use weft_comm::{Group, GroupOptions, TransportKind, Wire};

#[derive(Args, Debug, Clone)]
pub struct CommBenchArgs {
    /// Ranks to start, as processes on this machine.
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// All-reduce and ping-pong message size in bytes (2560 = 640 floats, Gemma 3 270M).
    #[arg(long, default_value_t = 2560)]
    pub bytes: usize,
    #[arg(long, default_value = "tcp")]
    pub transport: TransportKind,
    /// Timed iterations of each latency test.
    #[arg(long, default_value_t = 2000)]
    pub iters: usize,
    /// Size of the bandwidth test's messages.
    #[arg(long, default_value_t = 16 << 20)]
    pub bw_bytes: usize,
    /// Payload format of the all-reduce: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub wire: Wire,
    /// Injected one-way delay on every link, µs (emulates a slower network).
    #[arg(long, default_value_t = 0.0)]
    pub link_delay_us: f64,
    #[arg(long)]
    pub json: bool,
}

/// The hidden per-rank entry point the parent starts.
#[derive(Args, Debug, Clone)]
pub struct CommRankArgs {
    #[arg(long)]
    pub rank: usize,
    #[arg(long, value_delimiter = ',')]
    pub addrs: Vec<String>,
    #[command(flatten)]
    pub bench: CommBenchArgs,
}

pub fn run(a: CommBenchArgs) -> Result<()> {
    if a.ranks < 2 {
        bail!("--ranks must be at least 2 (got {})", a.ranks);
    }
    if !a.bytes.is_multiple_of(4) || a.bytes == 0 {
        bail!(
            "--bytes must be a positive multiple of 4 (f32 values), got {}",
            a.bytes
        );
    }
    let listeners: Vec<TcpListener> = (0..a.ranks)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()
        .context("picking free local ports")?;
    let addrs: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.to_string()))
        .collect::<std::io::Result<_>>()?;
    drop(listeners);
    let exe = std::env::current_exe().context("finding the weft binary")?;
    let secret = weft_comm::secret::random_secret();
    let mut kids = Vec::new();
    for r in 0..a.ranks {
        let mut c = Command::new(&exe);
        c.args([
            "bench",
            "comm-rank",
            "--rank",
            &r.to_string(),
            "--addrs",
            &addrs.join(","),
        ])
        .args([
            "--bytes",
            &a.bytes.to_string(),
            "--iters",
            &a.iters.to_string(),
        ])
        .args([
            "--bw-bytes",
            &a.bw_bytes.to_string(),
            "--link-delay-us",
            &a.link_delay_us.to_string(),
        ])
        .args([
            "--transport",
            transport_name(a.transport),
            "--wire",
            wire_name(a.wire),
        ])
        .env("WEFT_BENCH_SECRET", &secret)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        kids.push(c.spawn().with_context(|| format!("starting rank {r}"))?);
    }
    let mut report: Option<Value> = None;
    for (r, k) in kids.into_iter().enumerate() {
        let out = k
            .wait_with_output()
            .with_context(|| format!("waiting for rank {r}"))?;
        if !out.status.success() {
            bail!("rank {r} failed ({})", out.status);
        }
        if r == 0 {
            let s = String::from_utf8_lossy(&out.stdout);
            report = Some(
                serde_json::from_str(s.trim()).with_context(|| format!("rank 0 printed {s:?}"))?,
            );
        }
    }
    let v = report.ok_or_else(|| anyhow!("rank 0 printed no report"))?;
    if a.json {
        outln!("{v}")?;
    } else {
        outln!(
            "{} ranks over {}, {} B all-reduce ({}): median {:.1} µs, p99 {:.1} µs",
            a.ranks,
            v["transport"].as_str().unwrap_or("?"),
            a.bytes,
            wire_name(a.wire),
            v["allreduce_median_us"].as_f64().unwrap_or(0.0),
            v["allreduce_p99_us"].as_f64().unwrap_or(0.0)
        )?;
        outln!(
            "ping-pong rank 0 <-> 1, {} B: median {:.1} µs round trip, p99 {:.1} µs",
            a.bytes,
            v["pingpong_median_us"].as_f64().unwrap_or(0.0),
            v["pingpong_p99_us"].as_f64().unwrap_or(0.0)
        )?;
        outln!(
            "{} MiB: send 0 -> 1 {:.2} GB/s; all-reduce {:.2} GB/s algorithm, {:.2} GB/s bus",
            a.bw_bytes >> 20,
            v["send_gb_s"].as_f64().unwrap_or(0.0),
            v["allreduce_alg_gb_s"].as_f64().unwrap_or(0.0),
            v["allreduce_bus_gb_s"].as_f64().unwrap_or(0.0)
        )?;
    }
    Ok(())
}

fn transport_name(t: TransportKind) -> &'static str {
    match t {
        TransportKind::Tcp => "tcp",
        TransportKind::Shm => "shm",
        TransportKind::Auto => "auto",
    }
}

fn wire_name(w: Wire) -> &'static str {
    match w {
        Wire::F32 => "f32",
        Wire::F16 => "f16",
        Wire::Bf16 => "bf16",
    }
}

/// Median and 99th percentile of `v` (sorted in place), in µs.
fn median_p99(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

pub fn run_rank(a: CommRankArgs) -> Result<()> {
    let b = &a.bench;
    let secret = std::env::var("WEFT_BENCH_SECRET").context(
        "WEFT_BENCH_SECRET is not set (rank processes are started by `weft bench comm`)",
    )?;
    let opts = GroupOptions {
        secret: secret.into_bytes(),
        transport: b.transport,
        delay: Duration::from_nanos((b.link_delay_us * 1e3) as u64),
        max_frame: 1 << 20,
        ..GroupOptions::default()
    };
    let mut g = Group::connect(a.rank, &a.addrs, opts)
        .with_context(|| format!("rank {} joining", a.rank))?;
    let n = b.bytes / 4;
    let mut buf = vec![1f32; n];
    let mut times = vec![0f64; b.iters];
    for _ in 0..b.iters.min(200) {
        g.all_reduce_sum_as(&mut buf, b.wire)?;
    }
    g.barrier()?;
    for t in times.iter_mut() {
        let s = Instant::now();
        g.all_reduce_sum_as(&mut buf, b.wire)?;
        *t = s.elapsed().as_secs_f64() * 1e6;
    }
    let (ar_med, ar_p99) = median_p99(&mut times);
    g.barrier()?;
    let mut msg = vec![0u8; b.bytes];
    let mut pp = vec![0f64; b.iters];
    match a.rank {
        0 => {
            for t in pp.iter_mut() {
                let s = Instant::now();
                g.send(1, &msg)?;
                g.recv(1, &mut msg)?;
                *t = s.elapsed().as_secs_f64() * 1e6;
            }
        }
        1 => {
            for _ in 0..b.iters {
                g.recv(0, &mut msg)?;
                g.send(0, &msg)?;
            }
        }
        _ => {}
    }
    let (pp_med, pp_p99) = median_p99(&mut pp);
    g.barrier()?;
    // Bandwidth: 0 -> 1 one way, then an all-reduce of the same size on every rank.
    let mut big = vec![0u8; b.bw_bytes];
    let mut ack = [0u8; 1];
    let reps = 5;
    let mut send_s = f64::MAX;
    for _ in 0..reps {
        let s = Instant::now();
        match a.rank {
            0 => {
                g.send(1, &big)?;
                g.recv(1, &mut ack)?;
            }
            1 => {
                g.recv(0, &mut big)?;
                g.send(0, &ack)?;
            }
            _ => {}
        }
        send_s = send_s.min(s.elapsed().as_secs_f64());
    }
    g.barrier()?;
    let mut bigf = vec![1f32; b.bw_bytes / 4];
    let mut ar_s = f64::MAX;
    for _ in 0..reps {
        g.barrier()?;
        let s = Instant::now();
        g.all_reduce_sum(&mut bigf)?;
        ar_s = ar_s.min(s.elapsed().as_secs_f64());
    }
    g.barrier()?;
    if a.rank == 0 {
        let ranks = a.addrs.len() as f64;
        let alg = b.bw_bytes as f64 / ar_s / 1e9;
        let kind = g.link_info(1).map(|(_, k)| k).unwrap_or("?");
        outln!(
            "{}",
            json!({
                "ranks": a.addrs.len(),
                "bytes": b.bytes,
                "transport": kind,
                "wire": wire_name(b.wire),
                "link_delay_us": b.link_delay_us,
                "iters": b.iters,
                "allreduce_median_us": ar_med,
                "allreduce_p99_us": ar_p99,
                "pingpong_median_us": pp_med,
                "pingpong_p99_us": pp_p99,
                "bw_bytes": b.bw_bytes,
                "send_gb_s": b.bw_bytes as f64 / send_s / 1e9,
                "allreduce_alg_gb_s": alg,
                "allreduce_bus_gb_s": alg * 2.0 * (ranks - 1.0) / ranks,
            })
        )?;
    }
    Ok(())
}
