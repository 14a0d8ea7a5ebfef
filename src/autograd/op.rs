//! What a graph node keeps for its backward formula, and the formula. A node keeps only the
//! tensors its formula reads (PyTorch's saved tensors) plus the shapes and dtypes of its inputs:
//! the graph's edges (`super::Edge`) are separate, so an activation nobody's backward reads is
//! freed as soon as the forward pass lets go of it.
//!
//! Saved tensors are detached handles (sharing the buffer, no graph node), so a node never keeps
//! another node alive through them. Formulas are written with tensor ops (run under `no_grad`)
//! or the backends' backward kernels, one module per op family (`op/elementwise.rs`, ...,
//! named as `tensor/`'s): a new op adds its variant here, a line to [`Op::name`] and to the
//! dispatch in [`Op::backward`], and its formula to its family's module.

mod activation;
mod attention;
mod batch_norm;
mod cast;
mod conv;
mod cross_entropy;
mod dropout;
mod elementwise;
mod embedding;
mod layer_norm;
mod matmul;
mod pool;
mod reduce;
mod softmax;
mod view;

use crate::backend::{
    Activation, AdaptivePoolParams, BatchNormParams, BinaryOp, Conv2dParams, DropoutParams,
    EmbeddingParams, MaskedSoftmaxParams, MatmulDims, Pool2dParams, UnaryOp,
};
use crate::base::error::{Error, Result};
use crate::tensor::{DType, Device, Shape, Tensor};

pub(crate) enum Op {
    ToDType {
        from: DType,
    },
    ToDevice {
        from: Device,
    },
    /// `saved` is the output for exp, sqrt and relu (whose derivatives read it), the input for
    /// log, sqr and abs, nothing for neg.
    Unary {
        saved: Option<Tensor>,
        op: UnaryOp,
    },
    Affine {
        mul: f64,
    },
    Powf {
        x: Tensor,
        e: f64,
    },
    /// Add and sub keep only the shapes; mul, div, maximum and minimum keep both operands.
    Binary {
        operands: Option<(Tensor, Tensor)>,
        lhs_shape: Shape,
        rhs_shape: Shape,
        op: BinaryOp,
    },
    BroadcastTo {
        from: Shape,
    },
    Sum {
        from: Shape,
        dim: usize,
    },
    /// Max or min along `dim`; `index` holds the position chosen in each lane.
    MaxMin {
        from: Shape,
        dim: usize,
        index: Tensor,
    },
    Reshape {
        from: Shape,
    },
    /// A copy into another layout (contiguous(), a memory-format change): the gradient passes
    /// through as it is.
    Relayout,
    Permute {
        perm: Vec<usize>,
    },
    Narrow {
        from: Shape,
        dim: usize,
        start: usize,
    },
    Cat {
        lens: Vec<usize>,
        dim: usize,
    },
    Gather {
        from: Shape,
        dim: usize,
        index: Tensor,
    },
    Matmul {
        lhs: Tensor,
        rhs: Tensor,
        dims: MatmulDims,
    },
    /// `x·wᵀ + b` in one product (inputs x, w, b).
    Linear {
        x: Tensor,
        w: Tensor,
    },
    /// `gelu_tanh(x·wᵀ + b)` in one product, `pre` the pre-activation (inputs x, w, b).
    LinearGelu {
        x: Tensor,
        w: Tensor,
        pre: Tensor,
    },
    /// `x` is kept when the weight needs a gradient, `w` when the input does.
    Conv2d {
        x: Option<Tensor>,
        w: Option<Tensor>,
        x_shape: Shape,
        w_shape: Shape,
        p: Conv2dParams,
    },
    /// Inputs x, w, b (and the residual when `p.residual`); `y`, the output, is kept for the
    /// fused ReLU's mask.
    BatchNorm {
        x: Tensor,
        w: Tensor,
        b: Tensor,
        y: Option<Tensor>,
        mean: Tensor,
        invstd: Tensor,
        /// What the implementation that ran keeps besides (cuDNN's reserve space).
        reserve: Option<Tensor>,
        p: BatchNormParams,
    },
    MaxPool2d {
        from: Shape,
        argmax: Tensor,
        p: Pool2dParams,
    },
    AvgPool2d {
        from: Shape,
        p: Pool2dParams,
    },
    AdaptiveAvgPool2d {
        from: Shape,
        p: AdaptivePoolParams,
    },
    Softmax {
        y: Tensor,
        dim: usize,
        log: bool,
    },
    /// Layer norm and RMS norm (what the backward reads: `tensor/layer_norm.rs`).
    Norm(Box<crate::tensor::layer_norm::NormNode>),
    /// GELU / SiLU of the saved input `x`.
    Activation {
        x: Tensor,
        act: Activation,
    },
    /// An embedding lookup by the saved indices (the table is the one input).
    Embedding {
        idx: Tensor,
        p: EmbeddingParams,
    },
    /// Dropout; `state` is the generator state the forward drew its mask at.
    Dropout {
        state: Tensor,
        p: DropoutParams,
    },
    /// The fused cross-entropy (what the backward reads: `tensor/cross_entropy.rs`).
    CrossEntropy(Box<crate::tensor::cross_entropy::CrossEntropyNode>),
    /// The scaled, causal-masked softmax of attention's math path, from its saved output.
    MaskedSoftmax {
        y: Tensor,
        p: MaskedSoftmaxParams,
    },
    /// Fused scaled-dot-product attention (what the backward reads: `tensor/attention.rs`).
    Sdpa(Box<crate::tensor::attention::SdpaNode>),
    /// The same over one packed `[B, T, 3, H, D]` projection (one input, one gradient).
    SdpaPacked(Box<crate::tensor::attention::SdpaNode>),
    /// A user-defined function (`autograd::custom_function`).
    Custom(Box<super::hooks::CustomOp>),
    /// A checkpointed function, recomputed in backward (`autograd::checkpoint`).
    Checkpoint(Box<super::checkpoint::CheckpointOp>),
}

impl Op {
    /// The op's name, for errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Op::ToDType { .. } => "to_dtype",
            Op::ToDevice { .. } => "to_device",
            Op::Unary { op, .. } => op.name(),
            Op::Affine { .. } => "affine",
            Op::Powf { .. } => "powf",
            Op::Binary { op, .. } => op.name(),
            Op::BroadcastTo { .. } => "broadcast_as",
            Op::Sum { .. } => "sum",
            Op::MaxMin { .. } => "max/min",
            Op::Reshape { .. } => "reshape",
            Op::Relayout => "contiguous",
            Op::Permute { .. } => "permute",
            Op::Narrow { .. } => "narrow",
            Op::Cat { .. } => "cat",
            Op::Gather { .. } => "gather",
            Op::Matmul { .. } => "matmul",
            Op::Linear { .. } => "linear",
            Op::LinearGelu { .. } => "linear_gelu",
            Op::Conv2d { .. } => "conv2d",
            Op::BatchNorm { p, .. } if p.residual => "batch_norm_add_relu",
            Op::BatchNorm { p, .. } if p.relu => "batch_norm_relu",
            Op::BatchNorm { .. } => "batch_norm",
            Op::MaxPool2d { .. } => "max_pool2d",
            Op::AvgPool2d { .. } => "avg_pool2d",
            Op::AdaptiveAvgPool2d { .. } => "adaptive_avg_pool2d",
            Op::Softmax { .. } => "softmax",
            Op::Norm(n) => n.name(),
            Op::Activation { act, .. } => act.name(),
            Op::Embedding { .. } => "embedding",
            Op::Dropout { .. } => "dropout",
            Op::CrossEntropy(_) => "cross_entropy",
            Op::MaskedSoftmax { .. } => "scaled_masked_softmax",
            Op::Sdpa(_) | Op::SdpaPacked(_) => "scaled_dot_product_attention",
            Op::Custom(f) => f.name,
            Op::Checkpoint(c) => c.name(),
        }
    }

    /// The gradient of each input (in the order the op recorded them) whose `needs` entry is
    /// true, given `g`, the gradient of the output; `None` for the others. An input whose
    /// `may_beside` entry is true may get its gradient computed beside the main stream
    /// (`beside.rs`); those that did are added to `beside`. An input offered in `add_into`
    /// may get its gradient added into the one offered (see [`AddInto`]). Each op family's
    /// formulas are in the module of its name.
    pub(crate) fn backward(
        &self,
        g: &Tensor,
        needs: &[bool],
        may_beside: &[bool],
        beside: &mut Vec<usize>,
        add_into: &mut AddInto,
    ) -> Result<Vec<Option<Tensor>>> {
        let w = &mut Wanted {
            needs,
            may_beside,
            beside,
            add_into,
        };
        match self {
            Op::ToDType { .. } | Op::ToDevice { .. } => cast::backward(self, g, w),
            Op::Unary { .. } | Op::Affine { .. } | Op::Powf { .. } | Op::Binary { .. } => {
                elementwise::backward(self, g, w)
            }
            Op::Sum { .. } | Op::MaxMin { .. } => reduce::backward(self, g, w),
            Op::BroadcastTo { .. }
            | Op::Reshape { .. }
            | Op::Relayout
            | Op::Permute { .. }
            | Op::Narrow { .. }
            | Op::Cat { .. }
            | Op::Gather { .. } => view::backward(self, g, w),
            Op::Matmul { .. } => matmul::backward(self, g, w),
            Op::Linear { .. } | Op::LinearGelu { .. } => matmul::linear_backward(self, g, w),
            Op::Conv2d { .. } => conv::backward(self, g, w),
            Op::BatchNorm { .. } => batch_norm::backward(self, g, w),
            Op::MaxPool2d { .. } | Op::AvgPool2d { .. } | Op::AdaptiveAvgPool2d { .. } => {
                pool::backward(self, g, w)
            }
            Op::Softmax { .. } => softmax::backward(self, g, w),
            Op::Norm(_) => layer_norm::backward(self, g, w),
            Op::Activation { .. } => activation::backward(self, g, w),
            Op::Embedding { .. } => embedding::backward(self, g, w),
            Op::Dropout { .. } => dropout::backward(self, g, w),
            Op::CrossEntropy(_) => cross_entropy::backward(self, g, w),
            Op::MaskedSoftmax { .. } | Op::Sdpa(_) | Op::SdpaPacked(_) => {
                attention::backward(self, g, w)
            }
            Op::Custom(f) => f.backward(g, needs),
            Op::Checkpoint(c) => c.backward(g, needs),
        }
    }

    /// The error of a family's formulas handed an op of another family (a dispatch bug).
    fn misrouted(&self, family: &str) -> Error {
        Error::Backward(format!(
            "{}: routed to the backward of the {family} family",
            self.name()
        ))
    }
}

/// Gradients the engine has already summed for some inputs of a node (another consumer's part
/// came first), offered so that the formula adds its own part into them in place rather than
/// returning a new tensor for the engine to add: a residual network's block input gets the
/// shortcut's gradient first and the convolution's second, and cuDNN adds the second as it
/// writes it (beta = 1), a pass over the activation fewer per block. The engine offers only
/// tensors nothing else holds ([`Op::adds_into`] says which inputs may take one).
///
/// A formula that takes an offer returns that tensor, its own part added, as the input's
/// gradient; the engine puts the offers not taken back and adds to them as to any sum.
#[derive(Default)]
pub(crate) struct AddInto {
    /// Per input: the gradient summed so far, when offered and not taken.
    pub(crate) offered: Vec<Option<Tensor>>,
}

impl Op {
    /// Whether the formula can add input `i`'s gradient into one offered (`AddInto`).
    pub(crate) fn adds_into(&self, i: usize) -> bool {
        matches!(self, Op::Conv2d { .. }) && i == 0
    }
}

/// Which input gradients a formula computes, and which of them may run beside the main stream.
pub(super) struct Wanted<'a> {
    needs: &'a [bool],
    may_beside: &'a [bool],
    beside: &'a mut Vec<usize>,
    add_into: &'a mut AddInto,
}

impl Wanted<'_> {
    /// The gradient summed so far for input `i`, when the engine offers one: the formula
    /// returns it with its own part added, or gives it back with [`Wanted::decline`].
    fn take_offer(&mut self, i: usize) -> Option<Tensor> {
        self.add_into.offered.get_mut(i).and_then(Option::take)
    }

    /// Gives an offer back untouched: the engine adds the formula's result to it.
    fn decline(&mut self, i: usize, t: Tensor) {
        if let Some(slot) = self.add_into.offered.get_mut(i) {
            *slot = Some(t);
        }
    }

    /// Whether input `i`'s gradient is wanted.
    fn need(&self, i: usize) -> bool {
        self.needs.get(i).copied().unwrap_or(false)
    }

    /// Whether input `i`'s gradient may be computed beside the main stream.
    fn may_beside(&self, i: usize) -> bool {
        self.may_beside.get(i).copied().unwrap_or(false)
    }

    /// Records that input `i`'s gradient was computed beside.
    fn went_beside(&mut self, i: usize) {
        self.beside.push(i);
    }

    /// `f()` when input `i`'s gradient is wanted.
    fn maybe(&self, i: usize, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
        self.need(i).then(f).transpose()
    }

    /// The gradient list of a one-input op.
    fn one(&self, f: impl FnOnce() -> Result<Tensor>) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![self.maybe(0, f)?])
    }
}
