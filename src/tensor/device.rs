//! Where a tensor's storage lives.

/// A compute device. `Cpu` is always present; `Cuda(ordinal)` is an NVIDIA GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl Device {
    /// The CUDA device `ordinal`, after checking that the driver, a GPU and the CUDA libraries
    /// (NVRTC, cuBLAS, cuBLASLt, cuDNN) are there; the error names what is missing.
    /// Creates the device's context and stream on first use.
    pub fn cuda(ordinal: usize) -> crate::Result<Device> {
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
