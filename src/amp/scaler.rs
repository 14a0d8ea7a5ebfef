//! The loss scaler: dynamic (apex's rule) or static, with its state on the device.
//!
//! The state is four F32 0-d tensors on the model's device: `scale`, `found_inf` (non-zero when
//! a gradient since the last update held an Inf or NaN), `unskipped` (clean steps since the
//! last change of scale) and `skipped_total`. A step reads none of them on the host: the
//! overflow check writes `found_inf`, the optimizer step reads it and `1/scale` as tensors, and
//! the update rewrites the state. [`LossScaler::stats`] reads them when asked, and the log line
//! of every `report_interval` updates (when the log shows it) is the only read the scaler makes
//! on its own. The host-side part of an update (the step count, the report) is a replay hook
//! inside a CUDA-graph capture, so a replayed step counts as an eager one does.

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Tensor};

use super::policy::{LossScale, Policy, Properties};
use super::{autocast, fused};
use crate::multi_tensor::{ScaleRule, ScalerDeviceState};

/// The scaler state read to the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerStats {
    pub loss_id: usize,
    /// The current loss scale.
    pub scale: f64,
    /// Clean steps since the scale last changed (apex's `_unskipped`).
    pub unskipped: u64,
    /// Steps skipped for overflow since the scaler was made (or restored).
    pub skipped_total: u64,
    /// Updates (optimizer steps) since the scaler was made; host-side, never a device read.
    pub steps: u64,
}

/// The part of a scaler saved with a checkpoint (apex's `loss_scaler{i}` entries).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerState {
    pub loss_scale: f64,
    pub unskipped: u64,
    pub skipped_total: u64,
}

#[derive(Debug)]
pub struct LossScaler {
    rule: ScaleRule,
    found_inf: Tensor,
    /// The device state's other three tensors and the host-side counters, shared with the
    /// replay hooks of captured steps.
    host: Arc<HostSide>,
}

/// What an update does on the host after its kernel, in eager steps and in replays alike.
#[derive(Debug)]
struct HostSide {
    loss_id: usize,
    dynamic: bool,
    report_interval: u64,
    verbosity: u8,
    scale: Tensor,
    unskipped: Tensor,
    skipped_total: Tensor,
    /// Updates so far, and skipped_total at the last report.
    counters: Mutex<(u64, u64)>,
}

impl HostSide {
    fn counters(&self) -> std::sync::MutexGuard<'_, (u64, u64)> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stats(&self) -> Result<ScalerStats> {
        Ok(ScalerStats {
            loss_id: self.loss_id,
            scale: self.scale.item()?,
            unskipped: self.unskipped.item()? as u64,
            skipped_total: self.skipped_total.item()? as u64,
            steps: self.counters().0,
        })
    }

    /// One update done: the count, and a report line every `report_interval` updates when the
    /// log would show it (a static scale has nothing to report; the report costs a host read).
    fn after_update(&self) -> Result<()> {
        let steps = {
            let mut c = self.counters();
            c.0 += 1;
            c.0
        };
        let due = self.dynamic
            && self.verbosity > 0
            && self.report_interval > 0
            && steps % self.report_interval == 0;
        if !due || !log::log_enabled!(log::Level::Info) {
            return Ok(());
        }
        let s = self.stats()?;
        let skipped = {
            let mut c = self.counters();
            let d = s.skipped_total.saturating_sub(c.1);
            c.1 = s.skipped_total;
            d
        };
        // Skipped steps are news (apex prints each one); a quiet interval is debug detail.
        let level = if skipped > 0 {
            log::Level::Info
        } else {
            log::Level::Debug
        };
        log::log!(
            level,
            "amp: loss scaler {}: step {}, scale {}, {} step(s) skipped in the last {} ({} in all)",
            self.loss_id,
            s.steps,
            s.scale,
            skipped,
            self.report_interval,
            s.skipped_total
        );
        Ok(())
    }
}

impl LossScaler {
    /// The scaler of loss `loss_id` under `policy` (resolved as `props`), state on `device`.
    pub fn new(
        loss_id: usize,
        policy: &Policy,
        props: &Properties,
        device: Device,
    ) -> Result<LossScaler> {
        let (dynamic, init) = match props.loss_scale {
            LossScale::Dynamic => (true, policy.init_scale.min(policy.max_loss_scale)),
            LossScale::Static(v) => (false, v),
        };
        let zero = || Tensor::scalar(0.0, DType::F32, device);
        let scale = Tensor::scalar(init, DType::F32, device)?;
        // Anomaly reports give the scale of the scaler last made or used.
        crate::tensor::anomaly_check::set_loss_scale(&scale);
        Ok(LossScaler {
            rule: ScaleRule {
                growth: policy.growth_factor,
                backoff: policy.backoff_factor,
                window: policy.scale_window,
                // No floor is the smallest positive f32; a static scale lies within [min, max].
                min: policy
                    .min_loss_scale
                    .unwrap_or(f32::MIN_POSITIVE as f64)
                    .min(init),
                max: policy.max_loss_scale.max(init),
            },
            found_inf: zero()?,
            host: Arc::new(HostSide {
                loss_id,
                dynamic,
                report_interval: policy.report_interval,
                verbosity: policy.verbosity,
                scale,
                unskipped: zero()?,
                skipped_total: zero()?,
                counters: Mutex::new((0, 0)),
            }),
        })
    }

    pub fn loss_id(&self) -> usize {
        self.host.loss_id
    }

    pub fn is_dynamic(&self) -> bool {
        self.host.dynamic
    }

    /// The device scale (F32 0-d); reading it is a host synchronisation.
    pub fn scale_tensor(&self) -> &Tensor {
        &self.host.scale
    }

    /// The device overflow flag (F32 0-d, non-zero after an overflow since the last update).
    pub fn found_inf(&self) -> &Tensor {
        &self.found_inf
    }

    /// `loss · scale` in FP32 (F64 stays F64), recorded so that backward yields scaled
    /// gradients. Drops autocast's cast cache, as apex does when a loss is scaled.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        autocast::clear_cache();
        if crate::anomaly::is_enabled() {
            crate::tensor::anomaly_check::set_loss_scale(&self.host.scale);
        }
        let _s = autocast::suspend();
        if loss.elem_count() != 1 {
            return Err(Error::invalid_shape(
                "amp::scale_loss",
                loss.shape(),
                "the loss must be a single value",
            ));
        }
        let loss = if loss.dtype().is_half() {
            loss.to_dtype(DType::F32)?
        } else {
            loss.clone()
        };
        loss.mul(&self.host.scale)
    }

    /// `1/scale` as an F32 0-d tensor (exact for the powers of two a dynamic scaler holds).
    pub fn inv_scale(&self) -> Result<Tensor> {
        let _g = crate::no_grad();
        let s = &self.host.scale;
        Tensor::scalar(1.0, DType::F32, s.device())?.div(s)
    }

    /// Sets `found_inf` when any of `grads` holds an Inf or NaN (one multi-tensor launch, no host
    /// read).
    pub fn check(&self, grads: &[Tensor]) -> Result<()> {
        fused::non_finite_check(grads, &self.found_inf)
    }

    /// The end of a step: apex's rule on the device state (resets `found_inf`), then the host
    /// side (the step count, a report line every `report_interval` updates) now, or at every
    /// replay when this runs inside a CUDA-graph capture.
    pub fn update(&mut self) -> Result<()> {
        let h = &self.host;
        let state = ScalerDeviceState {
            scale: &h.scale,
            found_inf: &self.found_inf,
            unskipped: &h.unskipped,
            skipped_total: &h.skipped_total,
        };
        fused::update_scale(state, h.dynamic, self.rule)?;
        let host = self.host.clone();
        if crate::graph::on_replay(move || host.after_update()) {
            return Ok(());
        }
        self.host.after_update()
    }

    /// Reads the state to the host (a synchronisation: call it when you log, not every step).
    pub fn stats(&self) -> Result<ScalerStats> {
        self.host.stats()
    }

    /// The state a checkpoint saves.
    pub fn state(&self) -> Result<ScalerState> {
        let s = self.stats()?;
        Ok(ScalerState {
            loss_scale: s.scale,
            unskipped: s.unskipped,
            skipped_total: s.skipped_total,
        })
    }

    /// Restores a saved state (the overflow flag is cleared).
    pub fn load_state(&mut self, st: &ScalerState) -> Result<()> {
        if !(st.loss_scale.is_finite() && st.loss_scale > 0.0) {
            return Err(Error::invalid_arg(
                "LossScaler::load_state",
                "loss_scale",
                st.loss_scale,
                "a finite scale > 0",
            ));
        }
        let h = &self.host;
        let dev = h.scale.device();
        // In place: the tensors keep their addresses (captured steps read them).
        let set = |t: &Tensor, v: f64| t.copy_in_place(&Tensor::scalar(v, DType::F32, dev)?);
        set(&h.scale, st.loss_scale)?;
        set(&h.unskipped, st.unskipped as f64)?;
        set(&h.skipped_total, st.skipped_total as f64)?;
        set(&self.found_inf, 0.0)?;
        h.counters().1 = st.skipped_total;
        Ok(())
    }
}
