//! Batch normalisation over dim 1 of `[n, c, ...]`.
//!
//! Training mode normalises with the batch statistics (one backend kernel, which also updates
//! the running statistics in place); eval mode is an affine map per channel built from the
//! running statistics, composed from elementwise ops. The fused variants end in a residual add
//! and a ReLU in the same kernel (ResNet's `bn → relu` and `bn → + identity → relu`).

use super::{DType, Shape, Tensor};
use crate::autograd::Op;
use crate::backend::BatchNormParams;
use crate::error::{Error, Result};

/// Arguments of [`Tensor::batch_norm`] beyond the tensors (PyTorch's defaults: 0.1, 1e-5).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormConfig {
    pub training: bool,
    pub momentum: f64,
    pub eps: f64,
}

impl Default for BatchNormConfig {
    fn default() -> Self {
        BatchNormConfig {
            training: true,
            momentum: 0.1,
            eps: 1e-5,
        }
    }
}

/// What follows the normalisation in one kernel: `y = relu(bn(x) + residual)`, each part
/// optional.
#[derive(Clone, Copy)]
struct Epilogue<'a> {
    residual: Option<&'a Tensor>,
    relu: bool,
}

impl Tensor {
    /// `y = (x − mean)/√(var + eps)·weight + bias` per channel. In training, batch statistics
    /// are used and `running_mean`/`running_var` updated (unbiased variance); in eval, the
    /// running statistics are used. Parameters and statistics may be of any float dtype; the
    /// statistics are computed in f32 (f64 for f64 inputs) and `y` has the input's dtype.
    pub fn batch_norm(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        cfg: BatchNormConfig,
    ) -> Result<Tensor> {
        let epi = Epilogue {
            residual: None,
            relu: false,
        };
        self.batch_norm_impl(epi, weight, bias, running_mean, running_var, cfg)
    }

    /// `relu(batch_norm(x))` as one op: one pass writes the activation, and the backward reads
    /// the saved output for the ReLU's mask (ResNet's `bn → relu`).
    pub fn batch_norm_relu(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        cfg: BatchNormConfig,
    ) -> Result<Tensor> {
        let epi = Epilogue {
            residual: None,
            relu: true,
        };
        self.batch_norm_impl(epi, weight, bias, running_mean, running_var, cfg)
    }

    /// `relu(batch_norm(x) + residual)` as one op (the end of a ResNet block): the residual has
    /// this tensor's shape; its gradient is the one through the ReLU.
    pub fn batch_norm_add_relu(
        &self,
        residual: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        cfg: BatchNormConfig,
    ) -> Result<Tensor> {
        let epi = Epilogue {
            residual: Some(residual),
            relu: true,
        };
        self.batch_norm_impl(epi, weight, bias, running_mean, running_var, cfg)
    }

    /// The epilogue composed from separate ops (eval mode, and what the fused kernels do not
    /// cover: f64 on CUDA, a residual of another dtype).
    fn batch_norm_then(&self, y: Tensor, epi: Epilogue<'_>) -> Result<Tensor> {
        let y = match epi.residual {
            Some(r) => y.add(r)?,
            None => y,
        };
        if epi.relu {
            y.relu()
        } else {
            Ok(y)
        }
    }

    fn batch_norm_impl(
        &self,
        epi: Epilogue<'_>,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        cfg: BatchNormConfig,
    ) -> Result<Tensor> {
        let op = match (epi.residual.is_some(), epi.relu) {
            (true, _) => "batch_norm_add_relu",
            (false, true) => "batch_norm_relu",
            _ => "batch_norm",
        };
        self.float_only(op)?;
        if self.rank() < 2 {
            return Err(Error::invalid_shape(
                op,
                self.shape(),
                "input must be [n, c, ...]",
            ));
        }
        let c = self.dims()[1];
        for t in [weight, bias, running_mean, running_var] {
            self.same_device(op, t)?;
            if t.dims() != [c] {
                return Err(Error::shape_mismatch(
                    op,
                    self.shape(),
                    t.shape(),
                    format!("parameters and statistics must be [{c}]"),
                ));
            }
        }
        if let Some(r) = epi.residual {
            self.same_device(op, r)?;
            if r.shape() != self.shape() {
                return Err(Error::shape_mismatch(
                    op,
                    self.shape(),
                    r.shape(),
                    "the residual must have the input's shape",
                ));
            }
        }
        // Written so that NaN fails too.
        let eps_ok = cfg.eps > 0.0;
        if !eps_ok || !(0.0..=1.0).contains(&cfg.momentum) {
            return Err(Error::invalid_arg(
                op,
                "eps/momentum",
                format!("{}/{}", cfg.eps, cfg.momentum),
                "eps > 0 and momentum in [0, 1]",
            ));
        }
        let acc = if self.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        if !cfg.training {
            let y = self.batch_norm_eval(weight, bias, running_mean, running_var, cfg.eps, acc)?;
            return self.batch_norm_then(y, epi);
        }
        // The CUDA fused kernels cover f16/bf16/f32; a residual of another dtype promotes.
        let fusable = (self.device().is_cpu() || self.dtype() != DType::F64)
            && epi.residual.is_none_or(|r| r.dtype() == self.dtype());
        if (epi.relu || epi.residual.is_some()) && !fusable {
            let plain = Epilogue {
                residual: None,
                relu: false,
            };
            let y = self.batch_norm_impl(plain, weight, bias, running_mean, running_var, cfg)?;
            return self.batch_norm_then(y, epi);
        }
        let n = self.dims()[0];
        let spatial = self.elem_count() / (n * c).max(1);
        if n * spatial < 2 {
            return Err(Error::invalid_shape(
                op,
                self.shape(),
                "training needs more than one value per channel",
            ));
        }
        let (run, keep) = self.op_formats(None);
        let p = BatchNormParams {
            n,
            c,
            spatial,
            eps: cfg.eps,
            momentum: cfg.momentum,
            format: run,
            residual: epi.residual.is_some(),
            relu: epi.relu,
        };
        let x = self.packed_as(run)?;
        let res = epi.residual.map(|r| r.packed_as(run)).transpose()?;
        // The kernel takes parameters in the accumulation type; a cast is recorded so that the
        // gradient returns in the parameters' own dtype (O3 keeps BatchNorm in half).
        let (w, b) = (
            weight.to_dtype(acc)?.compact()?,
            bias.to_dtype(acc)?.compact()?,
        );
        let in_place = |t: &Tensor| {
            let l = t.layout();
            t.dtype() == acc && l.offset() == 0 && t.storage().len() == c
        };
        let res_storage = res.as_ref().map(|r| r.storage());
        let res_layout = res.as_ref().map(|r| r.layout());
        let res_arg = res_storage.as_deref().zip(res_layout.as_deref());
        let (y, saved) = if in_place(running_mean) && in_place(running_var) {
            let mut rm = running_mean.storage_mut();
            let mut rv = running_var.storage_mut();
            x.storage().batch_norm_train(
                &x.layout(),
                res_arg,
                &w.storage(),
                &b.storage(),
                &mut rm,
                &mut rv,
                &p,
            )?
        } else {
            // Statistics kept in half (O3), or views: update a wide copy, then store it back.
            let (rm_acc, rv_acc) = (
                running_mean.detach().to_dtype(acc)?.compact()?,
                running_var.detach().to_dtype(acc)?.compact()?,
            );
            let (rm_acc, rv_acc) = (rm_acc.owned()?, rv_acc.owned()?);
            let out = x.storage().batch_norm_train(
                &x.layout(),
                res_arg,
                &w.storage(),
                &b.storage(),
                &mut rm_acc.storage_mut(),
                &mut rv_acc.storage_mut(),
                &p,
            )?;
            for (stat, wide) in [(running_mean, &rm_acc), (running_var, &rv_acc)] {
                stat.update_values(&wide.to_dtype(stat.dtype())?)?;
            }
            out
        };
        drop(res_storage);
        let cs = Shape::new(vec![c]);
        let (mean, invstd) = (
            Tensor::from_storage(saved.mean, cs.clone()),
            Tensor::from_storage(saved.invstd, cs),
        );
        let reserve = saved.reserve.map(|r| {
            let len = r.len();
            Tensor::from_storage(r, Shape::new(vec![len]))
        });
        let mut inputs = vec![self, &w, &b];
        if let Some(r) = epi.residual {
            inputs.push(r);
        }
        let y =
            Tensor::from_op_with_output(y, x.layout().dense_like(), &inputs, |y| Op::BatchNorm {
                x: x.detach(),
                w: w.detach(),
                b: b.detach(),
                y: p.relu.then_some(y),
                mean,
                invstd,
                reserve,
                p,
            });
        y.to_memory_format(keep)
    }

    fn batch_norm_eval(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        rm: &Tensor,
        rv: &Tensor,
        eps: f64,
        acc: DType,
    ) -> Result<Tensor> {
        let c = self.dims()[1];
        let mut bshape = vec![1; self.rank()];
        bshape[1] = c;
        let (rm, rv) = (rm.detach().to_dtype(acc)?, rv.detach().to_dtype(acc)?);
        let scale = weight
            .to_dtype(acc)?
            .mul(&rv.add_scalar(eps)?.powf(-0.5)?)?;
        let shift = bias.to_dtype(acc)?.sub(&rm.mul(&scale)?)?;
        let scale = scale.to_dtype(self.dtype())?.reshape(bshape.clone())?;
        let shift = shift.to_dtype(self.dtype())?.reshape(bshape)?;
        self.mul(&scale)?.add(&shift)
    }
}
