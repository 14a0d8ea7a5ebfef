//! Learning-rate schedules: pure functions of the host step index. [`LrSchedule::apply`] sets
//! every group's lr on the host (the fused kernels read it from the group's device
//! hyperparameter block, so a captured step follows); a schedule costs one small write per group
//! whose lr changed and no sync.
//!
//! With several groups, the schedule's values are those of the *reference group* (the first
//! whose base lr is not 0, else the first) and every group keeps its ratio to it: group g gets
//! `lr_at(step) · base_g / base_ref`, PyTorch's `LambdaLR` with the factor
//! `lr_at(step) / base_ref`. A group whose base lr equals the reference's gets `lr_at(step)`
//! exactly, so one group (or groups of one base lr) behave as before groups existed.

use super::Optimizer;
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    /// `base·gamma^(step / step_size)` (torch StepLR).
    Step {
        base: f64,
        step_size: u64,
        gamma: f64,
    },
    /// Cosine from `base` to `min` over `total` steps (torch CosineAnnealingLR, then flat at `min`).
    Cosine { base: f64, min: f64, total: u64 },
    /// Linear from `base·start_factor` to `base` over `warmup` steps, then `base`.
    LinearWarmup {
        base: f64,
        start_factor: f64,
        warmup: u64,
    },
    /// GPT training's schedule (nanoGPT, llm.c): linear warm-up to `base` over `warmup` steps
    /// (`base·(step+1)/warmup`), then cosine down to `min` at `total`, then flat at `min`.
    WarmupCosine {
        base: f64,
        min: f64,
        warmup: u64,
        total: u64,
    },
    /// torch OneCycleLR (cosine annealing): from max/div_factor up to `max` over `pct_start` of
    /// `total`, then down to max/(div_factor·final_div_factor).
    OneCycle {
        max: f64,
        total: u64,
        pct_start: f64,
        div_factor: f64,
        final_div_factor: f64,
    },
}

fn cos_anneal(start: f64, end: f64, pct: f64) -> f64 {
    end + (start - end) / 2.0 * ((std::f64::consts::PI * pct).cos() + 1.0)
}

impl LrSchedule {
    /// torch's OneCycleLR defaults (pct_start 0.3, div_factor 25, final_div_factor 1e4).
    pub fn one_cycle(max: f64, total: u64) -> Self {
        LrSchedule::OneCycle {
            max,
            total,
            pct_start: 0.3,
            div_factor: 25.0,
            final_div_factor: 1e4,
        }
    }

    /// The learning rate at `step` (0-based).
    pub fn lr_at(&self, step: u64) -> Result<f64> {
        let lr = match *self {
            LrSchedule::Step {
                base,
                step_size,
                gamma,
            } => {
                if step_size == 0 {
                    return Err(Error::invalid_arg(
                        "LrSchedule::Step",
                        "step_size",
                        0,
                        "at least 1",
                    ));
                }
                base * gamma.powf((step / step_size) as f64)
            }
            LrSchedule::Cosine { base, min, total } => {
                if total == 0 {
                    return Err(Error::invalid_arg(
                        "LrSchedule::Cosine",
                        "total",
                        0,
                        "at least 1",
                    ));
                }
                cos_anneal(base, min, (step.min(total)) as f64 / total as f64)
            }
            LrSchedule::LinearWarmup {
                base,
                start_factor,
                warmup,
            } => {
                if step >= warmup {
                    base
                } else {
                    base * (start_factor + (1.0 - start_factor) * step as f64 / warmup as f64)
                }
            }
            LrSchedule::WarmupCosine {
                base,
                min,
                warmup,
                total,
            } => {
                if total == 0 || warmup > total {
                    return Err(Error::invalid_arg(
                        "LrSchedule::WarmupCosine",
                        "warmup, total",
                        format!("{warmup}, {total}"),
                        "total >= 1 and warmup <= total",
                    ));
                }
                if step < warmup {
                    base * (step + 1) as f64 / warmup as f64
                } else if total == warmup {
                    min
                } else {
                    let pct = (step.min(total) - warmup) as f64 / (total - warmup) as f64;
                    cos_anneal(base, min, pct)
                }
            }
            LrSchedule::OneCycle {
                max,
                total,
                pct_start,
                div_factor,
                final_div_factor,
            } => {
                if total < 2
                    || !(pct_start > 0.0 && pct_start < 1.0)
                    || div_factor <= 0.0
                    || final_div_factor <= 0.0
                {
                    return Err(Error::invalid_arg(
                        "LrSchedule::OneCycle",
                        "total, pct_start, div_factors",
                        format!("{total}, {pct_start}, {div_factor}, {final_div_factor}"),
                        "total >= 2, pct_start in (0, 1), factors > 0",
                    ));
                }
                let initial = max / div_factor;
                let min = initial / final_div_factor;
                // torch: phase ends at pct_start·total − 1 and total − 1.
                let up_end = pct_start * total as f64 - 1.0;
                let down_end = total as f64 - 1.0;
                let s = step.min(total - 1) as f64;
                if s <= up_end {
                    cos_anneal(initial, max, if up_end > 0.0 { s / up_end } else { 1.0 })
                } else {
                    cos_anneal(max, min, (s - up_end) / (down_end - up_end))
                }
            }
        };
        if !lr.is_finite() || lr < 0.0 {
            return Err(Error::invalid_arg(
                "LrSchedule",
                "lr",
                lr,
                "a finite lr >= 0 (check the schedule's values)",
            ));
        }
        Ok(lr)
    }

    /// Sets each group's lr for `step`: the schedule's value scaled by the group's base lr over
    /// the reference group's (see the module docs); returns the schedule's value.
    pub fn apply(&self, opt: &mut dyn Optimizer, step: u64) -> Result<f64> {
        let lr = self.lr_at(step)?;
        let bases = opt.base_lrs();
        let reference = bases
            .iter()
            .copied()
            .find(|&b| b != 0.0)
            .unwrap_or_default();
        for (g, &base) in bases.iter().enumerate() {
            let group_lr = if base == reference {
                lr
            } else {
                lr * (base / reference)
            };
            opt.set_lr(g, group_lr)?;
        }
        Ok(lr)
    }
}
