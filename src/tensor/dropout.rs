//! Dropout with a counter-based generator (`backend::dropout`'s rule): the generator's seed and
//! offset are a tensor on the device of the values, read and advanced there, so the CPU and the
//! GPU draw the same mask from the same state, a captured step draws a new mask on every replay,
//! and nothing is read on the host. The backward applies the forward's mask again (its saved
//! state), storing no mask. A checkpoint's recompute draws at the states its forward drew at
//! (`dropout_replay.rs`).

use super::{dropout_replay, Device, Shape, Tensor};
use crate::autograd::Op;
use crate::backend::DropoutParams;
use crate::base::error::{Error, Result};

/// A dropout generator: `[seed, offset]` (I64 holding u64 bits) on one device.
#[derive(Debug)]
pub struct DropoutGenerator {
    state: Tensor,
}

impl DropoutGenerator {
    pub fn new(seed: u64, device: Device) -> Result<DropoutGenerator> {
        let state =
            Tensor::from_vec(vec![seed as i64, 0i64], [2], Device::Cpu)?.to_device(device)?;
        Ok(DropoutGenerator { state })
    }

    /// The seed and the offset (values drawn so far): a host read of the state.
    pub fn state(&self) -> Result<(u64, u64)> {
        let v = self.state.to_vec::<i64>()?;
        Ok((v[0] as u64, v[1] as u64))
    }

    /// The state as a tensor (for checkpoints; `set_state` restores it in place).
    pub fn state_tensor(&self) -> &Tensor {
        &self.state
    }

    pub fn device(&self) -> Device {
        self.state.device()
    }
}

impl Tensor {
    /// Zeroes each value with probability `p` and scales the rest by `1/(1 − p)` (PyTorch's
    /// `F.dropout` in training), drawing from `gen`; the identity when `p` is 0.
    pub fn dropout(&self, p: f64, gen: &DropoutGenerator) -> Result<Tensor> {
        let op = "dropout";
        self.float_only(op)?;
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid_arg(op, "p", p, "a probability in [0, 1]"));
        }
        if self.device() != gen.device() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: self.device(),
                rhs: gen.device(),
            });
        }
        if p == 0.0 {
            return Ok(self.clone());
        }
        let dp = DropoutParams {
            n: self.elem_count(),
            p,
        };
        // Row-major values: value i of the draw is logical element i on every device.
        let x = self.contiguous()?;
        // A checkpoint's recompute draws at the state its forward drew at, leaving `gen` alone.
        let (y, saved) = match dropout_replay::next_state(&dp, self.device())? {
            Some(at) => x
                .storage()
                .dropout(&x.layout(), &mut at.storage_mut(), &dp)?,
            None => x
                .storage()
                .dropout(&x.layout(), &mut gen.state.storage_mut(), &dp)?,
        };
        let saved = Tensor::from_storage(saved, Shape::new(vec![2]));
        dropout_replay::note(&saved, &dp);
        Ok(Tensor::from_op(y, self.shape().clone(), &[self], || {
            Op::Dropout {
                state: saved,
                p: dp,
            }
        }))
    }

    /// The backward: the output's gradient (`self`) through the forward's mask.
    pub(crate) fn dropout_backward(&self, state: &Tensor, p: &DropoutParams) -> Result<Tensor> {
        let g = self.contiguous()?;
        let s = g
            .storage()
            .dropout_backward(&g.layout(), &state.storage(), p)?;
        Ok(Tensor::from_storage(s, self.shape().clone()))
    }
}
