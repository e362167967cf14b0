//! `weft simulate`: predicted speed, time to first token and memory per node of a model
//! on clusters of 1 to 1,024 identical machines, for each layout kind and link, from the
//! planner's cost model (weft-sim over weft-plan); as a table, JSON or an SVG plot; or,
//! with --published, the published multi-node results beside their predictions.

use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::json;
use weft_cluster::planning::{type_mix, TypeBytes};
use weft_gguf::{GgmlType, GgufFile};
use weft_model::ModelConfig;
use weft_plan::{ModelProfile, Workload};
use weft_sim::{calibrate, engines, models, simulate, Kind, Profiles, Row, Scenario};

use crate::paths::weft_home;
use crate::simulate_args::SimulateArgs;
use crate::simulate_this::{measure_one_node, this_machine, ThisMachine};

/// The most nodes one simulation takes.
const MAX_NODES: usize = 4096;

/// Node counts: "1,2,4" or "1..1024" (the powers of two from 1 to 1024).
fn node_counts(s: &str) -> Result<Vec<usize>> {
    let parse = |t: &str| {
        t.trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| (1..=MAX_NODES).contains(&n))
            .ok_or_else(|| anyhow!("--nodes: {t:?} is not a node count from 1 to {MAX_NODES}"))
    };
    if let Some((lo, hi)) = s.split_once("..") {
        let (lo, hi) = (parse(lo)?, parse(hi)?);
        if lo > hi {
            bail!("--nodes: {lo}..{hi} runs backwards");
        }
        let mut v = Vec::new();
        let mut n = lo;
        while n <= hi {
            v.push(n);
            n *= 2;
        }
        return Ok(v);
    }
    s.split(',').map(parse).collect()
}

/// The model: a built-in profile, or a GGUF file's (its weight-type mix and mean bits).
struct Model {
    profile: ModelProfile,
    bits: f64,
    mix: Vec<TypeBytes>,
    /// Read from a GGUF file (not a built-in profile).
    file: bool,
}

fn model(name: &str, bits: Option<f64>, kv_bytes: usize) -> Result<Model> {
    let path = Path::new(name);
    if path.exists() || name.ends_with(".gguf") {
        if bits.is_some() {
            bail!("--bits applies to model profiles; {name} has its own weight types");
        }
        let file = GgufFile::open(path).with_context(|| format!("opening {name}"))?;
        let cfg = ModelConfig::from_gguf(&file).with_context(|| format!("reading {name}"))?;
        let mut profile = weft_cluster::model_profile(&file, &cfg, weft_model::CacheType::F32);
        // The engine's cache holds `kv_bytes` a value (f32 above).
        profile.kv_bytes_per_token = profile.kv_bytes_per_token / 4 * kv_bytes as u64;
        let weights: u64 = file.tensors().iter().map(|t| t.n_elements()).sum();
        let bits = profile.total_bytes() as f64 * 8.0 / weights.max(1) as f64;
        return Ok(Model {
            profile,
            bits,
            mix: type_mix(&file, &cfg),
            file: true,
        });
    }
    let arch = models::named(name).map_err(|e| anyhow!(e))?;
    if let Some(b) = bits.filter(|b| !(b.is_finite() && *b >= 1.0 && *b <= 32.0)) {
        bail!("--bits {b}: give bits per weight from 1 to 32");
    }
    let b = bits.unwrap_or(arch.bits);
    // A profile's weights stream at the rate of the type people run at that width.
    let ty = match b {
        b if b <= 5.0 => GgmlType::Q4_K,
        b if b <= 6.6 => GgmlType::Q6_K,
        b if b <= 9.0 => GgmlType::Q8_0,
        _ => GgmlType::F16,
    };
    Ok(Model {
        profile: arch.profile(bits, kv_bytes),
        bits: b,
        mix: vec![TypeBytes {
            ty,
            long: 1.0,
            short: 0.0,
        }],
        file: false,
    })
}

pub fn run(a: SimulateArgs) -> Result<()> {
    if a.published {
        return published(a.json);
    }
    let nodes = node_counts(&a.nodes)?;
    let kinds: Vec<Kind> = if a.layout.is_empty() {
        Kind::ALL.to_vec()
    } else {
        a.layout
            .iter()
            .map(|s| Kind::parse(s).map_err(|e| anyhow!("--layout: {e}")))
            .collect::<Result<_>>()?
    };
    if let Some(d) = a.delay_us.iter().find(|d| !(d.is_finite() && **d >= 0.0)) {
        bail!("--delay-us {d}: a delay is >= 0 µs");
    }
    let profiles = match &a.profiles {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Profiles::from_json(&text).map_err(|e| anyhow!("{}: {e}", p.display()))?
        }
        None => Profiles::default(),
    };
    let engine = engines::named(&a.engine).map_err(|e| anyhow!("--engine: {e}"))?;
    let name = a.model.as_deref().unwrap_or_default();
    let m = model(name, a.bits, engine.kv_bytes)?;
    let max_nodes = nodes.iter().copied().max().unwrap_or(1);
    let is_this = a.hardware.eq_ignore_ascii_case("this");
    let cores = weft_kernels::pool::usable_cores();
    let sharing = if a.same_machine { max_nodes } else { 1 };
    let threads = a.threads.unwrap_or((cores / sharing).max(1));
    let hardware = if is_this {
        let cache = weft_home().join("calibration");
        let this = ThisMachine {
            threads,
            sharing,
            cache: &cache,
            fresh: a.recalibrate,
        };
        this_machine(&this, &m.mix, m.bits)?
    } else {
        if a.same_machine || a.threads.is_some() {
            bail!("--same-machine and --threads apply to --hardware this");
        }
        profiles
            .hardware(&a.hardware)
            .map_err(|e| anyhow!("--hardware: {e}"))?
    };
    let ctx = a.ctx.unwrap_or(a.prompt + a.output).max(1);
    let workload = Workload {
        n_ctx: ctx,
        parallel: a.batch.max(1),
        prompt: a.prompt.max(1),
        ubatch: 512,
    };
    let links = a
        .link
        .iter()
        .map(|l| profiles.link(l).map_err(|e| anyhow!("--link: {e}")))
        .collect::<Result<Vec<_>>>()?;
    let base = Scenario {
        model: m.profile,
        bits: m.bits,
        hardware,
        link: links[0].clone(),
        engine,
        delay_us: 0.0,
        workload,
        output: a.output,
    };
    // One single-node figure fixes the efficiencies for every link and delay.
    let measured = match (a.measure, is_this && m.file) {
        (false, _) => None,
        (true, true) => Some(measure_one_node(
            Path::new(name),
            threads,
            a.same_machine && threads == 1,
            a.prompt.max(1),
            3,
        )?),
        (true, false) => bail!("--measure needs --hardware this and a GGUF file"),
    };
    let base = match (a.calibrate, measured) {
        (Some(tok_s), _) => {
            calibrate(&base, tok_s, a.calibrate_prefill).map_err(|e| anyhow!("--calibrate: {e}"))?
        }
        (None, Some((decode, prefill))) => calibrate(&base, decode, Some(prefill)).map_err(|e| {
            anyhow!("--measure: calibrating to {decode:.1} decode and {prefill:.1} prefill tok/s: {e}")
        })?,
        (None, None) => base,
    };
    let t = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    for link in &links {
        for &delay_us in &a.delay_us {
            let s = Scenario {
                link: link.clone(),
                delay_us,
                ..base.clone()
            };
            rows.extend(simulate(&s, &nodes, &kinds));
        }
    }
    let elapsed = t.elapsed().as_secs_f64();
    let title = format!(
        "{} on {} ({}), {}",
        base.model.name,
        base.hardware.name,
        base.engine.name,
        links
            .iter()
            .map(|l| l.name.as_str())
            .collect::<Vec<_>>()
            .join(" / ")
    );
    if let Some(path) = &a.plot {
        let svg = weft_sim::plot::svg(&rows, &title).map_err(|e| anyhow!(e))?;
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    }
    if a.json {
        outln!(
            "{}",
            json!({
                "model": base.model.name, "hardware": base.hardware,
                "engine": base.engine, "workload": {"prompt": a.prompt, "output": a.output,
                "batch": a.batch, "ctx": ctx}, "bits": base.bits,
                "elapsed_ms": elapsed * 1e3, "rows": rows,
            })
        )?;
        return Ok(());
    }
    print_rows(&title, &rows, elapsed)
}

fn gb(b: u64) -> String {
    format!("{:.1}", b as f64 / 1e9)
}

fn print_rows(title: &str, rows: &[Row], elapsed: f64) -> Result<()> {
    outln!("{title}")?;
    outln!(
        "{:>5} {:<7} {:<18} {:<12} {:>7} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>7}",
        "nodes",
        "kind",
        "layout",
        "link",
        "+µs",
        "decode/s",
        "batch/s",
        "prefill/s",
        "TTFT ms",
        "comp ms",
        "link ms",
        "bubble",
        "GB/node"
    )?;
    for r in rows {
        if r.name == "-" {
            continue;
        }
        outln!(
            "{:>5} {:<7} {:<18} {:<12} {:>7} {:>9.2} {:>9.2} {:>9.1} {:>8.0} {:>8.2} {:>8.2} {:>8.2} {:>7}{}",
            r.nodes,
            r.layout.name(),
            r.name,
            r.link,
            r.delay_us,
            r.decode_tok_s,
            r.batch_tok_s,
            r.prefill_tok_s,
            r.ttft_ms,
            r.compute_ms,
            r.network_ms,
            r.bubble_ms,
            gb(r.memory_per_node),
            if r.fits { "" } else { "  does not fit" }
        )?;
    }
    outln!("{} rows in {:.1} ms", rows.len(), elapsed * 1e3)?;
    Ok(())
}

fn published(as_json: bool) -> Result<()> {
    let rows = weft_sim::published::check().map_err(|e| anyhow!(e))?;
    if as_json {
        outln!("{}", json!({"rows": rows}))?;
        return Ok(());
    }
    outln!(
        "{:<16} {:<10} {:<9} {:>5} {:>10} {:>10} {:>7}",
        "model",
        "engine",
        "link",
        "nodes",
        "published",
        "predicted",
        "error"
    )?;
    for r in &rows {
        outln!(
            "{:<16} {:<10} {:<9} {:>5} {:>10.1} {:>10.1} {:>6.0}%{}",
            r.model,
            r.engine,
            r.link,
            r.nodes,
            r.published_tok_s,
            r.predicted_tok_s,
            r.error * 100.0,
            match (&r.calibrated_on, r.calibration) {
                (Some(on), _) => format!("  (calibrated on {on})"),
                (None, true) => "  (calibration)".to_string(),
                (None, false) => String::new(),
            }
        )?;
    }
    let checked: Vec<_> = rows.iter().filter(|r| !r.calibration).collect();
    let within = checked.iter().filter(|r| r.error.abs() <= 0.2).count();
    outln!(
        "{within} of {} predictions within ±20 %; sources: {}",
        checked.len(),
        weft_sim::published::PUBLISHED[0].source
    )?;
    Ok(())
}
