//! Reductions: sum, mean, max, min, argmax over one or more dims.

use super::autocast::{self, OpKind};
use super::{Shape, Tensor};
use crate::autograd::Op;
use crate::backend::ReduceOp;
use crate::base::error::{Error, Result};

impl Tensor {
    fn reduced_shape(&self, dim: usize, keepdim: bool) -> Shape {
        let mut d = self.dims().to_vec();
        if keepdim {
            d[dim] = 1;
        } else {
            d.remove(dim);
        }
        Shape::new(d)
    }

    /// Sum over `dim` (negative counts from the end). Half inputs accumulate in f32.
    pub fn sum_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        if let Some(x) = autocast::inputs1(OpKind::Sum, self)? {
            return x.sum_dim(dim, keepdim);
        }
        self.float_only("sum")?;
        let d = self.shape().dim("sum", dim)?;
        let x = self.contiguous()?;
        let s = x.storage().reduce(&x.layout(), ReduceOp::Sum, d)?;
        Ok(Tensor::from_op(
            s,
            self.reduced_shape(d, keepdim),
            &[self],
            || Op::Sum {
                from: self.shape().clone(),
                dim: d,
            },
        ))
    }

    /// Sum over several dims.
    pub fn sum_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let mut ds = dims
            .iter()
            .map(|&d| self.shape().dim("sum", d))
            .collect::<Result<Vec<_>>>()?;
        ds.sort_unstable();
        if let Some(w) = ds.windows(2).find(|w| w[0] == w[1]) {
            // As PyTorch: a dim named twice (`[0, 0]`, or `[1, -1]` of a rank-2 tensor) is an
            // error, not a sum over it once.
            return Err(Error::invalid_arg(
                "sum",
                "dims",
                format!("{dims:?}"),
                format!(
                    "each dimension at most once (dim {} of the rank-{} tensor appears twice)",
                    w[0],
                    self.rank()
                ),
            ));
        }
        let mut t = self.clone();
        // Highest first, so that removing a dim does not renumber the ones still to do.
        for &d in ds.iter().rev() {
            t = t.sum_dim(d as isize, keepdim)?;
        }
        Ok(t)
    }

    /// Sum of every element, as a 0-d tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        if let Some(x) = autocast::inputs1(OpKind::Sum, self)? {
            return x.sum_all();
        }
        self.float_only("sum")?;
        if self.rank() == 0 {
            return Ok(self.clone());
        }
        self.reshape(vec![self.elem_count()])?.sum_dim(0, false)
    }

    pub fn mean_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        if let Some(x) = autocast::inputs1(OpKind::Mean, self)? {
            return x.mean_dim(dim, keepdim);
        }
        self.float_only("mean")?;
        let d = self.shape().dim("mean", dim)?;
        let n = self.dims()[d];
        self.sum_dim(dim, keepdim)?.affine(1.0 / n as f64, 0.0)
    }

    pub fn mean_all(&self) -> Result<Tensor> {
        if let Some(x) = autocast::inputs1(OpKind::Mean, self)? {
            return x.mean_all();
        }
        self.float_only("mean")?;
        if self.elem_count() == 0 {
            return Err(Error::invalid_shape(
                "mean",
                self.shape(),
                "mean of an empty tensor",
            ));
        }
        self.sum_all()?.affine(1.0 / self.elem_count() as f64, 0.0)
    }

    fn max_min(
        &self,
        dim: isize,
        keepdim: bool,
        op: ReduceOp,
        name: &'static str,
    ) -> Result<Tensor> {
        self.float_only(name)?;
        let d = self.shape().dim(name, dim)?;
        if self.dims()[d] == 0 {
            return Err(Error::invalid_shape(
                name,
                self.shape(),
                format!("{name} over an empty dimension {d}"),
            ));
        }
        let x = self.contiguous()?;
        let (xs, xl) = (x.storage(), &x.layout());
        let s = xs.reduce(xl, op, d)?;
        let shape = self.reduced_shape(d, keepdim);
        if !crate::autograd::records(&[self]) {
            return Ok(Tensor::from_storage(s, shape));
        }
        // The position chosen in each lane, for the backward scatter.
        let index = match op {
            ReduceOp::Max => xs.argmax(xl, d)?,
            _ => xs
                .unary(xl, crate::backend::UnaryOp::Neg)?
                .argmax(&xl.dense_like(), d)?,
        };
        drop(xs);
        let mut kd = self.dims().to_vec();
        kd[d] = 1;
        let index = Tensor::from_storage(index, Shape::new(kd));
        Ok(Tensor::from_op(s, shape, &[self], || Op::MaxMin {
            from: self.shape().clone(),
            dim: d,
            index,
        }))
    }

    /// Maximum over `dim`; the gradient goes to the (first) maximal element.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.max_min(dim, keepdim, ReduceOp::Max, "max")
    }

    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.max_min(dim, keepdim, ReduceOp::Min, "min")
    }

    /// Index (I64) of the first maximum along `dim`.
    pub fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let d = self.shape().dim("argmax", dim)?;
        if self.dims()[d] == 0 {
            return Err(Error::invalid_shape(
                "argmax",
                self.shape(),
                format!("argmax over an empty dimension {d}"),
            ));
        }
        let x = self.contiguous()?;
        let s = x.storage().argmax(&x.layout(), d)?;
        Ok(Tensor::from_storage(s, self.reduced_shape(d, keepdim)))
    }

    /// Sums a broadcast gradient back to `shape` (the inverse of broadcasting).
    pub(crate) fn sum_to_shape(&self, shape: &Shape) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let extra = self.rank() - shape.rank();
        let mut t = self.clone();
        for _ in 0..extra {
            t = t.sum_dim(0, false)?;
        }
        for (d, &n) in shape.dims().iter().enumerate() {
            if n == 1 && t.dims()[d] != 1 {
                t = t.sum_dim(d as isize, true)?;
            }
        }
        Ok(t)
    }
}
