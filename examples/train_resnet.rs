//! The main job: train a small-image ResNet on Fashion-MNIST under an AMP policy.
//!
//!     cargo run --release --example train_resnet [-- OPTIONS]
//!
//! With no options: the full Fashion-MNIST when installed (else the bundled 10k/2k subset), the
//! first GPU when one is usable (else the CPU, saying why), policy O2 (f16 weights and
//! activations, FP32 masters and batch norm, dynamic loss scaling), SGD + one-cycle, 10 epochs;
//! metrics, a plot, checkpoints and the final weights under `runs/train_resnet/`.
//! `--help` lists the options; a run config (`--config configs/run_*.toml`) holds the same
//! settings, and flags override it. The loop itself is `mixprec::train::trainer`.
//!
//! Several GPUs: `--nproc-per-node N` starts N processes (one per GPU) and supervises them; the
//! same binary also runs unchanged under `torchrun --no-python` and `srun` (README: "Several
//! GPUs").

use std::path::PathBuf;

use clap::Parser;
use mixprec::io::checkpoint::Checkpoint;
use mixprec::train::config::{OPTIMIZERS, SCHEDULES};
use mixprec::train::progress::ProgressMode;
use mixprec::train::trainer::checkpoint_config;
use mixprec::train::{run, RunConfig, RunOptions};

#[derive(Parser, Debug)]
#[command(
    name = "train_resnet",
    about = "Train a small-image ResNet on Fashion-MNIST with mixed precision (mixprec)"
)]
struct Cli {
    /// A run config (TOML; see configs/run_fashion_mnist.toml). Flags override its values.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// An AMP policy file (configs/O0.toml … O3.toml, *_bf16.toml).
    #[arg(long, value_name = "FILE", conflicts_with = "opt_level")]
    policy: Option<String>,
    /// apex's opt level with its defaults (default: O2).
    #[arg(long, value_name = "LEVEL", value_parser = ["O0", "O1", "O2", "O3"])]
    opt_level: Option<String>,
    /// `bundled`, or a directory with the four Fashion-MNIST IDX files (default: auto).
    #[arg(long, value_name = "DIR")]
    data: Option<String>,
    /// Epochs (the schedule spans them all).
    #[arg(long)]
    epochs: Option<usize>,
    /// Training batch size.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Fused optimizer.
    #[arg(long, value_parser = OPTIMIZERS)]
    optimizer: Option<String>,
    /// Learning-rate schedule.
    #[arg(long, value_parser = SCHEDULES)]
    schedule: Option<String>,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long)]
    device: Option<String>,
    /// Continue a run from a checkpoint (its settings, then any flags given here).
    #[arg(long, value_name = "CKPT")]
    resume: Option<PathBuf>,
    /// Output directory (metrics, plot, checkpoints, weights).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Seeds the weights, the data order and the augmentation.
    #[arg(long)]
    seed: Option<u64>,
    /// Channels per stage, e.g. 16,32,64.
    #[arg(long, value_delimiter = ',')]
    widths: Option<Vec<usize>>,
    /// Residual blocks per stage, e.g. 1,1,1.
    #[arg(long, value_delimiter = ',')]
    blocks: Option<Vec<usize>>,
    /// Random crop + horizontal flip of training images.
    #[arg(long)]
    augment: Option<bool>,
    /// Run every training step eagerly instead of replaying it as a CUDA graph (GPU only; the
    /// config key `cuda_graph = false` does the same).
    #[arg(long)]
    no_cuda_graph: bool,
    /// Stop after this many epochs (the schedule still spans --epochs): an interrupted run.
    #[arg(long, value_name = "N")]
    stop_after: Option<usize>,
    /// bar (terminal), lines (logs) or off; default: bar on a terminal, else lines.
    #[arg(long, value_parser = ["bar", "lines", "off"])]
    progress: Option<String>,
    /// Data-parallel training: start N processes on this machine, one per GPU (cuda:0 ..
    /// cuda:N-1; N CPU processes without a GPU), and supervise them. --batch-size is per process.
    #[arg(long, value_name = "N")]
    nproc_per_node: Option<usize>,
    /// The rendezvous port of --nproc-per-node (default: a free one).
    #[arg(long, value_name = "PORT", requires = "nproc_per_node")]
    master_port: Option<u16>,
    /// With several processes: batch-norm statistics over every process's batch.
    #[arg(long)]
    sync_batchnorm: bool,
}

impl Cli {
    /// Applies every flag that was given; returns the names of those that were.
    fn apply(&self, c: &mut RunConfig) -> Vec<&'static str> {
        let mut given = Vec::new();
        macro_rules! set {
            ($flag:ident, $name:literal, $dst:expr) => {
                if let Some(v) = &self.$flag {
                    $dst = v.clone().into();
                    given.push($name);
                }
            };
        }
        set!(data, "--data", c.data.dir);
        set!(epochs, "--epochs", c.epochs);
        set!(batch_size, "--batch-size", c.data.batch_size);
        set!(lr, "--lr", c.optimizer.lr);
        set!(optimizer, "--optimizer", c.optimizer.name);
        set!(schedule, "--schedule", c.schedule.kind);
        set!(device, "--device", c.device);
        set!(out, "--out", c.out);
        set!(seed, "--seed", c.seed);
        set!(widths, "--widths", c.model.widths);
        set!(blocks, "--blocks", c.model.blocks);
        set!(augment, "--augment", c.data.augment);
        if let Some(p) = &self.policy {
            c.amp.policy = Some(p.clone());
            given.push("--policy");
        }
        if let Some(l) = &self.opt_level {
            c.amp.policy = None;
            c.amp.opt_level = l.clone();
            given.push("--opt-level");
        }
        if self.no_cuda_graph {
            c.cuda_graph = false;
            given.push("--no-cuda-graph");
        }
        given
    }
}

fn main() -> std::process::ExitCode {
    // Ranks other than 0 log warnings and errors only (rank 0 reports for the run).
    let rank0 = std::env::var("RANK").map_or(true, |r| r.trim() == "0");
    let level = if rank0 { "info" } else { "warn" };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level)).init();
    let cli = Cli::parse();
    // Under a launcher (ours, torchrun, srun) this process is one rank: it trains.
    let launched = std::env::var_os("RANK").is_some() || std::env::var_os("SLURM_PROCID").is_some();
    let result = match cli.nproc_per_node {
        Some(n) if !launched => spawn_ranks(n, cli.master_port),
        _ => train(cli),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            match std::env::var("RANK") {
                Ok(r) if launched => eprintln!("train_resnet (rank {r}): {e}"),
                _ => eprintln!("train_resnet: {e}"),
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// `--nproc-per-node N`: this program N times, with the same arguments but that one, as ranks
/// 0..N of one run on this machine; the first failure ends the run (see
/// `mixprec::distributed::launch`).
fn spawn_ranks(n: usize, port: Option<u16>) -> mixprec::Result<()> {
    use mixprec::distributed::launch::{launch, LaunchConfig};
    let mut args = Vec::new();
    let mut it = std::env::args_os().skip(1);
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--nproc-per-node" || s == "--master-port" {
            it.next();
        } else if !(s.starts_with("--nproc-per-node=") || s.starts_with("--master-port=")) {
            args.push(a);
        }
    }
    let exe = std::env::current_exe()
        .map_err(|e| mixprec::Error::io("finding this program to start the ranks", e))?;
    let mut cfg = LaunchConfig::new(n, exe, args);
    cfg.master_port = port;
    launch(&cfg).map(|_| ())
}

fn train(cli: Cli) -> mixprec::Result<()> {
    let mut cfg = match (&cli.resume, &cli.config) {
        (Some(ckpt), _) => checkpoint_config(&Checkpoint::load(ckpt)?)?,
        (None, Some(file)) => RunConfig::from_toml_file(file)?,
        (None, None) => RunConfig::default(),
    };
    let given = cli.apply(&mut cfg);
    cfg.validate("command line")?;
    if cli.resume.is_some() {
        let changes: Vec<_> = given
            .iter()
            .filter(|f| !matches!(**f, "--out" | "--device" | "--data"))
            .collect();
        if !changes.is_empty() {
            log::warn!(
                "resuming with {changes:?} changed from the checkpoint's run: it will not match \
                 the uninterrupted run"
            );
        }
    }
    let progress = cli.progress.as_deref().map(|p| match p {
        "bar" => ProgressMode::Bar,
        "lines" => ProgressMode::Lines,
        _ => ProgressMode::Off,
    });
    let summary = run(
        &cfg,
        &RunOptions {
            resume: cli.resume.clone(),
            progress,
            stop_after: cli.stop_after,
            sync_batch_norm: cli.sync_batchnorm,
        },
    )?;
    if summary.rank != 0 {
        return Ok(());
    }
    if let Some(last) = summary.last() {
        println!(
            "done: test accuracy {:.2}% after {} epochs, final train loss {}, {:.1} s on {}{}",
            100.0 * last.test_accuracy,
            last.epoch,
            last.train_loss,
            summary.seconds,
            summary.device,
            match summary.world_size {
                1 => String::new(),
                n => format!(" (rank 0 of {n} processes)"),
            }
        );
    }
    println!(
        "wrote {} (metrics.csv, metrics.jsonl, metrics.png, config.toml), checkpoint {}, weights {}",
        summary.out.display(),
        summary.last_checkpoint.display(),
        summary.weights.display()
    );
    Ok(())
}
