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
use super::{DType, Device, DropoutGenerator, Layout, Shape, Storage, Tensor};
use crate::autograd::Op;
use crate::backend::{bthd_as_bhtd, MaskedSoftmaxParams, SdpaKeyValue, SdpaParams, SdpaSaved};
use crate::base::error::{Error, Result};

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
/// kernels available on the device ([`crate::backend::cuda::flash_attention_available`]).
pub fn fused_supported(device: Device, dtype: DType, head_dim: usize, opts: &SdpaOptions) -> bool {
    let Device::Cuda(ordinal) = device else {
        return false;
    };
    dtype.is_half()
        && matches!(head_dim, 64 | 128)
        && opts.mask.is_none()
        && opts.dropout_p == 0.0
        && crate::backend::cuda::flash_attention_available(ordinal)
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
        // The fused kernels take one head size for q, k and v.
        let ok = self.rank() == 4
            && k.rank() == 4
            && v.rank() == 4
            && k.dtype() == self.dtype()
            && v.dtype() == self.dtype()
            && v.dims()[3] == self.dims()[3];
        if ok && fused_supported(self.device(), dtype, self.dims()[3], opts) {
            AttentionPath::Fused
        } else {
            AttentionPath::Math
        }
    }

    /// The math path on checked inputs.
    fn sdpa_math(&self, k: &Tensor, v: &Tensor, opts: &SdpaOptions, d: &Dims) -> Result<Tensor> {
        let scores = Shape::new(vec![d.batch, d.heads, d.seq_q, d.seq_k]);
        let out = Shape::new(vec![d.batch, d.heads, d.seq_q, d.head_dim_v]);
        let dropout = |p: Tensor| match (opts.dropout_p > 0.0, opts.generator) {
            (true, Some(g)) => p.dropout(opts.dropout_p, g),
            _ => Ok(p),
        };
        let Some(m) = opts.mask else {
            // QKᵀ: k passed transposed to the product.
            let s = Tensor::matmul_raw(self, k, false, true, &scores)?;
            let probs = dropout(s.scaled_masked_softmax(d.scale, opts.causal)?)?;
            return Tensor::matmul_raw(&probs, v, false, false, &out);
        };
        // With a mask, the whole computation in the accumulation type, rounded once at the end:
        // PyTorch runs a masked call in a fused kernel that keeps scores and probabilities in
        // f32, and half scores or probabilities were measurably further from the exact result.
        let acc = if self.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let (qa, ka, va) = (self.to_dtype(acc)?, k.to_dtype(acc)?, v.to_dtype(acc)?);
        let probs = Tensor::matmul_raw(&qa, &ka, false, true, &scores)?
            .affine(d.scale, 0.0)?
            .add(m)?
            .scaled_masked_softmax(1.0, opts.causal)?;
        Tensor::matmul_raw(&dropout(probs)?, &va, false, false, &out)?.to_dtype(self.dtype())
    }

    /// The fused path on checked inputs: q, k, v as they are where their last dim is dense
    /// (strided views of a fused QKV projection pass without a copy).
    fn sdpa_fused_checked(
        &self,
        k: &Tensor,
        v: &Tensor,
        opts: &SdpaOptions,
        d: &Dims,
    ) -> Result<Tensor> {
        let (q, k, v) = (fused_operand(self)?, fused_operand(k)?, fused_operand(v)?);
        let (o, layout, lse, p) = fused_forward(&q, &k, &v, opts, d)?;
        Ok(Tensor::from_op_with_output(o, layout, &[&q, &k, &v], |o| {
            Op::Sdpa(Box::new(SdpaNode {
                q: q.detach(),
                k: k.detach(),
                v: v.detach(),
                o,
                lse,
                p,
            }))
        }))
    }

    /// Attention over one fused QKV projection `self` `[B, T, 3, H, D]` (q, k, v in that order
    /// along dim 2, GPT-2's `c_attn` output viewed so): the same as taking the three slices,
    /// permuting each to `[B, H, T, D]` and calling [`Tensor::scaled_dot_product_attention`].
    /// On the fused path it is one autograd node over the projection, whose backward writes
    /// dq, dk, dv into one `[B, T, 3, H, D]` gradient: three slices would each scatter into a
    /// zeroed projection-sized gradient, summed after.
    pub fn scaled_dot_product_attention_packed(&self, opts: &SdpaOptions) -> Result<Tensor> {
        if let Some(x) = autocast::inputs1(OpKind::Attention, self)? {
            return x.scaled_dot_product_attention_packed(opts);
        }
        if self.rank() != 5 || self.dims()[2] != 3 {
            return Err(Error::invalid_shape(
                OP,
                self.shape(),
                "a packed projection must be [batch, seq, 3, heads, head_dim]",
            ));
        }
        let slices = |t: &Tensor| -> Result<(Tensor, Tensor, Tensor)> {
            let part = |i: usize| t.narrow(2, i, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3]);
            Ok((part(0)?, part(1)?, part(2)?))
        };
        let (q, k, v) = slices(self)?;
        if q.attention_path(&k, &v, opts) != AttentionPath::Fused {
            return q.scaled_dot_product_attention(&k, &v, opts);
        }
        let d = check(&q, &k, &v, opts)?;
        // The kernels read the slices where they lie; the graph sees one op on `self`.
        let (q, k, v) = slices(&self.detach())?;
        let (q, k, v) = (fused_operand(&q)?, fused_operand(&k)?, fused_operand(&v)?);
        let (o, layout, lse, p) = fused_forward(&q, &k, &v, opts, &d)?;
        Ok(Tensor::from_op_with_output(o, layout, &[self], |o| {
            Op::SdpaPacked(Box::new(SdpaNode { q, k, v, o, lse, p }))
        }))
    }

    /// The packed node's backward: dq, dk, dv side by side as `[B, T, 3, H, D]`.
    pub(crate) fn sdpa_backward_packed(&self, n: &SdpaNode) -> Result<Tensor> {
        let p = &n.p;
        if let Some(packed) =
            self.sdpa_backward_with(n, |g, l, saved| g.sdpa_backward_packed(l, saved, p))?
        {
            let shape = vec![p.batch, p.seq_q, 3, p.heads, p.head_dim];
            return Ok(Tensor::from_storage(packed, Shape::new(shape)));
        }
        let (dq, dk, dv) = self.sdpa_backward(n)?;
        // Each is a [B, H, T, D] view of a dense [B, T, H, D] buffer: back to that, with a
        // unit dim for the stack.
        let bthd = |t: Tensor| t.permute(&[0, 2, 1, 3])?.unsqueeze(2);
        Tensor::cat(&[&bthd(dq)?, &bthd(dk)?, &bthd(dv)?], 2)
    }

    /// The fused path whatever [`Tensor::attention_path`] would choose (on the CPU: its
    /// reference implementation), for tests that compare the two paths. Masks and dropout are
    /// refused, as the fused kernels refuse them.
    #[doc(hidden)]
    pub fn scaled_dot_product_attention_fused(
        &self,
        k: &Tensor,
        v: &Tensor,
        opts: &SdpaOptions,
    ) -> Result<Tensor> {
        let d = check(self, k, v, opts)?;
        if opts.mask.is_some() || opts.dropout_p > 0.0 {
            return Err(Error::Unsupported {
                op: OP,
                detail: "the fused path takes no additive mask and no dropout".into(),
            });
        }
        self.sdpa_fused_checked(k, v, opts, &d)
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
        let p = MaskedSoftmaxParams {
            batch: self.dims()[..r - 2].iter().product(),
            seq_q: self.dims()[r - 2],
            seq_k: self.dims()[r - 1],
            scale,
            causal,
        };
        let x = self.contiguous()?;
        let y = x.storage().masked_softmax(&x.layout(), &p)?;
        Ok(Tensor::from_op_with_output(
            y,
            self.shape().clone(),
            &[self],
            |y| Op::MaskedSoftmax { y, p },
        ))
    }

    /// The masked softmax's backward: the output's gradient (`self`) through the saved output.
    pub(crate) fn masked_softmax_backward(
        &self,
        y: &Tensor,
        p: &MaskedSoftmaxParams,
    ) -> Result<Tensor> {
        let g = self.contiguous()?;
        let s = g
            .storage()
            .masked_softmax_backward(&g.layout(), &y.storage(), &y.layout(), p)?;
        Ok(Tensor::from_storage(s, y.shape().clone()))
    }

    /// Runs `f` on dO (`self`, made a fused operand) and what the forward saved.
    fn sdpa_backward_with<R>(
        &self,
        n: &SdpaNode,
        f: impl FnOnce(&Storage, &Layout, SdpaSaved<'_, Storage>) -> Result<R>,
    ) -> Result<R> {
        let g = fused_operand(self)?;
        let gs = g.storage();
        let (qs, ks, vs, os, ls) = (
            n.q.storage(),
            n.k.storage(),
            n.v.storage(),
            n.o.storage(),
            n.lse.storage(),
        );
        let (ql, kl, vl, ol, ll) = (
            n.q.layout(),
            n.k.layout(),
            n.v.layout(),
            n.o.layout(),
            n.lse.layout(),
        );
        let saved = SdpaSaved {
            q: (&*qs, &*ql),
            k: (&*ks, &*kl),
            v: (&*vs, &*vl),
            o: (&*os, &*ol),
            lse: (&*ls, &*ll),
        };
        f(&gs, &g.layout(), saved)
    }

    /// The fused path's backward: dq, dk, dv from dO (`self`) and what the forward saved.
    pub(crate) fn sdpa_backward(&self, n: &SdpaNode) -> Result<(Tensor, Tensor, Tensor)> {
        let p = &n.p;
        let (dq, dk, dv) =
            self.sdpa_backward_with(n, |g, l, saved| g.sdpa_backward(l, saved, p))?;
        Ok((
            Tensor::from_storage(dq, bthd_as_bhtd(p.batch, p.heads, p.seq_q, p.head_dim)),
            Tensor::from_storage(dk, bthd_as_bhtd(p.batch, p.heads, p.seq_k, p.head_dim)),
            Tensor::from_storage(dv, bthd_as_bhtd(p.batch, p.heads, p.seq_k, p.head_dim_v)),
        ))
    }
}

/// What the fused path's backward reads: the forward's q, k, v (as it read them), its output
/// and the rows' log-sum-exps.
#[derive(Debug)]
pub(crate) struct SdpaNode {
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    pub(crate) o: Tensor,
    pub(crate) lse: Tensor,
    pub(crate) p: SdpaParams,
}

/// The fused kernels' forward on q, k, v: the output's storage and `[B, H, T, Dv]` layout (a
/// view of a dense `[B, T, H, Dv]` buffer), the rows' log-sum-exps and the sizes.
fn fused_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &SdpaOptions,
    d: &Dims,
) -> Result<(
    crate::tensor::storage::Storage,
    crate::base::Layout,
    Tensor,
    SdpaParams,
)> {
    let p = SdpaParams {
        batch: d.batch,
        heads: d.heads,
        seq_q: d.seq_q,
        seq_k: d.seq_k,
        head_dim: d.head_dim,
        head_dim_v: d.head_dim_v,
        causal: opts.causal,
        scale: d.scale,
    };
    let (o, lse) = {
        let (qs, ks, vs) = (q.storage(), k.storage(), v.storage());
        let (ql, kl, vl) = (q.layout(), k.layout(), v.layout());
        let kv = SdpaKeyValue {
            k: (&*ks, &*kl),
            v: (&*vs, &*vl),
        };
        qs.sdpa_forward(&ql, kv, &p)?
    };
    let lse = Tensor::from_storage(lse, Shape::new(vec![p.batch, p.heads, p.seq_q]));
    let layout = bthd_as_bhtd(p.batch, p.heads, p.seq_q, p.head_dim_v);
    Ok((o, layout, lse, p))
}

/// An operand of the fused kernels: as it is when its last dim is dense, else a contiguous copy.
fn fused_operand(t: &Tensor) -> Result<Tensor> {
    let l = t.layout();
    if l.dims().last() == Some(&1) || l.strides().last() == Some(&1) {
        Ok(t.clone())
    } else {
        t.contiguous()
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
