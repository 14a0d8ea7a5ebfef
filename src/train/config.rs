//! The run configuration of the main training job: model, data, optimizer, schedule, AMP policy
//! and where to write. Read from TOML (`configs/run_*.toml`) by serde derive: every key is
//! optional and falls back to [`RunConfig::default`]; an unknown key, a wrong type or a bad value
//! is an [`Error::Config`] naming the file, the line and column, the key (`optimizer.lr`), the
//! value as written and what is allowed ([`KEYS`]). Command-line flags override the file and are
//! held to the same checks ([`RunConfig::validate`], the one place the limits live).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::amp::{OptLevel, Policy};
use crate::config_toml::ConfigText;
use crate::error::{fmt_number, Error, Result};
use crate::tensor::Device;

/// The ResNet trained by the main job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// `auto` (the small-image ResNet below for images under 64 pixels, else ResNet-50),
    /// `small`, or torchvision's `resnet18`, `resnet34`, `resnet50` (ImageNet stem).
    pub arch: String,
    /// Residual blocks per stage.
    pub blocks: Vec<usize>,
    /// Channels per stage (one per entry of `blocks`).
    pub widths: Vec<usize>,
    /// `basic` (two 3x3 convs) or `bottleneck` (1x1, 3x3, 1x1).
    pub block: String,
    /// How activations and weights are laid out: `channels_last` (NHWC, PyTorch's
    /// `torch.channels_last`), `contiguous` (NCHW) or `auto` (channels_last on a GPU, where
    /// cuDNN and the batch-norm kernels run natively in it; contiguous on the CPU).
    pub memory_format: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Fashion-MNIST: `auto` (`$FASHION_MNIST_DIR`; else on a GPU the system's full set when
    /// installed; else the bundled subset), `bundled`, `full` (the system's full set) or a
    /// directory with the four IDX files; `imagefolder:DIR` (class folders under DIR/train and
    /// DIR/val, torchvision's ImageFolder layout) or `cifar10:DIR` (the binary version's
    /// batches).
    pub dir: String,
    pub batch_size: usize,
    pub eval_batch_size: usize,
    /// Training augmentation: random crop (padding 2 up to 28 px, 4 above) + horizontal flip;
    /// image folders of 64 px and more: RandomResizedCrop + flip.
    pub augment: bool,
    /// Train on the first N images only (quick runs and tests; an image folder's first images
    /// are its first classes'); 0 = all.
    pub train_limit: usize,
    /// Evaluate on the first N test images only; 0 = all.
    pub test_limit: usize,
    /// imagefolder: side of the square images the model sees; 0 = 224. At 64 and above:
    /// RandomResizedCrop(size) + flip for training (with `augment`), Resize(size·256/224) +
    /// CenterCrop(size) for evaluation; below: Resize(size) + CenterCrop(size).
    pub image_size: usize,
    /// Threads decoding and augmenting; 0 = one per core for image folders; for Fashion-MNIST
    /// and CIFAR-10, 2 on a GPU and 1 on the CPU.
    pub workers: usize,
    /// imagefolder: serve one grey channel (`convert("L")`) instead of RGB.
    pub grayscale: bool,
    /// imagefolder: Normalize's mean and std per channel; empty = ImageNet's.
    pub mean: Vec<f64>,
    pub std: Vec<f64>,
    /// imagefolder: skip (and count) files that do not decode instead of stopping.
    pub skip_bad_files: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// `sgd`, `adam`, `adamw` or `lamb` (all fused, multi-tensor).
    pub name: String,
    /// Peak learning rate (the schedule scales it).
    pub lr: f64,
    /// SGD momentum.
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    /// Adam/AdamW/LAMB betas.
    pub betas: (f64, f64),
    pub eps: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleConfig {
    /// `one-cycle` (linear warm-up then cosine to zero), `cosine`, `step` or `constant`.
    pub kind: String,
    /// one-cycle: fraction of the steps spent warming up.
    pub warmup_fraction: f64,
    /// step: multiply the lr by `gamma` every `step_epochs` epochs.
    pub step_epochs: usize,
    pub gamma: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AmpConfig {
    /// A policy file (`configs/O2.toml`); takes precedence over `opt_level`.
    pub policy: Option<String>,
    /// `O0`..`O3`, apex's defaults for that level, when no policy file is given.
    pub opt_level: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    pub epochs: usize,
    pub seed: u64,
    /// `auto` (the first GPU when usable, else the CPU, saying why), `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Where metrics, the plot, checkpoints and the final weights go.
    pub out: PathBuf,
    /// Write `checkpoints/epoch-NNN.safetensors` every this many epochs (the latest is always
    /// kept as `checkpoints/last.safetensors`); 0 = only `last`.
    pub checkpoint_every: usize,
    pub label_smoothing: f64,
    /// On a GPU, capture the training step into a CUDA graph and replay it (the default);
    /// false runs every step eagerly. No effect on the CPU.
    #[serde(default = "yes")]
    pub cuda_graph: bool,
    /// On a GPU, only convolution algorithms that give bitwise the same result on every run
    /// (PyTorch's `cudnn.deterministic`): a resumed run then equals an uninterrupted one bit for
    /// bit, in any process. Off by default (the timed choice may pick a faster engine that
    /// reduces with atomics); true turns it on for the rest of the process. No effect on the
    /// CPU, which is always deterministic.
    pub deterministic: bool,
    /// Anomaly mode (`crate::anomaly`): stop with an error naming the first op and module whose
    /// output or gradient is non-finite. A debugging mode: one host read per op, the step runs
    /// eagerly (no CUDA graph).
    pub detect_anomaly: bool,
    /// Stop with an error when this many consecutive steps were skipped for a non-finite loss
    /// or non-finite gradients (a diverged run); 0 = never stop.
    pub divergence_steps: u64,
    pub model: ModelConfig,
    pub data: DataConfig,
    pub optimizer: OptimizerConfig,
    pub schedule: ScheduleConfig,
    pub amp: AmpConfig,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            arch: "auto".into(),
            blocks: vec![1, 1, 1],
            widths: vec![16, 32, 64],
            block: "basic".into(),
            memory_format: "auto".into(),
        }
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            dir: "auto".into(),
            batch_size: 128,
            eval_batch_size: 500,
            augment: false,
            train_limit: 0,
            test_limit: 0,
            image_size: 0,
            workers: 0,
            grayscale: false,
            mean: Vec::new(),
            std: Vec::new(),
            skip_bad_files: false,
        }
    }
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            name: "sgd".into(),
            lr: 0.1,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 5e-4,
            betas: (0.9, 0.999),
            eps: 1e-8,
        }
    }
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            kind: "one-cycle".into(),
            warmup_fraction: 0.25,
            step_epochs: 30,
            gamma: 0.1,
        }
    }
}

impl Default for AmpConfig {
    fn default() -> Self {
        AmpConfig {
            policy: None,
            opt_level: "O2".into(),
        }
    }
}

impl Default for RunConfig {
    /// The README's main run: ResNet 16-32-64 on Fashion-MNIST, SGD + one-cycle, O2.
    fn default() -> Self {
        RunConfig {
            epochs: 10,
            seed: 0,
            device: "auto".into(),
            out: PathBuf::from("runs/train_resnet"),
            checkpoint_every: 1,
            label_smoothing: 0.0,
            cuda_graph: true,
            deterministic: false,
            detect_anomaly: false,
            divergence_steps: 100,
            model: ModelConfig::default(),
            data: DataConfig::default(),
            optimizer: OptimizerConfig::default(),
            schedule: ScheduleConfig::default(),
            amp: AmpConfig::default(),
        }
    }
}

/// Serde's default for keys added after checkpoints were written (`cuda_graph`).
fn yes() -> bool {
    true
}

pub const OPTIMIZERS: [&str; 4] = ["sgd", "adam", "adamw", "lamb"];
pub const SCHEDULES: [&str; 4] = ["one-cycle", "cosine", "step", "constant"];
pub const BLOCKS: [&str; 2] = ["basic", "bottleneck"];
pub const OPT_LEVELS: [&str; 4] = ["O0", "O1", "O2", "O3"];
pub const ARCHS: [&str; 5] = ["auto", "small", "resnet18", "resnet34", "resnet50"];
pub const MEMORY_FORMATS: [&str; 3] = ["auto", "contiguous", "channels_last"];

/// The largest peak learning rate a run accepts (from a file or a flag).
pub const MAX_LR: f64 = 1e3;
/// The largest batch (per process) a run accepts: 2^24 images.
pub const MAX_BATCH: usize = 1 << 24;
/// The most data worker threads a run accepts.
pub const MAX_WORKERS: usize = 1024;

/// What each key allows, in the words of every error about it (a file's or a flag's).
pub const KEYS: &[(&str, &str)] = &[
    ("epochs", "an integer >= 1"),
    ("seed", "an integer in [0, 2^64)"),
    ("device", "\"auto\", \"cpu\", \"cuda\" or \"cuda:N\""),
    ("out", "a directory path (not empty)"),
    (
        "checkpoint_every",
        "an integer >= 0 (0: only checkpoints/last)",
    ),
    ("label_smoothing", "a number in [0, 1]"),
    (
        "cuda_graph",
        "true or false (on a GPU: capture the training step into a CUDA graph)",
    ),
    (
        "deterministic",
        "true or false (on a GPU: only convolution algorithms that are bitwise reproducible)",
    ),
    (
        "detect_anomaly",
        "true or false (stop at the first op whose output or gradient is non-finite)",
    ),
    (
        "divergence_steps",
        "an integer >= 0 (consecutive non-finite steps before stopping; 0: never stop)",
    ),
    ("model", "a [model] table"),
    ("model.blocks", "a non-empty array of integers >= 1"),
    (
        "model.widths",
        "a non-empty array of integers >= 1, one per stage (as many as model.blocks)",
    ),
    ("model.block", "\"basic\" or \"bottleneck\""),
    (
        "model.memory_format",
        "\"auto\" (channels_last on a GPU, else contiguous), \"contiguous\" or \"channels_last\"",
    ),
    (
        "model.arch",
        "\"auto\", \"small\", \"resnet18\", \"resnet34\" or \"resnet50\"",
    ),
    ("data", "a [data] table"),
    (
        "data.dir",
        "\"auto\", \"bundled\", \"full\", a directory holding the four IDX files, \
         \"imagefolder:DIR\" or \"cifar10:DIR\"",
    ),
    (
        "data.batch_size",
        "an integer from 1 to 16777216, in digits (per process)",
    ),
    (
        "data.eval_batch_size",
        "an integer from 1 to 16777216, in digits (per process)",
    ),
    ("data.augment", "true or false"),
    ("data.train_limit", "an integer >= 0 (0: all)"),
    ("data.test_limit", "an integer >= 0 (0: all)"),
    ("data.image_size", "an integer in [0, 4096] (0: 224)"),
    (
        "data.workers",
        "an integer from 0 to 1024 (0: one per core for image folders; for Fashion-MNIST and \
         CIFAR-10, 2 on a GPU, 1 on the CPU)",
    ),
    ("data.grayscale", "true or false"),
    (
        "data.mean",
        "an array of numbers in [-1000, 1000], one per channel, as many as data.std (empty: \
         ImageNet's)",
    ),
    (
        "data.std",
        "an array of numbers in [1e-6, 1000], one per channel, as many as data.mean (empty: \
         ImageNet's)",
    ),
    ("data.skip_bad_files", "true or false"),
    ("optimizer", "an [optimizer] table"),
    ("optimizer.name", "\"sgd\", \"adam\", \"adamw\" or \"lamb\""),
    ("optimizer.lr", "a number > 0 and <= 1000"),
    ("optimizer.momentum", "a number in [0, 1]"),
    ("optimizer.nesterov", "true or false"),
    ("optimizer.weight_decay", "a number in [0, 1]"),
    (
        "optimizer.betas",
        "two numbers in [0, 1), e.g. [0.9, 0.999]",
    ),
    ("optimizer.eps", "a number in [0, 1]"),
    ("schedule", "a [schedule] table"),
    (
        "schedule.kind",
        "\"one-cycle\", \"cosine\", \"step\" or \"constant\"",
    ),
    ("schedule.warmup_fraction", "a number in [0, 1]"),
    ("schedule.step_epochs", "an integer >= 1"),
    ("schedule.gamma", "a number in [0, 1]"),
    ("amp", "an [amp] table"),
    ("amp.policy", "a policy file, e.g. \"configs/O2.toml\""),
    ("amp.opt_level", "\"O0\", \"O1\", \"O2\" or \"O3\""),
];

/// What `key` allows (see [`KEYS`]).
pub fn allowed(key: &str) -> Option<&'static str> {
    KEYS.iter().find(|(k, _)| *k == key).map(|(_, a)| *a)
}

fn invalid(file: &str, key: &str, value: impl Into<String>) -> Error {
    Error::config(file, key, value, allowed(key).unwrap_or("see KEYS"))
}

impl RunConfig {
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<RunConfig> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading the run config {}", path.display()), e))?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Parses `text` over the defaults; `file` names the source in errors.
    pub fn from_toml_str(text: &str, file: &str) -> Result<RunConfig> {
        let doc = ConfigText::parse(text, file)?;
        let c: RunConfig = doc.deserialize(|k| allowed(k).map(String::from))?;
        c.validate(file).map_err(|e| doc.locate(e))?;
        Ok(c)
    }

    /// Checks every value against [`KEYS`] and what no single key can (one width per stage).
    /// The one place the limits live: a file's values and a flag's are held to the same.
    /// `file` names the source in the error (a file, `command line`, ...).
    pub fn validate(&self, file: &str) -> Result<()> {
        let bad = |key: &str, value: String| Err(invalid(file, key, value));
        let unit = |x: f64| x.is_finite() && (0.0..=1.0).contains(&x);
        let one_of = |key: &str, v: &str, set: &[&str]| {
            if set.contains(&v) {
                Ok(())
            } else {
                bad(key, format!("{v:?}"))
            }
        };
        if self.epochs == 0 {
            return bad("epochs", "0".into());
        }
        if parse_device(&self.device).is_err() {
            return bad("device", format!("{:?}", self.device));
        }
        if self.out.as_os_str().is_empty() {
            return bad("out", "\"\"".into());
        }
        if !unit(self.label_smoothing) {
            return bad("label_smoothing", fmt_number(self.label_smoothing));
        }
        let m = &self.model;
        if m.blocks.is_empty() || m.blocks.contains(&0) {
            return bad("model.blocks", format!("{:?}", m.blocks));
        }
        if m.widths.is_empty() || m.widths.contains(&0) || m.widths.len() != m.blocks.len() {
            return bad(
                "model.widths",
                format!("{:?} for blocks {:?}", m.widths, m.blocks),
            );
        }
        one_of("model.block", &m.block, &BLOCKS)?;
        one_of("model.arch", &m.arch, &ARCHS)?;
        one_of("model.memory_format", &m.memory_format, &MEMORY_FORMATS)?;
        let d = &self.data;
        if d.dir.is_empty() {
            return bad("data.dir", "\"\"".into());
        }
        // `kind:rest` names a kind of data; a path with a colon in it is still a directory.
        if let Some((kind, _)) = d.dir.split_once(':') {
            if !kind.is_empty() && !kind.contains('/') && kind != "imagefolder" && kind != "cifar10"
            {
                return bad("data.dir", format!("{:?}", d.dir));
            }
        }
        if d.image_size > 4096 {
            return bad("data.image_size", d.image_size.to_string());
        }
        // Each list's own values first, then whether they pair up.
        if d.std
            .iter()
            .any(|s| !(s.is_finite() && (1e-6..=1e3).contains(s)))
        {
            return bad("data.std", format!("{:?}", d.std));
        }
        if d.mean
            .iter()
            .any(|m| !(m.is_finite() && (-1e3..=1e3).contains(m)))
            || d.mean.len() != d.std.len()
        {
            return bad("data.mean", format!("{:?} with std {:?}", d.mean, d.std));
        }
        if d.batch_size == 0 || d.batch_size > MAX_BATCH {
            return bad("data.batch_size", d.batch_size.to_string());
        }
        if d.eval_batch_size == 0 || d.eval_batch_size > MAX_BATCH {
            return bad("data.eval_batch_size", d.eval_batch_size.to_string());
        }
        if d.workers > MAX_WORKERS {
            return bad("data.workers", d.workers.to_string());
        }
        let o = &self.optimizer;
        one_of("optimizer.name", &o.name, &OPTIMIZERS)?;
        if !(o.lr.is_finite() && o.lr > 0.0 && o.lr <= MAX_LR) {
            return bad("optimizer.lr", fmt_number(o.lr));
        }
        if !unit(o.momentum) {
            return bad("optimizer.momentum", fmt_number(o.momentum));
        }
        if !unit(o.weight_decay) {
            return bad("optimizer.weight_decay", fmt_number(o.weight_decay));
        }
        let beta = |b: f64| b.is_finite() && (0.0..1.0).contains(&b);
        if !(beta(o.betas.0) && beta(o.betas.1)) {
            return bad(
                "optimizer.betas",
                format!("[{}, {}]", fmt_number(o.betas.0), fmt_number(o.betas.1)),
            );
        }
        if !unit(o.eps) {
            return bad("optimizer.eps", fmt_number(o.eps));
        }
        let s = &self.schedule;
        one_of("schedule.kind", &s.kind, &SCHEDULES)?;
        if !unit(s.warmup_fraction) {
            return bad("schedule.warmup_fraction", fmt_number(s.warmup_fraction));
        }
        if s.step_epochs == 0 {
            return bad("schedule.step_epochs", "0".into());
        }
        if !unit(s.gamma) {
            return bad("schedule.gamma", fmt_number(s.gamma));
        }
        if self.amp.policy.as_deref() == Some("") {
            return bad("amp.policy", "\"\"".into());
        }
        one_of("amp.opt_level", &self.amp.opt_level, &OPT_LEVELS)?;
        Ok(())
    }

    /// The AMP policy: the policy file when one is named, else apex's defaults for the level.
    pub fn policy(&self) -> Result<Policy> {
        match &self.amp.policy {
            Some(file) => Policy::from_toml_file(file),
            None => Ok(Policy::opt_level(parse_opt_level(&self.amp.opt_level)?)),
        }
    }

    /// The configuration as TOML (saved with every checkpoint and at the start of a run).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# unserialisable config: {e}\n"))
    }
}

pub fn parse_opt_level(s: &str) -> Result<OptLevel> {
    match s {
        "O0" => Ok(OptLevel::O0),
        "O1" => Ok(OptLevel::O1),
        "O2" => Ok(OptLevel::O2),
        "O3" => Ok(OptLevel::O3),
        _ => Err(invalid("run config", "amp.opt_level", format!("{s:?}"))),
    }
}

/// The device a run asked for, and a note saying why `auto` chose it.
pub fn select_device(spec: &str) -> Result<(Device, String)> {
    Ok(match parse_device(spec)? {
        None => match Device::cuda(0) {
            Ok(d) => (d, " (auto: the first GPU)".into()),
            Err(e) => {
                // The first clause says what is missing; the rest is for RUST_LOG=debug.
                let why = e.to_string();
                let why = why.trim_start_matches("cuda: ");
                let why = why.split(" (RUST_LOG").next().unwrap_or(why).to_string();
                (Device::Cpu, format!(" (auto: no usable GPU: {why})"))
            }
        },
        Some(None) => (Device::Cpu, String::new()),
        Some(Some(n)) => (Device::cuda(n)?, String::new()),
    })
}

/// Which device a run asked for: `None` = auto, `Some(None)` = CPU, `Some(Some(n))` = GPU n.
pub fn parse_device(s: &str) -> Result<Option<Option<usize>>> {
    match s {
        "auto" => Ok(None),
        "cpu" => Ok(Some(None)),
        "cuda" => Ok(Some(Some(0))),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(|n| Some(Some(n)))
            .ok_or_else(|| invalid("run config", "device", format!("{s:?}"))),
    }
}
