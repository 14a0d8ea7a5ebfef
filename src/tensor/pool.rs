//! Max, average and adaptive average pooling over NCHW.

use super::{Layout, MemoryFormat, Shape, Tensor};
use crate::autograd::Op;
use crate::backend::{AdaptivePoolParams, Pool2dParams};
use crate::base::error::{Error, Result};

impl Tensor {
    fn pool_params(
        &self,
        op: &'static str,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<Pool2dParams> {
        self.float_only(op)?;
        if self.rank() != 4 {
            return Err(Error::invalid_shape(
                op,
                self.shape(),
                "input must be [n, c, h, w]",
            ));
        }
        if kernel.0 == 0 || kernel.1 == 0 || stride.0 == 0 || stride.1 == 0 {
            return Err(Error::invalid_arg(
                op,
                "kernel/stride",
                format!("{kernel:?}/{stride:?}"),
                "at least 1 in both dims",
            ));
        }
        if padding.0 * 2 > kernel.0 || padding.1 * 2 > kernel.1 {
            return Err(Error::invalid_arg(
                op,
                "padding",
                format!("{padding:?}"),
                format!("at most half the kernel {kernel:?}"),
            ));
        }
        let d = self.dims();
        if d[2] + 2 * padding.0 < kernel.0 || d[3] + 2 * padding.1 < kernel.1 {
            return Err(Error::invalid_shape(
                op,
                self.shape(),
                format!("the (padded) input is smaller than the kernel {kernel:?}"),
            ));
        }
        Ok(Pool2dParams {
            n: d[0],
            c: d[1],
            h: d[2],
            w: d[3],
            kh: kernel.0,
            kw: kernel.1,
            stride,
            padding,
            count_include_pad: true,
            format: MemoryFormat::Contiguous,
        })
    }

    /// Max pooling (floor mode); padded cells never win.
    pub fn max_pool2d(
        &self,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<Tensor> {
        let mut p = self.pool_params("max_pool2d", kernel, stride, padding)?;
        let (run, keep) = self.op_formats(None);
        p.format = run;
        let x = self.packed_as(run)?;
        let (s, argmax) = x.storage().max_pool2d(&x.layout(), &p)?;
        let out = Layout::with_format(Shape::new(vec![p.n, p.c, p.out_h(), p.out_w()]), run);
        // The argmax record is the backend's own (ops::PoolOps::max_pool2d): kept whole, as
        // one dimension of its own length, for its backward.
        let record = Layout::contiguous(Shape::new(vec![argmax.len()]));
        let argmax = Tensor::from_storage(argmax, record);
        Tensor::from_op(s, out, &[self], || Op::MaxPool2d {
            from: self.shape().clone(),
            argmax,
            p,
        })
        .to_memory_format(keep)
    }

    /// Average pooling (floor mode); with `count_include_pad` the divisor is always kh·kw.
    pub fn avg_pool2d(
        &self,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
        count_include_pad: bool,
    ) -> Result<Tensor> {
        let mut p = self.pool_params("avg_pool2d", kernel, stride, padding)?;
        p.count_include_pad = count_include_pad;
        let (run, keep) = self.op_formats(None);
        p.format = run;
        let x = self.packed_as(run)?;
        let s = x.storage().avg_pool2d(&x.layout(), &p)?;
        let out = Layout::with_format(Shape::new(vec![p.n, p.c, p.out_h(), p.out_w()]), run);
        Tensor::from_op(s, out, &[self], || Op::AvgPool2d {
            from: self.shape().clone(),
            p,
        })
        .to_memory_format(keep)
    }

    /// Average pooling to a fixed output size (PyTorch's AdaptiveAvgPool2d).
    pub fn adaptive_avg_pool2d(&self, out_h: usize, out_w: usize) -> Result<Tensor> {
        let op = "adaptive_avg_pool2d";
        self.float_only(op)?;
        if self.rank() != 4 {
            return Err(Error::invalid_shape(
                op,
                self.shape(),
                "input must be [n, c, h, w]",
            ));
        }
        let d = self.dims();
        if out_h == 0 || out_w == 0 || d[2] == 0 || d[3] == 0 {
            return Err(Error::invalid_arg(
                op,
                "output size",
                format!("({out_h}, {out_w})"),
                "non-zero, on a non-empty input",
            ));
        }
        let p = AdaptivePoolParams {
            n: d[0],
            c: d[1],
            h: d[2],
            w: d[3],
            out_h,
            out_w,
            format: MemoryFormat::Contiguous,
        };
        let (run, keep) = self.op_formats(None);
        let p = AdaptivePoolParams { format: run, ..p };
        let x = self.packed_as(run)?;
        let s = x.storage().adaptive_avg_pool2d(&x.layout(), &p)?;
        let out = Layout::with_format(Shape::new(vec![p.n, p.c, out_h, out_w]), run);
        Tensor::from_op(s, out, &[self], || Op::AdaptiveAvgPool2d {
            from: self.shape().clone(),
            p,
        })
        .to_memory_format(keep)
    }
}
