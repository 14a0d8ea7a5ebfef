//! The layer-norm family's operands: layer norm and RMS norm over the last dim(s) of a tensor,
//! seen as `rows` rows of `cols` values each.
//!
//! Statistics are in the accumulation type (f32 for f32/f16/bf16, f64 for f64) whatever the
//! input's dtype. The affine parameters (`weight`, `bias`: `cols` values) are either of the
//! input's dtype or of its accumulation type (f32 parameters of a half input, as AMP's O2 keeps
//! them); their gradients come back in their own dtype.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::{DType, Layout, Shape};

/// Which normalisation: `Layer` subtracts the row's mean and divides by its standard deviation;
/// `Rms` only divides by the root mean square (no mean, no bias).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    Layer,
    Rms,
}

impl NormKind {
    pub fn name(self) -> &'static str {
        match self {
            NormKind::Layer => "layer_norm",
            NormKind::Rms => "rms_norm",
        }
    }
}

/// A norm over `rows` contiguous rows of `cols` values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNormParams {
    pub kind: NormKind,
    pub rows: usize,
    pub cols: usize,
    pub eps: f64,
}

/// What the forward keeps for the backward: per row, the mean (zero for RMS norm) and
/// `rstd = 1/sqrt(var + eps)` (`1/sqrt(mean(x²) + eps)` for RMS norm), in the accumulation type.
#[derive(Debug)]
pub struct NormSaved<S> {
    pub mean: S,
    pub rstd: S,
}

/// What the backward returns: the input's gradient, and the weight's and bias's when the norm
/// has them and they were asked for.
#[derive(Debug)]
pub struct NormGrads<S> {
    pub input: S,
    pub weight: Option<S>,
    pub bias: Option<S>,
}

impl<S> NormGrads<S> {
    /// The same buffers converted one by one (a backend's into the tensor layer's).
    pub fn map<T>(self, mut f: impl FnMut(S) -> T) -> NormGrads<T> {
        NormGrads {
            input: f(self.input),
            weight: self.weight.map(&mut f),
            bias: self.bias.map(f),
        }
    }
}

/// The backward's parameters besides the norm's: the parameters' dtype (the weight's, else the
/// bias's: their gradients' dtype; `None` without parameters) and which gradients to compute.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormBackwardParams {
    pub norm: LayerNormParams,
    pub param_dtype: Option<DType>,
    pub want: NormParamGrads,
}

/// Layer norm and RMS norm (contiguous operands; weight and bias of `cols` values).
pub trait LayerNormOps: BackendStorage {
    /// The norm of `self` (the input, `rows × cols`) with the optional affine parameters: the
    /// output (the input's dtype) and the per-row statistics for the backward.
    fn layer_norm(
        &self,
        l: &Layout,
        affine: NormAffine<'_, Self>,
        p: &LayerNormParams,
    ) -> Result<(Self, NormSaved<Self>)>;

    /// Called on the output's gradient with the forward's input, statistics and weight: the
    /// input's gradient and the parameters' that `p.want` asks for.
    fn layer_norm_backward(
        &self,
        l: &Layout,
        o: NormBackwardOperands<'_, Self>,
        p: &NormBackwardParams,
    ) -> Result<NormGrads<Self>>;
}

/// The layout of a whole buffer of per-row statistics.
pub fn norm_stats_layout(rows: usize) -> Layout {
    Layout::contiguous(Shape::new(vec![rows]))
}

impl<S> NormSaved<S> {
    /// The same buffers converted one by one.
    pub fn map<T>(self, mut f: impl FnMut(S) -> T) -> NormSaved<T> {
        NormSaved {
            mean: f(self.mean),
            rstd: f(self.rstd),
        }
    }
}

/// A storage and its layout.
pub type NormOperand<'a, S> = (&'a S, &'a Layout);

/// The forward's operands besides the input: the optional affine parameters (of the input's
/// dtype, or f32 for a half input; both of one dtype).
pub struct NormAffine<'a, S> {
    pub weight: Option<NormOperand<'a, S>>,
    pub bias: Option<NormOperand<'a, S>>,
}

/// Which parameter gradients the backward computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormParamGrads {
    pub weight: bool,
    pub bias: bool,
}

/// The backward's operands besides the output's gradient: the forward's input (contiguous, of
/// the gradient's dtype), its saved statistics (laid out as [`norm_stats_layout`]) and the
/// weight when the forward had one.
pub struct NormBackwardOperands<'a, S> {
    pub x: NormOperand<'a, S>,
    pub saved: NormSaved<NormOperand<'a, S>>,
    pub weight: Option<NormOperand<'a, S>>,
}
