//! Scaled-dot-product attention (PyTorch's `F.scaled_dot_product_attention`): validation, the
//! autocast hook, the choice between the fused path and the math path, and the math path.
//!
//! The math path is `softmax(scale·QKᵀ + mask, causal)·V` from recorded ops: two batched products
//! (the transposes passed to the product, never copied), the family's fused scaled, causal-masked
//! softmax (f32 math, the input's dtype out), dropout on the probabilities. The fused path (flash
//! attention: `O` and the row log-sum-exps in one pass, no `[Tq, Tk]` matrix kept) is taken only
//! where [`fused_supported`] says so; its autograd op saves q, k, v, O and the log-sum-exps.
//!
//! Under autocast the op is in the half class (as torch's): q, k and v are cast to the scope's
//! half type (the mask keeps its dtype), and the output has the inputs' dtype.

use super::autocast::{self, OpKind};
use super::{DType, Device, DropoutGenerator, Shape, Tensor};
use crate::error::{Error, Result};

const OP: &str = "scaled_dot_product_attention";

/// The options of [`Tensor::scaled_dot_product_attention`] (PyTorch's keyword arguments).
#[derive(Clone, Copy, Debug, Default)]
pub struct SdpaOptions<'a> {
    /// Masks key `j > i` for query `i` (top-left aligned, as torch's `is_causal`).
    pub causal: bool,
    /// The scores' scale; `1/sqrt(head_dim)` when `None`.
    pub scale: Option<f64>,
    /// Added to the scaled scores: broadcastable to `[B, H, Tq, Tk]`, of f32 or the inputs'
    /// dtype (`-inf` masks an entry out).
    pub mask: Option<&'a Tensor>,
    /// Dropout on the attention probabilities; needs `generator` when > 0.
    pub dropout_p: f64,
    /// Where dropout draws its masks.
    pub generator: Option<&'a DropoutGenerator>,
}

/// Which implementation a call runs (see [`Tensor::attention_path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    /// Flash attention: one kernel forward, one backward, nothing of size `Tq × Tk` kept.
    Fused,
    /// `softmax(scale·QKᵀ + mask)·V` from batched products and the fused masked softmax.
    Math,
}

/// Whether the fused path takes a call on `device` in `dtype` with this head size and these
/// options: CUDA, f16/bf16, head_dim 64 or 128, no additive mask, no dropout, and the fused
/// kernel built into this process ([`crate::backend::cuda::flash_attention_available`]).
pub fn fused_supported(device: Device, dtype: DType, head_dim: usize, opts: &SdpaOptions) -> bool {
    matches!(device, Device::Cuda(_))
        && dtype.is_half()
        && matches!(head_dim, 64 | 128)
        && opts.mask.is_none()
        && opts.dropout_p == 0.0
        && crate::backend::cuda::flash_attention_available()
}

/// The checked sizes and scale of a call.
#[derive(Clone, Copy, Debug)]
struct Dims {
    batch: usize,
    heads: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
    head_dim_v: usize,
    scale: f64,
}

impl Tensor {
    /// Attention of the queries `self` `[B, H, Tq, D]` over the keys `k` `[B, H, Tk, D]` and the
    /// values `v` `[B, H, Tk, Dv]`: `softmax(scale·QKᵀ + mask)·V`, `[B, H, Tq, Dv]`, with the
    /// causal mask and dropout of `opts`. q, k and v may be strided views (slices of one fused
    /// QKV projection `[B, T, 3, H, D]` permuted to `[B, H, T, D]`, say). A row whose every key
    /// is masked out gives zeros (torch's math path since 2.5). Which implementation runs:
    /// [`Tensor::attention_path`].
    pub fn scaled_dot_product_attention(
        &self,
        k: &Tensor,
        v: &Tensor,
        opts: &SdpaOptions,
    ) -> Result<Tensor> {
        if let Some(c) = autocast::inputs_n(OpKind::Attention, &[self, k, v])? {
            if let [q, k, v] = c.as_slice() {
                return q.scaled_dot_product_attention(k, v, opts);
            }
        }
        let d = check(self, k, v, opts)?;
        match self.attention_path(k, v, opts) {
            AttentionPath::Fused => self.sdpa_fused_checked(k, v, opts, &d),
            AttentionPath::Math => self.sdpa_math(k, v, opts, &d),
        }
    }

    /// Which path [`Tensor::scaled_dot_product_attention`] takes for these inputs (under
    /// autocast: for them cast to the scope's half type). Inputs the call would refuse give
    /// `Math`.
    pub fn attention_path(&self, k: &Tensor, v: &Tensor, opts: &SdpaOptions) -> AttentionPath {
        let dtype = match autocast::active() {
            Some(half) if self.dtype().is_float() => half,
            _ => self.dtype(),
        };
        let ok = self.rank() == 4
            && k.rank() == 4
            && v.rank() == 4
            && k.dtype() == self.dtype()
            && v.dtype() == self.dtype();
        if ok && fused_supported(self.device(), dtype, self.dims()[3], opts) {
            AttentionPath::Fused
        } else {
            AttentionPath::Math
        }
    }

    /// The math path on checked inputs.
    fn sdpa_math(&self, k: &Tensor, v: &Tensor, opts: &SdpaOptions, d: &Dims) -> Result<Tensor> {
        let scores = Shape::new(vec![d.batch, d.heads, d.seq_q, d.seq_k]);
        // QKᵀ: k passed transposed to the product.
        let s = Tensor::matmul_raw(self, k, false, true, &scores)?;
        let probs = match opts.mask {
            None => s.scaled_masked_softmax(d.scale, opts.causal)?,
            Some(m) => {
                // The mask is added in the accumulation type, and the softmax reads that sum.
                let acc = if self.dtype() == DType::F64 {
                    DType::F64
                } else {
                    DType::F32
                };
                s.to_dtype(acc)?
                    .affine(d.scale, 0.0)?
                    .add(m)?
                    .scaled_masked_softmax(1.0, opts.causal)?
                    .to_dtype(self.dtype())?
            }
        };
        let probs = match (opts.dropout_p > 0.0, opts.generator) {
            (true, Some(g)) => probs.dropout(opts.dropout_p, g)?,
            _ => probs,
        };
        let out = Shape::new(vec![d.batch, d.heads, d.seq_q, d.head_dim_v]);
        Tensor::matmul_raw(&probs, v, false, false, &out)
    }

    /// The fused path on checked inputs.
    fn sdpa_fused_checked(
        &self,
        _k: &Tensor,
        _v: &Tensor,
        _opts: &SdpaOptions,
        _d: &Dims,
    ) -> Result<Tensor> {
        Err(Error::Unsupported {
            op: OP,
            detail: "fused attention is not built yet".into(),
        })
    }

    /// `softmax(scale·x)` over the last dim with, when `causal`, entry `j > i` of each trailing
    /// `[Tq, Tk]` matrix masked out (0 in the output): the attention probabilities of the math
    /// path, computed in f32 (f64 for f64) and returned in `self`'s dtype. A row with nothing
    /// left unmasked (every score `-inf`) gives zeros.
    pub fn scaled_masked_softmax(&self, scale: f64, causal: bool) -> Result<Tensor> {
        let op = "scaled_masked_softmax";
        self.float_only(op)?;
        if self.rank() < 2 {
            return Err(Error::invalid_shape(
                op,
                self.shape(),
                "at least 2 dims, the last two [Tq, Tk]",
            ));
        }
        if !scale.is_finite() {
            return Err(Error::invalid_arg(op, "scale", scale, "a finite value"));
        }
        let r = self.rank();
        let (tq, tk) = (self.dims()[r - 2], self.dims()[r - 1]);
        let acc = if self.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let mut s = self.to_dtype(acc)?.affine(scale, 0.0)?;
        if causal {
            let mut m = vec![0.0f64; tq * tk];
            for i in 0..tq {
                for j in (i + 1).min(tk)..tk {
                    m[i * tk + j] = f64::NEG_INFINITY;
                }
            }
            let m = Tensor::from_vec(m, [tq, tk], Device::Cpu)?
                .to_dtype(acc)?
                .to_device(self.device())?;
            s = s.add(&m)?;
        }
        s.softmax(-1)?.to_dtype(self.dtype())
    }
}

/// Checks q, k, v and the options; the sizes and the scale.
fn check(q: &Tensor, k: &Tensor, v: &Tensor, opts: &SdpaOptions) -> Result<Dims> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 {
            return Err(Error::invalid_shape(
                OP,
                t.shape(),
                format!("{name} must be [batch, heads, seq, head_dim] (4 dims)"),
            ));
        }
    }
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    if kd[..2] != qd[..2] || vd[..2] != qd[..2] || kd[3] != qd[3] || vd[2] != kd[2] {
        return Err(Error::invalid_arg(
            OP,
            "q, k, v",
            format!("shapes {qd:?}, {kd:?}, {vd:?}"),
            "q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, Dv]",
        ));
    }
    if qd[3] == 0 {
        return Err(Error::invalid_shape(
            OP,
            q.shape(),
            "a head_dim of at least 1",
        ));
    }
    q.float_only(OP)?;
    for t in [k, v] {
        q.same_device(OP, t)?;
        if t.dtype() != q.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                lhs: q.dtype(),
                rhs: t.dtype(),
            });
        }
    }
    let scale = opts.scale.unwrap_or(1.0 / (qd[3] as f64).sqrt());
    if !scale.is_finite() {
        return Err(Error::invalid_arg(OP, "scale", scale, "a finite value"));
    }
    if !(0.0..=1.0).contains(&opts.dropout_p) {
        return Err(Error::invalid_arg(
            OP,
            "dropout_p",
            opts.dropout_p,
            "a probability in [0, 1]",
        ));
    }
    if opts.dropout_p > 0.0 {
        let Some(g) = opts.generator else {
            return Err(Error::invalid_arg(
                OP,
                "generator",
                "None",
                "a DropoutGenerator when dropout_p > 0",
            ));
        };
        if g.device() != q.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: q.device(),
                rhs: g.device(),
            });
        }
    }
    if let Some(m) = opts.mask {
        q.same_device(OP, m)?;
        if !(m.dtype() == DType::F32 || m.dtype() == q.dtype()) {
            return Err(Error::UnsupportedDType {
                op: OP,
                got: m.dtype(),
                expected: "a mask of f32 or of q's dtype",
            });
        }
        let scores = Shape::new(vec![qd[0], qd[1], qd[2], kd[2]]);
        let b = m.shape().broadcast_with(OP, &scores)?;
        if b != scores || m.rank() > 4 {
            return Err(Error::shape_mismatch(
                OP,
                m.shape(),
                &scores,
                "the mask must broadcast to the scores [B, H, Tq, Tk]",
            ));
        }
    }
    Ok(Dims {
        batch: qd[0],
        heads: qd[1],
        seq_q: qd[2],
        seq_k: kd[2],
        head_dim: qd[3],
        head_dim_v: vd[3],
        scale,
    })
}
