//! A GPT run's rounds (the steps between two evaluations, see `gpt`'s module docs): the
//! round's steps, the evaluation the ranks average, rank 0's report (text sample, printed line,
//! metrics row and plot) and `checkpoints/last`, and the summary at the end.

use std::path::Path;
use std::time::Instant;

use super::{Extra, GptRecipe, GptRunSummary};
use crate::amp::{self, AmpModel};
use crate::data::{Gpt2Tokenizer, TokenLoader};
use crate::error::{Error, Result};
use crate::io::checkpoint::{Checkpoint, TrainProgress};
use crate::nn::{generate, Gpt, GptConfig, Module, SampleConfig, GPT2_VOCAB};
use crate::optim::Optimizer;
use crate::tensor::{DType, Device, Tensor};
use crate::train::distributed::Ranks;
use crate::train::metrics::{EpochRecord, MetricsWriter};
use crate::train::plot::plot_history;
use crate::train::progress::{EpochProgress, ProgressMode};
use crate::train::run_dir::CHECKPOINT_DIR;

/// The GPT's training step: the captured (or eager) AMP step over the step body.
pub(super) type GptStep<'a> = amp::CapturedStep<'a, Box<dyn Optimizer>>;

/// What the rounds share, set up once.
pub(super) struct Job<'a> {
    pub(super) recipe: &'a GptRecipe,
    pub(super) dev: Device,
    pub(super) ranks: &'a Ranks,
    pub(super) out: &'a Path,
    pub(super) model: &'a AmpModel<Gpt>,
    pub(super) tok: Gpt2Tokenizer,
    /// Rank 0's display mode (the other ranks show none).
    pub(super) progress: ProgressMode,
}

/// One round's training.
pub(super) struct RoundTrained {
    pub(super) round: usize,
    /// The mean of its steps' losses on this rank.
    loss: f64,
    /// Its last step's learning rate.
    lr: f64,
    secs: f64,
    /// Every rank's tokens per second.
    tokens_per_s: f64,
}

/// What the rounds leave for the summary, and the skipped-step count the next metrics row
/// starts from.
pub(super) struct Latest {
    train: f64,
    val: f64,
    tokens_per_s: f64,
    sample: String,
    skipped_before: u64,
}

impl Latest {
    /// Before the first round: no losses, no rate, no sample.
    pub(super) fn new() -> Latest {
        Latest {
            train: f64::NAN,
            val: f64::NAN,
            tokens_per_s: f64::NAN,
            sample: String::new(),
            skipped_before: 0,
        }
    }
}

impl Job<'_> {
    fn tokens_per_step(&self) -> usize {
        self.recipe.tokens_per_step() * self.ranks.world_size()
    }

    /// The steps from `step` to the end of its round (or of the run).
    pub(super) fn train_round(
        &self,
        stepper: &mut GptStep<'_>,
        train: &mut TokenLoader,
        step: &mut u64,
    ) -> Result<RoundTrained> {
        let r = self.recipe;
        let round = (*step / r.eval_every) as usize + 1;
        let rounds = r.steps.div_ceil(r.eval_every) as usize;
        let round_end = (round as u64 * r.eval_every).min(r.steps);
        let steps_in_round = round_end - *step;
        let mut bar =
            EpochProgress::new(round, rounds, steps_in_round, self.progress).with_unit("tokens");
        let schedule = r.schedule();
        let started = Instant::now();
        let mut loss_sum: Option<Tensor> = None;
        let mut lr = 0.0;
        while *step < round_end {
            lr = schedule.apply(stepper.optimizer().inner_mut(), *step)?;
            let batches = (0..r.grad_accum)
                .map(|_| train.next_batch(self.dev))
                .collect::<Result<Vec<_>>>()?;
            let loss = stepper.run_accumulated(&batches)?;
            // Summed on the device: the loss is read once per round, not per step.
            let l = loss.detach().to_dtype(DType::F32)?;
            loss_sum = Some(match loss_sum {
                Some(s) => s.add(&l)?,
                None => l.clone(),
            });
            *step += 1;
            bar.tick(self.tokens_per_step());
        }
        let loss = match loss_sum {
            Some(s) => s.item()? / steps_in_round as f64,
            None => f64::NAN,
        };
        let secs = started.elapsed().as_secs_f64();
        let tokens_per_s = (self.tokens_per_step() as u64 * steps_in_round) as f64 / secs;
        bar.finish();
        Ok(RoundTrained {
            round,
            loss,
            lr,
            secs,
            tokens_per_s,
        })
    }

    /// The val loss after a round; with the round's train loss, the means over the ranks (every
    /// rank ran the same steps and evaluates as many batches).
    pub(super) fn evaluate_round(
        &self,
        val: &mut TokenLoader,
        trained: &RoundTrained,
        latest: &mut Latest,
    ) -> Result<()> {
        let val_loss = |x: &Tensor, y: &Tensor| self.model.scope(|m| m.loss(x, y));
        let local_val = evaluate(
            self.model,
            val_loss,
            val,
            self.recipe.eval_batches,
            self.dev,
        )?;
        let sums = self.ranks.sum(&[trained.loss, local_val])?;
        let world = self.ranks.world_size() as f64;
        latest.train = sums[0] / world;
        latest.val = sums[1] / world;
        latest.tokens_per_s = trained.tokens_per_s;
        Ok(())
    }

    /// Rank 0's report of a round: a text sample, the printed line, the metrics row and plot.
    pub(super) fn report_round(
        &self,
        stepper: &mut GptStep<'_>,
        metrics: &mut MetricsWriter,
        (trained, step): (&RoundTrained, u64),
        latest: &mut Latest,
    ) -> Result<()> {
        let r = self.recipe;
        latest.sample = sample(self.model, r, self.dev, &self.tok, r.seed ^ step)?;
        let stats = stepper.optimizer().stats()?;
        let skipped_total: u64 = stats.iter().map(|s| s.skipped_total).sum();
        let scale = stats.first().map_or(1.0, |s| s.scale);
        let flops_per_token = GptConfig::from(r.gpt).train_flops_per_token(r.context);
        let mfu = peak_flops(self.dev)
            // Per GPU: the rate counts every rank's tokens.
            .map(|p| {
                let util =
                    flops_per_token * latest.tokens_per_s / (p * self.ranks.world_size() as f64);
                format!(", MFU {:.0}%", 100.0 * util)
            })
            .unwrap_or_default();
        println!(
            "step {step}/{}: train loss {:.4}, val loss {:.4}, lr {:.2e}, {} tokens/s{mfu}, loss scale {scale}",
            r.steps,
            latest.train,
            latest.val,
            trained.lr,
            crate::train::progress::group_thousands(latest.tokens_per_s.round() as u64)
        );
        println!("sample: {}\n", latest.sample);
        metrics.append(&EpochRecord {
            epoch: trained.round,
            step,
            train_loss: latest.train,
            train_accuracy: None,
            test_loss: latest.val,
            test_accuracy: f64::NAN,
            lr: trained.lr,
            images_per_s: latest.tokens_per_s,
            epoch_seconds: trained.secs,
            loss_scale: scale,
            skipped_steps: skipped_total - latest.skipped_before,
        })?;
        latest.skipped_before = skipped_total;
        plot_history(
            metrics.history(),
            &self.out.join("metrics.png"),
            &format!("train_gpt {}", r.model),
        )
    }

    /// Rank 0's `checkpoints/last` after a round: the state to continue exactly from.
    pub(super) fn save_last(
        &self,
        stepper: &mut GptStep<'_>,
        metrics: &MetricsWriter,
        train: &TokenLoader,
        (round, step): (usize, u64),
    ) -> Result<()> {
        let extra = Extra {
            recipe: self.recipe.clone(),
            train_loader: train.state(),
            history: metrics.history().to_vec(),
            world_size: self.ranks.world_size(),
        };
        let extra = serde_json::to_value(&extra)
            .map_err(|e| Error::invalid_arg("train_gpt", "checkpoint", e, "serialisable"))?;
        let progress = TrainProgress {
            epoch: round,
            step,
            seed: self.recipe.seed,
        };
        Checkpoint::capture(self.model, stepper.optimizer(), progress, extra)?
            .save(&self.out.join(CHECKPOINT_DIR).join("last.safetensors"))
    }

    /// The trained weights in GPT-2's layout (rank 0 writes them) and the run's summary.
    pub(super) fn finish(&self, step: u64, latest: Latest) -> Result<GptRunSummary> {
        let weights = self.out.join("model.safetensors");
        let state = self.model.state_dict()?;
        if self.ranks.is_main() {
            crate::io::hf_gpt2::save_hf_gpt2(&weights, &state, GPT2_VOCAB)?;
        }
        Ok(GptRunSummary {
            steps: step,
            train_loss: latest.train,
            val_loss: latest.val,
            tokens_per_s: latest.tokens_per_s,
            sample: latest.sample,
            weights,
            world_size: self.ranks.world_size(),
            rank: self.ranks.rank(),
            state,
        })
    }
}

/// The mean loss over `n` val batches (from the start of the val split each time).
fn evaluate<M: Module>(
    model: &AmpModel<M>,
    loss: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    val: &mut TokenLoader,
    n: usize,
    dev: Device,
) -> Result<f64> {
    let _g = crate::no_grad();
    let was = model.is_training();
    model.set_training(false);
    val.reset();
    let mut total = 0.0;
    let mut count = 0;
    let out = (|| {
        for _ in 0..n.min(val.batches_per_epoch().max(1)) {
            let (x, y) = val.next_batch(dev)?;
            total += loss(&x, &y)?.item()?;
            count += 1;
        }
        Ok(total / count.max(1) as f64)
    })();
    model.set_training(was);
    out
}

fn sample<M: Module>(
    model: &AmpModel<M>,
    r: &GptRecipe,
    dev: Device,
    tok: &Gpt2Tokenizer,
    seed: u64,
) -> Result<String> {
    let prompt = tok.encode(&r.prompt);
    let prompt = if prompt.is_empty() {
        vec![50256]
    } else {
        prompt
    };
    let ids = generate(
        model,
        dev,
        &prompt,
        &SampleConfig {
            max_new_tokens: r.sample_tokens,
            temperature: r.temperature,
            top_k: (r.top_k > 0).then_some(r.top_k),
            seed,
            vocab: GPT2_VOCAB,
            context: r.context,
        },
    )?;
    tok.decode(&ids)
}

/// The peak dense half-precision tensor-core rate of the device, for model-flops utilisation.
fn peak_flops(dev: Device) -> Option<f64> {
    let Device::Cuda(i) = dev else { return None };
    let (major, _) = crate::backend::cuda::device(i).ok()?.compute_capability();
    match major {
        9 => Some(989e12),
        8 => Some(312e12),
        _ => None,
    }
}
