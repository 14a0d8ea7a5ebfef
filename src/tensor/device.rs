//! Opening a CUDA device: [`Device`]'s constructors that ask the CUDA backend (the enum itself
//! is a base type, `base/device.rs`).

use crate::base::Device;

impl Device {
    /// The CUDA device `ordinal`, after checking that the driver, a GPU and the CUDA libraries
    /// (NVRTC, cuBLAS, cuBLASLt, cuDNN) are there; the error names what is missing.
    /// Creates the device's context and stream on first use.
    pub fn cuda(ordinal: usize) -> crate::base::error::Result<Device> {
        crate::backend::cuda::device(ordinal)?;
        Ok(Device::Cuda(ordinal))
    }

    /// [`Device::cuda`], or the CPU when CUDA is not usable here (one info line saying why; a
    /// machine without a GPU is not a problem to warn about).
    pub fn cuda_if_available(ordinal: usize) -> Device {
        match Device::cuda(ordinal) {
            Ok(d) => d,
            Err(e) => {
                log::info!("CUDA device {ordinal} is not available, using the CPU: {e}");
                Device::Cpu
            }
        }
    }
}
