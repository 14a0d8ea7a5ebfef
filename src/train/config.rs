//! The run configuration of the main training job: model, data, optimizer, schedule, AMP policy
//! and where to write. Read from TOML (`configs/run_*.toml`); every key is optional and falls back
//! to [`RunConfig::default`]; an unknown key or a bad value is an [`Error::Config`] naming the file,
//! the key (`optimizer.lr`), the value and what is allowed. Command-line flags override it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::amp::{OptLevel, Policy};
use crate::error::{Error, Result};

/// The ResNet trained by the main job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// `auto` (the small-image ResNet below for images under 64 pixels, else ResNet-50),
    /// `small`, or torchvision's `resnet18`, `resnet34`, `resnet50` (ImageNet stem).
    #[serde(default = "auto")]
    pub arch: String,
    /// Residual blocks per stage.
    pub blocks: Vec<usize>,
    /// Channels per stage (one per entry of `blocks`).
    pub widths: Vec<usize>,
    /// `basic` (two 3x3 convs) or `bottleneck` (1x1, 3x3, 1x1).
    pub block: String,
}

fn auto() -> String {
    "auto".into()
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataConfig {
    /// Fashion-MNIST: `auto` ($FASHION_MNIST_DIR, else the system's full set, else the bundled
    /// subset), `bundled`, or a directory with the four IDX files; `imagefolder:DIR` (class
    /// folders under DIR/train and DIR/val, torchvision's ImageFolder layout) or `cifar10:DIR`
    /// (the binary version's batches).
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
    #[serde(default)]
    pub image_size: usize,
    /// Threads decoding and augmenting; 0 = one per core for image folders, 1 otherwise.
    #[serde(default)]
    pub workers: usize,
    /// imagefolder: serve one grey channel (`convert("L")`) instead of RGB.
    #[serde(default)]
    pub grayscale: bool,
    /// imagefolder: Normalize's mean and std per channel; empty = ImageNet's.
    #[serde(default)]
    pub mean: Vec<f64>,
    #[serde(default)]
    pub std: Vec<f64>,
    /// imagefolder: skip (and count) files that do not decode instead of stopping.
    #[serde(default)]
    pub skip_bad_files: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
pub struct AmpConfig {
    /// A policy file (`configs/O2.toml`); takes precedence over `opt_level`.
    pub policy: Option<String>,
    /// `O0`..`O3`, apex's defaults for that level, when no policy file is given.
    pub opt_level: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
    pub model: ModelConfig,
    pub data: DataConfig,
    pub optimizer: OptimizerConfig,
    pub schedule: ScheduleConfig,
    pub amp: AmpConfig,
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
            model: ModelConfig {
                arch: "auto".into(),
                blocks: vec![1, 1, 1],
                widths: vec![16, 32, 64],
                block: "basic".into(),
            },
            data: DataConfig {
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
            },
            optimizer: OptimizerConfig {
                name: "sgd".into(),
                lr: 0.1,
                momentum: 0.9,
                nesterov: true,
                weight_decay: 5e-4,
                betas: (0.9, 0.999),
                eps: 1e-8,
            },
            schedule: ScheduleConfig {
                kind: "one-cycle".into(),
                warmup_fraction: 0.25,
                step_epochs: 30,
                gamma: 0.1,
            },
            amp: AmpConfig {
                policy: None,
                opt_level: "O2".into(),
            },
        }
    }
}

pub const OPTIMIZERS: [&str; 4] = ["sgd", "adam", "adamw", "lamb"];
pub const SCHEDULES: [&str; 4] = ["one-cycle", "cosine", "step", "constant"];
pub const BLOCKS: [&str; 2] = ["basic", "bottleneck"];
pub const ARCHS: [&str; 5] = ["auto", "small", "resnet18", "resnet34", "resnet50"];

/// Reads typed values out of one TOML table, naming `section.key` in every error.
struct Reader<'a> {
    file: &'a str,
    section: &'static str,
    table: &'a toml::Table,
}

impl<'a> Reader<'a> {
    fn key(&self, k: &str) -> String {
        if self.section.is_empty() {
            k.to_string()
        } else {
            format!("{}.{k}", self.section)
        }
    }

    fn err(&self, k: &str, v: &toml::Value, allowed: impl Into<String>) -> Error {
        Error::Config {
            file: self.file.to_string(),
            key: self.key(k),
            value: v.to_string(),
            allowed: allowed.into(),
        }
    }

    /// Rejects keys outside `known` (sections are checked by their own reader).
    fn only(&self, known: &[&str], sections: &[&str]) -> Result<()> {
        for (k, v) in self.table {
            if !known.contains(&k.as_str()) && !sections.contains(&k.as_str()) {
                let mut all: Vec<&str> = known.to_vec();
                all.extend(sections.iter().copied());
                return Err(self.err(k, v, format!("one of {all:?}")));
            }
        }
        Ok(())
    }

    fn sub(&self, name: &'static str) -> Result<Option<Reader<'a>>> {
        match self.table.get(name) {
            None => Ok(None),
            Some(toml::Value::Table(t)) => Ok(Some(Reader {
                file: self.file,
                section: name,
                table: t,
            })),
            Some(v) => Err(self.err(name, v, format!("a [{name}] table"))),
        }
    }

    fn usize(&self, k: &str, min: usize, dst: &mut usize) -> Result<()> {
        if let Some(v) = self.table.get(k) {
            *dst = v
                .as_integer()
                .and_then(|i| usize::try_from(i).ok())
                .filter(|&i| i >= min)
                .ok_or_else(|| self.err(k, v, format!("an integer >= {min}")))?;
        }
        Ok(())
    }

    fn u64(&self, k: &str, dst: &mut u64) -> Result<()> {
        if let Some(v) = self.table.get(k) {
            *dst = v
                .as_integer()
                .and_then(|i| u64::try_from(i).ok())
                .ok_or_else(|| self.err(k, v, "a non-negative integer"))?;
        }
        Ok(())
    }

    /// A float in `[lo, hi]` (integers accepted).
    fn f64(&self, k: &str, lo: f64, hi: f64, dst: &mut f64) -> Result<()> {
        if let Some(v) = self.table.get(k) {
            *dst = v
                .as_float()
                .or_else(|| v.as_integer().map(|i| i as f64))
                .filter(|x| (lo..=hi).contains(x))
                .ok_or_else(|| self.err(k, v, format!("a number in [{lo}, {hi}]")))?;
        }
        Ok(())
    }

    fn bool(&self, k: &str, dst: &mut bool) -> Result<()> {
        if let Some(v) = self.table.get(k) {
            *dst = v.as_bool().ok_or_else(|| self.err(k, v, "true or false"))?;
        }
        Ok(())
    }

    fn string(&self, k: &str, allowed: Option<&[&str]>, dst: &mut String) -> Result<()> {
        if let Some(v) = self.table.get(k) {
            let s = v.as_str().ok_or_else(|| self.err(k, v, "a string"))?;
            if let Some(allowed) = allowed {
                if !allowed.contains(&s) {
                    return Err(self.err(k, v, format!("one of {allowed:?}")));
                }
            }
            *dst = s.to_string();
        }
        Ok(())
    }

    /// A list of numbers, each in `[lo, hi]`.
    fn f64_list(&self, k: &str, lo: f64, hi: f64, dst: &mut Vec<f64>) -> Result<()> {
        if let Some(v) = self.table.get(k) {
            let bad = || self.err(k, v, format!("an array of numbers in [{lo}, {hi}]"));
            let arr = v.as_array().ok_or_else(bad)?;
            *dst = arr
                .iter()
                .map(|e| {
                    e.as_float()
                        .or_else(|| e.as_integer().map(|i| i as f64))
                        .filter(|x| (lo..=hi).contains(x))
                        .ok_or_else(bad)
                })
                .collect::<Result<_>>()?;
        }
        Ok(())
    }

    fn usize_list(&self, k: &str, dst: &mut Vec<usize>) -> Result<()> {
        if let Some(v) = self.table.get(k) {
            let bad = || self.err(k, v, "a non-empty array of positive integers");
            let arr = v.as_array().filter(|a| !a.is_empty()).ok_or_else(bad)?;
            *dst = arr
                .iter()
                .map(|e| {
                    e.as_integer()
                        .and_then(|i| usize::try_from(i).ok())
                        .filter(|&i| i > 0)
                        .ok_or_else(bad)
                })
                .collect::<Result<_>>()?;
        }
        Ok(())
    }
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
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| Error::Config {
            file: file.to_string(),
            key: "(syntax)".into(),
            value: e.message().to_string(),
            allowed: "a TOML run config (see configs/run_fashion_mnist.toml)".into(),
        })?;
        let mut c = RunConfig::default();
        let top = Reader {
            file,
            section: "",
            table: &table,
        };
        top.only(
            &[
                "epochs",
                "seed",
                "device",
                "out",
                "checkpoint_every",
                "label_smoothing",
            ],
            &["model", "data", "optimizer", "schedule", "amp"],
        )?;
        top.usize("epochs", 1, &mut c.epochs)?;
        top.u64("seed", &mut c.seed)?;
        top.string("device", None, &mut c.device)?;
        let mut out = c.out.display().to_string();
        top.string("out", None, &mut out)?;
        c.out = out.into();
        top.usize("checkpoint_every", 0, &mut c.checkpoint_every)?;
        top.f64("label_smoothing", 0.0, 1.0, &mut c.label_smoothing)?;

        if let Some(r) = top.sub("model")? {
            r.only(&["arch", "blocks", "widths", "block"], &[])?;
            r.string("arch", Some(&ARCHS), &mut c.model.arch)?;
            r.usize_list("blocks", &mut c.model.blocks)?;
            r.usize_list("widths", &mut c.model.widths)?;
            r.string("block", Some(&BLOCKS), &mut c.model.block)?;
        }
        if let Some(r) = top.sub("data")? {
            r.only(
                &[
                    "dir",
                    "batch_size",
                    "eval_batch_size",
                    "augment",
                    "train_limit",
                    "test_limit",
                    "image_size",
                    "workers",
                    "grayscale",
                    "mean",
                    "std",
                    "skip_bad_files",
                ],
                &[],
            )?;
            r.string("dir", None, &mut c.data.dir)?;
            r.usize("batch_size", 1, &mut c.data.batch_size)?;
            r.usize("eval_batch_size", 1, &mut c.data.eval_batch_size)?;
            r.bool("augment", &mut c.data.augment)?;
            r.usize("train_limit", 0, &mut c.data.train_limit)?;
            r.usize("test_limit", 0, &mut c.data.test_limit)?;
            r.usize("image_size", 0, &mut c.data.image_size)?;
            r.usize("workers", 0, &mut c.data.workers)?;
            r.bool("grayscale", &mut c.data.grayscale)?;
            r.f64_list("mean", -1e3, 1e3, &mut c.data.mean)?;
            r.f64_list("std", 1e-6, 1e3, &mut c.data.std)?;
            r.bool("skip_bad_files", &mut c.data.skip_bad_files)?;
        }
        if let Some(r) = top.sub("optimizer")? {
            r.only(
                &[
                    "name",
                    "lr",
                    "momentum",
                    "nesterov",
                    "weight_decay",
                    "betas",
                    "eps",
                ],
                &[],
            )?;
            r.string("name", Some(&OPTIMIZERS), &mut c.optimizer.name)?;
            r.f64("lr", f64::MIN_POSITIVE, 1e3, &mut c.optimizer.lr)?;
            r.f64("momentum", 0.0, 1.0, &mut c.optimizer.momentum)?;
            r.bool("nesterov", &mut c.optimizer.nesterov)?;
            r.f64("weight_decay", 0.0, 1.0, &mut c.optimizer.weight_decay)?;
            r.f64("eps", 0.0, 1.0, &mut c.optimizer.eps)?;
            if let Some(v) = r.table.get("betas") {
                let pair = v
                    .as_array()
                    .filter(|a| a.len() == 2)
                    .and_then(|a| Some((a[0].as_float()?, a[1].as_float()?)))
                    .filter(|(b1, b2)| (0.0..1.0).contains(b1) && (0.0..1.0).contains(b2));
                c.optimizer.betas = pair
                    .ok_or_else(|| r.err("betas", v, "two numbers in [0, 1), e.g. [0.9, 0.999]"))?;
            }
        }
        if let Some(r) = top.sub("schedule")? {
            r.only(&["kind", "warmup_fraction", "step_epochs", "gamma"], &[])?;
            r.string("kind", Some(&SCHEDULES), &mut c.schedule.kind)?;
            r.f64("warmup_fraction", 0.0, 1.0, &mut c.schedule.warmup_fraction)?;
            r.usize("step_epochs", 1, &mut c.schedule.step_epochs)?;
            r.f64("gamma", 0.0, 1.0, &mut c.schedule.gamma)?;
        }
        if let Some(r) = top.sub("amp")? {
            r.only(&["policy", "opt_level"], &[])?;
            let mut policy = String::new();
            r.string("policy", None, &mut policy)?;
            if !policy.is_empty() {
                c.amp.policy = Some(policy);
            }
            r.string(
                "opt_level",
                Some(&["O0", "O1", "O2", "O3"]),
                &mut c.amp.opt_level,
            )?;
        }
        c.validate(file)?;
        Ok(c)
    }

    /// Checks what no single key can: one width per stage, a parseable device, names in range.
    /// Flags that override a config call this again.
    pub fn validate(&self, file: &str) -> Result<()> {
        let err = |key: &str, value: String, allowed: &str| Error::Config {
            file: file.to_string(),
            key: key.into(),
            value,
            allowed: allowed.into(),
        };
        if self.model.widths.len() != self.model.blocks.len() {
            return Err(err(
                "model.widths",
                format!("{:?} for blocks {:?}", self.model.widths, self.model.blocks),
                "one width per stage (as many as model.blocks)",
            ));
        }
        parse_device(&self.device)
            .map_err(|_| err("device", self.device.clone(), "auto, cpu, cuda or cuda:N"))?;
        let checks: [(&str, &str, &[&str]); 5] = [
            ("optimizer.name", &self.optimizer.name, &OPTIMIZERS),
            ("schedule.kind", &self.schedule.kind, &SCHEDULES),
            ("model.block", &self.model.block, &BLOCKS),
            ("model.arch", &self.model.arch, &ARCHS),
            (
                "amp.opt_level",
                &self.amp.opt_level,
                &["O0", "O1", "O2", "O3"],
            ),
        ];
        for (key, v, allowed) in checks {
            if !allowed.contains(&v) {
                return Err(err(key, v.to_string(), &format!("one of {allowed:?}")));
            }
        }
        let positive = [
            ("epochs", self.epochs),
            ("data.batch_size", self.data.batch_size),
            ("data.eval_batch_size", self.data.eval_batch_size),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(err(key, "0".into(), "a positive integer"));
            }
        }
        if let Some(rest) = self.data.dir.split_once(':').filter(|(k, _)| {
            !k.is_empty() && !k.contains('/') && *k != "imagefolder" && *k != "cifar10"
        }) {
            return Err(err(
                "data.dir",
                self.data.dir.clone(),
                &format!(
                    "auto, bundled, a Fashion-MNIST directory, imagefolder:DIR or cifar10:DIR \
                     (`{}:` is not a kind of data)",
                    rest.0
                ),
            ));
        }
        if self.data.image_size > 4096 {
            return Err(err(
                "data.image_size",
                self.data.image_size.to_string(),
                "0 (224) or a side in 1..=4096",
            ));
        }
        if self.data.mean.len() != self.data.std.len() {
            return Err(err(
                "data.mean",
                format!("{:?} with std {:?}", self.data.mean, self.data.std),
                "as many values as data.std (one per channel, or both empty for ImageNet's)",
            ));
        }
        if !self.optimizer.lr.is_finite() || self.optimizer.lr <= 0.0 {
            return Err(err(
                "optimizer.lr",
                self.optimizer.lr.to_string(),
                "a positive number",
            ));
        }
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
        _ => Err(Error::invalid_arg(
            "train",
            "opt_level",
            s,
            "O0, O1, O2 or O3",
        )),
    }
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
            .ok_or_else(|| Error::invalid_arg("train", "device", s, "auto, cpu, cuda or cuda:N")),
    }
}
