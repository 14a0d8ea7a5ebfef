//! dtype and device conversion.

use super::{DType, Device, Tensor};
use crate::autograd::Op;
use crate::base::error::Result;

impl Tensor {
    /// The values in `dtype`; the gradient flows back converted to this tensor's dtype.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        let x = self.dense()?;
        let s = x.storage().to_dtype(&x.layout(), dtype)?;
        Ok(Tensor::from_op(s, x.layout().dense_like(), &[self], || {
            Op::ToDType { from: self.dtype() }
        }))
    }

    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.clone());
        }
        // Whole buffers move: a dense tensor over exactly its buffer keeps its strides.
        let l = self.layout();
        let x = if l.is_dense() && l.offset() == 0 && self.storage().len() == l.elem_count() {
            self.clone()
        } else {
            self.compact()?
        };
        let s = x.storage().to_device(device)?;
        Ok(Tensor::from_op(s, (*x.layout()).clone(), &[self], || {
            Op::ToDevice {
                from: self.device(),
            }
        }))
    }
}
