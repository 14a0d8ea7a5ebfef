//! Batch normalisation over dim 1 of `[n, c, ...]`.
//!
//! Training mode normalises with the batch statistics (one backend kernel, which also updates
//! the running statistics in place); eval mode is an affine map per channel built from the
//! running statistics, composed from elementwise ops. The fused variants end in a residual add
//! and a ReLU in the same kernel (ResNet's `bn → relu` and `bn → + identity → relu`).

use super::{DType, Shape, Storage, Tensor};
use crate::autograd::Op;
use crate::backend::{
    BatchNormElemtOperands, BatchNormGradOperands, BatchNormGradSums, BatchNormParams,
    BatchNormTrainOperands,
};
use crate::base::error::{Error, Result};

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
            let stats = (running_mean, running_var);
            return self.batch_norm_eval(epi, (weight, bias), stats, cfg.eps, acc);
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
        let res_storage = res.as_ref().map(|r| r.storage());
        let res_layout = res.as_ref().map(|r| r.layout());
        let res_arg = res_storage.as_deref().zip(res_layout.as_deref());
        let (y, saved) = update_running(running_mean, running_var, acc, |rm, rv| {
            let o = BatchNormTrainOperands {
                residual: res_arg,
                weight: &w.storage(),
                bias: &b.storage(),
                running_mean: rm,
                running_var: rv,
            };
            x.storage().batch_norm_train(&x.layout(), o, &p)
        })?;
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

    /// Eval mode: `(x − running_mean)·invstd·weight + bias` computed in the statistics' type
    /// (`acc`) and rounded once to the input's, as PyTorch's eval batch norm does for a half
    /// input (f32 math, f32 parameters). Folding the map into a half scale and shift would round
    /// three more times (scale, shift, the product) and give a half ResNet's logits several
    /// times the error. Without a gradient to record this is the backend's one-pass kernel
    /// (SyncBatchNorm's elementwise piece, with the fused epilogue); with one, the same map
    /// and epilogue composed from recorded ops in `acc`.
    fn batch_norm_eval(
        &self,
        epi: Epilogue<'_>,
        (weight, bias): (&Tensor, &Tensor),
        (rm, rv): (&Tensor, &Tensor),
        eps: f64,
        acc: DType,
    ) -> Result<Tensor> {
        let c = self.dims()[1];
        let (rm, rv) = (rm.detach().to_dtype(acc)?, rv.detach().to_dtype(acc)?);
        let invstd = rv.add_scalar(eps)?.powf(-0.5)?;
        let mut inputs = vec![self, weight, bias];
        inputs.extend(epi.residual);
        let fusable = (self.device().is_cpu() || self.dtype() != DType::F64)
            && epi.residual.is_none_or(|r| r.dtype() == self.dtype());
        if fusable && !crate::autograd::records(&inputs) {
            let n = self.dims()[0];
            let (run, keep) = self.op_formats(None);
            let p = BatchNormParams {
                n,
                c,
                spatial: self.elem_count() / (n * c).max(1),
                eps,
                momentum: 0.0,
                format: run,
                residual: epi.residual.is_some(),
                relu: epi.relu,
            };
            let (w, b) = (weight.detach().to_dtype(acc)?, bias.detach().to_dtype(acc)?);
            let y = self.batch_norm_elemt(epi.residual, &w, &b, &rm, &invstd, &p)?;
            return y.to_memory_format(keep);
        }
        let mut bshape = vec![1; self.rank()];
        bshape[1] = c;
        let scale = weight.to_dtype(acc)?.mul(&invstd)?;
        let shift = bias.to_dtype(acc)?.sub(&rm.mul(&scale)?)?;
        let (scale, shift) = (scale.reshape(bshape.clone())?, shift.reshape(bshape)?);
        let y = self.to_dtype(acc)?.mul(&scale)?.add(&shift)?;
        if epi.residual.is_none_or(|r| r.dtype() == self.dtype()) {
            // The epilogue in `acc` too (a residual promotes into it): still one rounding.
            return self.batch_norm_then(y, epi)?.to_dtype(self.dtype());
        }
        self.batch_norm_then(y.to_dtype(self.dtype())?, epi)
    }
}

/// SyncBatchNorm's pieces (`distributed::sync_batch_norm` runs them around its collectives and
/// records its own autograd node): no gradient is recorded here. The data operands are packed in
/// `p.format`; the tensor layer checks what the kernels read.
impl Tensor {
    /// This batch's statistics, F64 `[2c + 1]`: each channel's mean, its sum of squared
    /// deviations from the mean, then the count of values per channel.
    pub(crate) fn batch_norm_stats(&self, p: &BatchNormParams) -> Result<Tensor> {
        let op = "batch_norm_stats";
        self.bn_data(op, p)?;
        let x = self.packed_as(p.format)?;
        let s = x.storage().batch_norm_stats(&x.layout(), p)?;
        Ok(Tensor::from_storage(s, Shape::new(vec![p.stats_len()])))
    }

    /// Called on `ranks` rows of [`Tensor::batch_norm_stats`] (`[ranks, 2c + 1]`, rank order):
    /// the union's mean and invstd (`acc`) and count (F64 `[1]`). The running statistics are
    /// updated in place, whatever their dtype (a wide copy when they are not `acc`).
    pub(crate) fn batch_norm_gather_stats(
        &self,
        ranks: usize,
        running_mean: &Tensor,
        running_var: &Tensor,
        acc: DType,
        p: &BatchNormParams,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let op = "batch_norm_gather_stats";
        if self.dtype() != DType::F64 || self.dims() != [ranks, p.stats_len()] {
            return Err(Error::invalid_arg(
                op,
                "statistics",
                format!("{} {:?}", self.dtype(), self.dims()),
                format!(
                    "f64 [{ranks}, {}] (batch_norm_stats of every rank)",
                    p.stats_len()
                ),
            ));
        }
        for t in [running_mean, running_var] {
            self.same_device(op, t)?;
            if t.dims() != [p.c] {
                return Err(Error::shape_mismatch(
                    op,
                    self.shape(),
                    t.shape(),
                    format!("running statistics must be [{}]", p.c),
                ));
            }
        }
        let rows = self.contiguous()?;
        let (mean, invstd, count) = update_running(running_mean, running_var, acc, |rm, rv| {
            rows.storage().batch_norm_gather_stats(ranks, rm, rv, p)
        })?;
        let cs = Shape::new(vec![p.c]);
        Ok((
            Tensor::from_storage(mean, cs.clone()),
            Tensor::from_storage(invstd, cs),
            Tensor::from_storage(count, Shape::new(vec![1])),
        ))
    }

    /// `y = (x − mean)·invstd·weight + bias` and `p`'s epilogue, in `p.format`. `weight`,
    /// `bias`, `mean`, `invstd` are `[c]` in the statistics' dtype.
    pub(crate) fn batch_norm_elemt(
        &self,
        residual: Option<&Tensor>,
        weight: &Tensor,
        bias: &Tensor,
        mean: &Tensor,
        invstd: &Tensor,
        p: &BatchNormParams,
    ) -> Result<Tensor> {
        let op = "batch_norm_elemt";
        self.bn_data(op, p)?;
        let vecs = [weight, bias, mean, invstd];
        self.bn_vectors(op, &vecs, p)?;
        let x = self.packed_as(p.format)?;
        let r = residual.map(|r| self.bn_like(op, r, p)).transpose()?;
        let v: Vec<Tensor> = vecs.iter().map(|t| t.compact()).collect::<Result<_>>()?;
        let rs = r.as_ref().map(|r| r.storage());
        let rl = r.as_ref().map(|r| r.layout());
        let o = BatchNormElemtOperands {
            residual: rs.as_deref().zip(rl.as_deref()),
            weight: &v[0].storage(),
            bias: &v[1].storage(),
            mean: &v[2].storage(),
            invstd: &v[3].storage(),
        };
        let y = x.storage().batch_norm_elemt(&x.layout(), o, p)?;
        Ok(Tensor::from_storage(y, x.layout().dense_like()))
    }

    /// Called on the output gradient: `[Σ g'·x̂, Σ g']` (`[2c]`, the statistics' dtype) over this
    /// batch, g' through the fused ReLU (`y`, the forward's output, when `p.relu`).
    pub(crate) fn batch_norm_backward_reduce(
        &self,
        x: &Tensor,
        y: Option<&Tensor>,
        mean: &Tensor,
        invstd: &Tensor,
        p: &BatchNormParams,
    ) -> Result<Tensor> {
        let op = "batch_norm_backward_reduce";
        x.bn_data(op, p)?;
        x.bn_vectors(op, &[mean, invstd], p)?;
        let (g, x) = (x.bn_like(op, self, p)?, x.packed_as(p.format)?);
        let y = y.map(|y| x.bn_like(op, y, p)).transpose()?;
        let (mean, invstd) = (mean.compact()?, invstd.compact()?);
        let ys = y.as_ref().map(|y| y.storage());
        let yl = y.as_ref().map(|y| y.layout());
        let o = BatchNormGradOperands {
            x: (&*x.storage(), &x.layout()),
            y: ys.as_deref().zip(yl.as_deref()),
            mean: &mean.storage(),
            invstd: &invstd.storage(),
        };
        let s = g.storage().batch_norm_backward_reduce(&g.layout(), o, p)?;
        Ok(Tensor::from_storage(s, Shape::new(vec![2 * p.c])))
    }

    /// Called on the output gradient: the input's gradient (in `p.format`) given `sums` (as
    /// [`Tensor::batch_norm_backward_reduce`]'s, summed over the processes) and `count` (F64
    /// `[1]`: the values per channel over the processes), and g' for the residual when
    /// `p.residual`. `stats` are `(mean, invstd)`, `totals` `(sums, count)`.
    pub(crate) fn batch_norm_backward_elemt(
        &self,
        x: &Tensor,
        y: Option<&Tensor>,
        weight: &Tensor,
        (mean, invstd): (&Tensor, &Tensor),
        (sums, count): (&Tensor, &Tensor),
        p: &BatchNormParams,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let op = "batch_norm_backward_elemt";
        x.bn_data(op, p)?;
        x.bn_vectors(op, &[weight, mean, invstd], p)?;
        for (what, t, want) in [("sums", sums, 2 * p.c), ("count", count, 1)] {
            x.same_device(op, t)?;
            if t.dims() != [want] {
                return Err(Error::invalid_arg(
                    op,
                    what,
                    format!("{:?}", t.dims()),
                    format!("[{want}]"),
                ));
            }
        }
        let (g, x) = (x.bn_like(op, self, p)?, x.packed_as(p.format)?);
        let y = y.map(|y| x.bn_like(op, y, p)).transpose()?;
        let v: Vec<Tensor> = [weight, mean, invstd, sums, count]
            .iter()
            .map(|t| t.compact())
            .collect::<Result<_>>()?;
        let ys = y.as_ref().map(|y| y.storage());
        let yl = y.as_ref().map(|y| y.layout());
        let o = BatchNormGradOperands {
            x: (&*x.storage(), &x.layout()),
            y: ys.as_deref().zip(yl.as_deref()),
            mean: &v[1].storage(),
            invstd: &v[2].storage(),
        };
        let sums = BatchNormGradSums {
            weight: &*v[0].storage(),
            sums: &v[3].storage(),
            count: &v[4].storage(),
        };
        let (dx, dres) = g
            .storage()
            .batch_norm_backward_elemt(&g.layout(), o, sums, p)?;
        let dense = x.layout().dense_like();
        Ok((
            Tensor::from_storage(dx, dense.clone()),
            dres.map(|s| Tensor::from_storage(s, dense)),
        ))
    }

    /// The data operand of a SyncBatchNorm piece: a float `[n, c, ...]` tensor of `p`'s sizes.
    fn bn_data(&self, op: &'static str, p: &BatchNormParams) -> Result<()> {
        self.float_only(op)?;
        let dims = self.dims();
        if dims.len() < 2
            || dims[0] != p.n
            || dims[1] != p.c
            || self.elem_count() != p.n * p.c * p.spatial
        {
            return Err(Error::invalid_shape(
                op,
                self.shape(),
                format!(
                    "[{}, {}, ...] of {} values per channel",
                    p.n,
                    p.c,
                    p.n * p.spatial
                ),
            ));
        }
        Ok(())
    }

    /// Per-channel operands: `[c]` in the statistics' dtype (f32, f64 for f64 data), on this
    /// tensor's device.
    fn bn_vectors(&self, op: &'static str, ts: &[&Tensor], p: &BatchNormParams) -> Result<()> {
        let acc = if self.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        for t in ts {
            self.same_device(op, t)?;
            if t.dims() != [p.c] || t.dtype() != acc {
                return Err(Error::invalid_arg(
                    op,
                    "per-channel operand",
                    format!("{} {:?}", t.dtype(), t.dims()),
                    format!("{acc} [{}]", p.c),
                ));
            }
        }
        Ok(())
    }

    /// `t` (a gradient, an output or a residual of this data operand) packed in `p.format`:
    /// this tensor's shape, dtype and device.
    fn bn_like(&self, op: &'static str, t: &Tensor, p: &BatchNormParams) -> Result<Tensor> {
        self.same_device(op, t)?;
        if t.shape() != self.shape() || t.dtype() != self.dtype() {
            return Err(Error::invalid_arg(
                op,
                "operand",
                format!("{} {:?}", t.dtype(), t.dims()),
                format!("{} {:?} (the data's)", self.dtype(), self.dims()),
            ));
        }
        t.packed_as(p.format)
    }
}

/// Runs `f` on the running statistics' storages for a kernel that updates them in place, in
/// the statistics' dtype `acc`: their own buffers when they are `acc` and whole; otherwise
/// (kept in half at O3, or views) a wide copy, whose values are then stored back.
fn update_running<R>(
    running_mean: &Tensor,
    running_var: &Tensor,
    acc: DType,
    f: impl FnOnce(&mut Storage, &mut Storage) -> Result<R>,
) -> Result<R> {
    let own = |t: &Tensor| t.dtype() == acc && t.is_whole_buffer();
    if own(running_mean) && own(running_var) {
        return f(
            &mut running_mean.storage_mut(),
            &mut running_var.storage_mut(),
        );
    }
    let _g = crate::autograd::no_grad();
    let wide = |t: &Tensor| t.detach().to_dtype(acc)?.compact()?.owned();
    let (rm, rv) = (wide(running_mean)?, wide(running_var)?);
    let out = f(&mut rm.storage_mut(), &mut rv.storage_mut())?;
    for (stat, w) in [(running_mean, &rm), (running_var, &rv)] {
        stat.update_values(&w.to_dtype(stat.dtype())?)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Device, MemoryFormat};

    fn worst(got: &Tensor, want: &Tensor) -> f64 {
        let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
        assert_eq!(g.len(), w.len());
        let scale = w.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        g.iter()
            .zip(&w)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()))
            / scale
    }

    /// A training batch norm of 2 samples, 3 channels, 4 values each, contiguous.
    fn two_by_three_by_four() -> BatchNormParams {
        BatchNormParams {
            n: 2,
            c: 3,
            spatial: 4,
            format: MemoryFormat::Contiguous,
            eps: 1e-5,
            momentum: 0.1,
            residual: false,
            relu: false,
        }
    }

    /// Statistics that are not `ranks` whole rows are refused where a backend gets them (the
    /// storage API is public, and the CUDA kernel would read past a short buffer).
    #[test]
    fn gathered_statistics_must_be_whole_rows() {
        use crate::backend::cpu::CpuStorage;
        use crate::backend::BatchNormOps;
        let p = two_by_three_by_four();
        assert_eq!(p.stats_len(), 7);
        let (mut rm, mut rv) = (CpuStorage::F32(vec![0.0; 3]), CpuStorage::F32(vec![1.0; 3]));
        let short = CpuStorage::F64(vec![1.0; 13]);
        let e = short
            .batch_norm_gather_stats(2, &mut rm, &mut rv, &p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("batch_norm_gather_stats") && e.contains("13 value(s)"),
            "{e}"
        );
        assert!(e.contains("2 row(s) of 7"), "{e}");
        let (CpuStorage::F32(m), CpuStorage::F32(v)) = (&rm, &rv) else {
            unreachable!()
        };
        assert_eq!((m.as_slice(), v.as_slice()), (&[0.0; 3][..], &[1.0; 3][..]));
        let whole = CpuStorage::F64(vec![1.0; 14]);
        assert!(whole
            .batch_norm_gather_stats(2, &mut rm, &mut rv, &p)
            .is_ok());
    }

    /// SyncBatchNorm's pieces run as three processes would on three parts of one batch (2, 3
    /// and 1 samples), the parts' results joined, against one batch norm of the whole batch:
    /// output, running statistics, and every gradient.
    fn pieces_match_the_whole_batch(dtype: DType, residual: bool, relu: bool, tol: f64) {
        let (n, c, h, w) = (6, 3, 4, 5);
        let dev = Device::Cpu;
        let acc = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let x = Tensor::randn([n, c, h, w], 0.5, 2.0, 11, dtype, dev).unwrap();
        let r = Tensor::randn([n, c, h, w], 0.0, 1.0, 12, dtype, dev).unwrap();
        let up = Tensor::randn([n, c, h, w], 0.0, 1.0, 13, dtype, dev).unwrap();
        let weight = Tensor::randn([c], 1.0, 0.3, 14, acc, dev).unwrap();
        let bias = Tensor::randn([c], 0.0, 0.3, 15, acc, dev).unwrap();
        let cfg = BatchNormConfig::default();

        // One batch norm of the whole batch.
        let (xw, rw, ww, bw) = (
            x.to_variable(),
            r.to_variable(),
            weight.to_variable(),
            bias.to_variable(),
        );
        let stat = || {
            (
                Tensor::zeros([c], DType::F32, dev).unwrap(),
                Tensor::ones([c], DType::F32, dev).unwrap(),
            )
        };
        let (rm, rv) = stat();
        let y = match (residual, relu) {
            (true, _) => xw.batch_norm_add_relu(&rw, &ww, &bw, &rm, &rv, cfg),
            (false, true) => xw.batch_norm_relu(&ww, &bw, &rm, &rv, cfg),
            _ => xw.batch_norm(&ww, &bw, &rm, &rv, cfg),
        }
        .unwrap();
        y.mul(&up).unwrap().sum_all().unwrap().backward().unwrap();

        // The pieces, part by part.
        let sizes = [2, 3, 1];
        let starts = [0, 2, 5];
        let p_of = |k: usize| BatchNormParams {
            n: k,
            c,
            spatial: h * w,
            format: MemoryFormat::Contiguous,
            eps: cfg.eps,
            momentum: cfg.momentum,
            residual,
            relu,
        };
        let part = |t: &Tensor, i: usize| t.narrow(0, starts[i], sizes[i]).unwrap();
        let rows: Vec<Tensor> = (0..3)
            .map(|i| {
                part(&x, i)
                    .batch_norm_stats(&p_of(sizes[i]))
                    .unwrap()
                    .reshape([1, 2 * c + 1])
                    .unwrap()
            })
            .collect();
        let rows = Tensor::cat(&rows.iter().collect::<Vec<_>>(), 0).unwrap();
        let (mut ys, mut sums, mut kept) = (Vec::new(), Vec::new(), Vec::new());
        for (i, &size) in sizes.iter().enumerate() {
            let p = p_of(size);
            let (rm_i, rv_i) = stat();
            let (mean, invstd, count) = rows
                .batch_norm_gather_stats(3, &rm_i, &rv_i, acc, &p)
                .unwrap();
            assert!(
                worst(&rm_i, &rm) < tol && worst(&rv_i, &rv) < tol,
                "running statistics"
            );
            assert_eq!(count.to_vec_f64().unwrap(), [(n * h * w) as f64]);
            let res = residual.then(|| part(&r, i));
            let y_i = part(&x, i)
                .batch_norm_elemt(res.as_ref(), &weight, &bias, &mean, &invstd, &p)
                .unwrap();
            let g = part(&up, i);
            let y_saved = relu.then(|| y_i.clone());
            sums.push(
                g.batch_norm_backward_reduce(&part(&x, i), y_saved.as_ref(), &mean, &invstd, &p)
                    .unwrap(),
            );
            kept.push((g, y_saved, mean, invstd, count));
            ys.push(y_i);
        }
        let total = sums[0].add(&sums[1]).unwrap().add(&sums[2]).unwrap();
        let (mut dxs, mut drs) = (Vec::new(), Vec::new());
        for (i, (g, y_saved, mean, invstd, count)) in kept.iter().enumerate() {
            let (dx, dr) = g
                .batch_norm_backward_elemt(
                    &part(&x, i),
                    y_saved.as_ref(),
                    &weight,
                    (mean, invstd),
                    (&total, count),
                    &p_of(sizes[i]),
                )
                .unwrap();
            assert_eq!(dr.is_some(), residual);
            dxs.push(dx);
            drs.extend(dr);
        }
        let join = |ts: &[Tensor]| Tensor::cat(&ts.iter().collect::<Vec<_>>(), 0).unwrap();
        let what = format!("{dtype} residual {residual} relu {relu}");
        let e = worst(&join(&ys), &y);
        assert!(e < tol, "{what}: y off by {e:e}");
        let e = worst(&join(&dxs), &xw.grad().unwrap());
        assert!(e < tol, "{what}: dx off by {e:e}");
        let e = worst(&total.narrow(0, 0, c).unwrap(), &ww.grad().unwrap());
        assert!(e < tol, "{what}: dw off by {e:e}");
        let e = worst(&total.narrow(0, c, c).unwrap(), &bw.grad().unwrap());
        assert!(e < tol, "{what}: db off by {e:e}");
        if residual {
            let e = worst(&join(&drs), &rw.grad().unwrap());
            assert!(e < tol, "{what}: d residual off by {e:e}");
        }
    }

    #[test]
    fn sync_pieces_over_three_parts_match_one_batch_norm() {
        for (residual, relu) in [(false, false), (false, true), (true, true)] {
            pieces_match_the_whole_batch(DType::F64, residual, relu, 1e-12);
            pieces_match_the_whole_batch(DType::F32, residual, relu, 2e-5);
            // One rounding to the half type on each side, from statistics that differ in f32.
            pieces_match_the_whole_batch(DType::F16, residual, relu, 2e-3);
            pieces_match_the_whole_batch(DType::BF16, residual, relu, 1.6e-2);
        }
    }

    #[test]
    fn sync_pieces_refuse_what_they_cannot_read() {
        let dev = Device::Cpu;
        let x = Tensor::randn([2, 3, 2, 2], 0.0, 1.0, 1, DType::F32, dev).unwrap();
        let p = two_by_three_by_four();
        let wrong = BatchNormParams { c: 4, ..p };
        let e = x.batch_norm_stats(&wrong).unwrap_err().to_string();
        assert!(
            e.contains("batch_norm_stats") && e.contains("[2, 4, ...]"),
            "{e}"
        );
        let rows = x.batch_norm_stats(&p).unwrap();
        let (rm, rv) = (
            Tensor::zeros([3], DType::F32, dev).unwrap(),
            Tensor::ones([3], DType::F32, dev).unwrap(),
        );
        let e = rows
            .batch_norm_gather_stats(2, &rm, &rv, DType::F32, &p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("f64 [2, 7]"), "{e}");
        let half = Tensor::ones([3], DType::F16, dev).unwrap();
        let e = x
            .batch_norm_elemt(None, &half, &half, &half, &half, &p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("batch_norm_elemt") && e.contains("f32 [3]"),
            "{e}"
        );
    }
}
