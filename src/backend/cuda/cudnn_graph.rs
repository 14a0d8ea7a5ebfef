//! One convolution direction through cuDNN's graph (backend) API: the operation graph of a single
//! convolution node (NCHW or NHWC strides), the engine configurations cuDNN's heuristics propose
//! for it (modes A and B, then the fallback list), each built into an execution plan, and the
//! rebuild of one configuration from its engine id and knob choices (what the plan cache stores).
//! Timing and the choice between these and the legacy API's algorithms are `conv_tune.rs`'s and
//! `conv.rs`'s.
//!
//! Why this API and not only the legacy one: the legacy API reaches a subset of cuDNN 9's
//! engines. On ResNet-50's 14x14 layer3 convolution (f16) it offered two tensor-core
//! candidates, the faster well short of what PyTorch (which uses this API) reaches.

use std::ffi::c_void;

use cudarc::cudnn::sys as dsys;
use cudarc::cudnn::sys::cudnnBackendAttributeName_t as A;
use cudarc::cudnn::sys::cudnnBackendAttributeType_t as T;
use cudarc::cudnn::sys::cudnnBackendDescriptorType_t as D;
use dsys::cudnnBackendHeurMode_t as Heur;

use super::conv_plan::Dir;
use super::cudnn::data_type;
use crate::backend::Conv2dParams;
use crate::base::error::{Error, Result};
use crate::base::{DType, MemoryFormat};

/// Unique ids of the three tensors in the graph (and in every variant pack).
const UID_X: i64 = 1;
const UID_W: i64 = 2;
const UID_Y: i64 = 3;
/// The byte alignment the tensors are declared with; `execute` checks the pointers.
const ALIGNMENT: i64 = 16;
/// How many new configurations each heuristic mode may add to the candidates (PyTorch times up
/// to 10 in all). Mode A lists many knob variants of one engine first; the later modes bring
/// other engines (the fallback list has the generic ones that cover odd shapes).
const MODE_QUOTAS: [(Heur, usize); 3] = [
    (Heur::CUDNN_HEUR_MODE_A, 8),
    (Heur::CUDNN_HEUR_MODE_B, 4),
    (Heur::CUDNN_HEUR_MODE_FALLBACK, 4),
];
/// Room for an engine configuration's knob choices (cuDNN 9.2 has 44 knob types).
const MAX_KNOBS: usize = 64;

pub(super) fn status(what: &str, st: dsys::cudnnStatus_t) -> Result<()> {
    if st == dsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("cuDNN graph API, {what}: {st:?}")))
    }
}

/// One backend descriptor, destroyed on drop.
pub(super) struct Desc(pub(super) dsys::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created once by cudnnBackendCreateDescriptor, destroyed once.
        let _ = unsafe { dsys::cudnnBackendDestroyDescriptor(self.0) };
    }
}

impl Desc {
    pub(super) fn new(ty: D) -> Result<Desc> {
        let mut d: dsys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: `d` receives a new descriptor.
        status(&format!("creating a {ty:?}"), unsafe {
            dsys::cudnnBackendCreateDescriptor(ty, &mut d)
        })?;
        Ok(Desc(d))
    }

    /// Sets attribute `name` to `values`, whose Rust type must be what `ty` names.
    pub(super) fn set<V>(&self, name: A, ty: T, values: &[V]) -> Result<()> {
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

    pub(super) fn set_i64s(&self, name: A, v: &[i64]) -> Result<()> {
        self.set(name, T::CUDNN_TYPE_INT64, v)
    }

    pub(super) fn set_descs(&self, name: A, v: &[&Desc]) -> Result<()> {
        let raw: Vec<dsys::cudnnBackendDescriptor_t> = v.iter().map(|d| d.0).collect();
        self.set(name, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw)
    }

    pub(super) fn finalize(self, what: &str) -> Result<Desc> {
        // SAFETY: a live descriptor whose required attributes were set.
        status(&format!("finalizing {what}"), unsafe {
            dsys::cudnnBackendFinalize(self.0)
        })?;
        Ok(self)
    }

    /// Reads up to `out.len()` elements of attribute `name`; returns how many there were.
    pub(super) fn get<V>(&self, name: A, ty: T, out: &mut [V]) -> Result<usize> {
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

/// A dense tensor descriptor: logical dims `[n, c, h, w]` (filters `[k, c, r, s]`), strides of
/// the memory format (NHWC / KRSC for channels_last).
fn tensor(
    uid: i64,
    dims: [usize; 4],
    format: MemoryFormat,
    dt: dsys::cudnnDataType_t,
) -> Result<Desc> {
    let d = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    let [n, c, h, w] = dims.map(|v| v as i64);
    let strides = match format {
        MemoryFormat::Contiguous => [c * h * w, h * w, w, 1],
        MemoryFormat::ChannelsLast => [h * w * c, 1, w * c, c],
    };
    d.set(
        A::CUDNN_ATTR_TENSOR_DATA_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[dt],
    )?;
    d.set_i64s(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &[n, c, h, w])?;
    d.set_i64s(A::CUDNN_ATTR_TENSOR_STRIDES, &strides)?;
    d.set_i64s(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?;
    d.set_i64s(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[ALIGNMENT])?;
    d.finalize("a tensor descriptor")
}

/// cuDNN's numerical notes, by value (cuDNN 9.2's list; a newer cuDNN's extra notes show as
/// numbers). Notes are read as plain integers, never as the bindings' enum, which a value
/// unknown to them would make undefined behaviour.
const NUMERICAL_NOTES: [&str; 10] = [
    "TENSOR_CORE",
    "DOWN_CONVERT_INPUTS",
    "REDUCED_PRECISION_REDUCTION",
    "FFT",
    "NONDETERMINISTIC",
    "WINOGRAD",
    "WINOGRAD_TILE_4x4",
    "WINOGRAD_TILE_6x6",
    "WINOGRAD_TILE_13x13",
    "STRICT_NAN_PROP",
];
const BEHAVIOR_NOTES: [&str; 5] = [
    "RUNTIME_COMPILATION",
    "REQUIRES_FILTER_INT8x32_REORDER",
    "REQUIRES_BIAS_INT8x32_REORDER",
    "SUPPORTS_CUDA_GRAPH_NATIVE_API",
    "CUBLASLT_DEPENDENCY",
];

/// Which engines may run a convolution of one dtype.
#[derive(Clone, Copy, Debug)]
pub(super) struct EngineRules {
    pub(super) dtype: DType,
    /// f32 may use TF32 tensor cores.
    pub(super) tf32: bool,
    /// Only engines that give bitwise the same result on every run (see
    /// [`super::set_deterministic`]).
    pub(super) deterministic: bool,
    /// Engines that compile their kernels at run time are candidates.
    pub(super) runtime_compiled: bool,
}

/// Whether an engine with these numerical and behaviour notes is refused. It must compute what the
/// dtype promises: no inputs converted down, no reduction in reduced precision (half inputs
/// accumulate in f32), f32 on tensor cores (TF32) only when allowed (f64 tensor cores compute in
/// f64), and f32 without Winograd or FFT transforms unless TF32 is allowed (measured: through
/// Winograd in layer4, a CIFAR ResNet-18's f32 gradients lay about a hundred times further from f64
/// than PyTorch's). Nondeterministic engines are refused when determinism is asked for. Engines
/// that compile kernels at run time are refused unless `rules` admit them: each costs seconds of
/// NVRTC at plan build, for every shape of a network, in every process (the plan cache stores the
/// choice, not the compiled kernel).
fn refuses(numerical: &[u32], behavior: &[u32], rules: EngineRules) -> bool {
    use dsys::cudnnBackendBehaviorNote_t as B;
    use dsys::cudnnBackendNumericalNote_t as N;
    let has = |notes: &[u32], v: N| notes.contains(&(v as u32));
    let tf32_used =
        rules.dtype == DType::F32 && has(numerical, N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE);
    let transform = [
        N::CUDNN_NUMERICAL_NOTE_FFT,
        N::CUDNN_NUMERICAL_NOTE_WINOGRAD,
        N::CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_4x4,
        N::CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_6x6,
        N::CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_13x13,
    ]
    .into_iter()
    .any(|t| has(numerical, t));
    let runtime_compiled = behavior.contains(&(B::CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION as u32));
    has(numerical, N::CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS)
        || has(
            numerical,
            N::CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION,
        )
        || (transform && rules.dtype == DType::F32 && !rules.tf32)
        || (tf32_used && !rules.tf32)
        || (has(numerical, N::CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) && rules.deterministic)
        || (runtime_compiled && !rules.runtime_compiled)
}

/// The engine's notes (for logs), and whether [`refuses`] refuses it.
fn engine_notes(engine: &Desc, rules: EngineRules) -> Result<(bool, String)> {
    let mut numerical = [u32::MAX; 32];
    let n = engine.get(
        A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
        T::CUDNN_TYPE_NUMERICAL_NOTE,
        &mut numerical,
    )?;
    let numerical = &numerical[..n.min(numerical.len())];
    let mut behavior = [u32::MAX; 32];
    let m = engine.get(
        A::CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE,
        T::CUDNN_TYPE_BEHAVIOR_NOTE,
        &mut behavior,
    )?;
    let behavior = &behavior[..m.min(behavior.len())];
    let refused = refuses(numerical, behavior, rules);
    let name = |table: &[&str], kind: &str, v: u32| {
        table
            .get(v as usize)
            .map_or_else(|| format!("{kind}_{v}"), |s| s.to_string())
    };
    let names = numerical
        .iter()
        .map(|&v| name(&NUMERICAL_NOTES, "NUMERICAL", v))
        .chain(
            behavior
                .iter()
                .map(|&v| name(&BEHAVIOR_NOTES, "BEHAVIOR", v)),
        )
        .collect::<Vec<_>>()
        .join(" ");
    Ok((refused, format!("[{names}]")))
}

/// An execution plan that built for the graph, with what the choice, the logs and the plan
/// cache need.
pub(super) struct GraphCandidate {
    // Declared first so it is dropped before what it was built from.
    plan: Desc,
    /// Its engine configuration and what that was made of: kept alive with the plan.
    _keep: Vec<Desc>,
    /// The engine's global index and the configuration's knob choices (knob type, value):
    /// together they rebuild this configuration (None: cuDNN did not report the knobs; the
    /// candidate runs, but the plan cache cannot record it).
    pub(super) engine: i64,
    pub(super) knobs: Option<Vec<(u32, i64)>>,
    /// Its notes, as `engine_notes` writes them.
    pub(super) notes: String,
    pub(super) workspace: usize,
    /// The heuristic mode that proposed it (None: rebuilt from the plan cache).
    pub(super) mode: Option<Heur>,
}

impl std::fmt::Debug for GraphCandidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "graph engine {} {} ({} bytes of workspace)",
            self.engine, self.notes, self.workspace
        )
    }
}

/// The operation graph of one (geometry, dtype, direction): its descriptors and the unique ids
/// of its buffers in cuDNN's argument order.
pub(super) struct GraphConv {
    graph: Vec<Desc>,
    uids: [i64; 3],
}

// SAFETY: the descriptors are only used under the device's `dnn` mutex.
unsafe impl Send for GraphConv {}
// SAFETY: as above.
unsafe impl Send for GraphCandidate {}

/// A chosen graph-API plan: the candidate and the graph it runs.
pub(super) struct GraphPlan {
    // Declared first so that the plan is dropped before its graph.
    pub(super) candidate: GraphCandidate,
    pub(super) conv: GraphConv,
}

impl GraphPlan {
    /// Runs the plan on `ptrs` (argument order) with a workspace of at least its size.
    pub(super) fn execute(
        &self,
        handle: dsys::cudnnHandle_t,
        ptrs: [*mut c_void; 3],
        workspace: *mut c_void,
    ) -> Result<()> {
        self.conv.execute(handle, &self.candidate, ptrs, workspace)
    }
}

impl GraphConv {
    pub(super) fn new(
        handle: dsys::cudnnHandle_t,
        p: &Conv2dParams,
        dtype: DType,
        dir: Dir,
    ) -> Result<GraphConv> {
        let (dt, compute) = data_type(dtype)?;
        let f = p.format;
        let x = tensor(UID_X, [p.n, p.c_in, p.h, p.w], f, dt)?;
        // Groups are implied by the filter's channel count (c_in / groups).
        let w = tensor(UID_W, [p.c_out, p.c_in / p.groups, p.kh, p.kw], f, dt)?;
        let y = tensor(UID_Y, [p.n, p.c_out, p.out_h(), p.out_w()], f, dt)?;
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
            Dir::BackwardData | Dir::BackwardDataAdd => (
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
        // y = 1 * conv + beta * y, the scalars in the compute type.
        let beta = dir.beta();
        if dtype == DType::F64 {
            op.set(alpha_name, T::CUDNN_TYPE_DOUBLE, &[1.0f64])?;
            op.set(beta_name, T::CUDNN_TYPE_DOUBLE, &[beta])?;
        } else {
            op.set(alpha_name, T::CUDNN_TYPE_FLOAT, &[1.0f32])?;
            op.set(beta_name, T::CUDNN_TYPE_FLOAT, &[beta as f32])?;
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
        Ok(GraphConv {
            graph: vec![x, w, y, conv, op, graph],
            uids,
        })
    }

    fn op_graph(&self) -> Result<&Desc> {
        self.graph
            .last()
            .ok_or_else(|| Error::Cuda("cuDNN graph API: empty graph".into()))
    }

    /// The configurations the heuristics propose that build into plans, keep the dtype's promise
    /// and need at most `limit` bytes of workspace: up to each mode's quota of new ones (with
    /// `first_only`, the first such configuration); with why each other configuration is not a
    /// candidate (for the log).
    pub(super) fn candidates(
        &self,
        handle: dsys::cudnnHandle_t,
        rules: EngineRules,
        limit: usize,
        first_only: bool,
    ) -> Result<(Vec<GraphCandidate>, Vec<String>)> {
        let op_graph = self.op_graph()?;
        let mut out: Vec<GraphCandidate> = Vec::new();
        let mut skipped: Vec<String> = Vec::new();
        for (mode, quota) in MODE_QUOTAS {
            if first_only && !out.is_empty() {
                break;
            }
            // A mode with no answer for this graph leaves the others.
            let asked = std::time::Instant::now();
            let listed = engine_configs(op_graph, mode);
            // Mode B is documented to cost more host time than A: the log shows how much.
            log::trace!(
                "cuDNN heuristics {mode:?}: {} configurations in {:.2} ms",
                listed.as_ref().map_or(0, |c| c.len()),
                asked.elapsed().as_secs_f64() * 1e3
            );
            let configs = match listed {
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
            let mut added = 0;
            for config in configs {
                if added == quota || (first_only && !out.is_empty()) {
                    break;
                }
                let engine = config_engine(&config)?;
                let knobs = match knob_choices(&config) {
                    Ok(k) => Some(k),
                    Err(e) => {
                        log::debug!("engine {}: its knob choices are unknown: {e}", engine.1);
                        None
                    }
                };
                if knobs.is_some() && out.iter().any(|c| c.engine == engine.1 && c.knobs == knobs) {
                    continue;
                }
                match build(handle, config, engine, knobs, rules, limit)? {
                    // Unknown knobs: a configuration already there with the same engine and
                    // workspace is taken for the same one.
                    Ok(c)
                        if c.knobs.is_none()
                            && out
                                .iter()
                                .any(|o| o.engine == c.engine && o.workspace == c.workspace) => {}
                    Ok(mut c) => {
                        c.mode = Some(mode);
                        out.push(c);
                        added += 1;
                    }
                    Err(why) => skipped.push(why),
                }
            }
        }
        Ok((out, skipped))
    }

    /// The configuration of engine `engine` with `knobs` (what [`GraphCandidate`] records),
    /// rebuilt for this graph: an error if it no longer builds, keeps the dtype's promise or fits
    /// `limit`.
    pub(super) fn rebuild(
        &self,
        handle: dsys::cudnnHandle_t,
        engine: i64,
        knobs: &[(u32, i64)],
        rules: EngineRules,
        limit: usize,
    ) -> Result<GraphCandidate> {
        let e = Desc::new(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
        e.set_descs(A::CUDNN_ATTR_ENGINE_OPERATION_GRAPH, &[self.op_graph()?])?;
        e.set_i64s(A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, &[engine])?;
        let e = e.finalize(&format!("engine {engine}"))?;
        let choices = knobs
            .iter()
            .map(|&(ty, value)| {
                let k = Desc::new(D::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR)?;
                // The knob type as the C enum's integer (the bindings' enum may not know it).
                k.set(
                    A::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
                    T::CUDNN_TYPE_KNOB_TYPE,
                    &[ty],
                )?;
                k.set_i64s(A::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, &[value])?;
                k.finalize("a knob choice")
            })
            .collect::<Result<Vec<Desc>>>()?;
        let config = Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)?;
        config.set_descs(A::CUDNN_ATTR_ENGINECFG_ENGINE, &[&e])?;
        config.set_descs(
            A::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
            &choices.iter().collect::<Vec<_>>(),
        )?;
        let config = config.finalize("an engine configuration")?;
        let mut c = build(
            handle,
            config,
            (e, engine),
            Some(knobs.to_vec()),
            rules,
            limit,
        )?
        .map_err(|why| Error::Cuda(format!("cuDNN graph API: {why}")))?;
        c._keep.extend(choices);
        Ok(c)
    }

    /// Runs candidate `c` on `ptrs` (in cuDNN's argument order) with `workspace` (at least
    /// `c.workspace` bytes).
    pub(super) fn execute(
        &self,
        handle: dsys::cudnnHandle_t,
        c: &GraphCandidate,
        ptrs: [*mut c_void; 3],
        workspace: *mut c_void,
    ) -> Result<()> {
        if let Some(p) = ptrs
            .iter()
            .find(|p| !(**p as usize).is_multiple_of(ALIGNMENT as usize))
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
        pack.set_i64s(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &self.uids)?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            T::CUDNN_TYPE_VOID_PTR,
            &[workspace],
        )?;
        let pack = pack.finalize("the variant pack")?;
        // SAFETY: the plan was built on this handle for this graph, whose tensors these pointers
        // hold; the workspace holds at least the plan's workspace size (callers check).
        status("executing a plan", unsafe {
            dsys::cudnnBackendExecute(handle, c.plan.0, pack.0)
        })
    }
}

/// The engine configurations cuDNN's heuristics propose in `mode`, best first.
pub(super) fn engine_configs(graph: &Desc, mode: Heur) -> Result<Vec<Desc>> {
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

/// A configuration's engine, and the engine's global index.
fn config_engine(config: &Desc) -> Result<(Desc, i64)> {
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
    Ok((engine, index[0]))
}

/// A configuration's knob choices as (knob type, value), in the order cuDNN lists them.
fn knob_choices(config: &Desc) -> Result<Vec<(u32, i64)>> {
    let descs = (0..MAX_KNOBS)
        .map(|_| Desc::new(D::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR))
        .collect::<Result<Vec<_>>>()?;
    let mut raw: Vec<_> = descs.iter().map(|d| d.0).collect();
    let n = config.get(
        A::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &mut raw,
    )?;
    descs[..n.min(MAX_KNOBS)]
        .iter()
        .map(|k| {
            // Read as the C enum's integer (see NUMERICAL_NOTES).
            let mut ty = [u32::MAX];
            k.get(
                A::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
                T::CUDNN_TYPE_KNOB_TYPE,
                &mut ty,
            )?;
            let mut value = [0i64];
            k.get(
                A::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE,
                T::CUDNN_TYPE_INT64,
                &mut value,
            )?;
            Ok((ty[0], value[0]))
        })
        .collect()
}

/// An execution plan for `config` (of `engine`, with `knobs`), or why there is none: its engine
/// is refused, it does not build for this graph (not an error: the heuristics list engines that
/// may not support the exact graph), or it needs more than `limit` bytes of workspace.
fn build(
    handle: dsys::cudnnHandle_t,
    config: Desc,
    (engine, index): (Desc, i64),
    knobs: Option<Vec<(u32, i64)>>,
    rules: EngineRules,
    limit: usize,
) -> Result<std::result::Result<GraphCandidate, String>> {
    let (refused, notes) = engine_notes(&engine, rules)?;
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
    let plan = match plan.finalize("an execution plan") {
        Ok(plan) => plan,
        Err(e) => return Ok(Err(format!("engine {index}: {e}"))),
    };
    let mut ws = [0i64];
    plan.get(
        A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
        T::CUDNN_TYPE_INT64,
        &mut ws,
    )?;
    let workspace = ws[0].max(0) as usize;
    if workspace > limit {
        return Ok(Err(format!(
            "engine {index}: {workspace} bytes of workspace"
        )));
    }
    Ok(Ok(GraphCandidate {
        plan,
        _keep: vec![config, engine],
        engine: index,
        knobs,
        notes,
        workspace,
        mode: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsys::cudnnBackendBehaviorNote_t as B;
    use dsys::cudnnBackendNumericalNote_t as N;

    fn rules(dtype: DType) -> EngineRules {
        EngineRules {
            dtype,
            tf32: false,
            deterministic: false,
            runtime_compiled: false,
        }
    }

    #[test]
    fn nondeterministic_engines_are_refused_only_when_determinism_is_asked() {
        let notes = [
            N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE as u32,
            N::CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC as u32,
        ];
        let free = rules(DType::F16);
        assert!(!refuses(&notes, &[], free));
        let strict = EngineRules {
            deterministic: true,
            ..free
        };
        assert!(refuses(&notes, &[], strict));
        // A deterministic engine stays a candidate under the strict rules.
        assert!(!refuses(&notes[..1], &[], strict));
    }

    #[test]
    fn engines_keep_the_dtype_promise() {
        let tc = [N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE as u32];
        assert!(refuses(&tc, &[], rules(DType::F32)), "TF32 not allowed");
        let tf32 = EngineRules {
            tf32: true,
            ..rules(DType::F32)
        };
        assert!(!refuses(&tc, &[], tf32));
        assert!(!refuses(&tc, &[], rules(DType::BF16)));
        let wino = [N::CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_4x4 as u32];
        assert!(refuses(&wino, &[], rules(DType::F32)));
        assert!(!refuses(&wino, &[], rules(DType::F16)));
        for n in [
            N::CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS,
            N::CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION,
        ] {
            assert!(refuses(&[n as u32], &[], rules(DType::F16)), "{n:?}");
        }
        let nvrtc = [B::CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION as u32];
        assert!(refuses(&[], &nvrtc, rules(DType::F16)));
        let admitted = EngineRules {
            runtime_compiled: true,
            ..rules(DType::F16)
        };
        assert!(!refuses(&[], &nvrtc, admitted));
    }
}
