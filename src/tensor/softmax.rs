//! softmax and log_softmax (computed in f32, f64 for f64, whatever the storage type).

use super::autocast::{self, OpKind};
use super::Tensor;
use crate::autograd::Op;
use crate::base::error::Result;

impl Tensor {
    fn softmax_impl(&self, dim: isize, log: bool) -> Result<Tensor> {
        let kind = if log {
            OpKind::LogSoftmax
        } else {
            OpKind::Softmax
        };
        let name = kind.name();
        if let Some(x) = autocast::inputs1(kind, self)? {
            return x.softmax_impl(dim, log);
        }
        self.float_only(name)?;
        let d = self.shape().dim(name, dim)?;
        let x = self.contiguous()?;
        let s = x.storage().softmax(&x.layout(), d, log)?;
        Ok(Tensor::from_op_with_output(
            s,
            self.shape().clone(),
            &[self],
            |y| Op::Softmax { y, dim: d, log },
        ))
    }

    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, false)
    }

    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, true)
    }
}
