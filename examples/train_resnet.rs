//! The main job: train a ResNet under an AMP policy on Fashion-MNIST (by default), CIFAR-10
//! (`--data cifar10:DIR`) or your own images (`--data imagefolder:DIR`, class folders under
//! DIR/train and DIR/val).
//!
//!     cargo run --release --example train_resnet [-- OPTIONS]
//!
//! With no options: the first GPU when one is usable (with the full Fashion-MNIST when it is
//! installed), else the CPU with the bundled 10k/2k subset (a few minutes on 2 cores), policy
//! O2 (f16 weights and activations, FP32 masters and batch norm, dynamic loss scaling), SGD +
//! one-cycle, 10 epochs; metrics, a plot, checkpoints and the final weights under
//! `runs/train_resnet/`. `--help` lists the options with their defaults; a run config
//! (`--config configs/run_*.toml`) holds the same settings, and flags override it, held to the
//! same limits. The loop itself is `mixprec::train::trainer`.
//!
//! Several GPUs: `--nproc-per-node N` starts N processes (one per GPU) and supervises them; the
//! same binary also runs unchanged under `torchrun --no-python` and `srun` (README: "Several
//! GPUs").

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{CommandFactory, FromArgMatches, Parser};
use mixprec::error::fmt_number;
use mixprec::train::config::{allowed, OPTIMIZERS, OPT_LEVELS, SCHEDULES};
use mixprec::train::data_parallel::run_data_parallel;
use mixprec::train::distributed::{launched, parse_nproc, spawn_ranks, Nproc};
use mixprec::train::progress::ProgressMode;
use mixprec::train::run_dir::CHECKPOINT_DIR;
use mixprec::train::trainer::checkpoint_config;
use mixprec::train::{auto_checkpoint, find_checkpoint, run, Resume, RunConfig, RunOptions};
use mixprec::Error;

#[derive(Parser, Debug)]
#[command(
    name = "train_resnet",
    version,
    about = "Train a ResNet on Fashion-MNIST, CIFAR-10 or an image folder with mixed precision \
             (mixprec)",
    after_help = "Flags override the --config file (or, with --resume, the checkpoint's settings) \
                  and are held to the same limits as its keys."
)]
struct Cli {
    /// A run config (TOML; see configs/run_fashion_mnist.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// An AMP policy file (configs/O0.toml … O3.toml, *_bf16.toml).
    #[arg(long, value_name = "FILE", conflicts_with = "opt_level")]
    policy: Option<String>,
    /// apex's opt level with its defaults.
    #[arg(long, value_name = "LEVEL", value_parser = OPT_LEVELS)]
    opt_level: Option<String>,
    /// Fashion-MNIST: auto, bundled (the 10k/2k subset), full (the installed 60k/10k set) or a
    /// directory with the four IDX files; imagefolder:DIR (class folders under DIR/train and
    /// DIR/val) or cifar10:DIR (CIFAR-10's binary batches).
    #[arg(long, value_name = "auto|bundled|full|DIR|imagefolder:DIR|cifar10:DIR")]
    data: Option<String>,
    /// The network: auto (the small-image ResNet under 64 px, else ResNet-50), small, resnet18,
    /// resnet34 or resnet50 (torchvision's).
    #[arg(long, value_name = "ARCH")]
    model: Option<String>,
    /// imagefolder: side of the square images the model sees (0: 224).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    image_size: Option<String>,
    /// Threads decoding and augmenting (0: one per core for image folders; Fashion-MNIST and
    /// CIFAR-10: 2 on a GPU, 1 on the CPU).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    workers: Option<String>,
    /// Epochs (the schedule spans them all).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    epochs: Option<String>,
    /// Training batch size.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    batch_size: Option<String>,
    /// Peak learning rate.
    #[arg(long, value_name = "X", allow_negative_numbers = true)]
    lr: Option<String>,
    /// Fused optimizer.
    #[arg(long, value_parser = OPTIMIZERS)]
    optimizer: Option<String>,
    /// Learning-rate schedule.
    #[arg(long, value_parser = SCHEDULES)]
    schedule: Option<String>,
    /// auto (the first GPU when usable, else the CPU), cpu, cuda or cuda:N.
    #[arg(long)]
    device: Option<String>,
    /// Continue a run: `auto` (the newest checkpoint in --out that loads and verifies; a new
    /// run when there is none), a run directory, or a checkpoint file.
    #[arg(long, value_name = "auto|DIR|CKPT")]
    resume: Option<String>,
    /// Start over in a non-empty --out, deleting the earlier run's files (config, metrics,
    /// plot, checkpoints, weights).
    #[arg(long)]
    overwrite: bool,
    /// Output directory (metrics, plot, checkpoints, weights); one run at a time.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Seeds the weights, the data order and the augmentation.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    seed: Option<String>,
    /// Channels per stage, e.g. 16,32,64.
    #[arg(long, value_name = "LIST")]
    widths: Option<String>,
    /// Residual blocks per stage, e.g. 1,1,1.
    #[arg(long, value_name = "LIST")]
    blocks: Option<String>,
    /// Training augmentation: random crop + horizontal flip (RandomResizedCrop + flip for
    /// image folders of 64 px and more).
    #[arg(long, value_name = "BOOL")]
    augment: Option<String>,
    /// Stop with an error after this many consecutive steps with a non-finite loss or
    /// non-finite gradients (0: never).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    divergence_steps: Option<String>,
    /// Run every training step eagerly instead of replaying it as a CUDA graph (GPU only; the
    /// config key `cuda_graph = false` does the same).
    #[arg(long)]
    no_cuda_graph: bool,
    /// Only convolution algorithms that give bitwise the same result on every run (GPU only;
    /// the config key `deterministic = true` does the same).
    #[arg(long)]
    deterministic: bool,
    /// Stop at the first op whose output or gradient is non-finite, naming it, its module, its
    /// dtype and shape and the loss scale (slow: a debugging mode; the config key
    /// `detect_anomaly = true` does the same).
    #[arg(long)]
    detect_anomaly: bool,
    /// Stop after this many epochs (the schedule still spans --epochs): an interrupted run.
    #[arg(long, value_name = "N")]
    stop_after: Option<usize>,
    /// bar (terminal), lines (logs) or off; default: bar on a terminal, else lines.
    #[arg(long, value_parser = ["bar", "lines", "off"])]
    progress: Option<String>,
    /// Data-parallel training: start N processes on this machine, one per GPU (cuda:0 ..
    /// cuda:N-1; N CPU processes without a GPU), and supervise them; `gpu`: one per visible
    /// GPU (torchrun's word). --batch-size is per process.
    #[arg(long, value_name = "N|gpu", value_parser = parse_nproc, allow_negative_numbers = true)]
    nproc_per_node: Option<Nproc>,
    /// Data-parallel training in this one process (no launcher): a replica on each of N GPUs
    /// (cuda:0 .. cuda:N-1; N CPU replicas without a GPU), one thread each, gradients averaged
    /// over NCCL; `gpu`: every visible GPU. --batch-size is the global batch, split over the
    /// replicas (PyTorch's nn.DataParallel).
    #[arg(long, value_name = "N|gpu", value_parser = parse_nproc, allow_negative_numbers = true,
          conflicts_with_all = ["nproc_per_node", "resume", "sync_batchnorm"])]
    data_parallel: Option<Nproc>,
    /// The rendezvous port of --nproc-per-node (default: a free one).
    #[arg(long, value_name = "PORT", requires = "nproc_per_node")]
    master_port: Option<u16>,
    /// With several processes: batch-norm statistics over every process's batch.
    #[arg(long)]
    sync_batchnorm: bool,
    /// Image folders: a file that does not decode is skipped (counted, logged once) instead of
    /// stopping the run (the config key `data.skip_bad_files = true` does the same).
    #[arg(long)]
    skip_bad_files: bool,
}

/// The parser, with each flag's default (from `RunConfig::default`, the one source) in its help.
fn command() -> clap::Command {
    let d = RunConfig::default();
    let list = |v: &[usize]| {
        v.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let defaults = [
        ("opt_level", d.amp.opt_level.clone()),
        ("data", d.data.dir.clone()),
        ("model", d.model.arch.clone()),
        ("image_size", d.data.image_size.to_string()),
        ("workers", d.data.workers.to_string()),
        ("epochs", d.epochs.to_string()),
        ("batch_size", d.data.batch_size.to_string()),
        ("lr", fmt_number(d.optimizer.lr)),
        ("optimizer", d.optimizer.name.clone()),
        ("schedule", d.schedule.kind.clone()),
        ("device", d.device.clone()),
        ("out", d.out.display().to_string()),
        ("seed", d.seed.to_string()),
        ("widths", list(&d.model.widths)),
        ("blocks", list(&d.model.blocks)),
        ("augment", d.data.augment.to_string()),
        ("divergence_steps", d.divergence_steps.to_string()),
    ];
    let mut cmd = Cli::command();
    for (id, v) in defaults {
        cmd = cmd.mut_arg(id, |a| {
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            a.help(format!("{help} [default: {v}]"))
        });
    }
    cmd
}

/// A flag's value as its key's type; a bad one is the key's error, naming the flag.
fn parse<T: std::str::FromStr>(flag: &str, key: &str, v: &str) -> mixprec::Result<T> {
    v.trim().parse().map_err(|_| flag_error(flag, key, v))
}

fn flag_error(flag: &str, key: &str, v: &str) -> Error {
    Error::config(
        format!("command line {flag}"),
        key,
        v,
        allowed(key).unwrap_or(""),
    )
}

fn parse_list(flag: &str, key: &str, v: &str) -> mixprec::Result<Vec<usize>> {
    v.split(',').map(|x| parse(flag, key, x)).collect()
}

impl Cli {
    /// Applies every flag that was given; returns (flag, key) of each.
    fn apply(&self, c: &mut RunConfig) -> mixprec::Result<Vec<(&'static str, &'static str)>> {
        let mut given = Vec::new();
        macro_rules! set {
            ($flag:ident, $name:literal, $key:literal, $dst:expr, $conv:expr) => {
                if let Some(v) = &self.$flag {
                    $dst = $conv($name, $key, v)?;
                    given.push(($name, $key));
                }
            };
        }
        let text = |_: &str, _: &str, v: &String| -> mixprec::Result<String> { Ok(v.clone()) };
        set!(data, "--data", "data.dir", c.data.dir, text);
        set!(model, "--model", "model.arch", c.model.arch, text);
        set!(
            image_size,
            "--image-size",
            "data.image_size",
            c.data.image_size,
            parse
        );
        set!(workers, "--workers", "data.workers", c.data.workers, parse);
        set!(epochs, "--epochs", "epochs", c.epochs, parse);
        set!(
            batch_size,
            "--batch-size",
            "data.batch_size",
            c.data.batch_size,
            parse
        );
        set!(lr, "--lr", "optimizer.lr", c.optimizer.lr, parse);
        set!(
            optimizer,
            "--optimizer",
            "optimizer.name",
            c.optimizer.name,
            text
        );
        set!(
            schedule,
            "--schedule",
            "schedule.kind",
            c.schedule.kind,
            text
        );
        set!(device, "--device", "device", c.device, text);
        set!(seed, "--seed", "seed", c.seed, parse);
        set!(
            widths,
            "--widths",
            "model.widths",
            c.model.widths,
            parse_list
        );
        set!(
            blocks,
            "--blocks",
            "model.blocks",
            c.model.blocks,
            parse_list
        );
        set!(augment, "--augment", "data.augment", c.data.augment, parse);
        set!(
            divergence_steps,
            "--divergence-steps",
            "divergence_steps",
            c.divergence_steps,
            parse
        );
        if let Some(o) = &self.out {
            c.out = o.clone();
            given.push(("--out", "out"));
        }
        if let Some(p) = &self.policy {
            c.amp.policy = Some(p.clone());
            given.push(("--policy", "amp.policy"));
        }
        if let Some(l) = &self.opt_level {
            c.amp.policy = None;
            c.amp.opt_level = l.clone();
            given.push(("--opt-level", "amp.opt_level"));
        }
        if self.no_cuda_graph {
            c.cuda_graph = false;
            given.push(("--no-cuda-graph", "cuda_graph"));
        }
        if self.deterministic {
            c.deterministic = true;
            given.push(("--deterministic", "deterministic"));
        }
        if self.detect_anomaly {
            c.detect_anomaly = true;
            given.push(("--detect-anomaly", "detect_anomaly"));
        }
        if self.skip_bad_files {
            c.data.skip_bad_files = true;
            given.push(("--skip-bad-files", "data.skip_bad_files"));
        }
        Ok(given)
    }
}

fn main() -> std::process::ExitCode {
    // Ranks other than 0 log warnings and errors only (rank 0 reports for the run).
    let rank0 = std::env::var("RANK").map_or(true, |r| r.trim() == "0");
    let level = if rank0 { "info" } else { "warn" };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level)).init();
    let cli = Cli::from_arg_matches(&command().get_matches()).unwrap_or_else(|e| e.exit());
    // Under a launcher (ours, torchrun, srun) this process is one rank: it trains.
    let launched = launched();
    let result = match cli.nproc_per_node {
        Some(n) if !launched => n
            .count("train_resnet")
            .and_then(|n| spawn_ranks("train_resnet", n, cli.master_port)),
        // A run stopped by a signal exits as a process that signal ended (128 + it), after
        // saving and saying how to continue.
        _ => train(cli).map(|s| s.stopped.map_or(0, stop_status)),
    };
    match result {
        Ok(code) => std::process::ExitCode::from(code),
        Err(e) => {
            match std::env::var("RANK") {
                Ok(r) if launched => eprintln!("train_resnet (rank {r}): {e}"),
                _ => eprintln!("train_resnet: {e}"),
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// The exit status of a process stopped by `signal`, as a shell reports it.
fn stop_status(signal: i32) -> u8 {
    128u8.saturating_add(signal.clamp(0, 127) as u8)
}

/// Whether this process is one of several ranks (a launcher's variables say so).
fn several_processes() -> bool {
    mixprec::distributed::LaunchEnv::from_env().is_ok_and(|e| e.is_distributed())
}

/// The run directory a checkpoint file lies in (`DIR/checkpoints/NAME.safetensors` → `DIR`).
fn run_dir_of(ckpt: &Path) -> Option<PathBuf> {
    let parent = ckpt.parent()?;
    (parent.file_name()? == CHECKPOINT_DIR).then(|| parent.parent().map(Path::to_path_buf))?
}

/// The keys whose values differ between two configs (dotted, `optimizer.lr`).
fn changed_keys(a: &RunConfig, b: &RunConfig) -> Vec<String> {
    fn flat(prefix: &str, v: &toml::Value, out: &mut Vec<(String, String)>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    flat(&key, v, out);
                }
            }
            v => out.push((prefix.to_string(), v.to_string())),
        }
    }
    let table = |c: &RunConfig| {
        let mut v = Vec::new();
        if let Ok(t) = toml::Value::try_from(c) {
            flat("", &t, &mut v);
        }
        v
    };
    let (ta, tb) = (table(a), table(b));
    let mut keys: Vec<String> = ta
        .iter()
        .filter(|kv| !tb.contains(kv))
        .chain(tb.iter().filter(|kv| !ta.contains(kv)))
        .map(|(k, _)| k.clone())
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

fn train(cli: Cli) -> mixprec::Result<mixprec::train::RunSummary> {
    if cli.data_parallel.is_some() && launched() {
        return Err(Error::invalid_arg(
            "train_resnet",
            "--data-parallel",
            "under a launcher",
            "one process (--data-parallel uses several devices from it; under a launcher, each \
             process is one rank of DDP)",
        ));
    }
    // A config file is read (and checked) whatever else is given.
    let file_cfg = cli
        .config
        .as_ref()
        .map(RunConfig::from_toml_file)
        .transpose()?;
    let mut cfg = file_cfg.clone().unwrap_or_default();
    // Where --resume auto looks: --out, else the config's out.
    if let Some(o) = &cli.out {
        cfg.out = o.clone();
    }
    // Found once here (its settings are the run's); the run reports what was skipped.
    let (resume, found) = match cli.resume.as_deref() {
        None => (None, None),
        Some("auto") => (Some(Resume::Auto), auto_checkpoint(&cfg.out)?.map(Arc::new)),
        Some(p) => {
            let f = find_checkpoint(Path::new(p))?;
            (Some(Resume::From(f.path.clone())), Some(Arc::new(f)))
        }
    };
    let saved = match &found {
        Some(f) => Some(checkpoint_config(&f.checkpoint)?),
        None => None,
    };
    if let (Some(saved), None) = (&saved, &file_cfg) {
        // Resuming without a config: the checkpoint's settings, in the checkpoint's run
        // directory unless --out says otherwise.
        cfg = saved.clone();
        cfg.out = match (&cli.out, found.as_ref().and_then(|f| run_dir_of(&f.path))) {
            (Some(o), _) => o.clone(),
            (None, Some(dir)) => dir,
            (None, None) => saved.out.clone(),
        };
        // Checkpoints of earlier versions recorded the device rank 0 resolved to (`cuda:0`),
        // which a run of several processes refuses: each process takes cuda:LOCAL_RANK.
        if cfg.device.starts_with("cuda:") && several_processes() {
            cfg.device = "cuda".into();
        }
    }
    let given = cli.apply(&mut cfg)?;
    cfg.validate("command line").map_err(|e| match e {
        Error::Config {
            key,
            value,
            allowed,
            at,
            ..
        } => {
            let flag = given.iter().find(|(_, k)| *k == key).map(|(f, _)| *f);
            Error::Config {
                file: match flag {
                    Some(f) => format!("command line {f}"),
                    None => "command line".into(),
                },
                at,
                key,
                value,
                allowed,
            }
        }
        e => e,
    })?;
    if let Some(saved) = &saved {
        // Settings that do not change the numbers: where and how a run is shown, and what the
        // checkpoint recorded as resolved (`auto` → the device and data used).
        let neutral = [
            "out",
            "device",
            "data.dir",
            "data.workers",
            "checkpoint_every",
            "divergence_steps",
        ];
        let changes: Vec<String> = changed_keys(saved, &cfg)
            .into_iter()
            .filter(|k| !neutral.contains(&k.as_str()))
            .collect();
        if !changes.is_empty() {
            log::warn!(
                "resuming with {} changed from the checkpoint's run: it will not match the \
                 uninterrupted run",
                changes.join(", ")
            );
        }
    }
    let progress = cli.progress.as_deref().map(|p| match p {
        "bar" => ProgressMode::Bar,
        "lines" => ProgressMode::Lines,
        _ => ProgressMode::Off,
    });
    let opts = RunOptions {
        resume,
        found,
        progress,
        stop_after: cli.stop_after,
        sync_batch_norm: cli.sync_batchnorm,
        overwrite: cli.overwrite,
    };
    let summary = match cli.data_parallel {
        Some(n) => run_data_parallel(&cfg, &opts, n)?,
        None => run(&cfg, &opts)?,
    };
    if summary.rank != 0 || summary.stopped.is_some() {
        return Ok(summary);
    }
    if let Some(last) = summary.last() {
        println!(
            "done: test accuracy {:.2}% after {} epochs, final train loss {:.4}, {:.1} s on {}{}",
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
    // The kept epoch checkpoints in one item.
    let (epochs, mut files): (Vec<String>, Vec<String>) = summary
        .written
        .iter()
        .map(|p| p.display().to_string())
        .partition(|p| p.starts_with(&format!("{CHECKPOINT_DIR}/epoch-")));
    match epochs.as_slice() {
        [] => {}
        [one] => files.push(one.clone()),
        [first, .., last] => files.push(format!(
            "{first} … {} ({} files)",
            last.trim_start_matches(&format!("{CHECKPOINT_DIR}/")),
            epochs.len()
        )),
    }
    println!("wrote {}: {}", summary.out.display(), files.join(", "));
    Ok(summary)
}

/// The command line as a user types it (CI runs these: `cargo test --all-targets` builds the
/// example's tests).
#[cfg(test)]
mod tests {
    use super::*;
    use mixprec::train::distributed::gpu_processes;

    fn cli(args: &[&str]) -> Cli {
        let argv = std::iter::once("train_resnet").chain(args.iter().copied());
        Cli::from_arg_matches(&command().try_get_matches_from(argv).unwrap()).unwrap()
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("mixprec-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn version_and_help_with_defaults() {
        let cmd = command();
        assert_eq!(cmd.get_version(), Some(env!("CARGO_PKG_VERSION")));
        let help = command().render_help().to_string();
        for want in [
            "--epochs <N>",
            "[default: 10]",
            "[default: 0.1]",
            "[default: runs/train_resnet]",
            "[default: auto]",
            "--resume <auto|DIR|CKPT>",
            "--overwrite",
            "--divergence-steps <N>",
            "--skip-bad-files",
        ] {
            assert!(help.contains(want), "{want} not in:\n{help}");
        }
    }

    /// Flags are held to their keys' limits and words; a negative number reaches the check
    /// instead of being taken for a flag. Nothing is written, not even an empty --out.
    #[test]
    fn bad_flags_are_the_keys_errors() {
        let out = scratch("flags").join("out");
        let out_s = out.to_str().unwrap();
        for (args, want) in [
            (
                &["--lr", "-1"][..],
                "config command line --lr: key `optimizer.lr` = -1: a number > 0 and <= 1000",
            ),
            (
                &["--lr", "1e9"],
                "config command line --lr: key `optimizer.lr` = 1e9: a number > 0 and <= 1000",
            ),
            (
                &["--epochs", "0"],
                "config command line --epochs: key `epochs` = 0: an integer >= 1",
            ),
            (
                &["--batch-size", "-3"],
                "config command line --batch-size: key `data.batch_size` = -3: an integer from 1 \
                 to 16777216, in digits (per process)",
            ),
            (
                &["--batch-size", "1e21"],
                "config command line --batch-size: key `data.batch_size` = 1e21: an integer from \
                 1 to 16777216, in digits (per process)",
            ),
            (
                &["--batch-size", "1000000000000"],
                "key `data.batch_size` = 1000000000000: an integer from 1 to 16777216",
            ),
            (
                &["--workers", "100000"],
                "config command line --workers: key `data.workers` = 100000: an integer from 0 \
                 to 1024",
            ),
            // Within the bound but larger than the data: refused before --out is made.
            (
                &[
                    "--batch-size",
                    "100000",
                    "--data",
                    "bundled",
                    "--device",
                    "cpu",
                ],
                "invalid argument data.batch_size = 100000: at most the number of training images",
            ),
            (
                &["--widths", "8,x"],
                "config command line --widths: key `model.widths` = x",
            ),
            (
                &["--device", "gpu"],
                "config command line --device: key `device` = \"gpu\"",
            ),
        ] {
            let msg = train(cli(&[args, &["--out", out_s]].concat()))
                .unwrap_err()
                .to_string();
            assert!(msg.contains(want), "{args:?}: {msg}");
        }
        assert!(!out.exists());
    }

    /// `--data-parallel` takes a count or `gpu`, and is one process: not with
    /// `--nproc-per-node`, `--resume` or `--sync-batchnorm`.
    #[test]
    fn data_parallel_a_count_or_gpu_in_one_process() {
        assert_eq!(
            cli(&["--data-parallel", "2"]).data_parallel,
            Some(Nproc::Count(2))
        );
        assert_eq!(
            cli(&["--data-parallel=gpu"]).data_parallel,
            Some(Nproc::Gpu)
        );
        for other in [
            &["--nproc-per-node", "2"][..],
            &["--resume", "auto"],
            &["--sync-batchnorm"],
        ] {
            let argv = [&["train_resnet", "--data-parallel", "2"][..], other].concat();
            assert!(command().try_get_matches_from(argv).is_err(), "{other:?}");
        }
    }

    /// `--nproc-per-node` takes a count or `gpu`; `gpu` is the number of visible GPUs, and
    /// where there is none the error says why and what to give instead.
    #[test]
    fn nproc_per_node_a_count_or_gpu() {
        assert_eq!(
            cli(&["--nproc-per-node", "3"]).nproc_per_node,
            Some(Nproc::Count(3))
        );
        assert_eq!(
            cli(&["--nproc-per-node=gpu"]).nproc_per_node,
            Some(Nproc::Gpu)
        );
        for bad in ["0", "-1", "gpus", ""] {
            let argv = ["train_resnet", "--nproc-per-node", bad];
            let e = command()
                .try_get_matches_from(argv)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("a number of processes >= 1, or `gpu` (one per visible GPU)"),
                "{bad:?}: {e}"
            );
        }
        assert_eq!(gpu_processes("train_resnet", Ok(4)).unwrap(), 4);
        // A run stopped by SIGTERM exits as one the signal ended.
        assert_eq!(stop_status(15), 143);
        assert_eq!(stop_status(2), 130);
        let none = gpu_processes("train_resnet", Ok(0))
            .unwrap_err()
            .to_string();
        assert!(
            none.contains("CUDA sees no GPU") && none.contains("give a number"),
            "{none}"
        );
        let why = gpu_processes(
            "train_resnet",
            Err(Error::Cuda("libcuda.so.1 not found".into())),
        )
        .unwrap_err()
        .to_string();
        assert!(why.contains("libcuda.so.1 not found"), "{why}");
    }

    /// A `--config` given with `--resume` is read and checked (it was ignored, even when
    /// invalid).
    #[test]
    fn a_config_is_checked_with_resume_too() {
        let dir = scratch("config-resume");
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "epochs = 3\n[optimizer]\nlr = 1e9\n").unwrap();
        let msg = train(cli(&[
            "--config",
            bad.to_str().unwrap(),
            "--resume",
            "auto",
            "--out",
            dir.join("out").to_str().unwrap(),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            msg.contains(&format!(
                "config {}:3:6: key `optimizer.lr` = 1e9",
                bad.display()
            )),
            "{msg}"
        );
    }

    /// `--data DIR` is reported as that directory (not as FASHION_MNIST_DIR); a run that trains
    /// nothing (`--stop-after 0`) lists only the files it wrote, and a second run into the
    /// directory is refused.
    #[test]
    fn data_dir_and_an_honest_list_of_files() {
        let dir = scratch("data");
        let out = dir.join("out");
        let out_s = out.to_str().unwrap();
        let msg = train(cli(&[
            "--data", "/nowhere", "--device", "cpu", "--out", out_s,
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            msg.contains("/nowhere does not hold the Fashion-MNIST files")
                && msg.contains("train-images-idx3-ubyte[.gz] not found")
                && !msg.contains("FASHION_MNIST_DIR"),
            "{msg}"
        );
        let bundled = mixprec::data::fashion_mnist::bundled_dir();
        let s = train(cli(&[
            "--data",
            bundled.to_str().unwrap(),
            "--device",
            "cpu",
            "--stop-after",
            "0",
            "--out",
            out_s,
            "--progress",
            "off",
        ]))
        .unwrap();
        assert_eq!(s.data, format!("Fashion-MNIST from {}", bundled.display()));
        let written: Vec<String> = s.written.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(written, ["config.toml", "metrics.csv", "metrics.jsonl"]);
        assert!(!out.join("model.safetensors").exists());
        let msg = train(cli(&["--device", "cpu", "--out", out_s]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("is not empty"), "{msg}");
    }
}
