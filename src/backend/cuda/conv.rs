//! 2-D convolution through cuDNN (NCHW, groups, dilation): forward, backward-data and
//! backward-filter. Each (geometry, dtype, direction) gets its plan chosen once, on the first
//! call's real buffers, and cached with its workspace size. Two APIs compete for it:
//!
//! - cuDNN's graph API (`cudnn_graph.rs`): the heuristics' engine configurations, each timed
//!   (median of three runs);
//! - the legacy API: cuDNN's heuristics (`cudnnGet*Algorithm_v7`), then `cudnnFind*AlgorithmEx`
//!   (three rounds; each candidate's median decides).
//!
//! The faster of the two winners runs. Neither API wins everywhere (H200, f16, batch 64): the
//! graph API's engines run ResNet-50's 14x14 layer3 convolution 1.2-1.4x faster, the legacy
//! implicit-GEMM kernels its 7x7/2 stem forward 1.5x faster (the graph API's heuristics list no
//! engine as fast there within the workspace limit).
//!
//! `MIXPREC_CUDNN_API=graph` or `=legacy` forces one API (the legacy API still covers what no
//! graph engine supports); `MIXPREC_CUDNN_FIND=0` turns the timing off (the graph heuristics'
//! first choice, else the legacy one); `RUST_LOG=mixprec=debug` logs the timings and the choice.
//! The workspace is one grow-only buffer per device.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use cudarc::cudnn::{result as dnn, sys as dsys};
use cudarc::driver::{CudaSlice, DevicePtr};

use super::cudnn_graph::ConvPlan;
use super::device::{allow_tf32, cuda_err, CudaDevice};
use super::storage::CudaStorage;
use crate::backend::{BackendStorage, Conv2dParams};
use crate::error::{Error, Result};
use crate::tensor::{DType, Layout};

/// The most workspace the legacy heuristics' untimed choice may ask for.
const WORKSPACE_LIMIT: usize = 1 << 30;
/// The most workspace a timed candidate may ask for, in either API (cudnnFind's scratch; graph
/// engines needing more are not candidates).
const FIND_WORKSPACE: usize = 256 << 20;

fn find_enabled() -> bool {
    std::env::var("MIXPREC_CUDNN_FIND").map_or(true, |v| v != "0")
}

/// Which cuDNN API may run convolutions (`MIXPREC_CUDNN_API`): both, the fastest of them chosen
/// per plan (the default), or only one (`graph`: the legacy API still covers what no graph engine
/// supports; `legacy`: never the graph API).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    Fastest,
    Graph,
    Legacy,
}

fn api() -> Api {
    match std::env::var("MIXPREC_CUDNN_API").as_deref() {
        Ok("graph") => Api::Graph,
        Ok("legacy") => Api::Legacy,
        _ => Api::Fastest,
    }
}

/// Which convolution runs, with its buffers in cuDNN's argument order: forward (x, w) -> y,
/// backward-data (dy, w) -> dx, backward-filter (dy, x) -> dw.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Dir {
    Forward,
    BackwardData,
    BackwardFilter,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Algo {
    Fwd(dsys::cudnnConvolutionFwdAlgo_t),
    BwdData(dsys::cudnnConvolutionBwdDataAlgo_t),
    BwdFilter(dsys::cudnnConvolutionBwdFilterAlgo_t),
}

struct TensorDesc(dsys::cudnnTensorDescriptor_t);
impl Drop for TensorDesc {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let _ = unsafe { dnn::destroy_tensor_descriptor(self.0) };
    }
}
struct FilterDesc(dsys::cudnnFilterDescriptor_t);
impl Drop for FilterDesc {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let _ = unsafe { dnn::destroy_filter_descriptor(self.0) };
    }
}
struct ConvDesc(dsys::cudnnConvolutionDescriptor_t);
impl Drop for ConvDesc {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let _ = unsafe { dnn::destroy_convolution_descriptor(self.0) };
    }
}

/// How one (geometry, dtype, direction) runs.
enum Plan {
    Graph(ConvPlan),
    Legacy(LegacyPlan),
}

impl Plan {
    fn workspace(&self) -> usize {
        match self {
            Plan::Graph(g) => g.workspace,
            Plan::Legacy(l) => l.workspace,
        }
    }

    /// What runs: the graph engine with its notes, or the legacy algorithm.
    fn describe(&self) -> String {
        match self {
            Plan::Graph(g) => format!("{g:?}"),
            Plan::Legacy(l) => format!("legacy {:?} ({} bytes of workspace)", l.algo, l.workspace),
        }
    }

    /// How many graph-API engine configurations were candidates for this plan.
    fn graph_candidates(&self) -> usize {
        match self {
            Plan::Graph(g) => g.candidates,
            Plan::Legacy(l) => l.graph_candidates,
        }
    }
}

/// A legacy-API plan: descriptors and a `cudnnConvolution*Algo_t`.
struct LegacyPlan {
    /// The math the descriptor allows: cudnnFind's candidates must use exactly this one, or an
    /// f32 convolution could come back computed in TF32.
    math: dsys::cudnnMathType_t,
    x: TensorDesc,
    w: FilterDesc,
    y: TensorDesc,
    conv: ConvDesc,
    algo: Algo,
    workspace: usize,
    /// How many graph-API candidates it was chosen over (0: the graph API was not tried or had
    /// no engine).
    graph_candidates: usize,
}

pub(crate) struct Dnn {
    handle: dsys::cudnnHandle_t,
    workspace: Option<CudaSlice<u8>>,
    plans: HashMap<(Conv2dParams, DType, Dir, bool), Plan>,
}

// SAFETY: the handle and descriptors are only used under the device's `dnn` mutex.
unsafe impl Send for Dnn {}

impl Drop for Dnn {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created by cudnnCreate, destroyed once.
        let _ = unsafe { dnn::destroy_handle(self.handle) };
    }
}

fn dnn_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("cuDNN {what}: {e:?}"))
}

fn i(what: &'static str, v: usize) -> Result<c_int> {
    c_int::try_from(v)
        .map_err(|_| Error::invalid_arg("conv2d", what, v, "at most 2^31-1 for cuDNN"))
}

pub(super) fn data_type(d: DType) -> Result<(dsys::cudnnDataType_t, dsys::cudnnDataType_t)> {
    use dsys::cudnnDataType_t::*;
    Ok(match d {
        DType::F16 => (CUDNN_DATA_HALF, CUDNN_DATA_FLOAT),
        DType::BF16 => (CUDNN_DATA_BFLOAT16, CUDNN_DATA_FLOAT),
        DType::F32 => (CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT),
        DType::F64 => (CUDNN_DATA_DOUBLE, CUDNN_DATA_DOUBLE),
        DType::I64 => {
            return Err(Error::UnsupportedDType {
                op: "conv2d",
                got: d,
                expected: "a float dtype",
            })
        }
    })
}

/// Checks the geometry before anything computes output sizes (which would underflow).
fn check(op: &'static str, p: &Conv2dParams) -> Result<()> {
    let bad = |name: &'static str, v: String, allowed: &str| {
        Err(Error::invalid_arg(op, name, v, allowed))
    };
    if p.groups == 0 || p.c_in % p.groups != 0 || p.c_out % p.groups != 0 {
        return bad(
            "groups",
            p.groups.to_string(),
            &format!(
                "a positive divisor of c_in {} and c_out {}",
                p.c_in, p.c_out
            ),
        );
    }
    if p.kh == 0
        || p.kw == 0
        || p.stride.0 == 0
        || p.stride.1 == 0
        || p.dilation.0 == 0
        || p.dilation.1 == 0
    {
        return bad("kernel/stride/dilation", format!("{p:?}"), "positive sizes");
    }
    if p.h + 2 * p.padding.0 < p.dilation.0 * (p.kh - 1) + 1
        || p.w + 2 * p.padding.1 < p.dilation.1 * (p.kw - 1) + 1
    {
        return bad(
            "kernel",
            format!("{}x{}", p.kh, p.kw),
            "must fit the padded input",
        );
    }
    Ok(())
}

impl Dnn {
    fn new(dev: &CudaDevice) -> Result<Dnn> {
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let handle = dnn::create_handle().map_err(|e| dnn_err("cudnnCreate", e))?;
        let d = Dnn {
            handle,
            workspace: None,
            plans: HashMap::new(),
        };
        // SAFETY: live handle and stream.
        unsafe { dnn::set_stream(handle, dev.stream.cu_stream() as _) }
            .map_err(|e| dnn_err("cudnnSetStream", e))?;
        Ok(d)
    }

    /// The plan for one direction, chosen on the first call's buffers (`ptrs`, argument order):
    /// the faster of the graph API's and the legacy API's winners (see the module doc for the
    /// environment that narrows this).
    fn make_plan(
        &self,
        dev: &CudaDevice,
        p: &Conv2dParams,
        dtype: DType,
        dir: Dir,
        ptrs: [*mut c_void; 3],
    ) -> Result<Plan> {
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let api = api();
        let timed = find_enabled();
        let graph = if api == Api::Legacy {
            None
        } else {
            let g = super::probe::no_panic("cuDNN graph API", || {
                ConvPlan::tuned(
                    dev,
                    self.handle,
                    p,
                    dtype,
                    dir,
                    allow_tf32(),
                    ptrs,
                    FIND_WORKSPACE,
                    timed,
                )
            });
            match g {
                Ok(g) => Some(g),
                Err(e) => {
                    log::debug!("{e}; using the legacy API");
                    None
                }
            }
        };
        // Untimed, or asked for the graph API: its plan where it has one.
        let graph = match graph {
            Some(g) if api == Api::Graph || !timed => return Ok(Plan::Graph(g)),
            g => g,
        };
        let mut legacy = self.make_legacy_plan(p, dtype, dir)?;
        let legacy_ms = if timed {
            let [ap, bp, op] = ptrs;
            find(dev, self.handle, &mut legacy, dir, p, (ap, bp, op)).unwrap_or_else(|e| {
                log::debug!(
                    "cudnnFind for {dir:?} {dtype} {p:?} failed, keeping the heuristic choice: {e}"
                );
                None
            })
        } else {
            None
        };
        // Both timed on the same buffers: the faster wins (an untimed side loses).
        Ok(match graph {
            Some(g) if g.time_ms.unwrap_or(f32::INFINITY) <= legacy_ms.unwrap_or(f32::INFINITY) => {
                log::debug!(
                    "{dir:?} {dtype} {p:?}: graph {:?} ms vs legacy {legacy_ms:?} ms -> graph",
                    g.time_ms
                );
                Plan::Graph(g)
            }
            g => {
                log::debug!(
                    "{dir:?} {dtype} {p:?}: graph {:?} ms vs legacy {legacy_ms:?} ms -> legacy",
                    g.as_ref().and_then(|g| g.time_ms)
                );
                legacy.graph_candidates = g.map_or(0, |g| g.candidates);
                Plan::Legacy(legacy)
            }
        })
    }

    fn make_legacy_plan(&self, p: &Conv2dParams, dtype: DType, dir: Dir) -> Result<LegacyPlan> {
        let (dt, compute) = data_type(dtype)?;
        let nchw = dsys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        let x = TensorDesc(
            dnn::create_tensor_descriptor().map_err(|e| dnn_err("tensor descriptor", e))?,
        );
        let y = TensorDesc(
            dnn::create_tensor_descriptor().map_err(|e| dnn_err("tensor descriptor", e))?,
        );
        let w = FilterDesc(
            dnn::create_filter_descriptor().map_err(|e| dnn_err("filter descriptor", e))?,
        );
        let conv = ConvDesc(
            dnn::create_convolution_descriptor()
                .map_err(|e| dnn_err("convolution descriptor", e))?,
        );
        let xd = [i("n", p.n)?, i("c_in", p.c_in)?, i("h", p.h)?, i("w", p.w)?];
        let yd = [
            i("n", p.n)?,
            i("c_out", p.c_out)?,
            i("out_h", p.out_h())?,
            i("out_w", p.out_w())?,
        ];
        let wd = [
            i("c_out", p.c_out)?,
            i("c_in", p.c_in / p.groups)?,
            i("kh", p.kh)?,
            i("kw", p.kw)?,
        ];
        let math = math_type(dtype);
        // SAFETY: descriptors were just created; arrays are by value.
        unsafe {
            dnn::set_tensor4d_descriptor(x.0, nchw, dt, xd)
                .map_err(|e| dnn_err("input descriptor", e))?;
            dnn::set_tensor4d_descriptor(y.0, nchw, dt, yd)
                .map_err(|e| dnn_err("output descriptor", e))?;
            dnn::set_filter4d_descriptor(w.0, dt, nchw, wd)
                .map_err(|e| dnn_err("filter descriptor", e))?;
            dnn::set_convolution2d_descriptor(
                conv.0,
                i("padding", p.padding.0)?,
                i("padding", p.padding.1)?,
                i("stride", p.stride.0)?,
                i("stride", p.stride.1)?,
                i("dilation", p.dilation.0)?,
                i("dilation", p.dilation.1)?,
                dsys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                compute,
            )
            .map_err(|e| dnn_err("convolution descriptor", e))?;
            dnn::set_convolution_group_count(conv.0, i("groups", p.groups)?)
                .map_err(|e| dnn_err("group count", e))?;
            dnn::set_convolution_math_type(conv.0, math).map_err(|e| dnn_err("math type", e))?;
        }
        const N: usize = 16;
        let mut count: c_int = 0;
        let h = self.handle;
        // cuDNN's heuristic candidates in order; the first that fits WORKSPACE_LIMIT and whose
        // workspace size can be queried wins. `$get` and `$ws` take the same descriptors.
        macro_rules! heuristic {
            ($perf:ty, $get:path, $ws:path, $variant:path, $name:literal, $d1:expr, $d2:expr, $d3:expr) => {{
                // SAFETY: zeroed plain-data structs filled by cuDNN.
                let mut perf: [$perf; N] = unsafe { std::mem::zeroed() };
                // SAFETY: live handle and descriptors; `perf` holds N entries.
                unsafe {
                    $get(
                        h,
                        $d1,
                        $d2,
                        conv.0,
                        $d3,
                        N as c_int,
                        &mut count,
                        perf.as_mut_ptr(),
                    )
                }
                .map_err(|e| dnn_err($name, e))?;
                let mut pick = None;
                for pf in perf.iter().take(count.max(0) as usize) {
                    if pf.status != dsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS
                        || pf.memory > WORKSPACE_LIMIT
                    {
                        continue;
                    }
                    // SAFETY: as above.
                    if let Ok(ws) = unsafe { $ws(h, $d1, $d2, conv.0, $d3, pf.algo) } {
                        pick = Some(($variant(pf.algo), ws));
                        break;
                    }
                }
                pick
            }};
        }
        let (algo, workspace) = match dir {
            Dir::Forward => heuristic!(
                dsys::cudnnConvolutionFwdAlgoPerf_t,
                dnn::get_convolution_forward_algorithm,
                dnn::get_convolution_forward_workspace_size,
                Algo::Fwd,
                "cudnnGetConvolutionForwardAlgorithm_v7",
                x.0,
                w.0,
                y.0
            ),
            Dir::BackwardData => heuristic!(
                dsys::cudnnConvolutionBwdDataAlgoPerf_t,
                dnn::get_convolution_backward_data_algorithm,
                dnn::get_convolution_backward_data_workspace_size,
                Algo::BwdData,
                "cudnnGetConvolutionBackwardDataAlgorithm_v7",
                w.0,
                y.0,
                x.0
            ),
            Dir::BackwardFilter => heuristic!(
                dsys::cudnnConvolutionBwdFilterAlgoPerf_t,
                dnn::get_convolution_backward_filter_algorithm,
                dnn::get_convolution_backward_filter_workspace_size,
                Algo::BwdFilter,
                "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
                x.0,
                y.0,
                w.0
            ),
        }
        .ok_or_else(|| {
            Error::Cuda(format!(
                "cuDNN has no {dir:?} convolution algorithm for {dtype} {p:?} within {WORKSPACE_LIMIT} bytes of workspace"
            ))
        })?;
        Ok(LegacyPlan {
            math,
            x,
            w,
            y,
            conv,
            algo,
            workspace,
            graph_candidates: 0,
        })
    }
}

/// Runs one convolution direction: `a`, `b` are the two inputs in cuDNN's argument order and the
/// output has `out_len` elements.
fn run(
    dev: &std::sync::Arc<CudaDevice>,
    dir: Dir,
    p: &Conv2dParams,
    dtype: DType,
    a: &CudaStorage,
    b: &CudaStorage,
    out_len: usize,
) -> Result<CudaStorage> {
    let out = CudaStorage::alloc(dev, dtype, out_len)?;
    if out_len == 0 || a.is_empty() || b.is_empty() {
        if out_len > 0 {
            super::cast::fill(&out, 0.0)?;
        }
        return Ok(out);
    }
    let mut guard = dev.dnn.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        // A cuDNN missing a symbol would panic inside cudarc: an error instead.
        *guard = Some(super::probe::no_panic("creating the cuDNN handle", || {
            Dnn::new(dev)
        })?);
    }
    let dnn_state = guard
        .as_mut()
        .ok_or_else(|| Error::Cuda("cuDNN handle".into()))?;
    let ptrs = [a.ptr(), b.ptr(), out.ptr()].map(|p| p as *mut c_void);
    let key = (*p, dtype, dir, allow_tf32());
    if !dnn_state.plans.contains_key(&key) {
        let plan = dnn_state.make_plan(dev, p, dtype, dir, ptrs)?;
        dnn_state.plans.insert(key, plan);
    }
    let ws_needed = dnn_state.plans.get(&key).map_or(0, Plan::workspace);
    let have = dnn_state.workspace.as_ref().map_or(0, |w| w.len());
    if ws_needed > have {
        // SAFETY: cuDNN owns the workspace contents.
        let ws = unsafe { dev.stream.alloc::<u8>(ws_needed) }.map_err(|e| {
            cuda_err(
                &format!("allocating {ws_needed} bytes of cuDNN workspace"),
                e,
            )
        })?;
        dnn_state.workspace = Some(ws);
    }
    let (ws_ptr, ws_len) = match &dnn_state.workspace {
        Some(w) => (w.device_ptr(&dev.stream).0 as *mut c_void, w.len()),
        None => (std::ptr::null_mut(), 0),
    };
    let h = dnn_state.handle;
    let plan = match dnn_state.plans.get(&key) {
        Some(Plan::Legacy(plan)) => plan,
        Some(Plan::Graph(graph)) => {
            dev.ctx
                .bind_to_thread()
                .map_err(|e| cuda_err("binding the context", e))?;
            graph
                .execute(h, ptrs, ws_ptr)
                .map_err(|e| Error::Cuda(format!("{dir:?} convolution ({dtype}, {p:?}): {e}")))?;
            return Ok(out);
        }
        None => return Err(Error::Cuda("cuDNN plan cache".into())),
    };
    let (a1, b0) = (1.0f32, 0.0f32);
    let (a1d, b0d) = (1.0f64, 0.0f64);
    let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
        (&a1d as *const f64 as _, &b0d as *const f64 as _)
    } else {
        (&a1 as *const f32 as _, &b0 as *const f32 as _)
    };
    dev.ctx
        .bind_to_thread()
        .map_err(|e| cuda_err("binding the context", e))?;
    let (ap, bp, op) = (
        a.ptr() as *const c_void,
        b.ptr() as *const c_void,
        out.ptr() as *mut c_void,
    );
    // SAFETY: descriptors describe exactly these buffers (sizes checked by the callers); the
    // workspace holds at least the plan's size; alpha/beta outlive the call.
    let r = unsafe {
        match plan.algo {
            Algo::Fwd(algo) => dnn::convolution_forward(
                h,
                alpha,
                plan.x.0,
                ap,
                plan.w.0,
                bp,
                plan.conv.0,
                algo,
                ws_ptr,
                ws_len,
                beta,
                plan.y.0,
                op,
            ),
            Algo::BwdData(algo) => dnn::convolution_backward_data(
                h,
                alpha,
                plan.w.0,
                bp,
                plan.y.0,
                ap,
                plan.conv.0,
                algo,
                ws_ptr,
                ws_len,
                beta,
                plan.x.0,
                op,
            ),
            Algo::BwdFilter(algo) => dnn::convolution_backward_filter(
                h,
                alpha,
                plan.x.0,
                bp,
                plan.y.0,
                ap,
                plan.conv.0,
                algo,
                ws_ptr,
                ws_len,
                beta,
                plan.w.0,
                op,
            ),
        }
    };
    r.map_err(|e| dnn_err(&format!("{dir:?} convolution ({dtype}, {p:?})"), e))?;
    Ok(out)
}

/// Tensor cores for half types; for f32 plain FMA unless TF32 was allowed.
fn math_type(dtype: DType) -> dsys::cudnnMathType_t {
    match dtype {
        DType::F16 | DType::BF16 => dsys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        DType::F32 if allow_tf32() => dsys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        DType::F32 => dsys::cudnnMathType_t::CUDNN_FMA_MATH,
        _ => dsys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
    }
}

/// Times cuDNN's algorithms on the first call's buffers and keeps the fastest one that fits;
/// returns its median time in ms (`None`: no candidate, the heuristic choice stays).
/// cudnnFind times each candidate once, and its first run also pays a warm-up on whichever
/// candidate it times first: on ResNet-50's 3x3 shapes (H200) that made a candidate twice as slow
/// look fastest. So the choice is made on each candidate's median over `FIND_ROUNDS` runs.
fn find(
    dev: &CudaDevice,
    h: dsys::cudnnHandle_t,
    plan: &mut LegacyPlan,
    dir: Dir,
    p: &Conv2dParams,
    (ap, bp, op): (*const c_void, *const c_void, *mut c_void),
) -> Result<Option<f32>> {
    const N: usize = 16;
    const FIND_ROUNDS: usize = 3;
    // SAFETY: cuDNN owns the scratch contents.
    let scratch = unsafe { dev.stream.alloc::<u8>(FIND_WORKSPACE) }
        .map_err(|e| cuda_err("allocating cudnnFind scratch", e))?;
    let ws = scratch.device_ptr(&dev.stream).0 as *mut c_void;
    let mut count: c_int = 0;
    let ok = |st: dsys::cudnnStatus_t, mem: usize| {
        st == dsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS && mem <= FIND_WORKSPACE
    };
    // Times the candidates on (d1, p1), (d2, p2) -> (d3, out): those that fit, with their times.
    macro_rules! find_fastest {
        ($perf:ty, $find:path, $variant:path, $name:literal, $d1:expr, $p1:expr, $d2:expr, $p2:expr, $d3:expr) => {{
            // SAFETY: zeroed plain-data structs filled by cuDNN.
            let mut perf: [$perf; N] = unsafe { std::mem::zeroed() };
            // SAFETY: descriptors describe these buffers; scratch holds FIND_WORKSPACE bytes.
            unsafe {
                $find(
                    h,
                    $d1,
                    $p1,
                    $d2,
                    $p2,
                    plan.conv.0,
                    $d3,
                    op,
                    N as c_int,
                    &mut count,
                    perf.as_mut_ptr(),
                    ws,
                    FIND_WORKSPACE,
                )
            }
            .result()
            .map_err(|e| dnn_err($name, e))?;
            perf.iter()
                .take(count.max(0) as usize)
                .filter(|pf| ok(pf.status, pf.memory) && pf.mathType == plan.math)
                .map(|pf| ($variant(pf.algo), pf.time, pf.memory))
                .collect::<Vec<(Algo, f32, usize)>>()
        }};
    }
    // (algorithm, its times over the rounds, workspace)
    let mut seen: Vec<(Algo, Vec<f32>, usize)> = Vec::new();
    for _ in 0..FIND_ROUNDS {
        let round = match dir {
            Dir::Forward => find_fastest!(
                dsys::cudnnConvolutionFwdAlgoPerf_t,
                dsys::cudnnFindConvolutionForwardAlgorithmEx,
                Algo::Fwd,
                "cudnnFindConvolutionForwardAlgorithmEx",
                plan.x.0,
                ap,
                plan.w.0,
                bp,
                plan.y.0
            ),
            // a = dy, b = w, out = dx.
            Dir::BackwardData => find_fastest!(
                dsys::cudnnConvolutionBwdDataAlgoPerf_t,
                dsys::cudnnFindConvolutionBackwardDataAlgorithmEx,
                Algo::BwdData,
                "cudnnFindConvolutionBackwardDataAlgorithmEx",
                plan.w.0,
                bp,
                plan.y.0,
                ap,
                plan.x.0
            ),
            // a = dy, b = x, out = dw.
            Dir::BackwardFilter => find_fastest!(
                dsys::cudnnConvolutionBwdFilterAlgoPerf_t,
                dsys::cudnnFindConvolutionBackwardFilterAlgorithmEx,
                Algo::BwdFilter,
                "cudnnFindConvolutionBackwardFilterAlgorithmEx",
                plan.x.0,
                bp,
                plan.y.0,
                ap,
                plan.w.0
            ),
        };
        for (algo, time, memory) in round {
            match seen.iter_mut().find(|(a, _, _)| *a == algo) {
                Some((_, times, _)) => times.push(time),
                None => seen.push((algo, vec![time], memory)),
            }
        }
    }
    drop(scratch);
    let median = |times: &[f32]| {
        let mut t = times.to_vec();
        t.sort_by(f32::total_cmp);
        t[t.len() / 2]
    };
    // Only candidates timed in every round compete (one that failed once is not trusted).
    let choice = seen
        .iter()
        .filter(|(_, times, _)| times.len() == FIND_ROUNDS)
        .min_by(|a, b| median(&a.1).total_cmp(&median(&b.1)));
    log::debug!(
        "cudnnFind {dir:?} {p:?}: {} -> {:?}",
        seen.iter()
            .map(|(a, t, _)| format!("{a:?} {t:?} ms"))
            .collect::<Vec<_>>()
            .join(", "),
        choice.map(|c| c.0)
    );
    Ok(choice.map(|(algo, times, memory)| {
        plan.algo = *algo;
        plan.workspace = *memory;
        median(times)
    }))
}

/// One cached convolution plan, as [`conv_plans`] reports it.
#[derive(Clone, Debug)]
pub struct ConvPlanInfo {
    pub params: Conv2dParams,
    pub dtype: DType,
    /// "forward", "backward-data" or "backward-filter".
    pub direction: &'static str,
    /// Whether it runs through cuDNN's graph API (else the legacy API).
    pub graph_api: bool,
    /// How many graph-API engine configurations were timed or considered for it (0 when the
    /// graph API was not tried or had no engine for it).
    pub graph_candidates: usize,
    /// Bytes of workspace it needs.
    pub workspace: usize,
    /// What runs: "graph engine N [its numerical notes]" or "legacy <cuDNN algorithm>".
    pub algorithm: String,
}

/// The convolution plans device `ordinal` has chosen so far (one per geometry, dtype, direction
/// and TF32 setting): which API each runs through, for tests and for a look at a network.
pub fn conv_plans(ordinal: usize) -> Result<Vec<ConvPlanInfo>> {
    let dev = super::device::get(ordinal)?;
    let guard = dev.dnn.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dnn) = guard.as_ref() else {
        return Ok(Vec::new());
    };
    Ok(dnn
        .plans
        .iter()
        .map(|((params, dtype, dir, _), plan)| ConvPlanInfo {
            params: *params,
            dtype: *dtype,
            direction: match dir {
                Dir::Forward => "forward",
                Dir::BackwardData => "backward-data",
                Dir::BackwardFilter => "backward-filter",
            },
            graph_api: matches!(plan, Plan::Graph(_)),
            graph_candidates: plan.graph_candidates(),
            workspace: plan.workspace(),
            algorithm: plan.describe(),
        })
        .collect())
}

fn sizes(p: &Conv2dParams) -> (usize, usize, usize) {
    (
        p.n * p.c_in * p.h * p.w,
        p.c_out * (p.c_in / p.groups) * p.kh * p.kw,
        p.n * p.c_out * p.out_h() * p.out_w(),
    )
}

/// The checks and the run of one direction: `a`, `b` as [`run`] takes them.
fn conv(dir: Dir, a: &CudaStorage, b: &CudaStorage, p: &Conv2dParams) -> Result<CudaStorage> {
    let op = match dir {
        Dir::Forward => "conv2d",
        Dir::BackwardData => "conv2d_backward_input",
        Dir::BackwardFilter => "conv2d_backward_weight",
    };
    check(op, p)?;
    let (nx, nw, ny) = sizes(p);
    let (na, a_what, nb, b_what, n_out) = match dir {
        Dir::Forward => (nx, "the input", nw, "the weight", ny),
        Dir::BackwardData => (ny, "the output gradient", nw, "the weight", nx),
        Dir::BackwardFilter => (ny, "the output gradient", nx, "the input", nw),
    };
    for (s, n, what) in [(a, na, a_what), (b, nb, b_what)] {
        if s.len() != n {
            return Err(Error::invalid_arg(
                op,
                "len",
                s.len(),
                format!("{what} must have {n} elements"),
            ));
        }
    }
    run(&a.dev, dir, p, a.dtype(), a, b, n_out)
}

/// The operands of a convolution are packed in the params' format at offset 0 (the tensor
/// layer's `packed_as`), which is what cuDNN's descriptors describe.
fn packed(op: &'static str, s: &CudaStorage, l: &Layout) -> Result<()> {
    if l.offset() != 0 || l.elem_count() != s.len() {
        return Err(Error::invalid_arg(
            op,
            "layout",
            format!(
                "offset {} over {} of {} elements",
                l.offset(),
                l.elem_count(),
                s.len()
            ),
            "a packed operand (offset 0, the whole buffer)",
        ));
    }
    Ok(())
}

pub(crate) fn conv2d(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    p: &Conv2dParams,
) -> Result<CudaStorage> {
    packed("conv2d", x, lx)?;
    packed("conv2d", w, lw)?;
    conv(Dir::Forward, x, w, p)
}

/// `g` is the output gradient; returns the input gradient.
pub(crate) fn conv2d_backward_input(
    g: &CudaStorage,
    lg: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    p: &Conv2dParams,
) -> Result<CudaStorage> {
    packed("conv2d_backward_input", g, lg)?;
    packed("conv2d_backward_input", w, lw)?;
    conv(Dir::BackwardData, g, w, p)
}

/// `g` is the output gradient; returns the weight gradient.
pub(crate) fn conv2d_backward_weight(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    p: &Conv2dParams,
) -> Result<CudaStorage> {
    packed("conv2d_backward_weight", g, lg)?;
    packed("conv2d_backward_weight", x, lx)?;
    conv(Dir::BackwardFilter, g, x, p)
}
