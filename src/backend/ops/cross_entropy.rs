//! The cross-entropy family's operands: the loss of `rows` rows of `classes` logits against one
//! class index per row, fused (PyTorch's `F.cross_entropy` over `[n, c]`).
//!
//! The math is in the accumulation type (f32 for f16/bf16/f32, f64 for f64) whatever the logits'
//! dtype, and no copy of the logits in that type is made: the forward reads each row once and
//! keeps its logsumexp; the backward reads the logits, that logsumexp and the targets and writes
//! the logits' gradient in their own dtype. Per row, with `ε` the label smoothing, `V` the
//! class count, `t` the target and `lse = log Σ_j exp(x_j)`:
//!
//! `loss = lse − (1−ε)·x_t − (ε/V)·Σ_j x_j`, and
//! `dx_j = (exp(x_j − lse) − (1−ε)·[j = t] − ε/V)·dloss`.
//!
//! A row whose target is `ignore_index` has loss 0 and gradient 0.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::{Layout, Shape};

/// A cross-entropy over `rows` contiguous rows of `classes` logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyParams {
    pub rows: usize,
    pub classes: usize,
    /// ε in [0, 1]: the target distribution is `(1−ε)·one_hot + ε/classes`.
    pub label_smoothing: f64,
    /// The target value whose rows are left out (loss 0, gradient 0, not counted).
    pub ignore_index: Option<i64>,
}

impl CrossEntropyParams {
    /// Whether target `t` is a class index of the rows (`0..classes`).
    pub fn in_range(&self, t: i64) -> bool {
        t >= 0 && (t as u64) < self.classes as u64
    }

    /// Whether a row with target `t` is left out.
    pub fn ignored(&self, t: i64) -> bool {
        self.ignore_index == Some(t)
    }
}

/// What the forward gives, each in the accumulation type: per row the loss (0 for an ignored
/// row) and the logsumexp of the logits (what the backward reads); with an `ignore_index`, the
/// number of rows not ignored (one value), so that a mean needs no host read.
#[derive(Debug)]
pub struct CrossEntropyRows<S> {
    pub loss: S,
    pub lse: S,
    pub count: Option<S>,
}

impl<S> CrossEntropyRows<S> {
    /// The same buffers converted one by one (a backend's into the tensor layer's).
    pub fn map<T>(self, mut f: impl FnMut(S) -> T) -> CrossEntropyRows<T> {
        CrossEntropyRows {
            loss: f(self.loss),
            lse: f(self.lse),
            count: self.count.map(f),
        }
    }
}

/// The backward's operands besides the per-row gradient of the loss: the forward's logits and
/// targets and the logsumexp it saved (all contiguous).
pub struct CrossEntropyBackwardOperands<'a, S> {
    pub logits: (&'a S, &'a Layout),
    pub targets: (&'a S, &'a Layout),
    pub lse: (&'a S, &'a Layout),
}

/// The fused cross-entropy (contiguous operands: logits `rows × classes` of a float dtype,
/// targets `rows` i64).
pub trait CrossEntropyOps: BackendStorage {
    /// Called on the logits with the targets: the per-row losses, logsumexps and (with an
    /// `ignore_index`) the count of rows not ignored. A target outside `0..classes` that is not
    /// `ignore_index` is an error on the CPU; the CUDA backend raises its sticky index flag
    /// (an error at the thread's next read from the device) and gives that row a NaN loss.
    fn cross_entropy(
        &self,
        l: &Layout,
        targets: &Self,
        tl: &Layout,
        p: &CrossEntropyParams,
    ) -> Result<CrossEntropyRows<Self>>;

    /// Called on the per-row gradient of the loss (`rows` values of the accumulation type): the
    /// logits' gradient, in the logits' dtype.
    fn cross_entropy_backward(
        &self,
        l: &Layout,
        o: CrossEntropyBackwardOperands<'_, Self>,
        p: &CrossEntropyParams,
    ) -> Result<Self>;
}

/// The layout of a whole buffer of per-row values.
pub fn cross_entropy_rows_layout(rows: usize) -> Layout {
    Layout::contiguous(Shape::new(vec![rows]))
}
