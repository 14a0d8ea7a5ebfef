//! The main job: train a ResNet under an AMP policy on Fashion-MNIST (by default), CIFAR-10
//! (`--data cifar10:DIR`) or your own images (`--data imagefolder:DIR`, class folders under
//! DIR/train and DIR/val).
//!
//!     cargo run --release --example train_resnet [-- OPTIONS]
//!
//! With no options: the full Fashion-MNIST when installed (else the bundled 10k/2k subset), the
//! first GPU when one is usable (else the CPU, saying why), policy O2 (f16 weights and
//! activations, FP32 masters and batch norm, dynamic loss scaling), SGD + one-cycle, 10 epochs;
//! metrics, a plot, checkpoints and the final weights under `runs/train_resnet/`.
//! `--help` lists the options; a run config (`--config configs/run_*.toml`) holds the same
//! settings, and flags override it. The loop itself is `mixprec::train::trainer`.

use std::path::PathBuf;

use clap::Parser;
use mixprec::io::checkpoint::Checkpoint;
use mixprec::train::config::{ARCHS, OPTIMIZERS, SCHEDULES};
use mixprec::train::progress::ProgressMode;
use mixprec::train::trainer::checkpoint_config;
use mixprec::train::{run, RunConfig, RunOptions};

#[derive(Parser, Debug)]
#[command(
    name = "train_resnet",
    about = "Train a ResNet on Fashion-MNIST, CIFAR-10 or an image folder with mixed precision (mixprec)"
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
    /// Fashion-MNIST (`auto`, `bundled`, or a directory with its four IDX files),
    /// `imagefolder:DIR` (class folders under DIR/train and DIR/val) or `cifar10:DIR`.
    #[arg(long, value_name = "SPEC")]
    data: Option<String>,
    /// auto (small ResNet below 64 px, else resnet50), small, resnet18, resnet34 or resnet50.
    #[arg(long, value_parser = ARCHS)]
    model: Option<String>,
    /// Image folders: the side of the images the model sees (default 224).
    #[arg(long, value_name = "PIXELS")]
    image_size: Option<usize>,
    /// Decoding threads (default: one per core for image folders, else 1).
    #[arg(long)]
    workers: Option<usize>,
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
    /// Training augmentation: random crop + horizontal flip (RandomResizedCrop + flip for
    /// image folders of 64 px and more).
    #[arg(long)]
    augment: Option<bool>,
    /// Stop after this many epochs (the schedule still spans --epochs): an interrupted run.
    #[arg(long, value_name = "N")]
    stop_after: Option<usize>,
    /// bar (terminal), lines (logs) or off; default: bar on a terminal, else lines.
    #[arg(long, value_parser = ["bar", "lines", "off"])]
    progress: Option<String>,
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
        set!(model, "--model", c.model.arch);
        set!(image_size, "--image-size", c.data.image_size);
        set!(workers, "--workers", c.data.workers);
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
        given
    }
}

fn main() -> std::process::ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    match train(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train_resnet: {e}");
            std::process::ExitCode::FAILURE
        }
    }
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
            .filter(|f| !matches!(**f, "--out" | "--device" | "--data" | "--workers"))
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
        },
    )?;
    if let Some(last) = summary.last() {
        println!(
            "done: test accuracy {:.2}% after {} epochs, final train loss {}, {:.1} s on {}",
            100.0 * last.test_accuracy,
            last.epoch,
            last.train_loss,
            summary.seconds,
            summary.device
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
