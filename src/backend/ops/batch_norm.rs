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

/// The operands of [`BatchNormOps::batch_norm_train`] besides the input: the residual of the
/// fused add (laid out as the input), the affine parameters, and the running statistics, which
/// the forward updates in place.
#[derive(Debug)]
pub struct BatchNormTrainOperands<'a, S> {
    pub residual: Option<(&'a S, &'a Layout)>,
    pub weight: &'a S,
    pub bias: &'a S,
    pub running_mean: &'a mut S,
    pub running_var: &'a mut S,
}

/// The operands of [`BatchNormOps::batch_norm_backward`] besides the output gradient.
#[derive(Debug)]
pub struct BatchNormBackwardOperands<'a, S> {
    /// The forward's input.
    pub x: (&'a S, &'a Layout),
    /// The forward's output, which the fused ReLU's backward reads (`p.relu`).
    pub y: Option<(&'a S, &'a Layout)>,
    pub weight: &'a S,
    /// The forward's bias (cuDNN's fused ReLU backward reads it).
    pub bias: &'a S,
    /// What the forward saved.
    pub saved: BatchNormSaved<&'a S>,
}

/// The operands of [`BatchNormOps::batch_norm_elemt`] besides the input: the residual (laid
/// out as the input), the affine parameters and the statistics.
#[derive(Debug)]
pub struct BatchNormElemtOperands<'a, S> {
    pub residual: Option<(&'a S, &'a Layout)>,
    pub weight: &'a S,
    pub bias: &'a S,
    pub mean: &'a S,
    pub invstd: &'a S,
}

/// The operands of [`BatchNormOps::batch_norm_backward_reduce`] and
/// [`BatchNormOps::batch_norm_backward_elemt`] besides the output gradient.
#[derive(Debug)]
pub struct BatchNormGradOperands<'a, S> {
    /// The forward's input.
    pub x: (&'a S, &'a Layout),
    /// The forward's output, which the fused ReLU's backward reads (`p.relu`).
    pub y: Option<(&'a S, &'a Layout)>,
    pub mean: &'a S,
    pub invstd: &'a S,
}

/// What [`BatchNormOps::batch_norm_backward_elemt`] reads besides [`BatchNormGradOperands`]:
/// the weight, the gradient sums over every process (as `batch_norm_backward_reduce`'s) and the
/// count of values per channel over every process (F64 `[1]`).
#[derive(Debug)]
pub struct BatchNormGradSums<'a, S> {
    pub weight: &'a S,
    pub sums: &'a S,
    pub count: &'a S,
}

/// Batch normalisation. Operands contiguous, or channels_last where
/// [`BackendStorage::channels_last_native`] says so (`p.format`).
pub trait BatchNormOps: BackendStorage {
    /// Training-mode batch norm, with the fused epilogue `p.residual` / `p.relu` asks for.
    /// `weight`, `bias`, running statistics are F32 of length `c` (contiguous, offset 0; F64
    /// for F64 inputs); the running statistics are updated in place (unbiased variance, as
    /// PyTorch). Returns `y` (in `l`'s format) and what the backward reads.
    fn batch_norm_train(
        &self,
        l: &Layout,
        o: BatchNormTrainOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<(Self, BatchNormSaved<Self>)>;
    /// Called on the output gradient with what the forward saved.
    fn batch_norm_backward(
        &self,
        l: &Layout,
        o: BatchNormBackwardOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<BatchNormGrads<Self>>;

    // SyncBatchNorm's pieces (PyTorch's batch_norm_stats, _gather_stats, _elemt,
    // _backward_reduce, _backward_elemt): the statistics and the gradient sums leave the
    // backend between the pieces, to be combined over the processes.

    /// The local batch's statistics: F64 `[2c + 1]`, each channel's mean, each channel's sum
    /// of squared deviations from its mean, then the count of values per channel (`n·spatial`).
    fn batch_norm_stats(&self, l: &Layout, p: &BatchNormParams) -> Result<Self>;
    /// Called on `ranks` rows of [`BatchNormOps::batch_norm_stats`] (F64 `[ranks, 2c + 1]`,
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
    fn batch_norm_elemt(
        &self,
        l: &Layout,
        o: BatchNormElemtOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<Self>;
    /// Called on the output gradient: `[Σ g'·x̂, Σ g']` per channel over this batch (`[2c]`,
    /// the statistics' dtype; g' is the gradient through the fused ReLU, read from `y`), which
    /// are the weight's and the bias's gradients.
    fn batch_norm_backward_reduce(
        &self,
        l: &Layout,
        o: BatchNormGradOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<Self>;
    /// Called on the output gradient: the input's gradient given the sums and count over the
    /// processes, and g' for the residual when `p.residual`.
    fn batch_norm_backward_elemt(
        &self,
        l: &Layout,
        o: BatchNormGradOperands<'_, Self>,
        sums: BatchNormGradSums<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<(Self, Option<Self>)>;
}
