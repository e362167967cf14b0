//! `weft bench serve`: streams against a running `weft serve` (or one it starts), measuring
//! one stream's decode speed and time to first token alone, then C streams at once
//! (aggregate and per-stream tok/s), then time to first token while C-1 others run.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// Concurrent streams.
    #[arg(long, short = 'c', default_value_t = 8)]
    pub concurrency: usize,
    /// Tokens each stream generates.
    #[arg(long, short = 'n', default_value_t = 64)]
    pub max_tokens: usize,
    /// An existing server's base URL (default: start `weft serve` on a free port).
    #[arg(long)]
    pub url: Option<String>,
    #[arg(long)]
    pub api_key: Option<String>,
    /// Model file for the server this bench starts.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Threads of the server this bench starts.
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Time-to-first-token probes per phase.
    #[arg(long, default_value_t = 7)]
    pub probes: usize,
    /// Extra flags for the server this bench starts (e.g. "--prefill-chunk 16").
    #[arg(long, allow_hyphen_values = true)]
    pub server_args: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// One streamed request's timings.
struct StreamTiming {
    /// When the request was sent.
    sent: Instant,
    /// Tokens generated, as the final usage chunk says.
    tokens: usize,
    /// Arrival time of every chunk that carried text; never empty.
    arrivals: Vec<Instant>,
}

impl StreamTiming {
    fn first(&self) -> Instant {
        self.arrivals[0]
    }

    fn end(&self) -> Instant {
        self.arrivals[self.arrivals.len() - 1]
    }

    /// Seconds from sending to the first token.
    fn ttft(&self) -> f64 {
        (self.first() - self.sent).as_secs_f64()
    }

    /// Seconds from the first to the last token.
    fn decode(&self) -> f64 {
        (self.end() - self.first()).as_secs_f64()
    }
}

struct Client {
    base: String,
    key: Option<String>,
    model: String,
    agent: ureq::Agent,
}

impl Client {
    fn stream(&self, prompt: &str, max_tokens: usize) -> Result<StreamTiming> {
        let body = json!({
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": true, "stream_options": {"include_usage": true},
        });
        let t0 = Instant::now();
        let mut req = self.agent.post(format!("{}/v1/completions", self.base));
        if let Some(k) = &self.key {
            req = req.header("Authorization", format!("Bearer {k}"));
        }
        let resp = req
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .map_err(|e| anyhow!("POST {}/v1/completions: {e}", self.base))?;
        if resp.status() != 200 {
            let text = resp.into_body().read_to_string().unwrap_or_default();
            bail!("the server answered {text}");
        }
        let reader = BufReader::new(resp.into_body().into_reader());
        let mut tokens = 0usize;
        let mut arrivals = Vec::with_capacity(max_tokens);
        for line in reader.lines() {
            let line = line.context("reading the event stream")?;
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(data).context("a streamed chunk is not JSON")?;
            if let Some(e) = v.get("error") {
                bail!("the stream failed: {e}");
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = n as usize;
            }
            let has_text = v["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty());
            if has_text {
                arrivals.push(Instant::now());
            }
        }
        if arrivals.is_empty() {
            bail!("the stream carried no text");
        }
        if tokens == 0 {
            bail!("the stream carried no usage.completion_tokens");
        }
        Ok(StreamTiming {
            sent: t0,
            tokens,
            arrivals,
        })
    }
}

fn median(v: &mut [f64]) -> f64 {
    percentile(v, 0.5)
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// A pause of 0-100 ms before each time-to-first-token probe, so probes arrive at random
/// moments of the server's steps, as users' requests do. Back to back, each probe would
/// land just after the step that answered the previous one began, and always wait for
/// nearly a whole step. Seeded, so runs are comparable.
struct Jitter(u64);
impl Jitter {
    fn pause(&mut self) {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        std::thread::sleep(Duration::from_micros(self.0 % 100_000));
    }
}

/// A server this bench started, killed when dropped.
struct OwnServer(Child);
impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server(a: &ServeBenchArgs) -> Result<(OwnServer, String)> {
    let exe = std::env::current_exe().context("finding the weft binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(["serve", "--port", "0", "--parallel"])
        .arg(a.concurrency.max(1).to_string());
    if let Some(m) = &a.model {
        cmd.arg("--model").arg(m);
    }
    if let Some(t) = a.threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    if let Some(extra) = &a.server_args {
        cmd.args(extra.split_whitespace());
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting weft serve")?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("no server stdout"))?;
    let server = OwnServer(child);
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .ok_or_else(|| anyhow!("weft serve printed {line:?} instead of its address"))?
        .to_string();
    Ok((server, url))
}

const PROMPT: &str =
    "Write a long story about a lighthouse keeper who finds a message in a bottle.";
const SHORT: &str = "The capital of France is";

pub fn run(a: ServeBenchArgs) -> Result<()> {
    let (_own, base) = match &a.url {
        Some(u) => (
            None,
            u.trim_end_matches('/').trim_end_matches("/v1").to_string(),
        ),
        None => {
            let (s, u) = start_server(&a)?;
            (Some(s), u)
        }
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into();
    let key = a
        .api_key
        .clone()
        .or_else(|| std::env::var("WEFT_API_KEY").ok());
    let mut req = agent.get(format!("{base}/v1/models"));
    if let Some(k) = &key {
        req = req.header("Authorization", format!("Bearer {k}"));
    }
    let models: Value = serde_json::from_str(
        &req.call()
            .map_err(|e| anyhow!("GET {base}/v1/models: {e}"))?
            .into_body()
            .read_to_string()?,
    )?;
    let model = models["data"][0]["id"]
        .as_str()
        .ok_or_else(|| anyhow!("{base}/v1/models lists no model: {models}"))?
        .to_string();
    let client = Client {
        base,
        key,
        model,
        agent,
    };
    let c = a.concurrency.max(1);
    let n = a.max_tokens.max(2);
    client.stream(SHORT, 4)?; // warm-up: weights paged in, buffers sized
    let mut jitter = Jitter(0x2545_F491_4F6C_DD1D);

    let mut idle_ttft: Vec<f64> = (0..a.probes)
        .map(|_| {
            jitter.pause();
            client.stream(SHORT, 1).map(|t| t.ttft())
        })
        .collect::<Result<_>>()?;
    let one = client.stream(PROMPT, n)?;
    let one_tok_s = (one.tokens - 1) as f64 / one.decode().max(1e-9);

    // C streams at once: aggregate = all tokens after each stream's first, over the span
    // in which every stream was decoding, measured from first tokens to last tokens.
    let runs: Vec<StreamTiming> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..c)
            .map(|i| {
                let client = &client;
                s.spawn(move || client.stream(&format!("{PROMPT} ({i})"), n))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a stream thread panicked"))?)
            .collect::<Result<_>>()
    })?;
    let start = runs
        .iter()
        .map(StreamTiming::first)
        .min()
        .unwrap_or_else(Instant::now);
    let end = runs
        .iter()
        .map(StreamTiming::end)
        .max()
        .unwrap_or_else(Instant::now);
    let decoded: usize = runs.iter().map(|r| r.tokens - 1).sum();
    let aggregate = decoded as f64 / (end - start).as_secs_f64().max(1e-9);
    // Decode throughput proper: the window in which all C streams were decoding (from
    // the last stream's first token to the first stream's last), so the staggered
    // prefills at the start and the stragglers at the end are left out.
    let (win_start, win_end) = (
        runs.iter().map(StreamTiming::first).max().unwrap_or(start),
        runs.iter().map(StreamTiming::end).min().unwrap_or(end),
    );
    let in_window: usize = runs
        .iter()
        .map(|r| {
            r.arrivals
                .iter()
                .filter(|&&t| t > win_start && t <= win_end)
                .count()
        })
        .sum();
    let window = (win_end.saturating_duration_since(win_start)).as_secs_f64();
    let aggregate_decode = if window > 0.0 {
        in_window as f64 / window
    } else {
        aggregate
    };
    let mut per_stream: Vec<f64> = runs
        .iter()
        .map(|r| (r.tokens - 1) as f64 / r.decode().max(1e-9))
        .collect();
    let mut load_ttft: Vec<f64> = runs.iter().map(StreamTiming::ttft).collect();

    // Time to first token of a short prompt while C-1 long streams decode.
    let mut busy_ttft = Vec::new();
    std::thread::scope(|s| -> Result<()> {
        let long = (n * 4).max(256);
        let hs: Vec<_> = (0..c.saturating_sub(1))
            .map(|i| {
                let client = &client;
                s.spawn(move || client.stream(&format!("{PROMPT} [{i}]"), long))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(1500)); // let them all reach decoding
        for _ in 0..a.probes {
            jitter.pause();
            busy_ttft.push(client.stream(SHORT, 1)?.ttft());
        }
        for h in hs {
            h.join()
                .map_err(|_| anyhow!("a stream thread panicked"))??;
        }
        Ok(())
    })?;

    let idle_med = median(&mut idle_ttft);
    let busy_med = median(&mut busy_ttft);
    let out = json!({
        "concurrency": c,
        "max_tokens": n,
        "one_stream_tok_s": one_tok_s,
        "aggregate_tok_s": aggregate,
        "aggregate_over_one": aggregate / one_tok_s.max(1e-9),
        "aggregate_decode_tok_s": aggregate_decode,
        "aggregate_decode_over_one": aggregate_decode / one_tok_s.max(1e-9),
        "all_decoding_window_s": window,
        "per_stream_tok_s_median": median(&mut per_stream),
        "ttft_idle_median_ms": idle_med * 1e3,
        "ttft_idle_p99_ms": percentile(&mut idle_ttft, 0.99) * 1e3,
        "ttft_concurrent_start_median_ms": median(&mut load_ttft) * 1e3,
        "ttft_concurrent_start_p99_ms": percentile(&mut load_ttft, 0.99) * 1e3,
        "ttft_busy_median_ms": busy_med * 1e3,
        "ttft_busy_p99_ms": percentile(&mut busy_ttft, 0.99) * 1e3,
        "ttft_busy_over_idle": busy_med / idle_med.max(1e-9),
    });
    if a.json {
        outln!("{out}")?;
        return Ok(());
    }
    let f = |k: &str| out[k].as_f64().unwrap_or(0.0);
    outln!("streams        one: {:.1} tok/s", f("one_stream_tok_s"))?;
    outln!(
        "{c:>2} at once     decode {:.1} tok/s ({:.2}x one) over {:.2} s with all {c} decoding",
        f("aggregate_decode_tok_s"),
        f("aggregate_decode_over_one"),
        f("all_decoding_window_s"),
    )?;
    outln!(
        "               whole span {:.1} tok/s ({:.2}x one, prefills included), per stream median {:.1} tok/s",
        f("aggregate_tok_s"),
        f("aggregate_over_one"),
        f("per_stream_tok_s_median")
    )?;
    outln!(
        "TTFT idle      median {:.1} ms, p99 {:.1} ms",
        f("ttft_idle_median_ms"),
        f("ttft_idle_p99_ms")
    )?;
    outln!(
        "TTFT {c} start  median {:.1} ms, p99 {:.1} ms (all {c} arriving together)",
        f("ttft_concurrent_start_median_ms"),
        f("ttft_concurrent_start_p99_ms")
    )?;
    outln!(
        "TTFT busy      median {:.1} ms, p99 {:.1} ms with {} streams running ({:.2}x idle)",
        f("ttft_busy_median_ms"),
        f("ttft_busy_p99_ms"),
        c.saturating_sub(1),
        f("ttft_busy_over_idle")
    )?;
    Ok(())
}
