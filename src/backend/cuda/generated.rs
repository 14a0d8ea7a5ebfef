//! Modules generated at run time (the fusion engine's kernels, `crate::fuse`): compiled through
//! the registry's disk cache (`registry::generated_image`), loaded into a device once by their
//! owner, each kernel launched with one by-value parameter block of 8-byte words. Like every
//! kernel, a first load is refused during a capture, and launches follow the capture's stream
//! rules and the side stream's switch.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule};

use super::device::{cuda_err, CudaDevice};
use crate::base::error::Result;

/// A loaded generated module and its kernels.
pub(crate) struct GeneratedModule {
    dev: Arc<CudaDevice>,
    name: String,
    _module: Arc<CudaModule>,
    kernels: Vec<(String, CudaFunction)>,
}

impl std::fmt::Debug for GeneratedModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GeneratedModule({} on cuda:{})",
            self.name, self.dev.ordinal
        )
    }
}

/// Compiles (or finds in the disk cache) `source` and loads its `kernels` on device `ordinal`.
pub(crate) fn load(
    ordinal: usize,
    name: &str,
    source: &str,
    kernels: &[String],
) -> Result<GeneratedModule> {
    let dev = super::device::get(ordinal)?;
    super::graph::refuse(
        ordinal,
        "kernel launch",
        &format!(
            "generated module {name} first used during capture: run the same work once before \
             capturing (a warm-up step)"
        ),
    )?;
    let image = super::registry::generated_image(name, source, dev.arch)?;
    let module = dev
        .ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(image))
        .map_err(|e| cuda_err(&format!("loading module {name}.cu"), e))?;
    let kernels = kernels
        .iter()
        .map(|k| {
            module
                .load_function(k)
                .map(|f| (k.clone(), f))
                .map_err(|e| cuda_err(&format!("loading kernel {k} of {name}.cu"), e))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(GeneratedModule {
        dev,
        name: name.to_string(),
        _module: module,
        kernels,
    })
}

impl GeneratedModule {
    pub(crate) fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// How many blocks of `threads` threads of kernel `k` an SM holds at once (at least 1).
    pub(crate) fn blocks_per_sm(&self, k: usize, threads: u32) -> Result<usize> {
        let (name, func) = &self.kernels[k];
        let n = func
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .map_err(|e| cuda_err(&format!("the occupancy of {name} ({}.cu)", self.name), e))?;
        Ok((n as usize).max(1))
    }

    /// Launches kernel `k` on `blocks` × `threads` with `params` as its one parameter (a struct
    /// of as many 8-byte words, in the kernel's field order).
    pub(crate) fn launch(&self, k: usize, blocks: u32, threads: u32, params: &[u64]) -> Result<()> {
        super::graph::check_stream(self.dev.ordinal, "kernel launch")?;
        let (name, func) = &self.kernels[k];
        let mut block: Vec<u64> = params.to_vec();
        let mut ptrs = vec![block.as_mut_ptr() as *mut std::ffi::c_void];
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        // SAFETY: the kernel's one parameter is a struct of `params.len()` 8-byte words (the
        // generator writes both sides), read by the driver before the call returns; every
        // address in it is a live buffer of this device covering what the kernel indexes.
        unsafe {
            cudarc::driver::result::launch_kernel(
                func.cu_function(),
                (blocks.max(1), 1, 1),
                (threads, 1, 1),
                0,
                super::side_stream::current(&self.dev),
                &mut ptrs,
            )
        }
        .map_err(|e| cuda_err(&format!("launching {name} ({}.cu)", self.name), e))
    }
}
