//! Scaled-dot-product attention through cuDNN's fused attention engines (the graph API): the
//! forward and backward operation graphs those engines recognise (the two batched products
//! around a softmax, written out as matmul, pointwise, reduction and reshape nodes, as cuDNN's
//! frontend lowers its SDPA node), one execution plan per (direction, dtype, sizes, strides),
//! kept with the device's cuDNN state and run under its lock.
//!
//! Why beside `flash_attention.rs`: on Hopper, cuDNN's attention kernels use the warp-group
//! tensor-core instructions and the tensor memory accelerator, which our `mma.sync` kernels do
//! not; at GPT-2's shapes they are the faster path (RESULTS.md has the figures). The two are
//! interchangeable: the same inputs (strided views with a contiguous head dimension), the same
//! O layout `[B, Tq, H, D]`, and the same statistic saved for the backward (the natural-log
//! log-sum-exp of each scaled, masked row of scores), so the forward of one and the backward of
//! the other agree. Where cuDNN builds no plan (an older GPU or cuDNN, a shape its engines
//! refuse) the caller runs our kernels, and a graph that does not build is remembered as such.
//! `MIXPREC_CUDNN_ATTENTION=0`, or [`set_cudnn_attention`], turns this path off.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use cudarc::cudnn::sys as dsys;
use dsys::cudnnBackendAttributeName_t as A;
use dsys::cudnnBackendAttributeType_t as T;
use dsys::cudnnBackendDescriptorType_t as D;
use dsys::cudnnDataType_t as Dt;
use dsys::cudnnPointwiseMode_t as Pw;

use super::cudnn::{dnn_state, lock_dnn};
use super::cudnn_graph::Desc;
use super::cudnn_op_graph::{packed, Dims, OpGraph, Plan, Tn};
use super::flash_attention::{
    check_dims, check_view, sizes, FlashDims, FlashGrads, FlashInputGrads, FlashInputs, FlashOutput,
};
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::base::error::{Error, Result};
use crate::base::DType;

const OP: &str = "scaled_dot_product_attention (cuDNN)";

/// The unique ids of the graphs' non-virtual tensors (virtual ones count up from 100:
/// `cudnn_op_graph.rs`).
mod uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const O: i64 = 4;
    pub const STATS: i64 = 5;
    pub const SCALE: i64 = 6;
    pub const NEG_INF: i64 = 7;
    pub const DO: i64 = 8;
    pub const DQ: i64 = 9;
    pub const DK: i64 = 10;
    pub const DV: i64 = 11;
    pub const SOFTMAX_SUM: i64 = 12;
    pub const DQ_ACCUM: i64 = 13;
    pub const ONE: i64 = 14;
}

fn switch() -> &'static AtomicBool {
    static ON: OnceLock<AtomicBool> = OnceLock::new();
    ON.get_or_init(|| {
        AtomicBool::new(!std::env::var("MIXPREC_CUDNN_ATTENTION").is_ok_and(|v| v == "0"))
    })
}

/// Whether the fused attention path asks cuDNN first (on by default; `MIXPREC_CUDNN_ATTENTION=0`
/// starts a process with it off).
pub fn cudnn_attention_enabled() -> bool {
    switch().load(Ordering::Relaxed)
}

/// Turns the cuDNN attention path on or off for the calls that follow (tests compare it with
/// our kernels in one process).
pub fn set_cudnn_attention(on: bool) {
    switch().store(on, Ordering::Relaxed)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Dir {
    Forward,
    Backward,
}

/// What a plan is built for: the strides are those of the inputs (the outputs are contiguous).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct Key {
    dir: Dir,
    dtype: DType,
    /// batch, heads, seq_q, seq_k, head_dim
    dims: [usize; 5],
    causal: bool,
    strides: Vec<[i64; 3]>,
    /// The backward's dq, dk, dv strides (separate buffers or one packed).
    out: Option<[Dims; 3]>,
}

/// The device's attention plans (part of its cuDNN state; used under its lock). `None`: cuDNN
/// builds no plan for the key.
pub(super) type AttentionPlans = HashMap<Key, Option<Plan>>;

/// The causal mask of scores `s` `[b, h, sq, sk]`: keys after the query (column > row,
/// top-left aligned as PyTorch's `is_causal`) set to -inf.
fn causal_mask(g: &mut OpGraph, s: Tn, dims: Dims) -> Result<Tn> {
    let st = packed(dims);
    let row = g.virt(dims, st, Dt::CUDNN_DATA_INT32)?;
    let col = g.virt(dims, st, Dt::CUDNN_DATA_INT32)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_GEN_INDEX,
        Dt::CUDNN_DATA_FLOAT,
        &[s],
        row,
        Some(2),
    )?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_GEN_INDEX,
        Dt::CUDNN_DATA_FLOAT,
        &[s],
        col,
        Some(3),
    )?;
    let keep = g.virt(dims, st, Dt::CUDNN_DATA_BOOLEAN)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_CMP_GE,
        Dt::CUDNN_DATA_BOOLEAN,
        &[row, col],
        keep,
        None,
    )?;
    let neg_inf = g.scalar(uid::NEG_INF)?;
    let out = g.virt(dims, st, Dt::CUDNN_DATA_FLOAT)?;
    g.pw(Pw::CUDNN_POINTWISE_BINARY_SELECT, &[s, neg_inf, keep], out)?;
    Ok(out)
}

fn io_type(dt: DType) -> Option<Dt> {
    match dt {
        DType::F16 => Some(Dt::CUDNN_DATA_HALF),
        DType::BF16 => Some(Dt::CUDNN_DATA_BFLOAT16),
        _ => None,
    }
}

/// A view's `[b, h, t, d]` strides.
fn bhtd(s: [i64; 3]) -> Dims {
    [s[0], s[1], s[2], 1]
}

/// The same view as `[b, h, d, t]` (a transpose for the products).
fn bhdt(s: [i64; 3]) -> Dims {
    [s[0], s[1], 1, s[2]]
}

/// Strides of a contiguous `[B, T, H, D]` output seen as `[b, h, t, d]`.
fn bthd_out(h: i64, t: i64, d: i64) -> Dims {
    [t * h * d, d, h * d, 1]
}

/// The sizes of a problem as i64 (b, h, sq, sk, d).
fn sizes_i64(d: &FlashDims) -> [i64; 5] {
    [d.batch, d.heads, d.seq_q, d.seq_k, d.head_dim].map(|v| v as i64)
}

/// The forward graph: S = Q·Kᵀ·scale, the causal mask, P = softmax(S) with the row statistic
/// max + log Σ exp (f32, `[b, h, sq, 1]`), O = P·V.
fn forward_graph(d: &FlashDims, io: Dt, st: &[[i64; 3]]) -> Result<OpGraph> {
    let [b, h, sq, sk, hd] = sizes_i64(d);
    let f32_ = Dt::CUDNN_DATA_FLOAT;
    let mut g = OpGraph::new();
    let q = g.buffer(uid::Q, [b, h, sq, hd], bhtd(st[0]), io)?;
    let kt = g.buffer(uid::K, [b, h, hd, sk], bhdt(st[1]), io)?;
    let v = g.buffer(uid::V, [b, h, sk, hd], bhtd(st[2]), io)?;
    let sdims = [b, h, sq, sk];
    let s = g.virt(sdims, packed(sdims), f32_)?;
    g.matmul(q, kt, s)?;
    let scale = g.scalar(uid::SCALE)?;
    let mut scores = g.virt(sdims, packed(sdims), f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, &[s, scale], scores)?;
    if d.causal {
        scores = causal_mask(&mut g, scores, sdims)?;
    }
    let rdims = [b, h, sq, 1];
    let rst = packed(rdims);
    let max = g.virt(rdims, rst, f32_)?;
    g.reduction(
        dsys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_MAX,
        scores,
        max,
    )?;
    let centred = g.virt(sdims, packed(sdims), f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_SUB, &[scores, max], centred)?;
    let e = g.virt(sdims, packed(sdims), f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_EXP, &[centred], e)?;
    let sum = g.virt(rdims, rst, f32_)?;
    g.reduction(dsys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD, e, sum)?;
    let log_sum = g.virt(rdims, rst, f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_LOG, &[sum], log_sum)?;
    let stats = g.buffer(uid::STATS, rdims, rst, f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_ADD, &[max, log_sum], stats)?;
    // P in the operands' type: the second product's A operand.
    let p = g.virt(sdims, packed(sdims), io)?;
    g.pw(Pw::CUDNN_POINTWISE_DIV, &[e, sum], p)?;
    let o = g.buffer(uid::O, [b, h, sq, hd], bthd_out(h, sq, hd), io)?;
    g.matmul(p, v, o)?;
    Ok(g)
}

/// The backward graph: D = rowsum(dO∘O) (f32, kept in `softmax_sum`), P recomputed as
/// exp(S·scale − stats) under the mask, dV = Pᵀ·dO, dS = P∘(dO·Vᵀ − D)·scale, dK = dSᵀ·Q,
/// dQ = dS·K (accumulated in f32, then converted).
fn backward_graph(d: &FlashDims, io: Dt, st: &[[i64; 3]], out: [Dims; 3]) -> Result<OpGraph> {
    let [b, h, sq, sk, hd] = sizes_i64(d);
    let f32_ = Dt::CUDNN_DATA_FLOAT;
    let mut g = OpGraph::new();
    let q = g.buffer(uid::Q, [b, h, sq, hd], bhtd(st[0]), io)?;
    let kt = g.buffer(uid::K, [b, h, hd, sk], bhdt(st[1]), io)?;
    let vt = g.buffer(uid::V, [b, h, hd, sk], bhdt(st[2]), io)?;
    let o = g.buffer(uid::O, [b, h, sq, hd], bhtd(st[3]), io)?;
    let d_o = g.buffer(uid::DO, [b, h, sq, hd], bhtd(st[4]), io)?;
    let rdims = [b, h, sq, 1];
    let rst = packed(rdims);
    let stats = g.buffer(uid::STATS, rdims, rst, f32_)?;
    let scale = g.scalar(uid::SCALE)?;
    let one = g.scalar(uid::ONE)?;

    // D = Σ_d dO∘O, per row.
    let qdims = [b, h, sq, hd];
    let prod = g.virt(qdims, packed(qdims), f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, &[d_o, o], prod)?;
    let rowsum = g.virt(rdims, rst, f32_)?;
    g.reduction(
        dsys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD,
        prod,
        rowsum,
    )?;
    let softmax_sum = g.buffer(uid::SOFTMAX_SUM, rdims, rst, f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, &[rowsum, one], softmax_sum)?;

    // P = exp(S·scale − stats), masked.
    let sdims = [b, h, sq, sk];
    let sst = packed(sdims);
    let s = g.virt(sdims, sst, f32_)?;
    g.matmul(q, kt, s)?;
    let scaled = g.virt(sdims, sst, f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, &[s, scale], scaled)?;
    let mut centred = g.virt(sdims, sst, f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_SUB, &[scaled, stats], centred)?;
    if d.causal {
        centred = causal_mask(&mut g, centred, sdims)?;
    }
    let p = g.virt(sdims, sst, f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_EXP, &[centred], p)?;

    // dV = Pᵀ·dO.
    let tdims = [b, h, sk, sq];
    let tst = [h * sq * sk, sq * sk, 1, sk];
    let pt = g.virt(tdims, tst, io)?;
    g.reshape(p, pt)?;
    let kdims = [b, h, sk, hd];
    let dv = g.buffer(uid::DV, kdims, out[2], io)?;
    g.matmul(pt, d_o, dv)?;

    // dS = P∘(dO·Vᵀ − D)·scale.
    let dp = g.virt(sdims, sst, f32_)?;
    g.matmul(d_o, vt, dp)?;
    let dp_centred = g.virt(sdims, sst, f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_SUB, &[dp, softmax_sum], dp_centred)?;
    let ds_unscaled = g.virt(sdims, sst, f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, &[dp_centred, p], ds_unscaled)?;
    let ds = g.virt(sdims, sst, f32_)?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, &[ds_unscaled, scale], ds)?;

    // dK = dSᵀ·Q.
    let dst = g.virt(tdims, tst, io)?;
    g.reshape(ds, dst)?;
    let dk = g.buffer(uid::DK, kdims, out[1], io)?;
    g.matmul(dst, q, dk)?;

    // dQ = dS·K, accumulated in f32 (a buffer the caller zeroes), then converted.
    let k = g.virt(kdims, bhtd(st[1]), f32_)?;
    g.reshape(kt, k)?;
    let dq_accum = g.buffer(uid::DQ_ACCUM, qdims, packed(qdims), f32_)?;
    g.matmul(ds, k, dq_accum)?;
    let dq = g.buffer(uid::DQ, qdims, out[0], io)?;
    g.pw(Pw::CUDNN_POINTWISE_IDENTITY, &[dq_accum], dq)?;
    Ok(g)
}

/// cuDNN's version (e.g. 91000 for 9.10.0).
fn version() -> usize {
    // SAFETY: no arguments; the library was loaded with the handle.
    unsafe { dsys::cudnnGetVersion() }
}

/// Runs the plan for `key` (building it first), with `bufs` as (uid, device address) and the
/// by-value scalars. `Ok(false)`: cuDNN has no plan for it.
fn run(
    like: &CudaStorage,
    key: Key,
    graph: impl FnOnce() -> Result<OpGraph>,
    bufs: &[(i64, u64)],
    scale: f32,
) -> Result<bool> {
    let dev = &like.dev;
    let mut guard = lock_dnn(dev, OP)?;
    let dnn = dnn_state(&mut guard)?;
    if !dnn.attention.contains_key(&key) {
        super::graph::refuse(
            dev.ordinal,
            OP,
            "building a cuDNN attention plan during capture: run a warm-up step of the same \
             shapes first",
        )?;
        let built = graph()?.plan(dnn.handle())?;
        match &built {
            Ok(p) => log::info!(
                "cuDNN attention: a plan for {key:?} ({} bytes of workspace)",
                p.workspace
            ),
            Err(why) => {
                log::info!("cuDNN attention: no plan for {key:?} ({why}); our kernels run it")
            }
        }
        dnn.attention.insert(key.clone(), built.ok());
    }
    let Some(Some(plan)) = dnn.attention.get(&key) else {
        return Ok(false);
    };
    let workspace = if plan.workspace > 0 {
        Some(CudaStorage::alloc(
            dev,
            DType::F32,
            plan.workspace.div_ceil(4),
        )?)
    } else {
        None
    };
    // -inf masks from cuDNN 9.10 on; older versions want the lowest finite value.
    let neg_inf = if version() >= 91000 {
        f32::NEG_INFINITY
    } else {
        f32::MIN
    };
    let one = 1f32;
    let mut uids: Vec<i64> = bufs.iter().map(|b| b.0).collect();
    let mut ptrs: Vec<*mut c_void> = bufs.iter().map(|b| b.1 as *mut c_void).collect();
    for (id, v) in [
        (uid::SCALE, &scale),
        (uid::NEG_INF, &neg_inf),
        (uid::ONE, &one),
    ] {
        let wanted = match key.dir {
            Dir::Forward => id != uid::ONE,
            Dir::Backward => true,
        };
        if wanted && (key.causal || id != uid::NEG_INF) {
            uids.push(id);
            ptrs.push(v as *const f32 as *mut c_void);
        }
    }
    let pack = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
    pack.set(
        A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
        T::CUDNN_TYPE_VOID_PTR,
        &ptrs,
    )?;
    pack.set_i64s(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?;
    let ws_ptr = workspace
        .as_ref()
        .map_or(std::ptr::null_mut(), |w| w.ptr() as *mut c_void);
    pack.set(
        A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
        T::CUDNN_TYPE_VOID_PTR,
        &[ws_ptr],
    )?;
    let pack = pack.finalize("the attention variant pack")?;
    dev.ctx
        .bind_to_thread()
        .map_err(|e| super::device::cuda_err("binding the context", e))?;
    // SAFETY: the plan was built on this handle for this graph; the pointers are live buffers
    // of the sizes the graph's tensors describe (checked by the callers), the scalars live
    // until this call returns (cuDNN reads them at launch), the workspace holds the plan's size.
    super::cudnn_graph::status("executing the attention plan", unsafe {
        dsys::cudnnBackendExecute(dnn.handle(), plan.plan.0, pack.0)
    })?;
    Ok(true)
}

/// The forward through cuDNN: `Ok(None)` where it has no plan (the caller runs our kernels).
pub fn cudnn_forward(inp: &FlashInputs<'_>, d: &FlashDims) -> Result<Option<FlashOutput>> {
    let like = inp.q.buf;
    check_dims(d, like)?;
    let Some(io) = io_type(like.dtype()) else {
        return Ok(None);
    };
    let (q, qs) = check_view("q", &inp.q, d.seq_q, d, like)?;
    let (k, ks) = check_view("k", &inp.k, d.seq_k, d, like)?;
    let (v, vs) = check_view("v", &inp.v, d.seq_k, d, like)?;
    let (n_q, n_k) = sizes(d)?;
    if !cudnn_attention_enabled() || n_q == 0 || n_k == 0 {
        return Ok(None);
    }
    let o = CudaStorage::alloc(&like.dev, like.dtype(), n_q)?;
    let lse = CudaStorage::alloc(&like.dev, DType::F32, n_q / d.head_dim)?;
    let strides = vec![qs, ks, vs];
    let key = Key {
        dir: Dir::Forward,
        dtype: like.dtype(),
        dims: [d.batch, d.heads, d.seq_q, d.seq_k, d.head_dim],
        causal: d.causal,
        strides: strides.clone(),
        out: None,
    };
    let bufs = [
        (uid::Q, q),
        (uid::K, k),
        (uid::V, v),
        (uid::O, o.ptr()),
        (uid::STATS, lse.ptr()),
    ];
    let ran = run(like, key, || forward_graph(d, io, &strides), &bufs, d.scale)
        .map_err(|e| Error::Cuda(format!("{OP} forward: {e}")))?;
    Ok(ran.then_some(FlashOutput { o, lse }))
}

/// Where the backward writes dq, dk and dv.
enum GradsOut {
    /// Three new `[B, T, H, D]` buffers.
    Separate,
    /// One new `[B, T, 3, H, D]` buffer (q, k and v were the slices of one such projection).
    Packed,
}

enum Grads {
    Separate(FlashInputGrads),
    Packed(CudaStorage),
}

/// The backward through cuDNN: `Ok(None)` where it has no plan (the caller runs our kernels).
pub fn cudnn_backward(g: &FlashGrads<'_>, d: &FlashDims) -> Result<Option<FlashInputGrads>> {
    Ok(match backward(g, d, GradsOut::Separate)? {
        Some(Grads::Separate(r)) => Some(r),
        _ => None,
    })
}

/// The backward through cuDNN into one `[B, T, 3, H, D]` buffer (needs Tq = Tk): `Ok(None)`
/// where it has no plan.
pub fn cudnn_backward_packed(g: &FlashGrads<'_>, d: &FlashDims) -> Result<Option<CudaStorage>> {
    if d.seq_q != d.seq_k {
        return Err(Error::invalid_arg(
            OP,
            "seq_q",
            d.seq_q,
            format!("seq_k ({}) for gradients packed as one projection", d.seq_k),
        ));
    }
    Ok(match backward(g, d, GradsOut::Packed)? {
        Some(Grads::Packed(r)) => Some(r),
        _ => None,
    })
}

fn backward(g: &FlashGrads<'_>, d: &FlashDims, out: GradsOut) -> Result<Option<Grads>> {
    let like = g.q.buf;
    check_dims(d, like)?;
    let Some(io) = io_type(like.dtype()) else {
        return Ok(None);
    };
    let (q, qs) = check_view("q", &g.q, d.seq_q, d, like)?;
    let (k, ks) = check_view("k", &g.k, d.seq_k, d, like)?;
    let (v, vs) = check_view("v", &g.v, d.seq_k, d, like)?;
    let (o, os) = check_view("o", &g.o, d.seq_q, d, like)?;
    let (d_o, dos) = check_view("grad_out", &g.grad_out, d.seq_q, d, like)?;
    let (n_q, n_k) = sizes(d)?;
    let rows_q = n_q / d.head_dim.max(1);
    if !cudnn_attention_enabled() || n_q == 0 || n_k == 0 {
        return Ok(None);
    }
    if g.lse.dtype() != DType::F32 || g.lse.len() < rows_q || g.lse.ordinal() != like.ordinal() {
        return Err(Error::invalid_arg(
            OP,
            "lse",
            format!("{} buffer of {} elements", g.lse.dtype(), g.lse.len()),
            format!("the forward's f32 [B, H, Tq] statistic ({rows_q} elements)"),
        ));
    }
    let (dev, dt) = (&like.dev, like.dtype());
    let [_, h, sq, sk, hd] = sizes_i64(d);
    let (grads, ptrs, out_strides) = match out {
        GradsOut::Separate => {
            let dq = CudaStorage::alloc(dev, dt, n_q)?;
            let dk = CudaStorage::alloc(dev, dt, n_k)?;
            let dv = CudaStorage::alloc(dev, dt, n_k)?;
            let ptrs = [dq.ptr(), dk.ptr(), dv.ptr()];
            let strides = [
                bthd_out(h, sq, hd),
                bthd_out(h, sk, hd),
                bthd_out(h, sk, hd),
            ];
            (
                Grads::Separate(FlashInputGrads { dq, dk, dv }),
                ptrs,
                strides,
            )
        }
        GradsOut::Packed => {
            let buf = CudaStorage::alloc(dev, dt, 3 * n_q)?;
            // [B, T, 3, H, D]: slice i starts i·H·D elements in.
            let slice = (h * hd) as u64 * dt.size_in_bytes() as u64;
            let ptrs = [buf.ptr(), buf.ptr() + slice, buf.ptr() + 2 * slice];
            let st = [sq * 3 * h * hd, hd, 3 * h * hd, 1];
            (Grads::Packed(buf), ptrs, [st; 3])
        }
    };
    // cuDNN before 9.6 adds into dQ's accumulator without clearing it first; from 9.6 on the
    // engine clears it itself (a memset of B·T·H·D floats saved per step). The GPU tests run
    // with poisoned (NaN-filled) buffers, so an accumulator left unclear shows.
    let dq_accum = if version() >= 90600 {
        CudaStorage::alloc(dev, DType::F32, n_q)?
    } else {
        CudaStorage::zeroed(dev, DType::F32, n_q)?
    };
    let softmax_sum = CudaStorage::alloc(dev, DType::F32, rows_q)?;
    let strides = vec![qs, ks, vs, os, dos];
    let key = Key {
        dir: Dir::Backward,
        dtype: dt,
        dims: [d.batch, d.heads, d.seq_q, d.seq_k, d.head_dim],
        causal: d.causal,
        strides: strides.clone(),
        out: Some(out_strides),
    };
    let bufs = [
        (uid::Q, q),
        (uid::K, k),
        (uid::V, v),
        (uid::O, o),
        (uid::DO, d_o),
        (uid::STATS, g.lse.ptr()),
        (uid::DQ, ptrs[0]),
        (uid::DK, ptrs[1]),
        (uid::DV, ptrs[2]),
        (uid::SOFTMAX_SUM, softmax_sum.ptr()),
        (uid::DQ_ACCUM, dq_accum.ptr()),
    ];
    let graph = || backward_graph(d, io, &strides, out_strides);
    let ran = run(like, key, graph, &bufs, d.scale)
        .map_err(|e| Error::Cuda(format!("{OP} backward: {e}")))?;
    Ok(ran.then_some(grads))
}
