//! A linear layer's products through cuBLASLt, for the epilogues plain cuBLAS lacks: the bias
//! added to the f32 product before it is rounded (forward), and the bias gradient (the column
//! sums of the output gradient) computed by the weight-gradient product as it reads that
//! gradient (backward). Each saves a pass over a `[rows, out]` activation, which in a GPT-2 step
//! are a tenth of the time the separate bias add and reduction took.
//!
//! One plan per (dtype, shape, transposes, epilogue, operand alignment): the matmul descriptor,
//! the matrix layouts and the heuristic's algorithm, made once and kept, so a call costs one
//! attribute write (the bias pointer) and the launch. A shape cuBLASLt has no algorithm for is
//! remembered as such, and the caller falls back to the plain product and a separate kernel.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublaslt::sys as lsys;
use cudarc::driver::{CudaSlice, DevicePtr};
use lsys::cublasLtEpilogue_t as Epilogue;
use lsys::cublasLtMatmulDescAttributes_t as DescAttr;
use lsys::cublasLtMatmulPreferenceAttributes_t as PrefAttr;

use super::device::{allow_tf32, cuda_err, CudaDevice};
use super::storage::CudaStorage;
use crate::backend::{BackendStorage, MatmulDims};
use crate::base::error::{Error, Result};
use crate::base::DType;

/// The workspace cuBLASLt may use (Hopper's recommended size, as for cuBLAS).
const WORKSPACE_BYTES: usize = 32 << 20;

/// What the product does after the multiply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LtEpilogue {
    /// `D = op(A)·op(B) + bias` (the bias indexed by the output's column, row-major).
    Bias,
    /// `D = gelu_tanh(op(A)·op(B) + bias)`, the pre-activation written to the aux matrix.
    GeluAuxBias,
    /// `D = op(A)·op(B)`, and the bias gradient `Σ_k` of the second row-major operand.
    BiasGrad,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    dtype: DType,
    dims: (usize, usize, usize, bool, bool),
    epilogue: LtEpilogue,
    /// The alignment (bytes, at most 16) of A, B and D: algorithms assume what they are told.
    align: (u32, u32, u32),
    tf32: bool,
}

struct Plan {
    desc: lsys::cublasLtMatmulDesc_t,
    a: lsys::cublasLtMatrixLayout_t,
    b: lsys::cublasLtMatrixLayout_t,
    d: lsys::cublasLtMatrixLayout_t,
    algo: lsys::cublasLtMatmulAlgo_t,
    workspace: usize,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once for this plan and is destroyed once.
        unsafe {
            let _ = lsys::cublasLtMatmulDescDestroy(self.desc);
            let _ = lsys::cublasLtMatrixLayoutDestroy(self.a);
            let _ = lsys::cublasLtMatrixLayoutDestroy(self.b);
            let _ = lsys::cublasLtMatrixLayoutDestroy(self.d);
        }
    }
}

/// One device's cuBLASLt handle, workspace and plans (`None`: no algorithm for that key).
struct Lt {
    handle: lsys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: HashMap<PlanKey, Option<Plan>>,
}

// SAFETY: the handle and the plans' descriptors are used only under the registry's mutex.
unsafe impl Send for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created by cublasLtCreate, destroyed once, after its plans.
        let _ = unsafe { lsys::cublasLtDestroy(self.handle) };
    }
}

fn registry() -> &'static Mutex<HashMap<usize, Lt>> {
    static LT: OnceLock<Mutex<HashMap<usize, Lt>>> = OnceLock::new();
    LT.get_or_init(Default::default)
}

fn lt_err(what: &str, st: lsys::cublasStatus_t) -> Result<()> {
    if st == lsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("cuBLASLt, {what}: {st:?}")))
    }
}

fn new_lt(dev: &Arc<CudaDevice>) -> Result<Lt> {
    super::graph::refuse(
        dev.ordinal,
        "linear",
        "creating the cuBLASLt handle and workspace during capture: run a warm-up step first",
    )?;
    dev.ctx
        .bind_to_thread()
        .map_err(|e| cuda_err("binding the context", e))?;
    let mut handle = std::ptr::null_mut();
    // SAFETY: `handle` receives a new handle.
    lt_err("cublasLtCreate", unsafe {
        lsys::cublasLtCreate(&mut handle)
    })?;
    // SAFETY: cuBLASLt owns the workspace contents.
    let workspace = unsafe { dev.stream.alloc::<u8>(WORKSPACE_BYTES) }
        .map_err(|e| cuda_err("allocating the cuBLASLt workspace", e))?;
    Ok(Lt {
        handle,
        workspace,
        plans: HashMap::new(),
    })
}

/// The largest power of two (at most 16) dividing a device address.
fn alignment(ptr: u64) -> u32 {
    (1u32 << ptr.trailing_zeros().min(4)).min(16)
}

fn types(dtype: DType) -> Option<(lsys::cudaDataType_t, lsys::cublasComputeType_t)> {
    use lsys::cublasComputeType_t as C;
    use lsys::cudaDataType_t as T;
    match dtype {
        DType::F16 => Some((T::CUDA_R_16F, C::CUBLAS_COMPUTE_32F)),
        DType::BF16 => Some((T::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F)),
        DType::F32 if allow_tf32() => Some((T::CUDA_R_32F, C::CUBLAS_COMPUTE_32F_FAST_TF32)),
        DType::F32 => Some((T::CUDA_R_32F, C::CUBLAS_COMPUTE_32F)),
        // Double products and other types keep the plain path.
        _ => None,
    }
}

fn set_desc<V>(desc: lsys::cublasLtMatmulDesc_t, attr: DescAttr, v: &V) -> Result<()> {
    // SAFETY: `v` is a value of the type the attribute expects (the callers pair them).
    lt_err(&format!("setting {attr:?}"), unsafe {
        lsys::cublasLtMatmulDescSetAttribute(
            desc,
            attr,
            v as *const V as *const c_void,
            std::mem::size_of::<V>(),
        )
    })
}

fn layout(
    dt: lsys::cudaDataType_t,
    rows: usize,
    cols: usize,
    ld: usize,
) -> Result<lsys::cublasLtMatrixLayout_t> {
    let mut l = std::ptr::null_mut();
    // SAFETY: `l` receives a new layout.
    lt_err("creating a matrix layout", unsafe {
        lsys::cublasLtMatrixLayoutCreate(&mut l, dt, rows as u64, cols as u64, ld as i64)
    })?;
    Ok(l)
}

/// Builds the plan for `key`, or `None` when cuBLASLt offers no algorithm for it.
fn make_plan(handle: lsys::cublasLtHandle_t, key: &PlanKey) -> Result<Option<Plan>> {
    let Some((dt, compute)) = types(key.dtype) else {
        return Ok(None);
    };
    let (m, n, k, trans_a, trans_b) = key.dims;
    let mut desc = std::ptr::null_mut();
    // SAFETY: `desc` receives a new descriptor.
    lt_err("creating a matmul descriptor", unsafe {
        lsys::cublasLtMatmulDescCreate(&mut desc, compute, lsys::cudaDataType_t::CUDA_R_32F)
    })?;
    // Column-major view, as in matmul.rs: D (n×m col-major) = op(B)ᵀ · op(A)ᵀ, so cuBLASLt's
    // first operand is our B and its second our A.
    let op = |t: bool| if t { 1i32 } else { 0i32 };
    let (first_rows, first_cols) = if trans_b { (k, n) } else { (n, k) };
    let (second_rows, second_cols) = if trans_a { (m, k) } else { (k, m) };
    let mut plan = Plan {
        desc,
        a: layout(dt, first_rows, first_cols, first_rows)?,
        b: layout(dt, second_rows, second_cols, second_rows)?,
        d: layout(dt, n, m, n)?,
        // SAFETY: zeroed bytes are a valid (empty) algorithm description, replaced below.
        algo: unsafe { std::mem::zeroed() },
        workspace: 0,
    };
    set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSA, &op(trans_b))?;
    set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSB, &op(trans_a))?;
    let epilogue = match key.epilogue {
        // The row-major bias runs along D's (col-major) rows: the epilogue's bias.
        LtEpilogue::Bias => Epilogue::CUBLASLT_EPILOGUE_BIAS,
        // Σ over k of cuBLASLt's second operand (our A, the output gradient), one per column of
        // its D: the column sums of the row-major gradient.
        LtEpilogue::BiasGrad => Epilogue::CUBLASLT_EPILOGUE_BGRADB,
        LtEpilogue::GeluAuxBias => Epilogue::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
    };
    set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
    if key.epilogue == LtEpilogue::GeluAuxBias {
        // The aux matrix is laid out as D.
        set_desc(
            desc,
            DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
            &(n as i64),
        )?;
    }
    let mut pref = std::ptr::null_mut();
    // SAFETY: `pref` receives a new preference, destroyed below.
    lt_err("creating a preference", unsafe {
        lsys::cublasLtMatmulPreferenceCreate(&mut pref)
    })?;
    let set_pref = |attr: PrefAttr, v: u64| {
        // SAFETY: these attributes take a u64 (workspace) or u32 (alignments) value.
        lt_err(&format!("setting {attr:?}"), unsafe {
            match attr {
                PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES => {
                    lsys::cublasLtMatmulPreferenceSetAttribute(
                        pref,
                        attr,
                        &v as *const u64 as *const c_void,
                        8,
                    )
                }
                _ => {
                    let v32 = v as u32;
                    lsys::cublasLtMatmulPreferenceSetAttribute(
                        pref,
                        attr,
                        &v32 as *const u32 as *const c_void,
                        4,
                    )
                }
            }
        })
    };
    let found = (|| {
        set_pref(
            PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            WORKSPACE_BYTES as u64,
        )?;
        let (aa, ab, ad) = key.align;
        // Our B is cuBLASLt's A, our A its B.
        set_pref(
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            ab.into(),
        )?;
        set_pref(
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            aa.into(),
        )?;
        set_pref(
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            ad.into(),
        )?;
        set_pref(
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ad.into(),
        )?;
        // SAFETY: zeroed bytes are a valid result slot for the heuristic to fill.
        let mut result: lsys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        let mut count = 0i32;
        // SAFETY: live descriptors; one result slot.
        let st = unsafe {
            lsys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                plan.a,
                plan.b,
                plan.d,
                plan.d,
                pref,
                1,
                &mut result,
                &mut count,
            )
        };
        Ok::<_, Error>(
            (st == lsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && count > 0
                && result.state == lsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .then_some(result),
        )
    })();
    // SAFETY: created above, destroyed once.
    unsafe { lsys::cublasLtMatmulPreferenceDestroy(pref) };
    // (The plan itself is kept, not copied: its drop destroys the descriptors.)
    Ok(found?.map(|r| {
        plan.algo = r.algo;
        plan.workspace = r.workspaceSize;
        plan
    }))
}

/// `out = op(a)·op(b)` (row-major, one product) with `epilogue` reading or writing the vector
/// at `pv` (the bias, or the bias gradient's output) and, for GELU, writing the pre-activation
/// to `aux` (laid out as `out`), all of `out`'s dtype. `Ok(false)`: cuBLASLt has no algorithm
/// for this case and nothing ran; the caller takes the plain path.
pub(crate) fn linear_product(
    out: &CudaStorage,
    (pa, pb, pv): (u64, u64, u64),
    aux: Option<&CudaStorage>,
    d: &MatmulDims,
    epilogue: LtEpilogue,
) -> Result<bool> {
    let mut plain = d.batch != 1 || d.m == 0 || d.n == 0 || d.k == 0;
    if epilogue == LtEpilogue::GeluAuxBias {
        // The aux matrix's leading dimension must be a multiple of 8.
        plain |= !d.n.is_multiple_of(8) || aux.is_none_or(|a| alignment(a.ptr()) < 16);
    }
    // The epilogue reads and writes the vector with wide accesses.
    if plain || alignment(pv) < 16 || super::side_stream::is_beside(out.dev.ordinal) {
        return Ok(false);
    }
    let dtype = out.dtype();
    if types(dtype).is_none() {
        return Ok(false);
    }
    let dev = out.dev.clone();
    let key = PlanKey {
        dtype,
        dims: (d.m, d.n, d.k, d.trans_a, d.trans_b),
        epilogue,
        align: (alignment(pa), alignment(pb), alignment(out.ptr())),
        tf32: allow_tf32(),
    };
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    let lt = match reg.entry(dev.ordinal) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(super::probe::no_panic(
            "creating the cuBLASLt handle",
            || new_lt(&dev),
        )?),
    };
    if !lt.plans.contains_key(&key) {
        let plan = make_plan(lt.handle, &key)?;
        lt.plans.insert(key, plan);
    }
    let Some(plan) = lt.plans.get(&key).and_then(|p| p.as_ref()) else {
        return Ok(false);
    };
    let vp = pv as *const c_void;
    set_desc(plan.desc, DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &vp)?;
    if let Some(aux) = aux {
        let ap = aux.ptr() as *mut c_void;
        set_desc(
            plan.desc,
            DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
            &ap,
        )?;
    }
    let ws = lt.workspace.device_ptr(&dev.stream).0 as *mut c_void;
    let (alpha, beta) = (1.0f32, 0.0f32);
    dev.ctx
        .bind_to_thread()
        .map_err(|e| cuda_err("binding the context", e))?;
    // SAFETY: the pointers are live buffers of this device holding the m×k, k×n and m×n
    // matrices the plan's layouts describe (the callers checked the sizes) and the vector of
    // the epilogue's length; alpha and beta live on this frame for the call.
    let st = unsafe {
        lsys::cublasLtMatmul(
            lt.handle,
            plan.desc,
            &alpha as *const f32 as *const c_void,
            pb as *const c_void,
            plan.a,
            pa as *const c_void,
            plan.b,
            &beta as *const f32 as *const c_void,
            out.ptr() as *const c_void,
            plan.d,
            out.ptr() as *mut c_void,
            plan.d,
            &plan.algo,
            ws,
            plan.workspace,
            dev.stream.cu_stream() as lsys::cudaStream_t,
        )
    };
    if st == lsys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED {
        // The heuristic's algorithm refused at launch: remember the case as having none, and
        // let the caller take the plain path (nothing was written).
        lt.plans.insert(key, None);
        return Ok(false);
    }
    lt_err(&format!("cublasLtMatmul {dtype} {d:?} {epilogue:?}"), st)?;
    Ok(true)
}
