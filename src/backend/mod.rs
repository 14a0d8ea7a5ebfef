//! The backend contract: what a device must compute. Every op of the crate reaches a device
//! through [`BackendStorage`]; the CPU backend is the reference implementation and the CUDA
//! backend must agree with it (tests/cuda.rs).
//!
//! Invariants every implementation relies on:
//! - every operand travels with its [`Layout`] (shape, strides, offset); what layouts each op
//!   accepts is on [`BackendStorage`];
//! - half types (F16, BF16) compute in f32 and round once on store; F64 computes in f64;
//! - binary ops receive operands of one dtype (the tensor layer promotes first);
//! - arguments were validated by the tensor layer.

pub mod cpu;
pub mod cuda;

use crate::error::Result;
use crate::tensor::{DType, Layout, MemoryFormat, Shape};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryOp {
    Neg,
    Relu,
    Exp,
    Log,
    Sqrt,
    Sqr,
    Abs,
}

impl UnaryOp {
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Relu => "relu",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Sqr => "sqr",
            UnaryOp::Abs => "abs",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

/// `(outer, len, inner)`: a tensor seen as a 3-D block around one dimension.
pub type DimSplit = (usize, usize, usize);

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

/// 2-D convolution geometry, NCHW input `[n, c_in, h, w]`, weight `[c_out, c_in/groups, kh, kw]`,
/// output `[n, c_out, out_h, out_w]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dParams {
    pub n: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
    /// How x, y (and their gradients) and the weight are stored: NCHW/KCRS, or NHWC/KRSC.
    pub format: MemoryFormat,
}

impl Conv2dParams {
    pub fn out_h(&self) -> usize {
        (self.h + 2 * self.padding.0 - self.dilation.0 * (self.kh - 1) - 1) / self.stride.0 + 1
    }
    pub fn out_w(&self) -> usize {
        (self.w + 2 * self.padding.1 - self.dilation.1 * (self.kw - 1) - 1) / self.stride.1 + 1
    }
}

/// Max / average pooling geometry over NCHW `[n, c, h, w]` (floor mode, as PyTorch's default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pool2dParams {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    /// Average pooling only: count padded cells in the divisor (PyTorch's default, true).
    pub count_include_pad: bool,
    /// How input and output are stored (NCHW or NHWC).
    pub format: MemoryFormat,
}

impl Pool2dParams {
    pub fn out_h(&self) -> usize {
        (self.h + 2 * self.padding.0 - self.kh) / self.stride.0 + 1
    }
    pub fn out_w(&self) -> usize {
        (self.w + 2 * self.padding.1 - self.kw) / self.stride.1 + 1
    }
}

/// Adaptive average pooling of `[n, c, h, w]` to `[n, c, out_h, out_w]`; output cell `(i, j)`
/// averages rows `floor(i·h/out_h) .. ceil((i+1)·h/out_h)` (PyTorch's rule), columns alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AdaptivePoolParams {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub out_h: usize,
    pub out_w: usize,
    /// How input and output are stored (NCHW or NHWC).
    pub format: MemoryFormat,
}

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

/// What the batch-norm backward returns: the gradients of the input, weight and bias, and of the
/// residual when the forward added one (the gradient through the ReLU).
#[derive(Debug)]
pub struct BatchNormGrads<S> {
    pub input: S,
    pub weight: S,
    pub bias: S,
    pub residual: Option<S>,
}

/// What a device computes. Storage types are owned buffers of one dtype on one device; every
/// operand comes with its [`Layout`] (shape, strides, offset into the buffer).
///
/// Which layouts an op accepts (the tensor layer makes the one copy an op cannot take):
/// - elementwise ops (`to_dtype`, `unary`, `affine`, `powf`, `relu_backward`): dense layouts
///   ([`Layout::is_dense`]; `relu_backward`'s two operands with equal strides), computed over the
///   span, the result keeping the input's strides at offset 0;
/// - `binary` and `copy_strided`: any strides (broadcast views have stride 0), the result in the
///   dense layout `out` the caller gives;
/// - convolution, batch norm and pooling: contiguous, or channels_last where
///   [`BackendStorage::channels_last_native`] says so (the params carry the format);
/// - everything else: contiguous layouts (any offset).
///
/// Arguments are validated by the tensor layer (shapes, dtypes, devices, geometry): backends
/// trust them.
pub trait BackendStorage: Sized {
    fn dtype(&self) -> DType;
    /// Elements in the buffer (at least the span of any layout used with it).
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether convolution, batch norm and pooling run on channels_last operands here (else the
    /// tensor layer hands them contiguous copies and converts the result back).
    fn channels_last_native(&self) -> bool;

    /// The elements of `src` laid out as `dst` (dense, offset 0) in a new buffer: the one copy
    /// every view materialises through (contiguous(), memory-format changes, expand).
    fn copy_strided(&self, src: &Layout, dst: &Layout) -> Result<Self>;

    /// Same values in another dtype (floats round to nearest even; float → i64 truncates).
    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self>;

    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self>;
    /// `x·mul + add`.
    fn affine(&self, l: &Layout, mul: f64, add: f64) -> Result<Self>;
    /// `x^e`.
    fn powf(&self, l: &Layout, e: f64) -> Result<Self>;
    /// Elementwise op of two operands viewed with the shape of `out` (broadcast operands have
    /// stride-0 layouts), written in the dense layout `out`.
    fn binary(
        &self,
        l: &Layout,
        rhs: &Self,
        rl: &Layout,
        op: BinaryOp,
        out: &Layout,
    ) -> Result<Self>;
    /// `grad · (x > 0)`: the ReLU backward mask, called on `grad`.
    fn relu_backward(&self, l: &Layout, x: &Self, xl: &Layout) -> Result<Self>;

    /// Reduces dim `dim`. Half inputs accumulate in f32.
    fn reduce(&self, l: &Layout, op: ReduceOp, dim: usize) -> Result<Self>;
    /// Index (I64) of the maximum along `dim` (first one on ties).
    fn argmax(&self, l: &Layout, dim: usize) -> Result<Self>;
    /// `out[.., j, ..] = self[.., idx[.., j, ..], ..]` along `dim`; the output has idx's shape.
    fn gather(&self, l: &Layout, idx: &Self, il: &Layout, dim: usize) -> Result<Self>;
    /// Inverse of gather: zeros of shape `out` with `self[.., j, ..]` added at
    /// `idx[.., j, ..]` along `dim` (`self` and `idx` share a shape).
    fn scatter_add(
        &self,
        l: &Layout,
        idx: &Self,
        il: &Layout,
        dim: usize,
        out: &Shape,
    ) -> Result<Self>;
    /// Concatenates along `dim` (every other dim equal).
    fn cat(parts: &[(&Self, &Layout)], dim: usize) -> Result<Self>;

    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: &MatmulDims) -> Result<Self>;

    fn conv2d(&self, l: &Layout, weight: &Self, wl: &Layout, p: &Conv2dParams) -> Result<Self>;
    /// Gradient w.r.t. the input, called on the output gradient.
    fn conv2d_backward_input(
        &self,
        l: &Layout,
        weight: &Self,
        wl: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self>;
    /// Gradient w.r.t. the weight, called on the output gradient.
    fn conv2d_backward_weight(
        &self,
        l: &Layout,
        input: &Self,
        il: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self>;

    /// Training-mode batch norm, with the fused epilogue `p.residual` / `p.relu` asks for
    /// (`residual` laid out as the input). `weight`, `bias`, running statistics are F32 of length
    /// `c` (contiguous, offset 0); the running statistics are updated in place (unbiased
    /// variance, as PyTorch). Returns `(y, saved_mean, saved_invstd)`, y in `l`'s format.
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
    ) -> Result<(Self, Self, Self)>;
    /// Called on the output gradient; `y` is the forward output, which the fused ReLU's
    /// backward reads (`p.relu`).
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_backward(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        weight: &Self,
        saved_mean: &Self,
        saved_invstd: &Self,
        p: &BatchNormParams,
    ) -> Result<BatchNormGrads<Self>>;

    /// Returns `(out, argmax)` where argmax (I64) is the flat `h·w` index of each maximum.
    fn max_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<(Self, Self)>;
    /// Called on the output gradient.
    fn max_pool2d_backward(
        &self,
        l: &Layout,
        argmax: &Self,
        al: &Layout,
        p: &Pool2dParams,
    ) -> Result<Self>;
    fn avg_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<Self>;
    fn avg_pool2d_backward(&self, l: &Layout, p: &Pool2dParams) -> Result<Self>;
    fn adaptive_avg_pool2d(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self>;
    fn adaptive_avg_pool2d_backward(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self>;

    /// Softmax (or log-softmax) over `dim`, computed in f32 (f64 for F64).
    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self>;
    /// Called on the output gradient with the forward output `y`.
    fn softmax_backward(
        &self,
        l: &Layout,
        y: &Self,
        yl: &Layout,
        dim: usize,
        log: bool,
    ) -> Result<Self>;
}

// ---- multi-tensor kernels -------------------------------------------------------------------

/// One locked buffer of a multi-tensor op: its address (host address on the CPU, device address
/// on CUDA), dtype and element count. Built by `crate::multi_tensor` from tensors it holds locked
/// for the duration of the call; backends never see a dangling one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufRef {
    pub addr: u64,
    pub dtype: DType,
    pub len: usize,
}

/// Roles of the (up to) six buffers of one tensor in a multi-tensor op. Which roles an op uses
/// is documented on [`MtKernel`]; unused roles are `None`.
pub const MT_ROLES: usize = 6;

/// One tensor of a multi-tensor op: its buffers by role, its element count (every present buffer
/// has it) and its slot (index into per-tensor arrays: step counters, norms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MtEntry {
    pub bufs: [Option<BufRef>; MT_ROLES],
    pub len: usize,
    pub slot: usize,
}

/// The device scalars and per-tensor arrays of a multi-tensor op (all F32).
#[derive(Clone, Copy, Debug, Default)]
pub struct MtScalars {
    /// `[1]`: set to 1 on a non-finite input; when non-zero, optimizer kernels do nothing.
    pub found_inf: Option<BufRef>,
    /// `[1]`: every gradient (or input) is multiplied by it.
    pub mult: Option<BufRef>,
    /// `[slots]`: per-tensor step counters (updates read `steps[slot]` before this step).
    pub steps: Option<BufRef>,
    /// Op-specific outputs/inputs, see [`MtKernel`].
    pub aux: [Option<BufRef>; 2],
}

/// `torch.optim.SGD` (and apex FusedSGD) hyperparameters as the kernels take them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdKernelParams {
    pub lr: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub weight_decay: f32,
    pub nesterov: u32,
    pub wd_after_momentum: u32,
}

/// Adam/AdamW hyperparameters as the kernels take them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamKernelParams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1: decoupled weight decay (AdamW); 0: L2 (g += wd·p).
    pub adamw: u32,
    pub bias_correction: u32,
    pub amsgrad: u32,
}

/// LAMB hyperparameters (phase 1: moments and the raw update).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LambKernelParams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    /// 1−β1 with grad averaging, else 1.
    pub beta3: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Clip the global gradient norm to this (≤ 0: off).
    pub max_grad_norm: f32,
    pub bias_correction: u32,
    /// Apply the trust ratio even without weight decay.
    pub use_nvlamb: u32,
    pub _pad: u32,
}

/// NovoGrad hyperparameters.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NovoGradKernelParams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub beta3: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub bias_correction: u32,
    /// 1: weight decay inside the first moment (apex's moment_mode 0).
    pub reg_inside_moment: u32,
    /// 0: L2 norm of the gradient, 1: inf norm.
    pub norm_type: u32,
    pub _pad: u32,
}

/// Loss-scale update (apex/PyTorch `_amp_update_scale_`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleUpdateParams {
    pub growth: f32,
    pub backoff: f32,
    pub window: f32,
    pub min: f32,
    pub max: f32,
    pub _pad: u32,
}

/// The multi-tensor kernels. Roles are indices into [`MtEntry::bufs`]; "skips" means the kernel
/// does nothing when `found_inf` is non-zero; FP32 math, half outputs rounded once on store.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MtKernel {
    /// `out(1) = in(0)·mult`; sets found_inf on a non-finite input.
    Scale,
    /// Sets found_inf on a non-finite input(0).
    Check,
    /// `out(2) = a·x(0) + b·y(1)`; check 1: x, 2: y, 3: both for non-finite values.
    Axpby { a: f32, b: f32, check: u32 },
    /// Norms of in(0)·(mult or 1): aux[0][slot] per-tensor norm (optional), aux[1][0] the global
    /// norm. `inf`: max-abs instead of L2. Sets found_inf (when given) on a non-finite input.
    Norm { inf: bool },
    /// Fused SGD over g(0), p(1), momentum(2), half copy(5); skips; first step from steps[slot].
    Sgd(SgdKernelParams),
    /// Fused Adam over g(0), p(1), m(2), v(3), vmax(4, amsgrad), half copy(5); skips.
    Adam(AdamKernelParams),
    /// LAMB phase 1 over g(0), p(1), m(2), v(3), update out(4); aux[0][0] the global grad
    /// norm (of the unscaled grads) for clipping; skips.
    LambUpdate(LambKernelParams),
    /// LAMB phase 2 over update(0), p(1), copy(5): p −= lr·ratio·u, ratio from aux[0][slot]
    /// (‖p‖) and aux[1][slot] (‖u‖); `use_ratio` when use_nvlamb or wd ≠ 0; skips.
    LambApply { lr: f32, use_ratio: u32 },
    /// NovoGrad per-tensor moment: aux[0][slot] (v) ← first ? n² : β2·v + (1−β2)·n², n =
    /// aux[1][slot] the gradient norm; one entry per tensor; skips.
    NovoGradMoment { beta2: f32 },
    /// NovoGrad update over g(0), p(1), m(2), copy(5), v in aux[0][slot]; skips.
    NovoGrad(NovoGradKernelParams),
    /// steps[slot] += 1 for each entry unless found_inf.
    StepIncrement,
    /// The loss-scale update over aux[0] = [scale, unskipped, skipped_total] buffers: see
    /// `multi_tensor::amp_update_scale`. Entries: role 0 scale, 1 unskipped, 2 skipped (one entry).
    UpdateScale(ScaleUpdateParams),
}

/// Multi-tensor apply: one call runs `kernel` over every entry (one launch per dtype signature
/// on CUDA, with the chunk table cached on the device).
pub trait MultiTensorOps {
    fn multi_tensor(
        &self,
        kernel: &MtKernel,
        entries: &[MtEntry],
        scalars: &MtScalars,
    ) -> Result<()>;
}
