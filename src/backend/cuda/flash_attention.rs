//! Fused scaled-dot-product attention on tensor cores (the `flash_attention` kernel family, the
//! FlashAttention-2 algorithm): softmax(scale·Q·Kᵀ [+ causal mask])·V without materialising the
//! T×T scores, and its backward from the saved log-sum-exp. f16 and bf16 with f32 accumulation,
//! head dim 64 or 128, any sequence lengths; sm_80 or newer (mma.sync, ldmatrix, cp.async).
//!
//! Operands are [`FlashView`]s: a buffer, an element offset and strides for (batch, head, token)
//! with the head dimension contiguous, so Q, K and V can be views into one projection output
//! (say [B, T, 3, H, D]) with no copy. Outputs are contiguous `[B, T, H, D]` (heads merge with a
//! free reshape), the log-sum-exp f32 `[B, H, Tq]`.

use super::common::sfx;
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout, Shape};

/// Threads per block of the attention kernels (4 warps, `FA_THREADS` in the kernel source).
const THREADS: u32 = 128;
/// Query rows per forward block; keys per backward block.
const BLOCK_ROWS: usize = 64;

/// One attention operand: `buf` from element `offset` on, with `strides` (in elements) for
/// (batch, head, token); the head dimension has stride 1. The kernels copy 16 bytes at a time,
/// so the offset and the strides must be multiples of 8 elements.
#[derive(Clone, Copy, Debug)]
pub struct FlashView<'a> {
    pub buf: &'a CudaStorage,
    pub offset: usize,
    pub strides: [usize; 3],
}

impl<'a> FlashView<'a> {
    /// The view of a `[B, H, T, D]` layout of `buf` (any strides but a contiguous last dim).
    pub fn from_bhtd(buf: &'a CudaStorage, l: &Layout) -> Result<Self> {
        Self::from_rank4(buf, l, [0, 1, 2])
    }

    /// The view of a `[B, T, H, D]` layout of `buf` (any strides but a contiguous last dim).
    pub fn from_bthd(buf: &'a CudaStorage, l: &Layout) -> Result<Self> {
        Self::from_rank4(buf, l, [0, 2, 1])
    }

    /// Whether a `[B, H, T, D]` layout can be taken as it is: a contiguous last dimension and
    /// an offset and strides that are multiples of 8 elements (else make it contiguous first).
    pub fn fits_bhtd(l: &Layout) -> bool {
        l.rank() == 4
            && (l.dims()[3] <= 1 || l.strides()[3] == 1)
            && l.offset().is_multiple_of(8)
            && l.strides()[..3].iter().all(|s| s.is_multiple_of(8))
    }

    /// The layout that presents an output of these kernels (a contiguous `[B, T, H, D]` buffer:
    /// O, dQ, dK, dV) as a `[B, H, T, D]` tensor, the usual shape of attention operands; its
    /// transpose(1, 2) is contiguous again, so merging heads is a reshape.
    pub fn bthd_as_bhtd(batch: usize, heads: usize, seq: usize, head_dim: usize) -> Layout {
        Layout::new(
            Shape::new(vec![batch, heads, seq, head_dim]),
            vec![seq * heads * head_dim, head_dim, heads * head_dim, 1],
            0,
        )
    }

    /// `order` gives the layout dims of (batch, head, token).
    fn from_rank4(buf: &'a CudaStorage, l: &Layout, order: [usize; 3]) -> Result<Self> {
        let (dims, st) = (l.dims(), l.strides());
        if dims.len() != 4 || (dims[3] > 1 && st[3] != 1) {
            return Err(Error::invalid_arg(
                OP,
                "layout",
                format!("shape {dims:?} strides {st:?}"),
                "a rank-4 layout whose last (head) dimension is contiguous",
            ));
        }
        Ok(FlashView {
            buf,
            offset: l.offset(),
            strides: order.map(|i| st[i]),
        })
    }
}

/// The problem: `batch`·`heads` independent attentions of `seq_q` queries over `seq_k` keys,
/// `head_dim` (64 or 128) wide. `causal`: top-left aligned, key j visible to query i iff j ≤ i.
/// `scale` multiplies Q·Kᵀ before the softmax (usually 1/√head_dim).
#[derive(Clone, Copy, Debug)]
pub struct FlashDims {
    pub batch: usize,
    pub heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub scale: f32,
}

/// The forward's operands.
#[derive(Clone, Copy, Debug)]
pub struct FlashInputs<'a> {
    pub q: FlashView<'a>,
    pub k: FlashView<'a>,
    pub v: FlashView<'a>,
}

/// The forward's results: `o` `[B, Tq, H, D]` contiguous in the inputs' dtype, `lse` f32
/// `[B, H, Tq]`, the natural log of each row's Σ exp(scale·s) over its visible keys (what the
/// backward needs).
#[derive(Debug)]
pub struct FlashOutput {
    pub o: CudaStorage,
    pub lse: CudaStorage,
}

/// The backward's operands: the forward's inputs, its output `o` (any [`FlashView`]; a
/// contiguous `[B, Tq, H, D]` buffer has strides `[Tq·H·D, D, H·D]`), its `lse` as written, and
/// `grad_out`, dL/dO, as a view like `o`'s.
#[derive(Clone, Copy, Debug)]
pub struct FlashGrads<'a> {
    pub q: FlashView<'a>,
    pub k: FlashView<'a>,
    pub v: FlashView<'a>,
    pub o: FlashView<'a>,
    pub lse: &'a CudaStorage,
    pub grad_out: FlashView<'a>,
}

/// The gradients of Q, K and V, each `[B, T, H, D]` contiguous in the inputs' dtype.
#[derive(Debug)]
pub struct FlashInputGrads {
    pub dq: CudaStorage,
    pub dk: CudaStorage,
    pub dv: CudaStorage,
}

const OP: &str = "flash_attention";

/// Mirrors the kernels' `FlashParams` struct (all fields 8 bytes but the two floats
/// at the end, so `repr(C)` lays it out as the kernel's struct).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FlashParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    dout: u64,
    dq_acc: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    dvec: u64,
    batch: i64,
    heads: i64,
    seq_q: i64,
    seq_k: i64,
    head_dim: i64,
    q_s: [i64; 3],
    k_s: [i64; 3],
    v_s: [i64; 3],
    o_s: [i64; 3],
    do_s: [i64; 3],
    causal: i64,
    scale: f32,
    scale_log2: f32,
}

impl FlashParams {
    fn new(d: &FlashDims) -> Self {
        FlashParams {
            batch: d.batch as i64,
            heads: d.heads as i64,
            seq_q: d.seq_q as i64,
            seq_k: d.seq_k as i64,
            head_dim: d.head_dim as i64,
            causal: d.causal as i64,
            scale: d.scale,
            scale_log2: d.scale * std::f32::consts::LOG2_E,
            ..Default::default()
        }
    }
}

/// Checks the device, the problem's sizes and the dtype; returns the kernel-name suffix of the
/// dtype.
pub(super) fn check_dims(d: &FlashDims, like: &CudaStorage) -> Result<&'static str> {
    let arch = like.dev.arch;
    if arch.0 < 8 {
        return Err(Error::Unsupported {
            op: OP,
            detail: format!(
                "the flash-attention kernels need compute capability 8.0 or newer (mma.sync \
                 with bf16, cp.async); cuda:{} is {}.{}",
                like.ordinal(),
                arch.0,
                arch.1
            ),
        });
    }
    let dtype = like.dtype();
    if !matches!(dtype, DType::F16 | DType::BF16) {
        return Err(Error::UnsupportedDType {
            op: OP,
            got: dtype,
            expected: "f16 or bf16 (the tensor-core attention kernel)",
        });
    }
    if d.head_dim != 64 && d.head_dim != 128 {
        return Err(Error::invalid_arg(OP, "head_dim", d.head_dim, "64 or 128"));
    }
    if d.seq_k == 0 && d.seq_q > 0 {
        return Err(Error::invalid_arg(
            OP,
            "seq_k",
            0,
            "at least one key when there are queries (a softmax over no keys is undefined)",
        ));
    }
    if !d.scale.is_finite() {
        return Err(Error::invalid_arg(OP, "scale", d.scale, "a finite number"));
    }
    Ok(sfx(dtype))
}

/// Checks view `name` of `dtype` over `seq` tokens against `d` (dtype, device, alignment,
/// bounds); returns its device address and strides for the kernel.
pub(super) fn check_view(
    name: &'static str,
    v: &FlashView<'_>,
    seq: usize,
    d: &FlashDims,
    like: &CudaStorage,
) -> Result<(u64, [i64; 3])> {
    if v.buf.dtype() != like.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            lhs: like.dtype(),
            rhs: v.buf.dtype(),
        });
    }
    if v.buf.ordinal() != like.ordinal() {
        return Err(Error::invalid_arg(
            OP,
            name,
            format!("a buffer on cuda:{}", v.buf.ordinal()),
            format!("every operand on cuda:{}", like.ordinal()),
        ));
    }
    if !v.offset.is_multiple_of(8) || v.strides.iter().any(|s| !s.is_multiple_of(8)) {
        return Err(Error::invalid_arg(
            OP,
            name,
            format!("offset {} strides {:?}", v.offset, v.strides),
            "an offset and (batch, head, token) strides that are multiples of 8 elements \
             (16-byte copies; make the operand contiguous first)",
        ));
    }
    // The last element addressed, when there is any.
    let counts = [d.batch, d.heads, seq];
    let end = if counts.contains(&0) {
        Some(v.offset)
    } else {
        counts
            .iter()
            .zip(v.strides)
            .try_fold(v.offset + d.head_dim, |acc, (&n, s)| {
                (n - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
            })
    };
    match end {
        Some(end) if end <= v.buf.len() => {}
        _ => {
            return Err(Error::invalid_arg(
                OP,
                name,
                format!(
                    "offset {} strides {:?} over (batch {}, heads {}, tokens {seq}) × {}",
                    v.offset, v.strides, d.batch, d.heads, d.head_dim
                ),
                format!("elements inside its buffer of {}", v.buf.len()),
            ))
        }
    }
    let ptr = v.buf.ptr() + (v.offset * v.buf.dtype().size_in_bytes()) as u64;
    if !ptr.is_multiple_of(16) {
        return Err(Error::invalid_arg(
            OP,
            name,
            format!("device address {ptr:#x}"),
            "a 16-byte aligned start",
        ));
    }
    Ok((ptr, v.strides.map(|s| s as i64)))
}

/// The element counts of the query-side and key-side `[B, T, H, D]` tensors, or an error when
/// one does not fit an address.
pub(super) fn sizes(d: &FlashDims) -> Result<(usize, usize)> {
    let n = |t: usize| {
        d.batch
            .checked_mul(d.heads)
            .and_then(|x| x.checked_mul(t))
            .and_then(|x| x.checked_mul(d.head_dim))
    };
    match (n(d.seq_q), n(d.seq_k)) {
        (Some(q), Some(k)) => Ok((q, k)),
        _ => Err(Error::invalid_arg(
            OP,
            "dims",
            format!("{d:?}"),
            "batch·heads·seq·head_dim that fits in an address",
        )),
    }
}

/// A grid of `blocks` attention blocks, or an error when the launch cannot hold them.
fn block_grid(blocks: usize) -> Result<Grid> {
    match u32::try_from(blocks) {
        Ok(b) if b < i32::MAX as u32 => Ok(Grid {
            blocks: b.max(1),
            threads: THREADS,
        }),
        _ => Err(Error::invalid_arg(
            OP,
            "batch·heads·blocks",
            blocks,
            "fewer than 2³¹ thread blocks",
        )),
    }
}

/// softmax(scale·Q·Kᵀ)·V for every (batch, head): O `[B, Tq, H, D]` and the LSE `[B, H, Tq]`.
pub fn flash_forward(inp: &FlashInputs<'_>, d: &FlashDims) -> Result<FlashOutput> {
    let like = inp.q.buf;
    let s = check_dims(d, like)?;
    let mut p = FlashParams::new(d);
    (p.q, p.q_s) = check_view("q", &inp.q, d.seq_q, d, like)?;
    (p.k, p.k_s) = check_view("k", &inp.k, d.seq_k, d, like)?;
    (p.v, p.v_s) = check_view("v", &inp.v, d.seq_k, d, like)?;
    let (n_q, _) = sizes(d)?;
    let rows = n_q / d.head_dim;
    let o = CudaStorage::alloc(&like.dev, like.dtype(), n_q)?;
    let lse = CudaStorage::alloc(&like.dev, DType::F32, rows)?;
    if rows == 0 {
        return Ok(FlashOutput { o, lse });
    }
    p.o = o.ptr();
    p.lse = lse.ptr();
    let grid = block_grid(d.batch * d.heads * d.seq_q.div_ceil(BLOCK_ROWS))?;
    launch!(like.dev, Family::FlashAttention, format!("flash_fwd_{s}_d{}", d.head_dim), grid; p);
    Ok(FlashOutput { o, lse })
}

/// The gradients of Q, K and V from dL/dO (`g.grad_out`) and the forward's O and LSE.
pub fn flash_backward(g: &FlashGrads<'_>, d: &FlashDims) -> Result<FlashInputGrads> {
    let like = g.q.buf;
    let s = check_dims(d, like)?;
    let mut p = FlashParams::new(d);
    (p.q, p.q_s) = check_view("q", &g.q, d.seq_q, d, like)?;
    (p.k, p.k_s) = check_view("k", &g.k, d.seq_k, d, like)?;
    (p.v, p.v_s) = check_view("v", &g.v, d.seq_k, d, like)?;
    (p.o, p.o_s) = check_view("o", &g.o, d.seq_q, d, like)?;
    (p.dout, p.do_s) = check_view("grad_out", &g.grad_out, d.seq_q, d, like)?;
    let (n_q, n_k) = sizes(d)?;
    let (rows_q, rows_k) = (n_q / d.head_dim, n_k / d.head_dim);
    if g.lse.dtype() != DType::F32 || g.lse.len() < rows_q || g.lse.ordinal() != like.ordinal() {
        return Err(Error::invalid_arg(
            OP,
            "lse",
            format!(
                "{} buffer of {} elements on cuda:{}",
                g.lse.dtype(),
                g.lse.len(),
                g.lse.ordinal()
            ),
            format!(
                "the forward's f32 [B, H, Tq] log-sum-exp ({rows_q} elements) on cuda:{}",
                like.ordinal()
            ),
        ));
    }
    p.lse = g.lse.ptr();
    let (dev, dt) = (&like.dev, like.dtype());
    let dq = CudaStorage::alloc(dev, dt, n_q)?;
    if rows_k == 0 {
        let dk = CudaStorage::alloc(dev, dt, 0)?;
        let dv = CudaStorage::alloc(dev, dt, 0)?;
        return Ok(FlashInputGrads { dq, dk, dv });
    }
    if rows_q == 0 {
        // No query sees any key.
        let dk = CudaStorage::zeroed(dev, dt, n_k)?;
        let dv = CudaStorage::zeroed(dev, dt, n_k)?;
        return Ok(FlashInputGrads { dq, dk, dv });
    }
    let dk = CudaStorage::alloc(dev, dt, n_k)?;
    let dv = CudaStorage::alloc(dev, dt, n_k)?;
    let dq_acc = CudaStorage::alloc(dev, DType::F32, n_q)?;
    let dvec = CudaStorage::alloc(dev, DType::F32, rows_q)?;
    (p.dq, p.dk, p.dv, p.dq_acc, p.dvec) = (dq.ptr(), dk.ptr(), dv.ptr(), dq_acc.ptr(), dvec.ptr());
    // head_dim / 8 threads per (batch, query, head) row.
    launch!(like.dev, Family::FlashAttention, format!("flash_bwd_pre_{s}"),
        Grid::for_items(dev, rows_q.saturating_mul(d.head_dim / 8)); p);
    let grid = block_grid(d.batch * d.heads * d.seq_k.div_ceil(BLOCK_ROWS))?;
    launch!(like.dev, Family::FlashAttention, format!("flash_bwd_{s}_d{}", d.head_dim), grid; p);
    // 8 values per thread.
    launch!(like.dev, Family::FlashAttention, format!("flash_dq_convert_{s}"),
        Grid::for_items(dev, n_q / 8); p);
    Ok(FlashInputGrads { dq, dk, dv })
}
