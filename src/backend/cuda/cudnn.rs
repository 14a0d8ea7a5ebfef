//! The device's cuDNN state ([`Dnn`]: the handle, the convolution workspaces, the chosen plans,
//! batch norm's choices), made on first use and used only under its lock; cuDNN's data types.

use std::collections::HashMap;

use cudarc::cudnn::{result as dnn, sys as dsys};
use cudarc::driver::CudaSlice;

use super::conv_choice::RateKey;
use super::conv_plan::{Plan, PlanKey};
use super::conv_tune::Rates;
use super::device::{cuda_err, CudaDevice};
use crate::base::error::{Error, Result};
use crate::base::DType;

pub(crate) struct Dnn {
    pub(super) handle: dsys::cudnnHandle_t,
    pub(super) workspace: Option<CudaSlice<u8>>,
    /// The workspace of convolutions run beside (`side_stream.rs`), which may run while one on
    /// the main stream uses the other.
    pub(super) side_workspace: Option<CudaSlice<u8>>,
    pub(super) plans: HashMap<PlanKey, Plan>,
    /// The GPU, driver and cuDNN, as the plan cache's keys name them.
    pub(super) device_id: String,
    /// Candidate runs timed so far (warm-ups included).
    pub(super) timing_runs: u64,
    /// The best rate (flops per ms) each candidate reached on a convolution timed so far, for
    /// the floors of later ones.
    pub(super) rates: Rates<RateKey>,
    /// Batch norm's cuDNN descriptors and choices (`batch_norm.rs`).
    pub(super) batch_norm: super::batch_norm_choice::BnChoices,
    /// Attention's cuDNN plans (`cudnn_attention.rs`).
    pub(super) attention: super::cudnn_attention::AttentionPlans,
}

// SAFETY: the handle and descriptors are only used under the device's `dnn` mutex.
unsafe impl Send for Dnn {}

impl Dnn {
    fn new(dev: &CudaDevice) -> Result<Dnn> {
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let handle = dnn::create_handle().map_err(|e| dnn_err("cudnnCreate", e))?;
        let mut driver = 0;
        // SAFETY: an out-pointer; the driver is initialised (a context exists).
        let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
        let device_id = format!(
            "{} sm{}{} {} SMs driver {driver} cudnn {}",
            dev.ctx.name().unwrap_or_else(|_| "unnamed GPU".into()),
            dev.arch.0,
            dev.arch.1,
            dev.sm_count,
            dnn::get_version()
        );
        let d = Dnn {
            handle,
            workspace: None,
            side_workspace: None,
            plans: HashMap::new(),
            device_id,
            timing_runs: 0,
            rates: Rates::new(),
            batch_norm: Default::default(),
            attention: Default::default(),
        };
        // SAFETY: live handle and stream.
        unsafe { dnn::set_stream(handle, dev.stream.cu_stream() as _) }
            .map_err(|e| dnn_err("cudnnSetStream", e))?;
        Ok(d)
    }

    pub(super) fn handle(&self) -> dsys::cudnnHandle_t {
        self.handle
    }
}

impl Drop for Dnn {
    fn drop(&mut self) {
        self.plans.clear();
        self.batch_norm = Default::default();
        self.attention.clear();
        // SAFETY: created by cudnnCreate, destroyed once.
        let _ = unsafe { dnn::destroy_handle(self.handle) };
    }
}

pub(super) fn dnn_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("cuDNN {what}: {e:?}"))
}

/// The device's cuDNN state, locked, its handle made on first use (which a capture cannot
/// record: `op`'s warm-up step must have made it). Every cuDNN call runs under this lock.
pub(super) fn lock_dnn<'a>(
    dev: &'a std::sync::Arc<CudaDevice>,
    op: &'static str,
) -> Result<std::sync::MutexGuard<'a, Option<Dnn>>> {
    let mut guard = dev.dnn.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        super::graph::refuse(
            dev.ordinal,
            op,
            "creating the cuDNN handle during capture: run a warm-up step of the same shapes first",
        )?;
        // A cuDNN missing a symbol would panic inside cudarc: an error instead.
        *guard = Some(super::probe::no_panic("creating the cuDNN handle", || {
            Dnn::new(dev)
        })?);
    }
    Ok(guard)
}

/// The state inside a guard from [`lock_dnn`].
pub(super) fn dnn_state(guard: &mut Option<Dnn>) -> Result<&mut Dnn> {
    guard
        .as_mut()
        .ok_or_else(|| Error::Cuda("cuDNN handle".into()))
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
