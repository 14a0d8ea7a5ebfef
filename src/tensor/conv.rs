//! 2-D convolution over logical `[n, c, h, w]` tensors, contiguous (NCHW) or channels_last
//! (NHWC, with KRSC weights): the result keeps the input's format.

use super::autocast::{self, OpKind};
use super::{Layout, MemoryFormat, Shape, Tensor};
use crate::autograd::Op;
use crate::backend::Conv2dParams;
use crate::base::error::{Error, Result};

/// Stride, padding, dilation and groups of a convolution (PyTorch's defaults: 1, 0, 1, 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dConfig {
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
}

impl Default for Conv2dConfig {
    fn default() -> Self {
        Conv2dConfig {
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
            groups: 1,
        }
    }
}

impl Tensor {
    /// Convolution of `self` `[n, c_in, h, w]` with `weight` `[c_out, c_in/groups, kh, kw]`,
    /// plus `bias` `[c_out]` when given.
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cfg: Conv2dConfig,
    ) -> Result<Tensor> {
        if let Some((x, w, b)) = autocast::inputs3(OpKind::Conv2d, self, weight, bias)? {
            return x.conv2d(&w, b.as_ref(), cfg);
        }
        let op = "conv2d";
        self.same_device(op, weight)?;
        if self.dtype() != weight.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: weight.dtype(),
            });
        }
        self.float_only(op)?;
        if self.rank() != 4 || weight.rank() != 4 {
            return Err(Error::shape_mismatch(
                op,
                self.shape(),
                weight.shape(),
                "input [n,c,h,w] and weight [o,c/g,kh,kw] must be 4-D",
            ));
        }
        let (x, w) = (self.dims(), weight.dims());
        let g = cfg.groups;
        if g == 0 || x[1] % g != 0 || w[0] % g != 0 || w[1] * g != x[1] {
            return Err(Error::shape_mismatch(op, self.shape(), weight.shape(), format!("groups = {g}: input channels {} must equal weight dim 1 ({}) × groups, and both channel counts divisible by groups", x[1], w[1])));
        }
        for (name, v) in [("stride", cfg.stride), ("dilation", cfg.dilation)] {
            if v.0 == 0 || v.1 == 0 {
                return Err(Error::invalid_arg(
                    op,
                    name,
                    format!("{v:?}"),
                    "at least 1 in both dims",
                ));
            }
        }
        let p = Conv2dParams {
            n: x[0],
            c_in: x[1],
            h: x[2],
            w: x[3],
            c_out: w[0],
            kh: w[2],
            kw: w[3],
            stride: cfg.stride,
            padding: cfg.padding,
            dilation: cfg.dilation,
            groups: g,
            format: MemoryFormat::Contiguous,
        };
        let eff = |k: usize, d: usize| d * (k.max(1) - 1) + 1;
        if x[2] + 2 * cfg.padding.0 < eff(w[2], cfg.dilation.0)
            || x[3] + 2 * cfg.padding.1 < eff(w[3], cfg.dilation.1)
            || w[2] == 0
            || w[3] == 0
        {
            return Err(Error::shape_mismatch(
                op,
                self.shape(),
                weight.shape(),
                "the (padded) input is smaller than the kernel",
            ));
        }
        let (run, keep) = self.op_formats(Some(weight));
        let p = Conv2dParams { format: run, ..p };
        let (xr, wr) = (self.packed_as(run)?, weight.packed_as(run)?);
        let s = xr
            .storage()
            .conv2d(&xr.layout(), &wr.storage(), &wr.layout(), &p)?;
        let shape = Shape::new(vec![p.n, p.c_out, p.out_h(), p.out_w()]);
        let y = Tensor::from_op(s, Layout::with_format(shape, run), &[self, weight], || {
            Op::Conv2d {
                x: weight.requires_grad().then(|| xr.detach()),
                w: self.requires_grad().then(|| wr.detach()),
                x_shape: self.shape().clone(),
                w_shape: weight.shape().clone(),
                p,
            }
        });
        let y = y.to_memory_format(keep)?;
        match bias {
            None => Ok(y),
            Some(b) => {
                if b.dims() != [p.c_out] {
                    return Err(Error::shape_mismatch(
                        op,
                        weight.shape(),
                        b.shape(),
                        "bias must be [c_out]",
                    ));
                }
                y.add(&b.reshape(vec![1, p.c_out, 1, 1])?)
            }
        }
    }
}
