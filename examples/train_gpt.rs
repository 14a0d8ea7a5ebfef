//! The second main job: train a GPT on a text corpus with mixed precision.
//!
//!     cargo run --release --example train_gpt [-- OPTIONS]
//!
//! With no options: the first GPU when one is usable, else the CPU. On a GPU a small GPT
//! (6 layers, 6 heads, width 384, context 256) on the bundled Shakespeare for 600 steps under
//! O2 bf16 with the step captured into a CUDA graph; on the CPU a tiny one (4 layers, width
//! 128) on windows of 64 tokens for 300 steps in f32 (about five minutes on 2 cores). Both print the val
//! loss and a sample of generated text at each evaluation, and leave metrics, a plot, a
//! checkpoint and the final weights (Hugging Face GPT-2 layout) under `runs/train_gpt/`.
//! `--model gpt2` trains GPT-2 124M; `--data DIR` takes any folder of `.txt` files. A run
//! config (`--config FILE`, TOML) holds the same keys as the flags (`batch_size = 32`).
//!
//! Several GPUs: `--nproc-per-node N` starts N processes (one per GPU, `cuda:0` .. `cuda:N-1`)
//! and supervises them, data-parallel (DDP over NCCL; `--batch-size` is per process); the same
//! binary runs unchanged under `torchrun --no-python` and `srun`.

use std::path::PathBuf;

use clap::Parser;
use mixprec::train::distributed::{launched, parse_nproc, spawn_ranks, Nproc, Ranks};
use mixprec::train::gpt::{run_gpt, GptRunConfig, GptRunOptions};
use mixprec::train::progress::ProgressMode;
use mixprec::Error;

#[derive(Parser, Debug)]
#[command(
    name = "train_gpt",
    version,
    about = "Train a GPT on a text corpus with mixed precision (mixprec)",
    after_help = "Flags override the --config file. Unset values are chosen for the device \
                  (the GPU recipe or the CPU one)."
)]
struct Cli {
    /// A run config (TOML with the flags' names as keys, e.g. `steps = 1000`).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl (GPU: small, CPU: tiny).
    #[arg(long)]
    model: Option<String>,
    /// A folder of .txt / .txt.gz files (default: the bundled Shakespeare).
    #[arg(long, value_name = "DIR")]
    data: Option<PathBuf>,
    /// auto, cpu, cuda or cuda:N (with several processes: auto, cuda or cpu; each process
    /// trains on cuda:LOCAL_RANK).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Where the run's files go.
    #[arg(long, default_value = "runs/train_gpt")]
    out: PathBuf,
    /// Start over in a non-empty --out (deletes that run's files).
    #[arg(long)]
    overwrite: bool,
    /// Continue from a checkpoint: auto (--out's last) or a path.
    #[arg(long, value_name = "auto|PATH")]
    resume: Option<String>,
    /// O0, O1, O2 or O3 (GPU: O2, CPU: O0).
    #[arg(long)]
    opt_level: Option<String>,
    /// bf16 or f16 (f16 uses dynamic loss scaling).
    #[arg(long)]
    half: Option<String>,
    #[arg(long)]
    batch_size: Option<usize>,
    /// Tokens per sequence (default: the model's context).
    #[arg(long)]
    context: Option<usize>,
    /// Micro-batches per optimizer step (gradient accumulation).
    #[arg(long)]
    grad_accum: Option<usize>,
    #[arg(long)]
    steps: Option<u64>,
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    min_lr: Option<f64>,
    #[arg(long)]
    warmup: Option<u64>,
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Gradient clipping norm (0: off).
    #[arg(long)]
    clip: Option<f64>,
    #[arg(long)]
    dropout: Option<f64>,
    #[arg(long)]
    eval_every: Option<u64>,
    #[arg(long)]
    eval_batches: Option<usize>,
    /// Tokens generated at each evaluation.
    #[arg(long)]
    sample_tokens: Option<usize>,
    /// The generated sample's prompt.
    #[arg(long)]
    prompt: Option<String>,
    #[arg(long)]
    temperature: Option<f64>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    seed: Option<u64>,
    /// Capture the step into a CUDA graph: true or false (GPU default: true).
    #[arg(long)]
    captured: Option<bool>,
    /// Checkpoint every transformer block (recompute it in backward): true or false (false).
    #[arg(long)]
    checkpoint_activations: Option<bool>,
    /// With --nproc-per-node: shard the optimizer state and FP32 masters over the processes
    /// (ZeRO): true or false (false).
    #[arg(long)]
    zero: Option<bool>,
    /// Stop after N steps (at the next evaluation), resumable with --resume auto.
    #[arg(long, value_name = "N")]
    stop_after: Option<u64>,
    /// bar, lines or off (default: a bar on a terminal, lines otherwise).
    #[arg(long)]
    progress: Option<String>,
    /// Data-parallel training: start N processes on this machine, one per GPU (N CPU processes
    /// without a GPU), and supervise them; `gpu`: one per visible GPU. --batch-size is per
    /// process.
    #[arg(long, value_name = "N|gpu", value_parser = parse_nproc, allow_negative_numbers = true)]
    nproc_per_node: Option<Nproc>,
    /// The rendezvous port of --nproc-per-node (default: a free one).
    #[arg(long, value_name = "PORT", requires = "nproc_per_node")]
    master_port: Option<u16>,
}

fn config(cli: &Cli) -> mixprec::Result<GptRunConfig> {
    let mut c = match &cli.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| Error::io(format!("reading {}", p.display()), e))?;
            toml::from_str(&text).map_err(|e| {
                Error::invalid_arg(
                    "train_gpt",
                    "--config",
                    p.display(),
                    format!("valid TOML with known keys: {e}"),
                )
            })?
        }
        None => GptRunConfig::default(),
    };
    macro_rules! flag {
        ($($f:ident),*) => { $(if cli.$f.is_some() { c.$f = cli.$f.clone(); })* };
    }
    flag!(
        model,
        data,
        opt_level,
        half,
        batch_size,
        context,
        grad_accum,
        steps,
        lr,
        min_lr,
        warmup,
        weight_decay,
        clip,
        dropout,
        eval_every,
        eval_batches,
        sample_tokens,
        prompt,
        temperature,
        top_k,
        seed,
        captured,
        checkpoint_activations,
        zero
    );
    Ok(c)
}

fn run(cli: &Cli) -> mixprec::Result<()> {
    let config = config(cli)?;
    // With several processes: cuda:LOCAL_RANK for `auto` and `cuda`.
    let (device, _) = Ranks::from_env()?.device(&cli.device)?;
    let resume = match cli.resume.as_deref() {
        None => None,
        Some("auto") => {
            let last = cli.out.join("checkpoints").join("last.safetensors");
            last.exists().then_some(last)
        }
        Some(p) => Some(PathBuf::from(p)),
    };
    let progress = match cli.progress.as_deref() {
        None => ProgressMode::detect(),
        Some("bar") => ProgressMode::Bar,
        Some("lines") => ProgressMode::Lines,
        Some("off") => ProgressMode::Off,
        Some(o) => {
            return Err(Error::invalid_arg(
                "train_gpt",
                "--progress",
                o,
                "bar, lines or off",
            ))
        }
    };
    let summary = run_gpt(
        &config,
        &GptRunOptions {
            out: cli.out.clone(),
            device,
            resume,
            overwrite: cli.overwrite,
            progress,
            stop_after: cli.stop_after,
        },
    )?;
    if summary.rank != 0 {
        return Ok(());
    }
    println!(
        "done: {} steps, train loss {:.4}, val loss {:.4}, {:.0} tokens/s; weights in {}",
        summary.steps,
        summary.train_loss,
        summary.val_loss,
        summary.tokens_per_s,
        summary.weights.display()
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Under a launcher (ours, torchrun, srun) this process is one rank: it trains.
    let launched = launched();
    let result = match cli.nproc_per_node {
        Some(n) if !launched => n
            .count("train_gpt")
            .and_then(|n| spawn_ranks("train_gpt", n, cli.master_port)),
        _ => run(&cli).map(|()| 0),
    };
    match result {
        Ok(code) => std::process::ExitCode::from(code),
        Err(e) => {
            match std::env::var("RANK") {
                Ok(r) if launched => eprintln!("train_gpt (rank {r}): {e}"),
                _ => eprintln!("train_gpt: {e}"),
            }
            std::process::ExitCode::FAILURE
        }
    }
}
