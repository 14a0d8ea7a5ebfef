//! Training-mode batch norm through cuDNN's `*Ex` API, the candidate timed against our own
//! kernels for channels_last inputs (`batch_norm.rs` decides which runs).
//!
//! cuDNN's NHWC kernels in persistent mode (`CUDNN_BATCHNORM_SPATIAL_PERSISTENT`) keep part of
//! a channel's values on chip between the statistics and the normalisation, so they read the
//! input about once where our three launches read it twice; they are what PyTorch runs for a
//! channels_last half batch norm. The epilogues map onto cuDNN's own fusions: ReLU is
//! `BN_ACTIVATION`, residual add then ReLU is `BN_ADD_ACTIVATION` (a residual add with no ReLU
//! has no cuDNN form). With an activation the forward writes a reserve space (the ReLU's mask)
//! that the backward reads: it travels in [`crate::backend::BatchNormSaved`].
//!
//! Semantics are ours: the saved statistics are the batch mean and `1/sqrt(var + eps)` (biased
//! variance), the running variance is updated with the unbiased one, `momentum` is cuDNN's
//! exponential average factor, and the ReLU maps NaN to 0 (`CUDNN_NOT_PROPAGATE_NAN`).

use std::ffi::{c_int, c_void};

use cudarc::cudnn::sys as dsys;
use dsys::cudnnBatchNormOps_t as Ops;

use super::cudnn::data_type;
use super::cudnn_legacy::{dnn_err, TensorDesc};
use crate::backend::BatchNormParams;
use crate::base::error::{Error, Result};
use crate::base::{DType, MemoryFormat};

/// cuDNN refuses a smaller epsilon (`CUDNN_BN_MIN_EPSILON`).
const MIN_EPSILON: f64 = 1e-5;

const MODE: dsys::cudnnBatchNormMode_t =
    dsys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL_PERSISTENT;

struct ActivationDesc(dsys::cudnnActivationDescriptor_t);
impl Drop for ActivationDesc {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let _ = unsafe { dsys::cudnnDestroyActivationDescriptor(self.0) };
    }
}

/// Why cuDNN does not cover a batch norm, or None when it may (cuDNN itself can still refuse a
/// geometry: its workspace queries and runs then fail, and the candidate is not chosen).
pub(super) fn not_covered(p: &BatchNormParams, dtype: DType) -> Option<&'static str> {
    if p.format != MemoryFormat::ChannelsLast {
        return Some("NCHW runs our single-pass kernel");
    }
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32) {
        return Some("cuDNN's NHWC batch norm covers f16, bf16 and f32");
    }
    if p.residual && !p.relu {
        return Some("cuDNN fuses a residual add only before an activation");
    }
    if p.eps < MIN_EPSILON {
        return Some("cuDNN needs an epsilon of at least 1e-5");
    }
    None
}

/// The descriptors of one (geometry, dtype, epilogue) and the sizes cuDNN asks for with them.
/// Kept in the device's cuDNN state (`cudnn::Dnn`) and used only under its lock, as every
/// cuDNN handle and descriptor is.
pub(super) struct CudnnBatchNorm {
    /// x, y, the residual and their gradients: one NHWC descriptor.
    x: TensorDesc,
    /// Per-channel scale, bias and statistics (F32), derived from `x` as cuDNN requires.
    stats: TensorDesc,
    act: Option<ActivationDesc>,
    ops: Ops,
    pub(super) forward_workspace: usize,
    pub(super) backward_workspace: usize,
    /// Bytes of reserve space the forward writes for the backward, as cuDNN sizes it.
    pub(super) reserve: usize,
}

fn int(what: &'static str, v: usize) -> Result<c_int> {
    c_int::try_from(v)
        .map_err(|_| Error::invalid_arg("batch_norm", what, v, "at most 2^31-1 for cuDNN"))
}

fn status(what: &str, s: dsys::cudnnStatus_t) -> Result<()> {
    s.result().map_err(|e| dnn_err(what, e))
}

impl CudnnBatchNorm {
    /// Descriptors for `p` (covered, see [`not_covered`]), with the workspace and reserve sizes
    /// cuDNN reports on handle `h`.
    pub(super) fn new(
        h: dsys::cudnnHandle_t,
        p: &BatchNormParams,
        dtype: DType,
    ) -> Result<CudnnBatchNorm> {
        let (dt, _) = data_type(dtype)?;
        int("n·c·h·w", p.n * p.c * p.spatial)?;
        let x = TensorDesc::new()?;
        let stats = TensorDesc::new()?;
        // Spatial dims flattened into h (w = 1): the NHWC strides are the same.
        let dims = [int("n", p.n)?, int("c", p.c)?, int("h·w", p.spatial)?, 1];
        // SAFETY: descriptors just created; the arrays are by value.
        unsafe {
            cudarc::cudnn::result::set_tensor4d_descriptor(
                x.0,
                dsys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
                dt,
                dims,
            )
            .map_err(|e| dnn_err("batch-norm input descriptor", e))?;
            status(
                "deriving the batch-norm statistics descriptor",
                dsys::cudnnDeriveBNTensorDescriptor(stats.0, x.0, MODE),
            )?;
        }
        let (ops, act) = match (p.relu, p.residual) {
            (false, _) => (Ops::CUDNN_BATCHNORM_OPS_BN, None),
            (true, residual) => {
                let mut d = std::ptr::null_mut();
                // SAFETY: an out-pointer, then the descriptor just created.
                unsafe {
                    status(
                        "activation descriptor",
                        dsys::cudnnCreateActivationDescriptor(&mut d),
                    )?;
                    let d = ActivationDesc(d);
                    status(
                        "setting the ReLU",
                        dsys::cudnnSetActivationDescriptor(
                            d.0,
                            dsys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                            dsys::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
                            0.0,
                        ),
                    )?;
                    let ops = if residual {
                        Ops::CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION
                    } else {
                        Ops::CUDNN_BATCHNORM_OPS_BN_ACTIVATION
                    };
                    (ops, Some(d))
                }
            }
        };
        let mut bn = CudnnBatchNorm {
            x,
            stats,
            act,
            ops,
            forward_workspace: 0,
            backward_workspace: 0,
            reserve: 0,
        };
        let (xd, sd, ad) = (bn.x.0, bn.stats.0, bn.act_desc());
        let zd = bn.z_desc();
        // SAFETY: live handle and descriptors; out-pointers to fields.
        unsafe {
            status(
                "forward workspace size",
                dsys::cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
                    h,
                    MODE,
                    bn.ops,
                    xd,
                    zd,
                    xd,
                    sd,
                    ad,
                    &mut bn.forward_workspace,
                ),
            )?;
            status(
                "backward workspace size",
                dsys::cudnnGetBatchNormalizationBackwardExWorkspaceSize(
                    h,
                    MODE,
                    bn.ops,
                    xd,
                    bn.y_desc(),
                    xd,
                    zd,
                    xd,
                    sd,
                    ad,
                    &mut bn.backward_workspace,
                ),
            )?;
            status(
                "reserve space size",
                dsys::cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
                    h,
                    MODE,
                    bn.ops,
                    ad,
                    xd,
                    &mut bn.reserve,
                ),
            )?;
        }
        Ok(bn)
    }

    fn act_desc(&self) -> dsys::cudnnActivationDescriptor_t {
        self.act.as_ref().map_or(std::ptr::null_mut(), |a| a.0)
    }

    /// The residual's descriptor (null without one).
    fn z_desc(&self) -> dsys::cudnnTensorDescriptor_t {
        if self.ops == Ops::CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION {
            self.x.0
        } else {
            std::ptr::null_mut()
        }
    }

    /// The forward output's descriptor as the backward reads it (the activation's input mask
    /// comes from y; null without an activation).
    fn y_desc(&self) -> dsys::cudnnTensorDescriptor_t {
        if self.act.is_some() {
            self.x.0
        } else {
            std::ptr::null_mut()
        }
    }

    /// `y = act(bn(x) (+ z))`; updates the running statistics, writes the saved mean and
    /// inverse standard deviation, and the reserve space. Pointers are device addresses of
    /// buffers the descriptors describe (the workspace and reserve of at least the sizes above).
    pub(super) fn forward(
        &self,
        h: dsys::cudnnHandle_t,
        p: &BatchNormParams,
        [x, z, y]: [u64; 3],
        [weight, bias, running_mean, running_var, mean, invstd]: [u64; 6],
        (workspace, reserve): (u64, u64),
    ) -> Result<()> {
        let (one, zero) = (1.0f32, 0.0f32);
        let v = |p: u64| p as *mut c_void;
        // SAFETY: as the doc says; alpha/beta outlive the call.
        let s = unsafe {
            dsys::cudnnBatchNormalizationForwardTrainingEx(
                h,
                MODE,
                self.ops,
                &one as *const f32 as *const c_void,
                &zero as *const f32 as *const c_void,
                self.x.0,
                v(x),
                self.z_desc(),
                v(z),
                self.x.0,
                v(y),
                self.stats.0,
                v(weight),
                v(bias),
                p.momentum,
                v(running_mean),
                v(running_var),
                p.eps,
                v(mean),
                v(invstd),
                self.act_desc(),
                v(workspace),
                self.forward_workspace,
                v(reserve),
                self.reserve,
            )
        };
        status("batch-norm forward", s)
    }

    /// The gradients of x (and of the residual, `dz`), weight and bias from `dy`, with the
    /// forward's saved statistics, output `y` and reserve space.
    pub(super) fn backward(
        &self,
        h: dsys::cudnnHandle_t,
        p: &BatchNormParams,
        [x, y, dy]: [u64; 3],
        (dx, dz): (u64, u64),
        [weight, bias, dweight, dbias, mean, invstd]: [u64; 6],
        (workspace, reserve): (u64, u64),
    ) -> Result<()> {
        let (one, zero) = (1.0f32, 0.0f32);
        let (a, b) = (
            &one as *const f32 as *const c_void,
            &zero as *const f32 as *const c_void,
        );
        let v = |p: u64| p as *mut c_void;
        // SAFETY: as `forward`; alpha/beta outlive the call.
        let s = unsafe {
            dsys::cudnnBatchNormalizationBackwardEx(
                h,
                MODE,
                self.ops,
                a,
                b,
                a,
                b,
                self.x.0,
                v(x),
                self.y_desc(),
                v(y),
                self.x.0,
                v(dy),
                self.z_desc(),
                v(dz),
                self.x.0,
                v(dx),
                self.stats.0,
                v(weight),
                v(bias),
                v(dweight),
                v(dbias),
                p.eps,
                v(mean),
                v(invstd),
                self.act_desc(),
                v(workspace),
                self.backward_workspace,
                v(reserve),
                self.reserve,
            )
        };
        status("batch-norm backward", s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(format: MemoryFormat, residual: bool, relu: bool, eps: f64) -> BatchNormParams {
        BatchNormParams {
            n: 2,
            c: 64,
            spatial: 49,
            format,
            eps,
            momentum: 0.1,
            residual,
            relu,
        }
    }

    #[test]
    fn covers_channels_last_float_types_with_cudnn_epilogues() {
        let cl = MemoryFormat::ChannelsLast;
        for d in [DType::F16, DType::BF16, DType::F32] {
            for (res, relu) in [(false, false), (false, true), (true, true)] {
                assert_eq!(not_covered(&params(cl, res, relu, 1e-5), d), None);
            }
        }
        // What cuDNN's *Ex API has no form for, or refuses.
        assert!(not_covered(
            &params(MemoryFormat::Contiguous, false, true, 1e-5),
            DType::F16
        )
        .is_some());
        assert!(not_covered(&params(cl, true, false, 1e-5), DType::F16).is_some());
        assert!(not_covered(&params(cl, false, false, 1e-6), DType::F16).is_some());
        assert!(not_covered(&params(cl, false, false, 1e-5), DType::F64).is_some());
    }
}
