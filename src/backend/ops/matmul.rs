//! Matrix products.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::Layout;

/// A (batched) matrix product `C[b] = op(A[b]) · op(B[b])`, `C` is `m×n`, `k` the shared dimension.
/// With `trans_a`, `A` is stored `k×m`; with `trans_b`, `B` is stored `n×k`.
/// `a_batch_stride`/`b_batch_stride` of 0 broadcast one matrix over the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub a_batch_stride: usize,
    pub b_batch_stride: usize,
}

/// (Batched) matrix products (contiguous layouts).
pub trait MatmulOps: BackendStorage {
    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: &MatmulDims) -> Result<Self>;

    /// `self · op(w) + bias` for one (unbatched) product whose `n` columns each get `bias[j]`
    /// (a linear layer's `x·Wᵀ + b`); the bias is added to the f32 product before it is rounded,
    /// as cuBLASLt's bias epilogue does.
    fn linear_bias(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        bias: &Self,
        bl: &Layout,
        dims: &MatmulDims,
    ) -> Result<Self>;

    /// [`MatmulOps::linear_bias`] then GELU's tanh form, as cuBLASLt's GELU_AUX_BIAS epilogue:
    /// `(gelu_tanh(p), p)` with `p = self · op(w) + bias` (GELU taken of the f32 sum, `p` kept
    /// rounded for the backward).
    fn linear_bias_gelu(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        bias: &Self,
        bl: &Layout,
        dims: &MatmulDims,
    ) -> Result<(Self, Self)>;

    /// A linear layer's parameter gradients from its output gradient `self` (`[rows, out]`) and
    /// input `x` (`[rows, in]`): `dW = selfᵀ · x` (`dims` describes that product: `m` = out,
    /// `n` = in, `k` = rows, `trans_a`) and `db[j] = Σ_rows self[r, j]`, both summed in f32.
    fn linear_weight_grad(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        dims: &MatmulDims,
    ) -> Result<(Self, Self)>;
}
