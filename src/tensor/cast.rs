//! dtype and device conversion.

use super::{DType, Device, Tensor};
use crate::autograd::Op;
use crate::error::Result;

impl Tensor {
    /// The values in `dtype`; the gradient flows back converted to this tensor's dtype.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        let s = self.storage().to_dtype(dtype)?;
        Ok(Tensor::from_op(s, self.shape().clone(), &[self], || {
            Op::ToDType { from: self.dtype() }
        }))
    }

    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.clone());
        }
        let s = self.storage().to_device(device)?;
        Ok(Tensor::from_op(s, self.shape().clone(), &[self], || {
            Op::ToDevice {
                from: self.device(),
            }
        }))
    }
}
