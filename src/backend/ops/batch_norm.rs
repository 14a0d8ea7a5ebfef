//! Batch normalisation: the training forward (with a fused residual add and ReLU), its
//! backward, and SyncBatchNorm's pieces.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::{Layout, MemoryFormat};

/// Batch normalisation over `[n, c, spatial]` (H·W flattened), statistics per channel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormParams {
    pub n: usize,
    pub c: usize,
    pub spatial: usize,
    /// Contiguous: `[n, c, spatial]` in memory; ChannelsLast: `[n, spatial, c]`.
    pub format: MemoryFormat,
    pub eps: f64,
    /// Running-statistics momentum (PyTorch's convention: new = (1-m)·old + m·batch).
    pub momentum: f64,
    /// Fused epilogue: a residual is added after the normalisation (`y = bn(x) + r`) ...
    pub residual: bool,
    /// ... then ReLU (`y = relu(bn(x) [+ r])`).
    pub relu: bool,
}

impl BatchNormParams {
    /// The length of one rank's row of SyncBatchNorm statistics (`batch_norm_stats`): each
    /// channel's mean, each channel's sum of squared deviations, then the count.
    pub fn stats_len(&self) -> usize {
        2 * self.c + 1
    }

    /// Checks that `len` values are `ranks` rows of statistics before a backend reads them
    /// (`batch_norm_gather_stats`; the CUDA kernel would read past a shorter buffer).
    pub fn check_gathered_stats(&self, ranks: usize, len: usize) -> Result<()> {
        if len == ranks * self.stats_len() {
            return Ok(());
        }
        Err(crate::base::error::Error::invalid_arg(
            "batch_norm_gather_stats",
            "statistics",
            format!("{len} value(s)"),
            format!("{ranks} row(s) of {}", self.stats_len()),
        ))
    }
}

/// What a training-mode batch norm keeps for its backward: the batch statistics (`mean` and
/// `invstd = 1/sqrt(var + eps)`, F32 of length `c`, F64 for F64 inputs), and whatever else the
/// implementation that ran needs (cuDNN's reserve space, which holds its fused ReLU's mask; its
/// presence tells the CUDA backward that cuDNN ran the forward).
#[derive(Debug)]
pub struct BatchNormSaved<S> {
    pub mean: S,
    pub invstd: S,
    pub reserve: Option<S>,
}

impl<S> BatchNormSaved<S> {
    /// The same buffers converted one by one (a backend's into the tensor layer's).
    pub fn map<T>(self, mut f: impl FnMut(S) -> T) -> BatchNormSaved<T> {
        BatchNormSaved {
            mean: f(self.mean),
            invstd: f(self.invstd),
            reserve: self.reserve.map(f),
        }
    }

    /// As [`BatchNormSaved::map`], the first failure returned (the tensor layer's buffers
    /// into one backend's, each checked to be on it).
    pub fn try_map<T>(self, mut f: impl FnMut(S) -> Result<T>) -> Result<BatchNormSaved<T>> {
        Ok(BatchNormSaved {
            mean: f(self.mean)?,
            invstd: f(self.invstd)?,
            reserve: self.reserve.map(f).transpose()?,
        })
    }
}

/// What the batch-norm backward returns: the gradients of the input, weight and bias, and of the
/// residual when the forward added one (the gradient through the ReLU).
#[derive(Debug)]
pub struct BatchNormGrads<S> {
    pub input: S,
    pub weight: S,
    pub bias: S,
    pub residual: Option<S>,
}

impl<S> BatchNormGrads<S> {
    /// The same buffers converted one by one.
    pub fn map<T>(self, mut f: impl FnMut(S) -> T) -> BatchNormGrads<T> {
        BatchNormGrads {
            input: f(self.input),
            weight: f(self.weight),
            bias: f(self.bias),
            residual: self.residual.map(f),
        }
    }
}

/// Batch normalisation. Operands contiguous, or channels_last where
/// [`BackendStorage::channels_last_native`] says so (`p.format`).
pub trait BatchNormOps: BackendStorage {
    /// Training-mode batch norm, with the fused epilogue `p.residual` / `p.relu` asks for
    /// (`residual` laid out as the input). `weight`, `bias`, running statistics are F32 of length
    /// `c` (contiguous, offset 0); the running statistics are updated in place (unbiased
    /// variance, as PyTorch). Returns `y` (in `l`'s format) and what the backward reads.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_train(
        &self,
        l: &Layout,
        residual: Option<(&Self, &Layout)>,
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, BatchNormSaved<Self>)>;
    /// Called on the output gradient with what the forward saved; `y` is the forward output,
    /// which the fused ReLU's backward reads (`p.relu`); `bias` is the forward's (cuDNN's fused
    /// ReLU backward reads it).
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_backward(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        weight: &Self,
        bias: &Self,
        saved: BatchNormSaved<&Self>,
        p: &BatchNormParams,
    ) -> Result<BatchNormGrads<Self>>;

    // SyncBatchNorm's pieces (PyTorch's batch_norm_stats, _gather_stats, _elemt,
    // _backward_reduce, _backward_elemt): the statistics and the gradient sums leave the
    // backend between the pieces, to be combined over the processes.

    /// The local batch's statistics: F64 `[2c + 1]`, each channel's mean, each channel's sum
    /// of squared deviations from its mean, then the count of values per channel (`n·spatial`).
    fn batch_norm_stats(&self, l: &Layout, p: &BatchNormParams) -> Result<Self>;
    /// Called on `ranks` rows of [`BackendStorage::batch_norm_stats`] (F64 `[ranks, 2c + 1]`,
    /// contiguous, rank order): the union's `(mean, invstd, count)`, mean and invstd in the
    /// running statistics' dtype (`[c]`, biased variance as `batch_norm_train` saves them),
    /// count F64 `[1]`. The running statistics are updated in place (unbiased variance). Every
    /// process computes the same values from the same rows.
    fn batch_norm_gather_stats(
        &self,
        ranks: usize,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Self, Self)>;
    /// `y = (x − mean)·invstd·weight + bias` with `p`'s epilogue: the training forward's output
    /// given its statistics (`weight`, `bias`, `mean`, `invstd` as `batch_norm_train`'s).
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_elemt(
        &self,
        l: &Layout,
        residual: Option<(&Self, &Layout)>,
        weight: &Self,
        bias: &Self,
        mean: &Self,
        invstd: &Self,
        p: &BatchNormParams,
    ) -> Result<Self>;
    /// Called on the output gradient: `[Σ g'·x̂, Σ g']` per channel over this batch (`[2c]`,
    /// the statistics' dtype; g' is the gradient through the fused ReLU, read from `y`), which
    /// are the weight's and the bias's gradients.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_backward_reduce(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        mean: &Self,
        invstd: &Self,
        p: &BatchNormParams,
    ) -> Result<Self>;
    /// Called on the output gradient: the input's gradient given `sums` (as
    /// `batch_norm_backward_reduce`'s, summed over the processes) and `count` (F64 `[1]`, the
    /// values per channel over the processes), and g' for the residual when `p.residual`.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_backward_elemt(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        weight: &Self,
        mean: &Self,
        invstd: &Self,
        sums: &Self,
        count: &Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Option<Self>)>;
}
