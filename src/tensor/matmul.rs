//! Matrix products: 2-D, batched, and `linear` (x·Wᵀ + b).

use super::autocast::{self, OpKind};
use super::{Shape, Tensor};
use crate::autograd::Op;
use crate::backend::MatmulDims;
use crate::base::error::{Error, Result};

impl Tensor {
    /// Matrix product. `[m,k]·[k,n]`, batched `[..,m,k]·[..,k,n]` with equal batch dims, or
    /// `[..,m,k]·[k,n]` (the batch folded into the rows).
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        if let Some((a, b)) = autocast::inputs2(OpKind::Matmul, self, rhs)? {
            return a.matmul(&b);
        }
        if self.rank() < 2 || rhs.rank() < 2 {
            return Err(Error::shape_mismatch(
                "matmul",
                self.shape(),
                rhs.shape(),
                "both operands need at least 2 dims",
            ));
        }
        if self.rank() > 2 && rhs.rank() == 2 {
            let k = self.dims()[self.rank() - 1];
            // The product of the leading dims, not elem_count / k: that is 0 when k = 0.
            let rows = self.dims()[..self.rank() - 1].iter().product();
            let out = self.reshape(vec![rows, k])?.matmul(rhs)?;
            let mut dims = self.dims().to_vec();
            *dims.last_mut().expect("rank > 2") = rhs.dims()[1];
            return out.reshape(dims);
        }
        self.mm(rhs, false, false)
    }

    /// `x·Wᵀ (+ b)` for `x` of shape `[.., in]`, `W` `[out, in]`, `b` `[out]` (PyTorch's Linear).
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        if let Some((x, w, b)) = autocast::inputs3(OpKind::Linear, self, weight, bias)? {
            return x.linear(&w, b.as_ref());
        }
        if weight.rank() != 2 || self.rank() < 1 || self.dims()[self.rank() - 1] != weight.dims()[1]
        {
            return Err(Error::shape_mismatch(
                "linear",
                self.shape(),
                weight.shape(),
                "input [.., in] needs weight [out, in]",
            ));
        }
        // Checked here too so that the error names the op the caller used.
        if self.dtype() != weight.dtype() {
            return Err(Error::DTypeMismatch {
                op: "linear",
                lhs: self.dtype(),
                rhs: weight.dtype(),
            });
        }
        let inf = weight.dims()[1];
        let rows = self.dims()[..self.rank() - 1].iter().product();
        let x2 = self.reshape(vec![rows, inf])?;
        let y = match bias {
            None => x2.mm(weight, false, true)?,
            Some(b) => {
                if b.dims() != [weight.dims()[0]] {
                    return Err(Error::shape_mismatch(
                        "linear",
                        weight.shape(),
                        b.shape(),
                        "bias must be [out]",
                    ));
                }
                if b.dtype() == x2.dtype() {
                    x2.mm_bias(weight, b)?
                } else {
                    // Mixed dtypes promote as `add` does.
                    x2.mm(weight, false, true)?.add(b)?
                }
            }
        };
        let mut dims = self.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = weight.dims()[0];
        y.reshape(dims)
    }

    /// `gelu_tanh(x·Wᵀ + b)` (GPT-2's MLP up-projection) as one op: on the GPU the bias and the
    /// activation run in cuBLASLt's epilogue, which also keeps the pre-activation for the
    /// backward. The same values as `x.linear(w, Some(b))?.gelu_tanh()` but for the one
    /// rounding of the pre-activation the fused form skips.
    pub fn linear_gelu_tanh(&self, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
        if let Some((x, w, b)) = autocast::inputs3(OpKind::Linear, self, weight, Some(bias))? {
            let b = b.as_ref().unwrap_or(bias);
            return x.linear_gelu_tanh(&w, b);
        }
        let fused = weight.rank() == 2
            && self.rank() >= 1
            && bias.dims() == [weight.dims()[0]]
            && self.dtype() == weight.dtype()
            && bias.dtype() == self.dtype()
            && self.dims()[self.rank() - 1] == weight.dims()[1];
        if !fused {
            // The unfused ops say what is wrong, or promote mixed dtypes.
            return self.linear(weight, Some(bias))?.gelu_tanh();
        }
        self.same_device("linear", weight)?;
        self.same_device("linear", bias)?;
        self.float_only("linear")?;
        let inf = weight.dims()[1];
        let rows = self.dims()[..self.rank() - 1].iter().product();
        let x2 = self.reshape(vec![rows, inf])?;
        let (dims, shape) = matmul_dims(x2.shape(), weight.shape(), false, true)?;
        super::check_size("linear", &shape, self.dtype())?;
        let (x, wc, bc) = (x2.contiguous()?, weight.contiguous()?, bias.contiguous()?);
        let (s, pre) = x.storage().linear_bias_gelu(
            &x.layout(),
            &wc.storage(),
            &wc.layout(),
            &bc.storage(),
            &bc.layout(),
            &dims,
        )?;
        let pre = Tensor::from_storage(pre, super::Layout::contiguous(shape.clone()));
        let y = Tensor::from_op(s, shape, &[&x2, weight, bias], || Op::LinearGelu {
            x: x.detach(),
            w: wc.detach(),
            pre,
        });
        let mut out = self.dims().to_vec();
        *out.last_mut().expect("rank >= 1") = weight.dims()[0];
        y.reshape(out)
    }

    /// `self · wᵀ + b` as one op (`self` `[rows, in]`, `w` `[out, in]`, `b` `[out]`): the bias
    /// joins the product's epilogue, and its gradient the weight gradient's.
    fn mm_bias(&self, w: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.same_device("linear", w)?;
        self.same_device("linear", b)?;
        self.float_only("linear")?;
        let (dims, shape) = matmul_dims(self.shape(), w.shape(), false, true)?;
        super::check_size("linear", &shape, self.dtype())?;
        let (x, wc, bc) = (self.contiguous()?, w.contiguous()?, b.contiguous()?);
        let s = x.storage().linear_bias(
            &x.layout(),
            &wc.storage(),
            &wc.layout(),
            &bc.storage(),
            &bc.layout(),
            &dims,
        )?;
        Ok(Tensor::from_op(s, shape, &[self, w, b], || Op::Linear {
            x: x.detach(),
            w: wc.detach(),
        }))
    }

    /// A linear layer's weight and bias gradients from its output gradient `self` (`[rows,
    /// out]`) and input `x` (`[rows, in]`), in one product (not recorded).
    pub(crate) fn linear_weight_grad(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let (g, x) = (self.contiguous()?, x.contiguous()?);
        let (dims, shape) = matmul_dims(g.shape(), x.shape(), true, false)?;
        let (dw, db) =
            g.storage()
                .linear_weight_grad(&g.layout(), &x.storage(), &x.layout(), &dims)?;
        let out = Shape::new(vec![dims.m]);
        Ok((
            Tensor::from_storage(dw, super::Layout::contiguous(shape)),
            Tensor::from_storage(db, super::Layout::contiguous(out)),
        ))
    }

    /// `op(self)·op(rhs)` where `op` transposes the last two dims when asked; batch dims equal.
    fn mm(&self, rhs: &Tensor, trans_a: bool, trans_b: bool) -> Result<Tensor> {
        self.same_device("matmul", rhs)?;
        if self.dtype() != rhs.dtype() {
            return Err(Error::DTypeMismatch {
                op: "matmul",
                lhs: self.dtype(),
                rhs: rhs.dtype(),
            });
        }
        self.float_only("matmul")?;
        let (dims, shape) = matmul_dims(self.shape(), rhs.shape(), trans_a, trans_b)?;
        // [m, 0]·[0, n] can ask for more than exists.
        super::check_size("matmul", &shape, self.dtype())?;
        let (a, b) = (self.contiguous()?, rhs.contiguous()?);
        let s = a
            .storage()
            .matmul(&a.layout(), &b.storage(), &b.layout(), &dims)?;
        Ok(Tensor::from_op(s, shape, &[self, rhs], || Op::Matmul {
            lhs: a.detach(),
            rhs: b.detach(),
            dims,
        }))
    }

    /// The product the backward passes of matmul need, reshaped to `out` (not recorded).
    pub(crate) fn matmul_raw(
        a: &Tensor,
        b: &Tensor,
        trans_a: bool,
        trans_b: bool,
        out: &Shape,
    ) -> Result<Tensor> {
        let t = a.mm(b, trans_a, trans_b)?;
        t.reshape(out.clone())
    }
}

fn matmul_dims(a: &Shape, b: &Shape, ta: bool, tb: bool) -> Result<(MatmulDims, Shape)> {
    let (ra, rb) = (a.rank(), b.rank());
    let (ad, bd) = (a.dims(), b.dims());
    if ra != rb || ad[..ra - 2] != bd[..rb - 2] {
        return Err(Error::shape_mismatch(
            "matmul",
            a,
            b,
            "batch dims must be equal",
        ));
    }
    let (m, ka) = if ta {
        (ad[ra - 1], ad[ra - 2])
    } else {
        (ad[ra - 2], ad[ra - 1])
    };
    let (kb, n) = if tb {
        (bd[rb - 1], bd[rb - 2])
    } else {
        (bd[rb - 2], bd[rb - 1])
    };
    if ka != kb {
        return Err(Error::shape_mismatch(
            "matmul",
            a,
            b,
            format!("inner dims differ: {ka} vs {kb}"),
        ));
    }
    let batch: usize = ad[..ra - 2].iter().product();
    let mut out = ad[..ra - 2].to_vec();
    out.extend([m, n]);
    let dims = MatmulDims {
        batch,
        m,
        n,
        k: ka,
        trans_a: ta,
        trans_b: tb,
        a_batch_stride: m * ka,
        b_batch_stride: ka * n,
    };
    Ok((dims, Shape::new(out)))
}
