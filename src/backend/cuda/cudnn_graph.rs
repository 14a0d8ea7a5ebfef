//! One convolution direction through cuDNN's graph (backend) API: the operation graph of a single
//! convolution node, engine configurations from cuDNN's heuristics (mode A, then its fallback
//! list), and an autotune that times each one that builds on the call's own buffers.
//!
//! Why this and not only `cudnnFind*`: the legacy API reaches a subset of cuDNN 9's engines. On
//! ResNet-50's 14x14 layer3 convolution (H200, f16) it offered two tensor-core candidates, the
//! faster at ~0.7 of what PyTorch (which uses this API) reaches. `conv.rs` times the legacy API's
//! choice beside this one and keeps the faster; the legacy API also covers graphs no engine here
//! supports.

use std::ffi::c_void;

use cudarc::cudnn::sys as dsys;
use cudarc::cudnn::sys::cudnnBackendAttributeName_t as A;
use cudarc::cudnn::sys::cudnnBackendAttributeType_t as T;
use cudarc::cudnn::sys::cudnnBackendDescriptorType_t as D;
use cudarc::driver::sys::CUevent_flags;

use super::conv::{data_type, Dir};
use super::device::{cuda_err, CudaDevice};
use crate::backend::Conv2dParams;
use crate::error::{Error, Result};
use crate::tensor::DType;

/// Unique ids of the three tensors in the graph (and in every variant pack).
const UID_X: i64 = 1;
const UID_W: i64 = 2;
const UID_Y: i64 = 3;
/// The byte alignment the tensors are declared with; `execute` checks the pointers.
const ALIGNMENT: i64 = 16;
/// How many engine configurations the autotune times at most (PyTorch's default limit is 10).
const MAX_CANDIDATES: usize = 12;
/// Timed runs per candidate after one warm-up run; the median decides.
const TIMED_RUNS: usize = 3;

fn status(what: &str, st: dsys::cudnnStatus_t) -> Result<()> {
    if st == dsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("cuDNN graph API, {what}: {st:?}")))
    }
}

/// One backend descriptor, destroyed on drop.
struct Desc(dsys::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created once by cudnnBackendCreateDescriptor, destroyed once.
        let _ = unsafe { dsys::cudnnBackendDestroyDescriptor(self.0) };
    }
}

impl Desc {
    fn new(ty: D) -> Result<Desc> {
        let mut d: dsys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: `d` receives a new descriptor.
        status(&format!("creating a {ty:?}"), unsafe {
            dsys::cudnnBackendCreateDescriptor(ty, &mut d)
        })?;
        Ok(Desc(d))
    }

    /// Sets attribute `name` to `values`, whose Rust type must be what `ty` names.
    fn set<V>(&self, name: A, ty: T, values: &[V]) -> Result<()> {
        // SAFETY: `values` holds `len` elements of the type `ty` names (the callers below pair
        // them: i64 with INT64, descriptor handles with BACKEND_DESCRIPTOR, and so on).
        status(&format!("setting {name:?}"), unsafe {
            dsys::cudnnBackendSetAttribute(
                self.0,
                name,
                ty,
                values.len() as i64,
                values.as_ptr() as *const c_void,
            )
        })
    }

    fn set_i64s(&self, name: A, v: &[i64]) -> Result<()> {
        self.set(name, T::CUDNN_TYPE_INT64, v)
    }

    fn set_descs(&self, name: A, v: &[&Desc]) -> Result<()> {
        let raw: Vec<dsys::cudnnBackendDescriptor_t> = v.iter().map(|d| d.0).collect();
        self.set(name, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw)
    }

    fn finalize(self, what: &str) -> Result<Desc> {
        // SAFETY: a live descriptor whose required attributes were set.
        status(&format!("finalizing {what}"), unsafe {
            dsys::cudnnBackendFinalize(self.0)
        })?;
        Ok(self)
    }

    /// Reads up to `out.len()` elements of attribute `name`; returns how many there were.
    fn get<V>(&self, name: A, ty: T, out: &mut [V]) -> Result<usize> {
        let mut n = 0i64;
        // SAFETY: `out` has room for `out.len()` elements of the type `ty` names.
        status(&format!("reading {name:?}"), unsafe {
            dsys::cudnnBackendGetAttribute(
                self.0,
                name,
                ty,
                out.len() as i64,
                &mut n,
                if out.is_empty() {
                    std::ptr::null_mut()
                } else {
                    out.as_mut_ptr() as *mut c_void
                },
            )
        })?;
        Ok(n.max(0) as usize)
    }
}

/// A dense NCHW tensor (or KCRS filter) descriptor.
fn tensor(uid: i64, dims: [usize; 4], dt: dsys::cudnnDataType_t) -> Result<Desc> {
    let d = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    let dims = dims.map(|v| v as i64);
    let strides = [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1];
    d.set(
        A::CUDNN_ATTR_TENSOR_DATA_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[dt],
    )?;
    d.set_i64s(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
    d.set_i64s(A::CUDNN_ATTR_TENSOR_STRIDES, &strides)?;
    d.set_i64s(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?;
    d.set_i64s(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[ALIGNMENT])?;
    d.finalize("a tensor descriptor")
}

/// The engine's numerical and behaviour notes (for logs), and whether they refuse it for this
/// convolution. It must compute what the dtype promises: no inputs converted down, no reduction
/// in reduced precision (half inputs accumulate in f32), f32 on tensor cores (TF32) only when
/// allowed (f64 tensor cores compute in f64). Engines that compile kernels at run time are left
/// out too: each costs seconds at first use, for every shape of a network.
fn engine_notes(engine: &Desc, dtype: DType, tf32: bool) -> Result<(bool, String)> {
    use dsys::cudnnBackendBehaviorNote_t as B;
    use dsys::cudnnBackendNumericalNote_t as N;
    let mut notes =
        [N::CUDNN_NUMERICAL_NOTE_TYPE_COUNT; N::CUDNN_NUMERICAL_NOTE_TYPE_COUNT as usize];
    let n = engine.get(
        A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
        T::CUDNN_TYPE_NUMERICAL_NOTE,
        &mut notes,
    )?;
    let notes = &notes[..n.min(notes.len())];
    let mut behavior =
        [B::CUDNN_BEHAVIOR_NOTE_TYPE_COUNT; B::CUDNN_BEHAVIOR_NOTE_TYPE_COUNT as usize];
    let m = engine.get(
        A::CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE,
        T::CUDNN_TYPE_BEHAVIOR_NOTE,
        &mut behavior,
    )?;
    let behavior = &behavior[..m.min(behavior.len())];
    let tf32_used = dtype == DType::F32 && notes.contains(&N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE);
    let refused = notes.contains(&N::CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS)
        || notes.contains(&N::CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION)
        || (tf32_used && !tf32)
        || behavior.contains(&B::CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION);
    let names = notes
        .iter()
        .map(|n| format!("{n:?}"))
        .chain(behavior.iter().map(|b| format!("{b:?}")))
        .map(|n| {
            n.trim_start_matches("CUDNN_NUMERICAL_NOTE_")
                .trim_start_matches("CUDNN_BEHAVIOR_NOTE_")
                .to_string()
        })
        .collect::<Vec<_>>()
        .join(" ");
    Ok((refused, format!("[{names}]")))
}

/// An execution plan that built for the graph, with what the logs and the choice need.
struct Candidate {
    plan: Desc,
    /// The engine configuration it was built from (kept alive with it).
    config: Desc,
    /// The engine's global index.
    engine: i64,
    /// Its notes, as `engine_notes` writes them.
    notes: String,
    workspace: usize,
}

/// A built and chosen execution plan for one (geometry, dtype, direction).
pub(super) struct ConvPlan {
    // Declared first so it is dropped before what it was built from.
    plan: Desc,
    /// Its engine configuration, and the tensors, convolution, operation and operation graph:
    /// kept alive while the plan lives.
    _config: Desc,
    _graph: Vec<Desc>,
    /// The unique ids of the buffers `execute` takes, in cuDNN's argument order.
    uids: [i64; 3],
    /// Bytes of workspace the plan needs.
    pub(super) workspace: usize,
    /// The engine's global index and notes, for logs.
    pub(super) engine: i64,
    pub(super) notes: String,
    /// Its median time on the first call's buffers (ms), when the autotune ran.
    pub(super) time_ms: Option<f32>,
    /// How many engine configurations built for the graph (the candidates).
    pub(super) candidates: usize,
}

// SAFETY: the descriptors are only used under the device's `dnn` mutex.
unsafe impl Send for ConvPlan {}

impl std::fmt::Debug for ConvPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "graph engine {} {} ({} bytes of workspace)",
            self.engine, self.notes, self.workspace
        )
    }
}

/// The operation graph of one convolution node, and the uids of its buffers in argument order.
fn operation_graph(
    handle: dsys::cudnnHandle_t,
    p: &Conv2dParams,
    dtype: DType,
    dir: Dir,
) -> Result<(Vec<Desc>, [i64; 3])> {
    let (dt, compute) = data_type(dtype)?;
    let x = tensor(UID_X, [p.n, p.c_in, p.h, p.w], dt)?;
    // Groups are implied by the filter's channel count (c_in / groups).
    let w = tensor(UID_W, [p.c_out, p.c_in / p.groups, p.kh, p.kw], dt)?;
    let y = tensor(UID_Y, [p.n, p.c_out, p.out_h(), p.out_w()], dt)?;
    let conv = Desc::new(D::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
    conv.set(
        A::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[compute],
    )?;
    conv.set(
        A::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
        T::CUDNN_TYPE_CONVOLUTION_MODE,
        &[dsys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
    )?;
    let pair = |v: (usize, usize)| [v.0 as i64, v.1 as i64];
    conv.set_i64s(A::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[2])?;
    conv.set_i64s(A::CUDNN_ATTR_CONVOLUTION_DILATIONS, &pair(p.dilation))?;
    conv.set_i64s(A::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, &pair(p.stride))?;
    conv.set_i64s(A::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &pair(p.padding))?;
    conv.set_i64s(A::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &pair(p.padding))?;
    let conv = conv.finalize("the convolution descriptor")?;

    let (op_type, names, uids) = match dir {
        Dir::Forward => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
            ],
            [UID_X, UID_W, UID_Y],
        ),
        Dir::BackwardData => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
            ],
            [UID_Y, UID_W, UID_X],
        ),
        Dir::BackwardFilter => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
            ],
            [UID_Y, UID_X, UID_W],
        ),
    };
    let [x_name, w_name, y_name, conv_name, alpha_name, beta_name] = names;
    let op = Desc::new(op_type)?;
    op.set_descs(x_name, &[&x])?;
    op.set_descs(w_name, &[&w])?;
    op.set_descs(y_name, &[&y])?;
    op.set_descs(conv_name, &[&conv])?;
    // y = 1 * conv + 0 * y, the scalars in the compute type.
    if dtype == DType::F64 {
        op.set(alpha_name, T::CUDNN_TYPE_DOUBLE, &[1.0f64])?;
        op.set(beta_name, T::CUDNN_TYPE_DOUBLE, &[0.0f64])?;
    } else {
        op.set(alpha_name, T::CUDNN_TYPE_FLOAT, &[1.0f32])?;
        op.set(beta_name, T::CUDNN_TYPE_FLOAT, &[0.0f32])?;
    }
    let op = op.finalize("the convolution operation")?;
    let graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    graph.set(
        A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
        T::CUDNN_TYPE_HANDLE,
        &[handle],
    )?;
    graph.set_descs(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &[&op])?;
    let graph = graph.finalize("the operation graph")?;
    Ok((vec![x, w, y, conv, op, graph], uids))
}

/// The engine configurations cuDNN's heuristics propose in `mode`, best first.
fn engine_configs(graph: &Desc, mode: dsys::cudnnBackendHeurMode_t) -> Result<Vec<Desc>> {
    let heur = Desc::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set_descs(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[graph])?;
    heur.set(
        A::CUDNN_ATTR_ENGINEHEUR_MODE,
        T::CUDNN_TYPE_HEUR_MODE,
        &[mode],
    )?;
    let heur = heur.finalize("the engine heuristics")?;
    let count = heur.get::<dsys::cudnnBackendDescriptor_t>(
        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &mut [],
    )?;
    let configs = (0..count)
        .map(|_| Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
        .collect::<Result<Vec<_>>>()?;
    let mut raw: Vec<_> = configs.iter().map(|d| d.0).collect();
    let got = heur.get(
        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &mut raw,
    )?;
    let mut configs = configs;
    configs.truncate(got);
    Ok(configs)
}

/// An execution plan for `config`, which it keeps (its workspace not yet read), or why there is
/// none: its engine is refused, or it does not build for this graph (not an error: the
/// heuristics list engines that may not support the exact graph).
fn execution_plan(
    handle: dsys::cudnnHandle_t,
    config: Desc,
    dtype: DType,
    tf32: bool,
) -> Result<std::result::Result<Candidate, String>> {
    let engine = Desc::new(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    let mut raw = [engine.0];
    config.get(
        A::CUDNN_ATTR_ENGINECFG_ENGINE,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &mut raw,
    )?;
    let mut index = [-1i64];
    engine.get(
        A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX,
        T::CUDNN_TYPE_INT64,
        &mut index,
    )?;
    let index = index[0];
    let (refused, notes) = engine_notes(&engine, dtype, tf32)?;
    if refused {
        return Ok(Err(format!("engine {index} refused: {notes}")));
    }
    let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set(
        A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
        T::CUDNN_TYPE_HANDLE,
        &[handle],
    )?;
    plan.set_descs(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[&config])?;
    Ok(match plan.finalize("an execution plan") {
        Ok(plan) => Ok(Candidate {
            plan,
            config,
            engine: index,
            notes,
            workspace: 0,
        }),
        Err(e) => Err(format!("engine {index}: {e}")),
    })
}

fn workspace_size(plan: &Desc) -> Result<usize> {
    let mut ws = [0i64];
    plan.get(
        A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
        T::CUDNN_TYPE_INT64,
        &mut ws,
    )?;
    Ok(ws[0].max(0) as usize)
}

/// Runs `plan` on `ptrs` (in `uids` order) with `workspace`.
fn execute_plan(
    handle: dsys::cudnnHandle_t,
    plan: &Desc,
    uids: &[i64; 3],
    ptrs: [*mut c_void; 3],
    workspace: *mut c_void,
) -> Result<()> {
    if let Some(p) = ptrs
        .iter()
        .find(|p| (**p as usize) % ALIGNMENT as usize != 0)
    {
        return Err(Error::Cuda(format!(
            "cuDNN graph API: buffer {p:?} is not {ALIGNMENT}-byte aligned"
        )));
    }
    let pack = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
    pack.set(
        A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
        T::CUDNN_TYPE_VOID_PTR,
        &ptrs,
    )?;
    pack.set_i64s(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, uids)?;
    pack.set(
        A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
        T::CUDNN_TYPE_VOID_PTR,
        &[workspace],
    )?;
    let pack = pack.finalize("the variant pack")?;
    // SAFETY: the plan was built on this handle for tensors these pointers hold; the workspace
    // holds at least the plan's workspace size (callers check).
    status("executing a plan", unsafe {
        dsys::cudnnBackendExecute(handle, plan.0, pack.0)
    })
}

impl ConvPlan {
    /// Builds the graph for one direction and chooses its engine: with `autotune`, the fastest
    /// (median of `TIMED_RUNS`) of up to `MAX_CANDIDATES` plans run on `ptrs` (the call's
    /// buffers in argument order; the output is overwritten); without, the heuristics' first
    /// plan that builds. Plans needing more than `workspace_limit` bytes are skipped.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn tuned(
        dev: &CudaDevice,
        handle: dsys::cudnnHandle_t,
        p: &Conv2dParams,
        dtype: DType,
        dir: Dir,
        tf32: bool,
        ptrs: [*mut c_void; 3],
        workspace_limit: usize,
        autotune: bool,
    ) -> Result<ConvPlan> {
        let (graph, uids) = operation_graph(handle, p, dtype, dir)?;
        let op_graph = graph
            .last()
            .ok_or_else(|| Error::Cuda("empty graph".into()))?;
        let mut candidates: Vec<Candidate> = Vec::new();
        // Why each configuration the heuristics offered was not a candidate.
        let mut skipped: Vec<String> = Vec::new();
        for mode in [
            dsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            dsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ] {
            // A mode with no answer for this graph leaves the other.
            let configs = match engine_configs(op_graph, mode) {
                Ok(c) if c.is_empty() => {
                    skipped.push(format!("{mode:?}: no configurations"));
                    continue;
                }
                Ok(c) => c,
                Err(e) => {
                    skipped.push(format!("{mode:?}: {e}"));
                    continue;
                }
            };
            for config in configs {
                if candidates.len() == MAX_CANDIDATES || (!autotune && !candidates.is_empty()) {
                    break;
                }
                let mut c = match execution_plan(handle, config, dtype, tf32)? {
                    Ok(c) => c,
                    Err(why) => {
                        skipped.push(why);
                        continue;
                    }
                };
                c.workspace = workspace_size(&c.plan)?;
                if c.workspace > workspace_limit {
                    skipped.push(format!(
                        "engine {}: {} bytes of workspace",
                        c.engine, c.workspace
                    ));
                } else if !candidates
                    .iter()
                    .any(|o| o.engine == c.engine && o.workspace == c.workspace)
                {
                    candidates.push(c);
                }
            }
        }
        if !skipped.is_empty() {
            log::debug!(
                "cuDNN graph {dir:?} {dtype} {p:?}, not candidates: {}",
                skipped.join("; ")
            );
        }
        if candidates.is_empty() {
            return Err(Error::Cuda(format!(
                "cuDNN graph API: no engine for {dir:?} {dtype} {p:?} ({})",
                skipped.join("; ")
            )));
        }
        let n_candidates = candidates.len();
        let mut time_ms = None;
        let chosen = if autotune {
            let times = time_candidates(dev, handle, &candidates, &uids, ptrs)?;
            log::debug!(
                "cuDNN graph {dir:?} {dtype} {p:?}: {}",
                candidates
                    .iter()
                    .zip(&times)
                    .map(|(c, t)| format!("engine {} {t:?} ms", c.engine))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            times
                .iter()
                .enumerate()
                .filter_map(|(k, t)| t.map(|t| (k, t)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(k, t)| {
                    time_ms = Some(t);
                    k
                })
                .ok_or_else(|| {
                    Error::Cuda(format!(
                        "cuDNN graph API: every engine failed for {dir:?} {dtype} {p:?}"
                    ))
                })?
        } else {
            0
        };
        let c = candidates.swap_remove(chosen);
        log::debug!(
            "cuDNN graph {dir:?} {dtype} {p:?} -> engine {} {}",
            c.engine,
            c.notes
        );
        Ok(ConvPlan {
            plan: c.plan,
            _config: c.config,
            _graph: graph,
            uids,
            workspace: c.workspace,
            engine: c.engine,
            notes: c.notes,
            time_ms,
            candidates: n_candidates,
        })
    }

    /// Runs the plan on `ptrs` (argument order) with a workspace of at least `self.workspace`.
    pub(super) fn execute(
        &self,
        handle: dsys::cudnnHandle_t,
        ptrs: [*mut c_void; 3],
        workspace: *mut c_void,
    ) -> Result<()> {
        execute_plan(handle, &self.plan, &self.uids, ptrs, workspace)
    }
}

/// Each candidate's median time in ms over `TIMED_RUNS` runs after a warm-up; `None` for one
/// that failed to run. The events bracket the device's one stream: work other threads enqueue
/// meanwhile counts too (a slower choice then, never a wrong one).
fn time_candidates(
    dev: &CudaDevice,
    handle: dsys::cudnnHandle_t,
    candidates: &[Candidate],
    uids: &[i64; 3],
    ptrs: [*mut c_void; 3],
) -> Result<Vec<Option<f32>>> {
    let most = candidates
        .iter()
        .map(|c| c.workspace)
        .max()
        .unwrap_or(0)
        .max(1);
    // SAFETY: cuDNN owns the scratch contents.
    let scratch = unsafe { dev.stream.alloc::<u8>(most) }
        .map_err(|e| cuda_err("allocating the autotune workspace", e))?;
    let ws = {
        use cudarc::driver::DevicePtr;
        scratch.device_ptr(&dev.stream).0 as *mut c_void
    };
    let event = || {
        dev.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_err("creating a timing event", e))
    };
    let (start, end) = (event()?, event()?);
    let mut out = Vec::with_capacity(candidates.len());
    for Candidate { plan, .. } in candidates {
        let mut times = Vec::with_capacity(TIMED_RUNS);
        let mut ok = execute_plan(handle, plan, uids, ptrs, ws).is_ok();
        for _ in 0..TIMED_RUNS {
            if !ok {
                break;
            }
            start
                .record(&dev.stream)
                .map_err(|e| cuda_err("recording an event", e))?;
            ok = execute_plan(handle, plan, uids, ptrs, ws).is_ok();
            end.record(&dev.stream)
                .map_err(|e| cuda_err("recording an event", e))?;
            times.push(
                start
                    .elapsed_ms(&end)
                    .map_err(|e| cuda_err("reading a timing event", e))?,
            );
        }
        out.push(ok.then(|| {
            times.sort_by(f32::total_cmp);
            times[times.len() / 2]
        }));
    }
    drop(scratch);
    Ok(out)
}
