//! Layer norm and RMS norm over the last dim(s): validation, the autocast hook and the autograd
//! rule. Statistics are f32 (f64 for f64) whatever the input's dtype; the output has the
//! input's dtype. The weight and bias are of the input's dtype or f32 for a half input (AMP's
//! O2 keeps norm parameters f32); their gradients come back in their own dtype. Under autocast
//! both ops are in the f32 class (as torch's `layer_norm`): half inputs are cast to f32 and the
//! output is f32.

use super::autocast::{self, OpKind};
use super::{DType, Shape, Tensor};
use crate::autograd::Op;
use crate::backend::{LayerNormParams, NormAffine, NormKind};
use crate::base::error::{Error, Result};

/// What the backward of a norm reads (the node's saved tensors).
#[derive(Debug)]
pub(crate) struct NormNode {
    pub(crate) x: Tensor,
    pub(crate) weight: Option<Tensor>,
    pub(crate) has_bias: bool,
    pub(crate) param_dtype: Option<DType>,
    pub(crate) mean: Tensor,
    pub(crate) rstd: Tensor,
    pub(crate) p: LayerNormParams,
    pub(crate) param_shape: Shape,
}

impl Tensor {
    /// Layer norm over the last `normalized_shape.len()` dims (PyTorch's `F.layer_norm`):
    /// `(x − mean)/sqrt(var + eps)·weight + bias`, with the biased variance.
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        self.norm(NormKind::Layer, normalized_shape, weight, bias, eps)
    }

    /// RMS norm over the last `normalized_shape.len()` dims (PyTorch's `F.rms_norm`):
    /// `x/sqrt(mean(x²) + eps)·weight`.
    pub fn rms_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        self.norm(NormKind::Rms, normalized_shape, weight, None, eps)
    }

    fn norm(
        &self,
        kind: NormKind,
        ns: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let mut all = vec![self];
        all.extend(weight);
        all.extend(bias);
        let ak = match kind {
            NormKind::Layer => OpKind::LayerNorm,
            NormKind::Rms => OpKind::RmsNorm,
        };
        if let Some(c) = autocast::inputs_n(ak, &all)? {
            let mut it = c.iter();
            let x = it.next().unwrap_or(self);
            let w = weight.and_then(|_| it.next());
            let b = bias.and_then(|_| it.next());
            return x.norm(kind, ns, w, b, eps);
        }
        let p = self.check_norm(kind, ns, weight, bias, eps)?;
        let param_dtype = weight.or(bias).map(|t| t.dtype());
        let x = self.contiguous()?;
        let w = weight.map(|t| t.contiguous()).transpose()?;
        let b = bias.map(|t| t.contiguous()).transpose()?;
        let (y, saved) = {
            let xs = x.storage();
            let (ws, bs) = (
                w.as_ref().map(|t| t.storage()),
                b.as_ref().map(|t| t.storage()),
            );
            let (wl, bl) = (
                w.as_ref().map(|t| t.layout()),
                b.as_ref().map(|t| t.layout()),
            );
            let affine = NormAffine {
                weight: ws.as_deref().zip(wl.as_deref()),
                bias: bs.as_deref().zip(bl.as_deref()),
            };
            xs.layer_norm(&x.layout(), affine, &p)?
        };
        let stats = Shape::new(vec![p.rows]);
        let mean = Tensor::from_storage(saved.mean, stats.clone());
        let rstd = Tensor::from_storage(saved.rstd, stats);
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let node = NormNode {
            x: x.detach(),
            weight: w.map(|t| t.detach()),
            has_bias: bias.is_some(),
            param_dtype,
            mean,
            rstd,
            p,
            param_shape: Shape::new(ns.to_vec()),
        };
        Ok(Tensor::from_op(y, self.shape().clone(), &inputs, || {
            Op::Norm(Box::new(node))
        }))
    }

    /// Checks the operands of a norm and gives its parameters.
    fn check_norm(
        &self,
        kind: NormKind,
        ns: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<LayerNormParams> {
        let op = kind.name();
        self.float_only(op)?;
        let dims = self.dims();
        if ns.is_empty() || ns.len() > dims.len() || dims[dims.len() - ns.len()..] != *ns {
            return Err(Error::invalid_arg(
                op,
                "normalized_shape",
                format!("{ns:?}"),
                format!("one or more of the input's last dims (the input is {dims:?})"),
            ));
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::invalid_arg(op, "eps", eps, "a finite value >= 0"));
        }
        for (name, t) in [("weight", weight), ("bias", bias)] {
            let Some(t) = t else { continue };
            self.same_device(op, t)?;
            if t.dims() != ns {
                return Err(Error::invalid_arg(
                    op,
                    name,
                    format!("shape {:?}", t.dims()),
                    format!("normalized_shape, {ns:?}"),
                ));
            }
            let x = self.dtype();
            if !(t.dtype() == x || (t.dtype() == DType::F32 && x.is_half())) {
                return Err(Error::UnsupportedDType {
                    op,
                    got: t.dtype(),
                    expected: "parameters of the input's dtype, or f32 for an f16/bf16 input",
                });
            }
        }
        if let (Some(w), Some(b)) = (weight, bias) {
            if w.dtype() != b.dtype() {
                return Err(Error::DTypeMismatch {
                    op,
                    lhs: w.dtype(),
                    rhs: b.dtype(),
                });
            }
        }
        let cols: usize = ns.iter().product();
        let rows = dims[..dims.len() - ns.len()].iter().product();
        Ok(LayerNormParams {
            kind,
            rows,
            cols,
            eps,
        })
    }
}

impl NormNode {
    pub(crate) fn name(&self) -> &'static str {
        self.p.kind.name()
    }
}
