//! One convolution direction through cuDNN's legacy API: tensor, filter and convolution
//! descriptors (NCHW or NHWC), the algorithms cuDNN lists for them (`cudnnGet*Algorithm_v7`,
//! each with the math type it runs in), and their execution.
//!
//! A candidate is an (algorithm, math type) pair: cuDNN 8+ decides whether an algorithm uses
//! tensor cores from the math type set on the convolution descriptor, and its list reports the
//! math each entry was rated with. So the descriptor's math type is set to the candidate's before
//! it runs, and a candidate whose math breaks the dtype's promise is not one: for f32 without
//! TF32 only FMA math (cuDNN's default math would let Ampere+ use TF32), and never
//! `ALLOW_CONVERSION` (inputs converted down).

use std::cell::Cell;
use std::ffi::{c_int, c_void};

use cudarc::cudnn::{result as dnn, sys as dsys};
use dsys::cudnnMathType_t as M;

use super::conv_plan::Dir;
use super::cudnn::data_type;
use super::cudnn_graph::EngineRules;
use crate::backend::Conv2dParams;
use crate::base::error::{Error, Result};
use crate::base::{DType, MemoryFormat};

pub(super) fn dnn_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("cuDNN {what}: {e:?}"))
}

fn i(what: &'static str, v: usize) -> Result<c_int> {
    c_int::try_from(v)
        .map_err(|_| Error::invalid_arg("conv2d", what, v, "at most 2^31-1 for cuDNN"))
}

/// A cuDNN tensor descriptor, destroyed on drop.
pub(super) struct TensorDesc(pub(super) dsys::cudnnTensorDescriptor_t);
impl TensorDesc {
    pub(super) fn new() -> Result<TensorDesc> {
        Ok(TensorDesc(
            dnn::create_tensor_descriptor().map_err(|e| dnn_err("tensor descriptor", e))?,
        ))
    }
}
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

/// A legacy algorithm of one direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Algo {
    Fwd(dsys::cudnnConvolutionFwdAlgo_t),
    BwdData(dsys::cudnnConvolutionBwdDataAlgo_t),
    BwdFilter(dsys::cudnnConvolutionBwdFilterAlgo_t),
}

impl Algo {
    /// Whether it computes through a Winograd or FFT transform (refused for f32 without TF32:
    /// see `cudnn_graph::engine_notes`).
    pub(super) fn is_transform(self) -> bool {
        use dsys::cudnnConvolutionBwdDataAlgo_t as D;
        use dsys::cudnnConvolutionBwdFilterAlgo_t as W;
        use dsys::cudnnConvolutionFwdAlgo_t as F;
        match self {
            Algo::Fwd(a) => matches!(
                a,
                F::CUDNN_CONVOLUTION_FWD_ALGO_FFT
                    | F::CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING
                    | F::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD
                    | F::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED
            ),
            Algo::BwdData(a) => matches!(
                a,
                D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT
                    | D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING
                    | D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD
                    | D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED
            ),
            Algo::BwdFilter(a) => matches!(
                a,
                W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT
                    | W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING
                    | W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED
            ),
        }
    }

    /// cuDNN's number for it (what the plan cache stores).
    pub(super) fn code(self) -> i64 {
        match self {
            Algo::Fwd(a) => a as i64,
            Algo::BwdData(a) => a as i64,
            Algo::BwdFilter(a) => a as i64,
        }
    }
}

/// One legacy candidate: an algorithm, the math type it runs with, its workspace in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LegacyAlgo {
    pub(super) algo: Algo,
    pub(super) math: M,
    pub(super) workspace: usize,
}

impl LegacyAlgo {
    pub(super) fn math_code(&self) -> i64 {
        self.math as i64
    }

    pub(super) fn describe(&self) -> String {
        let math = format!("{:?}", self.math);
        format!(
            "legacy {:?} {} ({} bytes of workspace)",
            self.algo,
            math.trim_start_matches("CUDNN_"),
            self.workspace
        )
    }
}

/// The math type a candidate rated with `reported` runs in, or why it breaks the promise of
/// `dtype` (f32 computes in f32 unless TF32 is allowed; nothing converts its inputs down).
fn run_math(dtype: DType, tf32: bool, reported: M) -> std::result::Result<M, &'static str> {
    match (dtype, reported) {
        (_, M::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) => Err("converts its inputs down"),
        (DType::F32, M::CUDNN_TENSOR_OP_MATH) if !tf32 => Err("TF32 is not allowed"),
        // cuDNN's default math lets f32 use TF32 on Ampere+: pinned to FMA.
        (DType::F32, M::CUDNN_DEFAULT_MATH | M::CUDNN_FMA_MATH) if !tf32 => Ok(M::CUDNN_FMA_MATH),
        (_, m) => Ok(m),
    }
}

/// The math type the descriptor is created with (what cuDNN rates its list under): tensor cores
/// for half types, for f32 only when TF32 is allowed.
fn query_math(dtype: DType, tf32: bool) -> M {
    match dtype {
        DType::F16 | DType::BF16 => M::CUDNN_TENSOR_OP_MATH,
        DType::F32 if tf32 => M::CUDNN_TENSOR_OP_MATH,
        DType::F32 => M::CUDNN_FMA_MATH,
        _ => M::CUDNN_DEFAULT_MATH,
    }
}

/// The descriptors of one (geometry, dtype, direction).
pub(super) struct LegacyConv {
    x: TensorDesc,
    w: FilterDesc,
    y: TensorDesc,
    conv: ConvDesc,
    dir: Dir,
    dtype: DType,
    /// The math type now set on `conv`.
    math: Cell<M>,
}

// SAFETY: the descriptors are only used under the device's `dnn` mutex.
unsafe impl Send for LegacyConv {}

impl LegacyConv {
    pub(super) fn new(p: &Conv2dParams, dtype: DType, dir: Dir, tf32: bool) -> Result<LegacyConv> {
        let (dt, compute) = data_type(dtype)?;
        let format = match p.format {
            MemoryFormat::Contiguous => dsys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
            // NHWC activations, KRSC filters.
            MemoryFormat::ChannelsLast => dsys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
        };
        let x = TensorDesc::new()?;
        let y = TensorDesc::new()?;
        let w = FilterDesc(
            dnn::create_filter_descriptor().map_err(|e| dnn_err("filter descriptor", e))?,
        );
        let conv = ConvDesc(
            dnn::create_convolution_descriptor()
                .map_err(|e| dnn_err("convolution descriptor", e))?,
        );
        // Dims are logical (NCHW order) whatever the format; the format gives the strides.
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
        let math = query_math(dtype, tf32);
        // SAFETY: descriptors were just created; arrays are by value.
        unsafe {
            dnn::set_tensor4d_descriptor(x.0, format, dt, xd)
                .map_err(|e| dnn_err("input descriptor", e))?;
            dnn::set_tensor4d_descriptor(y.0, format, dt, yd)
                .map_err(|e| dnn_err("output descriptor", e))?;
            dnn::set_filter4d_descriptor(w.0, dt, format, wd)
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
        Ok(LegacyConv {
            x,
            w,
            y,
            conv,
            dir,
            dtype,
            math: Cell::new(math),
        })
    }

    fn set_math(&self, math: M) -> Result<()> {
        if self.math.get() != math {
            // SAFETY: a live descriptor.
            unsafe { dnn::set_convolution_math_type(self.conv.0, math) }
                .map_err(|e| dnn_err("math type", e))?;
            self.math.set(math);
        }
        Ok(())
    }

    /// cuDNN's candidates in its heuristics' order, each (algorithm, math) once: those that keep
    /// the dtype's promise and need at most `limit` bytes of workspace; with why each other entry
    /// is not a candidate (for the log).
    pub(super) fn candidates(
        &self,
        h: dsys::cudnnHandle_t,
        rules: EngineRules,
        limit: usize,
    ) -> Result<(Vec<LegacyAlgo>, Vec<String>)> {
        let tf32 = rules.tf32;
        const N: usize = 32;
        self.set_math(query_math(self.dtype, tf32))?;
        let mut count: c_int = 0;
        let (x, w, y, conv) = (self.x.0, self.w.0, self.y.0, self.conv.0);
        // (algorithm, status, reported math, deterministic) of each listed entry, in cuDNN's
        // order.
        macro_rules! listed {
            ($perf:ty, $get:path, $variant:path, $name:literal, $d1:expr, $d2:expr, $d3:expr) => {{
                // SAFETY: zeroed plain-data structs filled by cuDNN.
                let mut perf: [$perf; N] = unsafe { std::mem::zeroed() };
                // SAFETY: live handle and descriptors; `perf` holds N entries.
                unsafe {
                    $get(
                        h,
                        $d1,
                        $d2,
                        conv,
                        $d3,
                        N as c_int,
                        &mut count,
                        perf.as_mut_ptr(),
                    )
                }
                .map_err(|e| dnn_err($name, e))?;
                perf.iter()
                    .take(count.clamp(0, N as c_int) as usize)
                    .map(|pf| {
                        (
                            $variant(pf.algo),
                            pf.status,
                            pf.mathType,
                            pf.determinism == dsys::cudnnDeterminism_t::CUDNN_DETERMINISTIC,
                        )
                    })
                    .collect::<Vec<_>>()
            }};
        }
        let listed = match self.dir {
            Dir::Forward => listed!(
                dsys::cudnnConvolutionFwdAlgoPerf_t,
                dnn::get_convolution_forward_algorithm,
                Algo::Fwd,
                "cudnnGetConvolutionForwardAlgorithm_v7",
                x,
                w,
                y
            ),
            Dir::BackwardData | Dir::BackwardDataAdd => listed!(
                dsys::cudnnConvolutionBwdDataAlgoPerf_t,
                dnn::get_convolution_backward_data_algorithm,
                Algo::BwdData,
                "cudnnGetConvolutionBackwardDataAlgorithm_v7",
                w,
                y,
                x
            ),
            Dir::BackwardFilter => listed!(
                dsys::cudnnConvolutionBwdFilterAlgoPerf_t,
                dnn::get_convolution_backward_filter_algorithm,
                Algo::BwdFilter,
                "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
                x,
                y,
                w
            ),
        };
        let mut out: Vec<LegacyAlgo> = Vec::new();
        let mut skipped = Vec::new();
        for (algo, status, reported, deterministic) in listed {
            if status != dsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
                skipped.push(format!("{algo:?}: {status:?}"));
                continue;
            }
            if rules.deterministic && !deterministic {
                skipped.push(format!(
                    "{algo:?}: not deterministic (refused by set_deterministic)"
                ));
                continue;
            }
            let math = match run_math(self.dtype, tf32, reported) {
                Ok(m) => m,
                Err(why) => {
                    skipped.push(format!("{algo:?} {reported:?}: {why}"));
                    continue;
                }
            };
            if self.dtype == DType::F32 && !tf32 && algo.is_transform() {
                skipped.push(format!(
                    "{algo:?}: Winograd/FFT transforms lose f32 accuracy (allowed with TF32)"
                ));
                continue;
            }
            if out.iter().any(|c| c.algo == algo && c.math == math) {
                continue;
            }
            let workspace = match self.workspace(h, algo, math) {
                Ok(ws) => ws,
                Err(e) => {
                    skipped.push(format!("{algo:?} {math:?}: {e}"));
                    continue;
                }
            };
            if workspace > limit {
                skipped.push(format!("{algo:?} {math:?}: {workspace} bytes of workspace"));
                continue;
            }
            out.push(LegacyAlgo {
                algo,
                math,
                workspace,
            });
        }
        Ok((out, skipped))
    }

    /// The workspace `algo` needs when run with `math`.
    fn workspace(&self, h: dsys::cudnnHandle_t, algo: Algo, math: M) -> Result<usize> {
        self.set_math(math)?;
        let (x, w, y, conv) = (self.x.0, self.w.0, self.y.0, self.conv.0);
        // SAFETY: live handle and descriptors.
        unsafe {
            match algo {
                Algo::Fwd(a) => dnn::get_convolution_forward_workspace_size(h, x, w, conv, y, a),
                Algo::BwdData(a) => {
                    dnn::get_convolution_backward_data_workspace_size(h, w, y, conv, x, a)
                }
                Algo::BwdFilter(a) => {
                    dnn::get_convolution_backward_filter_workspace_size(h, x, y, conv, w, a)
                }
            }
        }
        .map_err(|e| dnn_err("workspace size", e))
    }

    /// Runs `a` on `ptrs` (cuDNN's argument order: forward (x, w) -> y, backward-data (dy, w)
    /// -> dx, backward-filter (dy, x) -> dw) with `ws_len` bytes of workspace at `ws`.
    pub(super) fn execute(
        &self,
        h: dsys::cudnnHandle_t,
        a: &LegacyAlgo,
        ptrs: [*mut c_void; 3],
        ws: *mut c_void,
        ws_len: usize,
    ) -> Result<()> {
        if ws_len < a.workspace {
            return Err(Error::Cuda(format!(
                "cuDNN {:?}: {ws_len} bytes of workspace, {} needed",
                a.algo, a.workspace
            )));
        }
        self.set_math(a.math)?;
        // y = 1 * conv + beta * y, the scalars in the compute type.
        let (a1d, bd) = (1.0f64, self.dir.beta());
        let (a1, b) = (1.0f32, bd as f32);
        let (alpha, beta): (*const c_void, *const c_void) = if self.dtype == DType::F64 {
            (&a1d as *const f64 as _, &bd as *const f64 as _)
        } else {
            (&a1 as *const f32 as _, &b as *const f32 as _)
        };
        let [ap, bp, op] = ptrs;
        let (ap, bp) = (ap as *const c_void, bp as *const c_void);
        let (x, w, y, conv) = (self.x.0, self.w.0, self.y.0, self.conv.0);
        // SAFETY: the descriptors describe exactly these buffers (sizes checked by the callers);
        // the workspace holds at least the algorithm's size; alpha/beta outlive the call.
        unsafe {
            match a.algo {
                Algo::Fwd(algo) => dnn::convolution_forward(
                    h, alpha, x, ap, w, bp, conv, algo, ws, ws_len, beta, y, op,
                ),
                Algo::BwdData(algo) => dnn::convolution_backward_data(
                    h, alpha, w, bp, y, ap, conv, algo, ws, ws_len, beta, x, op,
                ),
                Algo::BwdFilter(algo) => dnn::convolution_backward_filter(
                    h, alpha, x, bp, y, ap, conv, algo, ws, ws_len, beta, w, op,
                ),
            }
        }
        .map_err(|e| dnn_err(&format!("{:?}", a.algo), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn math_keeps_the_dtype_promise() {
        use M::*;
        // f32 without TF32: FMA only, whatever cuDNN rated the entry with.
        assert_eq!(
            run_math(DType::F32, false, CUDNN_DEFAULT_MATH),
            Ok(CUDNN_FMA_MATH)
        );
        assert_eq!(
            run_math(DType::F32, false, CUDNN_FMA_MATH),
            Ok(CUDNN_FMA_MATH)
        );
        assert!(run_math(DType::F32, false, CUDNN_TENSOR_OP_MATH).is_err());
        assert_eq!(
            run_math(DType::F32, true, CUDNN_TENSOR_OP_MATH),
            Ok(CUDNN_TENSOR_OP_MATH)
        );
        for d in [DType::F16, DType::BF16, DType::F32, DType::F64] {
            for tf32 in [false, true] {
                assert!(run_math(d, tf32, CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION).is_err());
            }
        }
        // Half types: tensor cores or not, as rated.
        for d in [DType::F16, DType::BF16] {
            for m in [CUDNN_TENSOR_OP_MATH, CUDNN_DEFAULT_MATH, CUDNN_FMA_MATH] {
                assert_eq!(run_math(d, false, m), Ok(m));
            }
        }
    }
}
