//! The end of an epoch and of the run: the divergence check, the evaluation, the metrics over
//! every rank, the record, the metrics files, plot and checkpoints (`end_epoch`, `record_epoch`,
//! `capture`); a stop on a signal or on divergence; and `finish`.

use std::time::Instant;

use super::{relative, Job, RunSummary, Step};
use crate::distributed::signals;
use crate::error::{fmt_number, Error, Result};
use crate::io::checkpoint::{Checkpoint, TrainProgress};
use crate::io::weights::save_weights;
use crate::train::metrics::EpochRecord;
use crate::train::model::{evaluate, Opt};
use crate::train::plot::plot_history;
use crate::train::resume::{checkpoint_path, epoch_name, PartialEpoch, PARTIAL_KEY};

impl Job {
    /// The end of epoch `epoch`: the divergence check, the evaluation, the metrics over every
    /// rank, the record, and (rank 0) the metrics files, the plot and the checkpoints.
    /// `[loss_sum, lr, seconds]` and `images` are this rank's, from `train_epoch`.
    pub(super) fn end_epoch(
        &mut self,
        step: &mut Step<'_>,
        epoch: usize,
        steps_done: u64,
        [loss_sum, lr, train_seconds]: [f64; 3],
        images: usize,
    ) -> Result<()> {
        let epoch_start = Instant::now() - std::time::Duration::from_secs_f64(train_seconds);
        if step.captures() {
            let st = step.stats();
            log::info!(
                "CUDA graph: {} eager step(s), {} capture(s), {} replayed step(s) so far",
                st.eager,
                st.captures,
                st.replays
            );
        }
        let scaler = step.optimizer().stats()?[0];
        if let Some(why) = self
            .watch
            .observe(steps_done, scaler.skipped_total, scaler.scale)
        {
            return Err(self.diverged(why, steps_done));
        }
        let train_loss = loss_sum / self.steps_per_epoch as f64;
        let local = evaluate(&self.model, &self.data.test, self.device, self.format)
            .map_err(|e| self.data.explain(e))?;
        // Every rank ran the same number of steps: the mean of the ranks' means.
        let sums = self
            .ranks
            .sum(&[local[0], local[1], local[2], train_loss])?;
        let (test_loss, test_accuracy) = (sums[0] / sums[2].max(1.0), sums[1] / sums[2].max(1.0));
        let train_loss = sums[3] / self.world as f64;
        let record = EpochRecord {
            epoch: epoch + 1,
            step: steps_done,
            train_loss,
            train_accuracy: None,
            test_loss,
            test_accuracy,
            lr,
            images_per_s: (images * self.world) as f64 / train_seconds,
            epoch_seconds: epoch_start.elapsed().as_secs_f64(),
            loss_scale: scaler.scale,
            skipped_steps: scaler.skipped_total.saturating_sub(self.skipped_before),
        };
        self.skipped_before = scaler.skipped_total;
        self.say(format!(
            "epoch {:>3}/{}  train loss {:.4}  test loss {:.4}  test accuracy {:.2}%  {:.0} images/s  lr {:.4}  loss scale {}  skipped {}  ({:.1} s)",
            record.epoch,
            self.cfg.epochs,
            record.train_loss,
            record.test_loss,
            100.0 * record.test_accuracy,
            record.images_per_s,
            record.lr,
            fmt_number(record.loss_scale),
            record.skipped_steps,
            record.epoch_seconds
        ));
        if self.main {
            let good = train_loss.is_finite() && test_loss.is_finite();
            self.record_epoch(step.optimizer(), &record, good)?;
        }
        Ok(())
    }

    /// Rank 0: appends `record` to the metrics, redraws the plot, and saves `last` (and the
    /// epoch's kept snapshot, every `checkpoint_every` epochs).
    fn record_epoch(&mut self, opt: &Opt, record: &EpochRecord, good: bool) -> Result<()> {
        let Some(metrics) = self.metrics.as_mut() else {
            return Ok(());
        };
        metrics.append(record)?;
        let device_label = match self.world {
            1 => self.device.to_string(),
            n => format!("{n} x {}", self.device),
        };
        plot_history(
            metrics.history(),
            &self.cfg.out.join("metrics.png"),
            &format!("train_resnet ({}, {device_label})", self.cfg.amp_label()),
        )?;
        let epoch = record.epoch;
        let ckpt = self.capture(opt, epoch, record.step, None)?;
        let last = checkpoint_path(&self.cfg.out, "last");
        ckpt.save(&last)?;
        // `last` now holds this epoch, good or not.
        self.last_good = self.last_good.take().filter(|(p, _)| *p != last);
        if good {
            self.last_good = Some((last.clone(), epoch));
        }
        let every = self.cfg.checkpoint_every;
        if every > 0 && epoch.is_multiple_of(every) {
            let kept = checkpoint_path(&self.cfg.out, &epoch_name(epoch));
            ckpt.save(&kept)?;
            if good {
                self.last_good = Some((kept.clone(), epoch));
            }
            self.written.push(relative(&self.cfg.out, &kept));
        }
        Ok(())
    }

    /// A checkpoint of the run after `epochs` complete epochs and `step` steps (and, inside an
    /// epoch, where in it).
    fn capture(
        &self,
        opt: &Opt,
        epochs: usize,
        step: u64,
        partial: Option<&PartialEpoch>,
    ) -> Result<Checkpoint> {
        let history = self.metrics.as_ref().map(|m| m.history()).unwrap_or(&[]);
        let mut extra = serde_json::json!({
            "config": &self.cfg,
            "history": history,
            "world_size": self.world,
        });
        if let Some(p) = partial {
            extra[PARTIAL_KEY] = serde_json::to_value(p).map_err(|e| {
                Error::config(
                    "checkpoint JSON",
                    PARTIAL_KEY,
                    e.to_string(),
                    "serialisable",
                )
            })?;
        }
        Checkpoint::capture(
            &*self.model,
            opt,
            TrainProgress {
                epoch: epochs,
                step,
                seed: self.cfg.seed,
            },
            extra,
        )
    }

    /// Every rank stopped after step `step`, inside epoch `epoch`: rank 0 saves `last` with
    /// where in the epoch the run is and every rank's running loss, and says how to continue.
    pub(super) fn stop_mid_epoch(
        &mut self,
        train_step: &mut Step<'_>,
        epoch: usize,
        step: u64,
        partial: &PartialEpoch,
        signal: i32,
    ) -> Result<()> {
        if !self.main {
            return Ok(());
        }
        let ckpt = self.capture(train_step.optimizer(), epoch, step, Some(partial))?;
        ckpt.save(&checkpoint_path(&self.cfg.out, "last"))?;
        self.say(self.resume_hint(
            signal,
            &format!(
                "after step {step} ({} of epoch {}'s {} steps)",
                partial.steps,
                epoch + 1,
                self.steps_per_epoch
            ),
        ));
        Ok(())
    }

    /// What a stopped run says: where it stopped, where its state is, how to continue.
    pub(super) fn resume_hint(&self, signal: i32, when: &str) -> String {
        format!(
            "stopped by {} {when}: saved {}; to continue, run the same command with \
             --resume auto (or --resume {})",
            signals::name(signal),
            checkpoint_path(&self.cfg.out, "last").display(),
            self.cfg.out.display()
        )
    }

    pub(super) fn diverged(&self, why: String, step: u64) -> Error {
        let advice = "lower the learning rate (--lr), or try --opt-level O1 or a bf16 policy \
                      (--policy configs/O2_bf16.toml) if f16 overflows";
        Error::Diverged {
            step,
            detail: match &self.last_good {
                Some((p, e)) => format!(
                    "{why}. The last checkpoint from before it: {} (epoch {e}); resume from it \
                     (--resume {}) and {advice}",
                    p.display(),
                    p.display()
                ),
                None => format!("{why}. No checkpoint from before it was kept; {advice}"),
            },
        }
    }

    /// The run's end: the final weights (rank 0) when this call trained to the end it was
    /// given, or when a resumed run finds its last epoch checkpointed but the weights never
    /// written (killed in between); none when a signal stopped it. The summary.
    pub(super) fn finish(
        mut self,
        first_epoch: usize,
        epochs_done: usize,
        stopped: Option<i32>,
    ) -> Result<RunSummary> {
        let out = self.cfg.out.clone();
        let last = checkpoint_path(&out, "last");
        let w = out.join("model.safetensors");
        let trained = epochs_done > first_epoch;
        let saved_last = self.main && (trained || stopped.is_some()) && last.is_file();
        if self.main && trained {
            self.written.push("metrics.png".into());
        }
        if saved_last {
            self.written.push(relative(&out, &last));
        }
        let weights = if !self.main || stopped.is_some() {
            None
        } else if trained {
            save_weights(&*self.model, &w)?;
            self.written.push("model.safetensors".into());
            Some(w)
        } else if first_epoch > 0 && !w.exists() {
            // A run killed after its last checkpoint and before its final weights: the resumed
            // model is that checkpoint's, so these are the weights the run would have written.
            self.say(
                "wrote model.safetensors, which the interrupted run had not, from the checkpoint",
            );
            save_weights(&*self.model, &w)?;
            self.written.push("model.safetensors".into());
            Some(w)
        } else {
            None
        };
        Ok(RunSummary {
            history: self
                .metrics
                .as_ref()
                .map(|m| m.history().to_vec())
                .unwrap_or_default(),
            out,
            last_checkpoint: saved_last.then_some(last),
            weights,
            written: self.written,
            device: self.device,
            data: self.data.source.clone(),
            seconds: self.started.elapsed().as_secs_f64(),
            world_size: self.world,
            rank: self.ranks.rank(),
            stopped,
        })
    }
}
