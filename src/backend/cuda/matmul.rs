//! Matrix products through cuBLAS (`cublasGemmStridedBatchedEx`): f16/bf16 inputs with f32
//! accumulation on tensor cores, f32 in plain f32 (TF32 only after [`super::set_allow_tf32`]),
//! f64 in f64. Row-major operands are handled by computing `Cᵀ = Bᵀ·Aᵀ` in cuBLAS's
//! column-major convention. The handle and its workspace are created once per device.
//!
//! One path for every dtype: cuBLASLt with a heuristic-chosen algorithm and the same 32 MiB
//! workspace measured no faster on large f16/bf16 products, where this path already matches
//! PyTorch's (benches/RESULTS.md has the figures), and cudarc's safe Lt wrapper would force TF32
//! on f32.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys as bsys};
use cudarc::driver::{CudaSlice, DevicePtr};

use super::device::{allow_tf32, cuda_err, CudaDevice};
use super::storage::CudaStorage;
use crate::backend::MatmulOps;
use crate::backend::{Activation, BinaryOp, ReduceOp};
use crate::backend::{BackendStorage, MatmulDims};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout, Shape};

use super::matmul_lt::LtEpilogue;

/// cuBLAS's recommended workspace for Hopper (32 MiB; 4 MiB before).
fn workspace_bytes(arch: (i32, i32)) -> usize {
    if arch.0 >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

pub(crate) struct Blas {
    handle: bsys::cublasHandle_t,
    _workspace: CudaSlice<u8>,
}

// SAFETY: the handle is only used under the device's `blas` mutex.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created by cublasCreate and destroyed once.
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }
}

impl Blas {
    fn new(dev: &CudaDevice) -> Result<Blas> {
        super::graph::refuse(
            dev.ordinal,
            "matmul",
            "creating the cuBLAS handle and workspace during capture: run a warm-up step first",
        )?;
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let handle = blas::create_handle().map_err(|e| cuda_err("cublasCreate", e))?;
        let bytes = workspace_bytes(dev.arch);
        // SAFETY: cuBLAS owns the workspace contents.
        let ws = unsafe { dev.stream.alloc::<u8>(bytes) }
            .map_err(|e| cuda_err("allocating the cuBLAS workspace", e))?;
        let b = Blas {
            handle,
            _workspace: ws,
        };
        // SAFETY: live handle and stream.
        unsafe { blas::set_stream(handle, dev.stream.cu_stream() as _) }
            .map_err(|e| cuda_err("cublasSetStream", e))?;
        let wp = b._workspace.device_ptr(&dev.stream).0;
        // SAFETY: the workspace lives as long as the handle (both in `Blas`).
        unsafe { bsys::cublasSetWorkspace_v2(handle, wp as *mut c_void, bytes) }
            .result()
            .map_err(|e| cuda_err("cublasSetWorkspace", e))?;
        Ok(b)
    }
}

fn to_i32(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid_arg("matmul", what, v, "at most 2^31-1 for cuBLAS"))
}

pub(crate) fn matmul(
    a: &CudaStorage,
    la: &Layout,
    b: &CudaStorage,
    lb: &Layout,
    d: &MatmulDims,
) -> Result<CudaStorage> {
    let dtype = a.dtype();
    // Contiguous operands (the tensor layer's promise), possibly at an offset.
    let (pa, pb) = (a.ptr_at(la)?, b.ptr_at(lb)?);
    let (dt, compute) = match dtype {
        DType::F16 => (
            bsys::cudaDataType_t::CUDA_R_16F,
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::BF16 => (
            bsys::cudaDataType_t::CUDA_R_16BF,
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F32 => (
            bsys::cudaDataType_t::CUDA_R_32F,
            if allow_tf32() {
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
            } else {
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F
            },
        ),
        DType::F64 => (
            bsys::cudaDataType_t::CUDA_R_64F,
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
        ),
        DType::I64 => {
            return Err(Error::UnsupportedDType {
                op: "matmul",
                got: dtype,
                expected: "a float dtype",
            })
        }
    };
    let (m, n, k, batch) = (d.m, d.n, d.k, d.batch);
    let need_a = if batch == 0 {
        0
    } else {
        (batch - 1) * d.a_batch_stride + m * k
    };
    let need_b = if batch == 0 {
        0
    } else {
        (batch - 1) * d.b_batch_stride + k * n
    };
    if a.len() < need_a || b.len() < need_b {
        return Err(Error::invalid_arg(
            "matmul",
            "dims",
            format!("{d:?}"),
            format!(
                "operands of {} and {} elements are too small",
                a.len(),
                b.len()
            ),
        ));
    }
    let dev = a.dev.clone();
    let out = CudaStorage::alloc(&dev, dtype, batch * m * n)?;
    if batch * m * n == 0 {
        return Ok(out);
    }
    if k == 0 {
        super::cast::fill(&out, 0.0)?;
        return Ok(out);
    }
    // Column-major view: C (m×n row-major) is Cᵀ (n×m col-major) = op(B)ᵀ · op(A)ᵀ.
    let (ta, lda) = if d.trans_b {
        (bsys::cublasOperation_t::CUBLAS_OP_T, k)
    } else {
        (bsys::cublasOperation_t::CUBLAS_OP_N, n)
    };
    let (tb, ldb) = if d.trans_a {
        (bsys::cublasOperation_t::CUBLAS_OP_T, m)
    } else {
        (bsys::cublasOperation_t::CUBLAS_OP_N, k)
    };
    let (mi, ni, ki) = (to_i32("n", n)?, to_i32("m", m)?, to_i32("k", k)?);
    let (ldai, ldbi, ldc) = (to_i32("lda", lda)?, to_i32("ldb", ldb)?, to_i32("n", n)?);
    let batch_i = to_i32("batch", batch)?;
    let (alpha32, beta32) = (1.0f32, 0.0f32);
    let (alpha64, beta64) = (1.0f64, 0.0f64);
    let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
        (&alpha64 as *const f64 as _, &beta64 as *const f64 as _)
    } else {
        (&alpha32 as *const f32 as _, &beta32 as *const f32 as _)
    };
    if super::side_stream::is_beside(dev.ordinal) {
        // cuBLAS's handle is bound to the main stream (side_stream.rs: only cuDNN goes beside).
        return Err(Error::Unsupported {
            op: "matmul",
            detail: "cuBLAS on the side stream".into(),
        });
    }
    let mut guard = dev.blas.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        // A cuBLAS missing a symbol would panic inside cudarc: an error instead.
        *guard = Some(super::probe::no_panic(
            "creating the cuBLAS handle",
            || Blas::new(&dev),
        )?);
    }
    let h = guard
        .as_ref()
        .map(|b| b.handle)
        .ok_or_else(|| Error::Cuda("cuBLAS handle".into()))?;
    dev.ctx
        .bind_to_thread()
        .map_err(|e| cuda_err("binding the context", e))?;
    // SAFETY: pointers are live buffers of this device whose sizes were checked above against the
    // strides and leading dimensions; alpha/beta live on this stack frame for the call.
    unsafe {
        blas::gemm_strided_batched_ex(
            h,
            ta,
            tb,
            mi,
            ni,
            ki,
            alpha,
            pb as *const c_void,
            dt,
            ldai,
            d.b_batch_stride as i64,
            pa as *const c_void,
            dt,
            ldbi,
            d.a_batch_stride as i64,
            beta,
            out.ptr() as *mut c_void,
            dt,
            ldc,
            (m * n) as i64,
            batch_i,
            compute,
            bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        )
    }
    .map_err(|e| cuda_err(&format!("cublasGemmStridedBatchedEx {dtype} {d:?}"), e))?;
    Ok(out)
}

/// Checks that `v` (at `l`) holds `len` elements of `dtype` (a linear layer's bias vector).
fn vector_ptr(
    op: &'static str,
    v: &CudaStorage,
    l: &Layout,
    dtype: DType,
    len: usize,
) -> Result<u64> {
    if v.dtype() != dtype {
        return Err(Error::DTypeMismatch {
            op,
            lhs: dtype,
            rhs: v.dtype(),
        });
    }
    if l.elem_count() != len || !l.is_contiguous() {
        return Err(Error::invalid_arg(
            op,
            "bias",
            format!("{:?}", l.dims()),
            format!("a contiguous vector of {len}"),
        ));
    }
    v.ptr_at(l)
}

/// Whether `linear_bias_gelu` may run the activation in cuBLASLt's epilogue.
/// `MIXPREC_LT_GELU=0` turns it off, for diagnosis: the biased product is then rounded to the
/// input type and the activation kernel runs on it, PyTorch's two roundings. Read once.
fn gelu_epilogue_on() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !*OFF.get_or_init(|| std::env::var("MIXPREC_LT_GELU").is_ok_and(|v| v == "0"))
}

impl MatmulOps for CudaStorage {
    fn linear_bias(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        bias: &Self,
        bl: &Layout,
        dims: &MatmulDims,
    ) -> Result<Self> {
        let pv = vector_ptr("linear", bias, bl, self.dtype(), dims.n)?;
        let need = (dims.m * dims.k, dims.k * dims.n);
        if self.len() < need.0 || w.len() < need.1 || w.dtype() != self.dtype() {
            // The plain product reports what is wrong.
            return matmul(self, l, w, wl, dims);
        }
        let out = CudaStorage::alloc(&self.dev, self.dtype(), dims.m * dims.n)?;
        let ptrs = (self.ptr_at(l)?, w.ptr_at(wl)?, pv);
        if super::matmul_lt::linear_product(&out, ptrs, None, dims, LtEpilogue::Bias)? {
            return Ok(out);
        }
        // No cuBLASLt algorithm: the product, then the bias along the rows.
        let y = matmul(self, l, w, wl, dims)?;
        let rows = Layout::contiguous(Shape::new(vec![dims.m, dims.n]));
        let along = Layout::new(rows.shape().clone(), vec![0, 1], bl.offset());
        super::elementwise::binary(&y, &rows, bias, &along, BinaryOp::Add, &rows)
    }

    fn linear_bias_gelu(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        bias: &Self,
        bl: &Layout,
        dims: &MatmulDims,
    ) -> Result<(Self, Self)> {
        let pv = vector_ptr("linear", bias, bl, self.dtype(), dims.n)?;
        let fits = self.len() >= dims.m * dims.k && w.len() >= dims.k * dims.n;
        if fits && w.dtype() == self.dtype() && gelu_epilogue_on() {
            let out = CudaStorage::alloc(&self.dev, self.dtype(), dims.m * dims.n)?;
            let pre = CudaStorage::alloc(&self.dev, self.dtype(), dims.m * dims.n)?;
            let ptrs = (self.ptr_at(l)?, w.ptr_at(wl)?, pv);
            let ep = LtEpilogue::GeluAuxBias;
            if super::matmul_lt::linear_product(&out, ptrs, Some(&pre), dims, ep)? {
                return Ok((out, pre));
            }
        }
        // No cuBLASLt algorithm: the biased product, then the activation kernel.
        let pre = self.linear_bias(l, w, wl, bias, bl, dims)?;
        let rows = Layout::contiguous(Shape::new(vec![dims.m, dims.n]));
        let out = super::activation::activation(&pre, &rows, Activation::GeluTanh)?;
        Ok((out, pre))
    }

    fn linear_weight_grad(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        dims: &MatmulDims,
    ) -> Result<(Self, Self)> {
        // `self` is the output gradient, [k rows, m outputs].
        if self.len() >= dims.m * dims.k && x.len() >= dims.k * dims.n && x.dtype() == self.dtype()
        {
            let dw = CudaStorage::alloc(&self.dev, self.dtype(), dims.m * dims.n)?;
            let db = CudaStorage::alloc(&self.dev, self.dtype(), dims.m)?;
            let ptrs = (self.ptr_at(l)?, x.ptr_at(xl)?, db.ptr());
            if super::matmul_lt::linear_product(&dw, ptrs, None, dims, LtEpilogue::BiasGrad)? {
                return Ok((dw, db));
            }
        }
        let dw = matmul(self, l, x, xl, dims)?;
        let db = super::reduce::reduce(self, l, ReduceOp::Sum, 0)?;
        Ok((dw, db))
    }

    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: &MatmulDims) -> Result<Self> {
        matmul(self, l, rhs, rl, dims)
    }
}
