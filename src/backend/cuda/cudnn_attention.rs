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

use super::conv::{dnn_state, lock_dnn};
use super::cudnn_graph::{engine_configs, Desc};
use super::flash_attention::{
    check_dims, check_view, sizes, FlashDims, FlashGrads, FlashInputGrads, FlashInputs, FlashOutput,
};
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::base::error::{Error, Result};
use crate::base::DType;

const OP: &str = "scaled_dot_product_attention (cuDNN)";

/// The unique ids of the graphs' non-virtual tensors (virtual ones count up from
/// `FIRST_VIRTUAL`).
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
    pub const FIRST_VIRTUAL: i64 = 100;
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

/// A built plan with every descriptor it refers to, or why there is none.
pub(super) struct Plan {
    _descs: Vec<Desc>,
    plan: Desc,
    workspace: usize,
}

/// The device's attention plans (part of its cuDNN state; used under its lock). `None`: cuDNN
/// builds no plan for the key.
pub(super) type AttentionPlans = HashMap<Key, Option<Plan>>;

/// An operation graph under construction: its tensors and operations, by index.
struct OpGraph {
    tensors: Vec<Desc>,
    ops: Vec<Desc>,
    /// Descriptors the operations refer to (pointwise modes, matmul and reduction settings).
    keep: Vec<Desc>,
    next_virtual: i64,
}

#[derive(Clone, Copy)]
struct Tn(usize);

type Dims = [i64; 4];

/// Packed strides of `dims` (the last dimension contiguous).
fn packed(d: Dims) -> Dims {
    [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1]
}

impl OpGraph {
    fn new() -> Self {
        OpGraph {
            tensors: Vec::new(),
            ops: Vec::new(),
            keep: Vec::new(),
            next_virtual: uid::FIRST_VIRTUAL,
        }
    }

    fn tensor(&mut self, id: i64, dims: Dims, strides: Dims, dt: Dt, kind: Kind) -> Result<Tn> {
        let d = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.set(
            A::CUDNN_ATTR_TENSOR_DATA_TYPE,
            T::CUDNN_TYPE_DATA_TYPE,
            &[dt],
        )?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_STRIDES, &strides)?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[id])?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[16])?;
        match kind {
            Kind::Buffer => {}
            Kind::Virtual => d.set(
                A::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
                T::CUDNN_TYPE_BOOLEAN,
                &[true],
            )?,
            Kind::ByValue => d.set(
                A::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
                T::CUDNN_TYPE_BOOLEAN,
                &[true],
            )?,
        }
        self.tensors.push(d.finalize("a tensor descriptor")?);
        Ok(Tn(self.tensors.len() - 1))
    }

    /// A tensor in device memory, named by `id` in the variant pack.
    fn buffer(&mut self, id: i64, dims: Dims, strides: Dims, dt: Dt) -> Result<Tn> {
        self.tensor(id, dims, strides, dt, Kind::Buffer)
    }

    /// An f32 scalar passed by value (a host pointer in the variant pack).
    fn scalar(&mut self, id: i64) -> Result<Tn> {
        self.tensor(id, [1; 4], [1; 4], Dt::CUDNN_DATA_FLOAT, Kind::ByValue)
    }

    /// An intermediate that never leaves the fused kernel.
    fn virt(&mut self, dims: Dims, strides: Dims, dt: Dt) -> Result<Tn> {
        let id = self.next_virtual;
        self.next_virtual += 1;
        self.tensor(id, dims, strides, dt, Kind::Virtual)
    }

    fn t(&self, x: Tn) -> &Desc {
        &self.tensors[x.0]
    }

    /// `y = mode(x[, b[, t]])`, computed in `prec`; `axis` for GEN_INDEX.
    fn pointwise(
        &mut self,
        mode: Pw,
        prec: Dt,
        inputs: &[Tn],
        y: Tn,
        axis: Option<i64>,
    ) -> Result<()> {
        let pw = Desc::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        pw.set(
            A::CUDNN_ATTR_POINTWISE_MODE,
            T::CUDNN_TYPE_POINTWISE_MODE,
            &[mode],
        )?;
        pw.set(
            A::CUDNN_ATTR_POINTWISE_MATH_PREC,
            T::CUDNN_TYPE_DATA_TYPE,
            &[prec],
        )?;
        if let Some(axis) = axis {
            pw.set_i64s(A::CUDNN_ATTR_POINTWISE_AXIS, &[axis])?;
        }
        let pw = pw.finalize("a pointwise descriptor")?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
        let names = [
            A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
            A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC,
            A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC,
        ];
        for (name, x) in names.iter().zip(inputs) {
            op.set_descs(*name, &[self.t(*x)])?;
        }
        op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[self.t(y)])?;
        op.set(
            A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1,
            T::CUDNN_TYPE_FLOAT,
            &[1f32],
        )?;
        op.set(
            A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2,
            T::CUDNN_TYPE_FLOAT,
            &[1f32],
        )?;
        self.ops
            .push(op.finalize(&format!("the pointwise {mode:?} operation"))?);
        self.keep.push(pw);
        Ok(())
    }

    /// `y = mode(inputs)` in f32.
    fn pw(&mut self, mode: Pw, inputs: &[Tn], y: Tn) -> Result<()> {
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, inputs, y, None)
    }

    /// `c = a · b` over the last two dimensions, batched over the first two, f32 accumulation.
    fn matmul(&mut self, a: Tn, b: Tn, c: Tn) -> Result<()> {
        let mm = Desc::new(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        mm.set(
            A::CUDNN_ATTR_MATMUL_COMP_TYPE,
            T::CUDNN_TYPE_DATA_TYPE,
            &[Dt::CUDNN_DATA_FLOAT],
        )?;
        let mm = mm.finalize("a matmul descriptor")?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[self.t(a)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[self.t(b)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[self.t(c)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&mm])?;
        self.ops.push(op.finalize("a matmul operation")?);
        self.keep.push(mm);
        Ok(())
    }

    /// `y = reduce(x)` over the dimensions where `y` has extent 1, in f32.
    fn reduction(&mut self, how: dsys::cudnnReduceTensorOp_t, x: Tn, y: Tn) -> Result<()> {
        let r = Desc::new(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        r.set(
            A::CUDNN_ATTR_REDUCTION_COMP_TYPE,
            T::CUDNN_TYPE_DATA_TYPE,
            &[Dt::CUDNN_DATA_FLOAT],
        )?;
        r.set(
            A::CUDNN_ATTR_REDUCTION_OPERATOR,
            T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
            &[how],
        )?;
        let r = r.finalize("a reduction descriptor")?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[self.t(x)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[self.t(y)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&r])?;
        self.ops.push(op.finalize("a reduction operation")?);
        self.keep.push(r);
        Ok(())
    }

    /// `y` = `x` seen with `y`'s dimensions and strides (a transpose, here).
    fn reshape(&mut self, x: Tn, y: Tn) -> Result<()> {
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[self.t(x)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[self.t(y)])?;
        self.ops.push(op.finalize("a reshape operation")?);
        Ok(())
    }

    /// The causal mask of scores `s` `[b, h, sq, sk]`: keys after the query (column > row,
    /// top-left aligned as PyTorch's `is_causal`) set to -inf.
    fn causal_mask(&mut self, s: Tn, dims: Dims) -> Result<Tn> {
        let st = packed(dims);
        let row = self.virt(dims, st, Dt::CUDNN_DATA_INT32)?;
        let col = self.virt(dims, st, Dt::CUDNN_DATA_INT32)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            Dt::CUDNN_DATA_FLOAT,
            &[s],
            row,
            Some(2),
        )?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            Dt::CUDNN_DATA_FLOAT,
            &[s],
            col,
            Some(3),
        )?;
        let keep = self.virt(dims, st, Dt::CUDNN_DATA_BOOLEAN)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_CMP_GE,
            Dt::CUDNN_DATA_BOOLEAN,
            &[row, col],
            keep,
            None,
        )?;
        let neg_inf = self.scalar(uid::NEG_INF)?;
        let out = self.virt(dims, st, Dt::CUDNN_DATA_FLOAT)?;
        self.pw(Pw::CUDNN_POINTWISE_BINARY_SELECT, &[s, neg_inf, keep], out)?;
        Ok(out)
    }

    /// Finalizes the graph and builds the first plan cuDNN's heuristics propose that builds.
    fn plan(self, handle: dsys::cudnnHandle_t) -> Result<std::result::Result<Plan, String>> {
        let graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set(
            A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
            T::CUDNN_TYPE_HANDLE,
            &[handle],
        )?;
        let ops: Vec<&Desc> = self.ops.iter().collect();
        graph.set_descs(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops)?;
        let graph = match graph.finalize("the attention operation graph") {
            Ok(g) => g,
            Err(e) => return Ok(Err(e.to_string())),
        };
        let mut why = Vec::new();
        for mode in [
            dsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            dsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ] {
            let configs = match engine_configs(&graph, mode) {
                Ok(c) => c,
                Err(e) => {
                    why.push(format!("{mode:?}: {e}"));
                    continue;
                }
            };
            for config in configs {
                let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
                plan.set(
                    A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                    T::CUDNN_TYPE_HANDLE,
                    &[handle],
                )?;
                plan.set_descs(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[&config])?;
                match plan.finalize("an attention execution plan") {
                    Ok(plan) => {
                        let mut ws = [0i64];
                        plan.get(
                            A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                            T::CUDNN_TYPE_INT64,
                            &mut ws,
                        )?;
                        let mut descs = self.tensors;
                        descs.extend(self.ops);
                        descs.extend(self.keep);
                        descs.push(graph);
                        descs.push(config);
                        return Ok(Ok(Plan {
                            _descs: descs,
                            plan,
                            workspace: ws[0].max(0) as usize,
                        }));
                    }
                    Err(e) => why.push(e.to_string()),
                }
            }
        }
        if why.is_empty() {
            why.push("the heuristics proposed no engine".into());
        }
        Ok(Err(why.join("; ")))
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Buffer,
    Virtual,
    ByValue,
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
        scores = g.causal_mask(scores, sdims)?;
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
        centred = g.causal_mask(centred, sdims)?;
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
    // cuDNN before 9.6 adds into dQ's accumulator without clearing it first.
    let dq_accum = CudaStorage::zeroed(dev, DType::F32, n_q)?;
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
