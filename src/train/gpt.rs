//! The GPT job behind `examples/train_gpt.rs`: a GPT (`nn::Gpt`) trained on token shards of a
//! text corpus under an AMP policy, with fused AdamW in two parameter groups, a warm-up + cosine
//! schedule, clipping, gradient accumulation, the step captured into a CUDA graph, evaluation of
//! the val loss with a sample of generated text, metrics and a plot, checkpoints with exact
//! resume, and the final weights in Hugging Face's GPT-2 layout.
//!
//! Between two evaluations lies one *round* (`eval_every` steps): the progress display, the
//! metrics files (`metrics.csv`/`.jsonl`, one row per round: `epoch` is the round, `images_per_s`
//! counts tokens, the accuracies are empty) and `checkpoints/last` follow rounds. `run_gpt`
//! sets the run up; the rounds themselves are in `gpt/rounds.rs`, a child module.
//!
//! Under a launcher (`train_gpt --nproc-per-node N`, `torchrun`, `srun`) each process is one
//! rank (see `train::distributed`): it trains on its device, joins the process group and wraps
//! the model in `DistributedDataParallel` (gradients averaged in buckets during backward, inside
//! the captured step too; with gradient accumulation only a step's last micro-batch averages,
//! the others run under `no_sync`). Each rank reads its own batches of the token stream
//! (`batch_size` is per rank, so a step trains on `world_size` times the tokens); rank 0 alone
//! locks the run directory, prints, writes metrics, samples text and checkpoints. The train and
//! val losses are the means over the ranks (each evaluates `eval_batches` of its own share of
//! the val split), tokens/s counts every rank's tokens. A checkpoint resumes at the world size
//! that wrote it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::distributed::Ranks;
mod rounds;

use super::metrics::{EpochRecord, MetricsWriter};
use super::progress::ProgressMode;
use super::run_dir::{RunDir, Use};
use crate::amp::{self, AmpModel, AmpOptimizer, OptLevel, Policy};
use crate::data::token_corpus::bundled_corpus_dir;
use crate::data::{
    prepare_token_shards, CorpusOptions, Gpt2Tokenizer, TokenLoader, TokenLoaderConfig,
    TokenLoaderState, TokenSplit,
};
use crate::distributed::{DdpConfig, DistributedDataParallel, NoSyncGuard, ProcessGroup, ZeroAdam};
use crate::error::{Error, Result};
use crate::io::checkpoint::Checkpoint;
use crate::nn::{Gpt, GptConfig, Module, StateDict};
use crate::optim::{AdamConfig, FusedAdam, LrSchedule, Optimizer, ParamGroups};
use crate::tensor::{DType, Device, Tensor};
use rounds::{Job, Latest};

/// The job's settings (flags and TOML keys by the same names). `None` means "chosen for the
/// device": the GPU recipe or the CPU one.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GptRunConfig {
    /// A size from `nn::GPT_SIZES` (GPU: `small`, CPU: `tiny`).
    pub model: Option<String>,
    /// Tokens per sequence (GPU: the model's context, CPU: 64).
    pub context: Option<usize>,
    /// A folder of `.txt` (or `.txt.gz`) files; the bundled Shakespeare by default.
    pub data: Option<PathBuf>,
    /// `O0`..`O3` (GPU: O2, CPU: O0).
    pub opt_level: Option<String>,
    /// The half type: `bf16` (default) or `f16` (with dynamic loss scaling).
    pub half: Option<String>,
    /// Sequences per micro-batch (GPU: 64, CPU: 8).
    pub batch_size: Option<usize>,
    /// Micro-batches per optimizer step (1).
    pub grad_accum: Option<usize>,
    /// Optimizer steps (GPU: 600, CPU: 300).
    pub steps: Option<u64>,
    /// Peak learning rate (GPU: 1e-3, CPU: 3e-3).
    pub lr: Option<f64>,
    /// The schedule's floor (lr / 10).
    pub min_lr: Option<f64>,
    /// Warm-up steps (steps / 20).
    pub warmup: Option<u64>,
    /// AdamW's decay on matrices (biases, norms and embeddings get none): 0.1.
    pub weight_decay: Option<f64>,
    /// Gradient clipping norm (1.0; 0 turns it off).
    pub clip: Option<f64>,
    /// Dropout (GPU: 0.2, CPU: 0).
    pub dropout: Option<f64>,
    /// Steps between evaluations (steps / 5).
    pub eval_every: Option<u64>,
    /// Val batches per evaluation (GPU: 20, CPU: 5).
    pub eval_batches: Option<usize>,
    /// Tokens sampled at each evaluation (GPU: 100, CPU: 60).
    pub sample_tokens: Option<usize>,
    /// The sample's prompt.
    pub prompt: Option<String>,
    pub temperature: Option<f64>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    /// Capture the step into a CUDA graph (GPU: true).
    pub captured: Option<bool>,
    /// Checkpoint every transformer block: keep only each block's input for backward and
    /// recompute the block there (false). Same gradients, less memory, about a third more time.
    pub checkpoint_activations: Option<bool>,
    /// Under several processes, shard the optimizer's state and FP32 masters over the ranks
    /// (ZeRO-2: `distributed::ZeroAdam`, gradients reduce-scattered instead of DDP's all-reduce)
    /// (false). Runs the step eagerly.
    pub zero: Option<bool>,
}

/// [`GptRunConfig`] with every choice made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptRecipe {
    pub model: String,
    pub gpt: GptConfigRecord,
    pub data: PathBuf,
    pub opt_level: String,
    pub half: String,
    pub batch_size: usize,
    pub context: usize,
    pub grad_accum: usize,
    pub steps: u64,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: u64,
    pub weight_decay: f64,
    pub clip: f64,
    pub eval_every: u64,
    pub eval_batches: usize,
    pub sample_tokens: usize,
    pub prompt: String,
    pub temperature: f64,
    pub top_k: usize,
    pub seed: u64,
    pub captured: bool,
    /// Recipes written before the key existed had none.
    #[serde(default)]
    pub checkpoint_activations: bool,
    #[serde(default)]
    pub zero: bool,
}

/// The model's sizes as the checkpoint records them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptConfigRecord {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub block_size: usize,
    pub vocab_size: usize,
    pub dropout: f64,
}

impl From<GptConfig> for GptConfigRecord {
    fn from(c: GptConfig) -> Self {
        GptConfigRecord {
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_embd: c.n_embd,
            block_size: c.block_size,
            vocab_size: c.vocab_size,
            dropout: c.dropout,
        }
    }
}

impl From<GptConfigRecord> for GptConfig {
    fn from(c: GptConfigRecord) -> Self {
        GptConfig {
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_embd: c.n_embd,
            block_size: c.block_size,
            vocab_size: c.vocab_size,
            dropout: c.dropout,
        }
    }
}

fn positive<T: PartialOrd + Default + std::fmt::Display>(key: &'static str, v: T) -> Result<T> {
    if v > T::default() {
        Ok(v)
    } else {
        Err(Error::invalid_arg("train_gpt", key, v, "a value > 0"))
    }
}

fn opt_level_of(s: &str) -> Result<OptLevel> {
    OptLevel::parse(s)
        .ok_or_else(|| Error::invalid_arg("train_gpt", "opt_level", s, "O0, O1, O2 or O3"))
}

impl GptRunConfig {
    /// Every choice made for `device`, checked.
    pub fn resolve(&self, device: Device) -> Result<GptRecipe> {
        let gpu = device.is_cuda();
        let model = self
            .model
            .clone()
            .unwrap_or_else(|| if gpu { "small" } else { "tiny" }.into());
        let mut gpt = GptConfig::named(&model)?;
        gpt.dropout = self.dropout.unwrap_or(if gpu { 0.2 } else { 0.0 });
        // The CPU recipe reads short windows: the 50k-way classifier costs the same per token
        // whatever the context, and five minutes on 2 cores buys about 150k tokens.
        let context = positive(
            "context",
            self.context
                .unwrap_or(if gpu { gpt.block_size } else { 64 }),
        )?;
        gpt.block_size = gpt.block_size.max(context);
        let steps = positive("steps", self.steps.unwrap_or(if gpu { 600 } else { 300 }))?;
        let lr = positive("lr", self.lr.unwrap_or(if gpu { 1e-3 } else { 3e-3 }))?;
        let opt_level = self
            .opt_level
            .clone()
            .unwrap_or_else(|| if gpu { "O2" } else { "O0" }.into());
        opt_level_of(&opt_level)?;
        let half = self.half.clone().unwrap_or_else(|| "bf16".into());
        if half != "bf16" && half != "f16" {
            return Err(Error::invalid_arg("train_gpt", "half", half, "bf16 or f16"));
        }
        let r = GptRecipe {
            model,
            gpt: gpt.into(),
            data: self.data.clone().unwrap_or_else(bundled_corpus_dir),
            opt_level,
            half,
            batch_size: positive(
                "batch_size",
                self.batch_size.unwrap_or(if gpu { 64 } else { 8 }),
            )?,
            context,
            grad_accum: positive("grad_accum", self.grad_accum.unwrap_or(1))?,
            steps,
            lr,
            min_lr: self.min_lr.unwrap_or(lr / 10.0),
            warmup: self.warmup.unwrap_or(steps / 20),
            weight_decay: self.weight_decay.unwrap_or(0.1),
            clip: self.clip.unwrap_or(1.0),
            eval_every: positive("eval_every", self.eval_every.unwrap_or((steps / 5).max(1)))?,
            eval_batches: positive(
                "eval_batches",
                self.eval_batches.unwrap_or(if gpu { 20 } else { 5 }),
            )?,
            sample_tokens: self.sample_tokens.unwrap_or(if gpu { 100 } else { 60 }),
            prompt: self.prompt.clone().unwrap_or_else(|| "ROMEO:".into()),
            temperature: self.temperature.unwrap_or(0.8),
            top_k: self.top_k.unwrap_or(200),
            seed: self.seed.unwrap_or(1337),
            captured: self.captured.unwrap_or(gpu && self.zero != Some(true)),
            checkpoint_activations: self.checkpoint_activations.unwrap_or(false),
            zero: self.zero.unwrap_or(false),
        };
        if r.captured && r.zero {
            return Err(Error::invalid_arg(
                "train_gpt",
                "captured",
                "true with zero = true",
                "captured = false: the sharded optimizer's step is not captured yet",
            ));
        }
        if r.captured && !gpu {
            return Err(Error::invalid_arg(
                "train_gpt",
                "captured",
                true,
                "false on the CPU (CUDA graphs need a GPU)",
            ));
        }
        if !(r.min_lr >= 0.0 && r.min_lr <= r.lr) || r.warmup > r.steps {
            return Err(Error::invalid_arg(
                "train_gpt",
                "min_lr/warmup",
                format!("{}/{}", r.min_lr, r.warmup),
                "0 <= min_lr <= lr and warmup <= steps",
            ));
        }
        if !(r.weight_decay >= 0.0 && r.clip >= 0.0 && r.temperature >= 0.0) {
            return Err(Error::invalid_arg(
                "train_gpt",
                "weight_decay/clip/temperature",
                format!("{}/{}/{}", r.weight_decay, r.clip, r.temperature),
                "each >= 0",
            ));
        }
        Ok(r)
    }
}

impl GptRecipe {
    fn policy(&self) -> Result<Policy> {
        let p = Policy::opt_level(opt_level_of(&self.opt_level)?);
        Ok(if self.half == "bf16" {
            p.with_half_dtype(DType::BF16)
        } else {
            p
        })
    }

    pub(super) fn schedule(&self) -> LrSchedule {
        LrSchedule::WarmupCosine {
            base: self.lr,
            min: self.min_lr,
            warmup: self.warmup,
            total: self.steps,
        }
    }

    /// One rank's tokens per optimizer step.
    pub(super) fn tokens_per_step(&self) -> usize {
        self.batch_size * self.context * self.grad_accum
    }
}

/// How the job was asked to start.
#[derive(Clone, Debug)]
pub struct GptRunOptions {
    pub out: PathBuf,
    /// Under a launcher: this rank's device (`Ranks::device` chooses `cuda:LOCAL_RANK`).
    pub device: Device,
    /// Continue from this checkpoint (its recipe wins over `config`).
    pub resume: Option<PathBuf>,
    pub overwrite: bool,
    pub progress: ProgressMode,
    /// Stop (with a checkpoint) after this many steps in all, rounded up to an evaluation: the
    /// run can be continued with `resume` as if it had never stopped.
    pub stop_after: Option<u64>,
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct GptRunSummary {
    pub steps: u64,
    pub train_loss: f64,
    pub val_loss: f64,
    /// Every rank's tokens.
    pub tokens_per_s: f64,
    /// Rank 0's (empty on the other ranks).
    pub sample: String,
    /// Written by rank 0.
    pub weights: PathBuf,
    /// The processes that trained (1 without a launcher) and this one's rank.
    pub world_size: usize,
    pub rank: usize,
    /// This rank's trained model (its state dict: the ranks' are equal, which tests check).
    pub state: StateDict,
}

/// The checkpoint's free-form part.
#[derive(Serialize, Deserialize)]
pub(super) struct Extra {
    pub(super) recipe: GptRecipe,
    pub(super) train_loader: TokenLoaderState,
    pub(super) history: Vec<EpochRecord>,
    /// The processes that trained (the loader's position means that many ranks' batches).
    #[serde(default = "one")]
    pub(super) world_size: usize,
}

fn one() -> usize {
    1
}

/// AdamW in two groups by GPT-2's rule (`ParamGroups::weight_decay_split`): decay on the
/// matrices, none on biases, norms and the embeddings.
/// With `zero` (a group), the same groups in `ZeroAdam`, which also clips (by the global norm).
fn optimizer(
    model: &Gpt,
    r: &GptRecipe,
    zero: Option<&ProcessGroup>,
) -> Result<Box<dyn Optimizer>> {
    let groups = ParamGroups::weight_decay_split(model.named_parameters())?;
    let config = AdamConfig {
        lr: r.lr,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: r.weight_decay,
        adam_w_mode: true,
        ..Default::default()
    };
    Ok(match zero {
        Some(g) => {
            let mut z = ZeroAdam::new(g, groups.with_config(config))?;
            z.set_micro_batches(r.grad_accum)?;
            if r.clip > 0.0 {
                z.clip_grad_norm(Some(r.clip))?;
            }
            Box::new(z)
        }
        None => Box::new(FusedAdam::with_param_groups(&groups, config)?),
    })
}

/// The corpus tokenized into `out/tokens` (once: later runs reuse the shards). Rank 0's job.
fn prepare_shards(r: &GptRecipe, out: &Path) -> Result<()> {
    let shards = out.join("tokens");
    let (manifest, reused) = prepare_token_shards(&r.data, &shards, &CorpusOptions::default())?;
    println!(
        "data: {} ({} train / {} val tokens{})",
        r.data.display(),
        manifest.train_tokens,
        manifest.val_tokens,
        if reused { ", shards reused" } else { "" }
    );
    Ok(())
}

/// Rank `world.0` of `world.1`'s train and val loaders over the prepared shards.
fn loaders(r: &GptRecipe, out: &Path, world: (usize, usize)) -> Result<(TokenLoader, TokenLoader)> {
    let shards = out.join("tokens");
    let cfg = TokenLoaderConfig::new(r.batch_size, r.context).ranks(world.0, world.1);
    let train = TokenLoader::open(&shards, TokenSplit::Train, cfg.shuffle(r.seed))?;
    let val = TokenLoader::open(&shards, TokenSplit::Val, cfg)?;
    Ok((train, val))
}

/// The GPT wrapped for data parallelism (`run_gpt` under a launcher).
pub type GptDdp = DistributedDataParallel<Arc<AmpModel<Gpt>>>;

/// The body of the training step ([`amp::CapturedStep`]'s) for a step of `k` micro-batches: a
/// micro-batch's loss divided by `k` (the step's gradients are the mean over its micro-batches).
/// Through `ddp` when given, where all micro-batches of a step but the last run under
/// `no_sync`: the gradients add up locally, and only their totals are averaged over the ranks
/// (the step calls the body `k` times in order, as `CapturedStep` does).
pub fn step_body<'a>(
    model: &'a AmpModel<Gpt>,
    ddp: Option<&'a GptDdp>,
    k: usize,
) -> impl FnMut(&Tensor, &Tensor) -> Result<Tensor> + 'a {
    let mut micro = 0;
    let mut no_sync: Option<NoSyncGuard<'a>> = None;
    move |x: &Tensor, y: &Tensor| {
        let l = match ddp {
            Some(d) => {
                if micro + 1 < k {
                    no_sync.get_or_insert_with(|| d.no_sync());
                } else {
                    no_sync = None;
                }
                micro = (micro + 1) % k.max(1);
                d.forward_with(|m| m.scope(|g| g.loss(x, y)))?
            }
            None => model.scope(|m| m.loss(x, y))?,
        };
        if k <= 1 {
            Ok(l)
        } else {
            l.mul_scalar(1.0 / k as f64)
        }
    }
}

/// Prints on rank 0 only.
fn say(main: bool, line: String) {
    if main {
        println!("{line}");
    }
}

/// The checkpoint a run continues from, with its free-form part.
struct Resumed<'p> {
    path: &'p Path,
    ckpt: Checkpoint,
    extra: Extra,
}

/// The recipe to train by: the checkpoint's when resuming (written at this world size: the data
/// position is per rank), the config's otherwise.
fn recipe_and_resume<'p>(
    config: &GptRunConfig,
    opts: &'p GptRunOptions,
    world: usize,
) -> Result<(GptRecipe, Option<Resumed<'p>>)> {
    let Some(path) = opts.resume.as_deref() else {
        return Ok((config.resolve(opts.device)?, None));
    };
    let ckpt = Checkpoint::load(path)?;
    let extra: Extra = serde_json::from_value(ckpt.extra.clone()).map_err(|e| {
        Error::invalid_arg(
            "train_gpt",
            "resume",
            path.display(),
            format!("a train_gpt checkpoint ({e})"),
        )
    })?;
    if extra.world_size != world {
        return Err(Error::invalid_arg(
            "train_gpt",
            "resume",
            format!(
                "{} (written by {} process(es))",
                path.display(),
                extra.world_size
            ),
            format!(
                "a checkpoint of a run on {world} process(es), as this one: the data \
                 position is per rank (resume with --nproc-per-node {})",
                extra.world_size
            ),
        ));
    }
    Ok((extra.recipe.clone(), Some(Resumed { path, ckpt, extra })))
}

/// Joins the process group, then rank 0 locks the run directory and writes into it the config
/// and the token shards, which the others read once it is done. The lock (rank 0's) and the
/// run's root.
fn open_run(
    ranks: &mut Ranks,
    opts: &GptRunOptions,
    recipe: &GptRecipe,
    resumed: Option<&Resumed>,
) -> Result<(Option<RunDir>, PathBuf)> {
    // Every rank joins before rank 0 checks the run directory: a refusal there then ends the
    // others through the group rather than leaving them at the rendezvous.
    ranks.join(opts.device)?;
    let how = match resumed {
        Some(r) => Use::Resume {
            checkpoint: r.path,
            overwrite: opts.overwrite,
            corrupt: &[],
        },
        None => Use::Fresh {
            overwrite: opts.overwrite,
        },
    };
    let dir = match ranks.is_main() {
        true => Some(RunDir::open(&opts.out, how)?),
        false => None,
    };
    let out = dir
        .as_ref()
        .map_or_else(|| opts.out.clone(), |d| d.root().to_path_buf());
    if ranks.is_main() {
        crate::io::write_atomic(&out.join("config.json"), |w| {
            serde_json::to_writer_pretty(w, recipe)
                .map_err(|e| Error::invalid_arg("train_gpt", "config", e, "serialisable"))
        })?;
        prepare_shards(recipe, &out)?;
    }
    if let Some(g) = &ranks.group {
        g.barrier()?;
    }
    Ok((dir, out))
}

/// The job's optimizer under AMP: `FusedAdam`, or `ZeroAdam` with `zero`.
type GptOptimizer = AmpOptimizer<Box<dyn Optimizer>>;

/// The model and its AdamW under the recipe's AMP policy, clipping set; the model described on
/// rank 0.
/// With `zero` (the group), the optimizer is `ZeroAdam`, which clips itself.
fn build_model(
    recipe: &GptRecipe,
    dev: Device,
    ranks: &Ranks,
    zero: Option<&ProcessGroup>,
) -> Result<(Arc<AmpModel<Gpt>>, GptOptimizer)> {
    let (main, world) = (ranks.is_main(), ranks.world_size());
    let gcfg: GptConfig = recipe.gpt.into();
    let model = Gpt::new(gcfg, recipe.seed, &dev)?
        .with_activation_checkpointing(recipe.checkpoint_activations);
    let params = model.num_parameters();
    say(
        main,
        format!(
            "model: {} ({} layers, {} heads, width {}, context {}): {:.1}M parameters on {dev}; {}{}",
            recipe.model,
            gcfg.n_layer,
            gcfg.n_head,
            gcfg.n_embd,
            recipe.context,
            params as f64 / 1e6,
            recipe.opt_level,
            if recipe.opt_level == "O0" {
                String::new()
            } else {
                format!(" {}", recipe.half)
            }
        ),
    );
    if world > 1 {
        say(
            main,
            format!(
                "distributed: {world} processes ({:?} backend), {} tokens per step in all",
                crate::distributed::Backend::for_device(dev),
                super::progress::group_thousands((recipe.tokens_per_step() * world) as u64)
            ),
        );
    }
    let opt = optimizer(&model, recipe, zero)?;
    let (model, mut opt) = amp::initialize(model, opt, recipe.policy()?)?;
    if recipe.clip > 0.0 && zero.is_none() {
        opt.clip_grad_norm(Some(recipe.clip))?;
    }
    Ok((Arc::new(model), opt))
}

impl Resumed<'_> {
    /// The model, optimizer and train loader put back where the checkpoint left them; its
    /// metrics history and step.
    fn restore(
        &self,
        model: &AmpModel<Gpt>,
        opt: &mut GptOptimizer,
        train: &mut TokenLoader,
    ) -> Result<(Vec<EpochRecord>, u64)> {
        self.ckpt.restore(model, opt)?;
        train.set_state(self.extra.train_loader)?;
        Ok((self.extra.history.clone(), self.ckpt.progress.step))
    }
}

/// Runs (or continues) a GPT training job; under a launcher, as one rank of a data-parallel run
/// (see the module docs).
pub fn run_gpt(config: &GptRunConfig, opts: &GptRunOptions) -> Result<GptRunSummary> {
    let dev = opts.device;
    let mut ranks = Ranks::from_env()?;
    let (main, world, rank) = (ranks.is_main(), ranks.world_size(), ranks.rank());
    let (recipe, resumed) = recipe_and_resume(config, opts, world)?;
    let (dir, out) = open_run(&mut ranks, opts, &recipe, resumed.as_ref())?;
    let (mut train, mut val) = loaders(&recipe, &out, (rank, world))?;
    let zero = match (&ranks.group, recipe.zero) {
        (Some(g), true) => Some(g),
        _ => None,
    };
    let (model, mut opt) = build_model(&recipe, dev, &ranks, zero)?;
    let (history, mut step) = match &resumed {
        Some(r) => {
            let (history, step) = r.restore(&model, &mut opt, &mut train)?;
            say(main, format!("resumed at step {step} of {}", recipe.steps));
            (history, step)
        }
        None => (Vec::new(), 0),
    };
    let mut metrics = match (main, history.is_empty()) {
        (false, _) => None,
        (true, true) => Some(MetricsWriter::create(&out)?),
        (true, false) => Some(MetricsWriter::resume(&out, &history)?),
    };
    // After the restore: the wrap copies rank 0's model to the others (they restored the same).
    let ddp = match ranks.group.as_ref().filter(|_| zero.is_none()) {
        Some(g) => Some(DistributedDataParallel::new(
            model.clone(),
            g,
            DdpConfig::default(),
        )?),
        None => None,
    };
    let k = recipe.grad_accum;
    let body = step_body(&model, ddp.as_ref(), k);
    let mut stepper = if recipe.captured {
        amp::CapturedStep::new(&*model, &mut opt, body)?
    } else {
        amp::CapturedStep::eager(&*model, &mut opt, body)?
    }
    .micro_batches(k)?;
    let job = Job {
        recipe: &recipe,
        dev,
        ranks: &ranks,
        out: &out,
        model: &model,
        tok: Gpt2Tokenizer::new(),
        progress: if main {
            opts.progress
        } else {
            ProgressMode::Off
        },
    };
    let mut latest = Latest::new();
    let stop = opts.stop_after.unwrap_or(u64::MAX).min(recipe.steps);
    while step < stop {
        let trained = job.train_round(&mut stepper, &mut train, &mut step)?;
        job.evaluate_round(&mut val, &trained, &mut latest)?;
        if let Some(metrics) = metrics.as_mut() {
            job.report_round(&mut stepper, metrics, (&trained, step), &mut latest)?;
            job.save_last(&mut stepper, metrics, &train, (trained.round, step))?;
        } else if zero.is_some() {
            // Rank 0's checkpoint gathers the sharded state: a collective of every rank.
            stepper.optimizer().state_dict()?;
        }
    }
    drop(stepper);
    let summary = job.finish(step, latest);
    drop(dir);
    summary
}
