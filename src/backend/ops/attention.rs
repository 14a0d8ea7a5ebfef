//! The attention family's operands: the scaled, causal-masked softmax of the math path, and the
//! fused (flash) scaled-dot-product attention's forward and backward.
//!
//! Masked softmax: `batch` matrices of `seq_q × seq_k` raw scores, contiguous; row `i` of each is
//! `softmax(scale·x)` over its entries, entry `j > i` masked out (0) when `causal`. f32 math (f64
//! for f64), the output in the input's dtype; a row with nothing unmasked (every score `-inf`)
//! gives zeros.
//!
//! Fused attention: q `[B, H, Tq, D]`, k `[B, H, Tk, D]`, v `[B, H, Tk, Dv]`, O and dO
//! `[B, H, Tq, Dv]`, each a 4-D layout of any strides whose last dim has stride 1 (slices of a
//! fused QKV projection pass as they are); the log-sum-exps `[B, H, Tq]` contiguous, in the
//! accumulation type (f32; f64 for f64). O, dq, dk and dv come back in the inputs' dtype as
//! contiguous `[B, T, H, D]` buffers (the flash kernels' layout: heads merge with a reshape);
//! [`bthd_as_bhtd`] presents one as the `[B, H, T, D]` tensor it is.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::{Layout, Shape};

/// A scaled, causal-masked softmax over `batch` contiguous `seq_q × seq_k` matrices.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaskedSoftmaxParams {
    pub batch: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub scale: f64,
    pub causal: bool,
}

impl MaskedSoftmaxParams {
    /// Rows of `seq_k` values.
    pub fn rows(&self) -> usize {
        self.batch * self.seq_q
    }
}

/// The sizes of a fused attention call (`causal`: key `j > i` masked for query `i`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SdpaParams {
    pub batch: usize,
    pub heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub causal: bool,
    pub scale: f64,
}

/// A storage and its layout.
pub type SdpaOperand<'a, S> = (&'a S, &'a Layout);

/// The forward's keys and values (the queries are the call's `self`).
pub struct SdpaKeyValue<'a, S> {
    pub k: SdpaOperand<'a, S>,
    pub v: SdpaOperand<'a, S>,
}

/// What the backward reads besides dO (the call's `self`): the forward's inputs, its output and
/// its log-sum-exps.
pub struct SdpaSaved<'a, S> {
    pub q: SdpaOperand<'a, S>,
    pub k: SdpaOperand<'a, S>,
    pub v: SdpaOperand<'a, S>,
    pub o: SdpaOperand<'a, S>,
    pub lse: SdpaOperand<'a, S>,
}

/// The masked softmax of the math path and the fused attention.
pub trait AttentionOps: BackendStorage {
    /// The probabilities of the raw scores `self` (see the module doc).
    fn masked_softmax(&self, l: &Layout, p: &MaskedSoftmaxParams) -> Result<Self>;

    /// Called on the probabilities' gradient dP with the forward's output P:
    /// `dS = scale·P∘(dP − rowsum(dP∘P))`, masked entries 0 (dP's dtype).
    fn masked_softmax_backward(
        &self,
        l: &Layout,
        y: &Self,
        yl: &Layout,
        p: &MaskedSoftmaxParams,
    ) -> Result<Self>;

    /// Attention of the queries `self`: the output O and the rows' log-sum-exps of the scaled,
    /// masked scores.
    fn sdpa_forward(
        &self,
        l: &Layout,
        kv: SdpaKeyValue<'_, Self>,
        p: &SdpaParams,
    ) -> Result<(Self, Self)>;

    /// Called on dO: dq, dk, dv (with `D = rowsum(dO∘O)`, `P = exp(scale·QKᵀ − lse)`,
    /// `dS = P∘(dO·Vᵀ − D)`: `dq = scale·dS·K`, `dk = scale·dSᵀ·Q`, `dv = Pᵀ·dO`).
    fn sdpa_backward(
        &self,
        l: &Layout,
        saved: SdpaSaved<'_, Self>,
        p: &SdpaParams,
    ) -> Result<(Self, Self, Self)>;

    /// As [`AttentionOps::sdpa_backward`] for q, k and v that are the three slices of one packed
    /// `[B, T, 3, H, D]` projection (T = Tq = Tk): their gradients side by side in one such
    /// buffer, written in place by the backend, or `None` where it cannot (the caller then packs
    /// `sdpa_backward`'s three buffers).
    fn sdpa_backward_packed(
        &self,
        _l: &Layout,
        _saved: SdpaSaved<'_, Self>,
        _p: &SdpaParams,
    ) -> Result<Option<Self>> {
        Ok(None)
    }
}

/// The layout of the log-sum-exps of a call.
pub fn sdpa_lse_layout(p: &SdpaParams) -> Layout {
    Layout::contiguous(Shape::new(vec![p.batch, p.heads, p.seq_q]))
}

/// The `[B, H, T, D]` layout of a contiguous `[B, T, H, D]` buffer (the fused path's outputs).
pub fn bthd_as_bhtd(batch: usize, heads: usize, seq: usize, dim: usize) -> Layout {
    Layout::new(
        Shape::new(vec![batch, heads, seq, dim]),
        vec![seq * heads * dim, dim, heads * dim, 1],
        0,
    )
}
