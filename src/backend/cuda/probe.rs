//! Looks for the CUDA libraries before cudarc touches them: cudarc panics when a library is
//! missing, mixprec returns an [`Error::Cuda`] naming the library and the file names searched.

use std::sync::OnceLock;

use crate::base::error::{Error, Result};

/// One library the backend loads at run time.
struct Lib {
    /// What a user would call it.
    what: &'static str,
    /// cudarc's base name (the candidates are derived from it as cudarc does).
    base: &'static str,
    present: unsafe fn() -> bool,
}

const LIBS: &[Lib] = &[
    Lib {
        what: "the CUDA driver (libcuda)",
        base: "cuda",
        present: cudarc::driver::sys::is_culib_present,
    },
    Lib {
        what: "NVRTC (libnvrtc)",
        base: "nvrtc",
        present: cudarc::nvrtc::sys::is_culib_present,
    },
    Lib {
        what: "cuBLAS (libcublas)",
        base: "cublas",
        present: cudarc::cublas::sys::is_culib_present,
    },
    Lib {
        what: "cuBLASLt (libcublasLt)",
        base: "cublasLt",
        present: cudarc::cublaslt::sys::is_culib_present,
    },
    Lib {
        what: "cuDNN (libcudnn)",
        base: "cudnn",
        present: cudarc::cudnn::sys::is_culib_present,
    },
];

/// Checks (once per process) that every CUDA library the backend needs can be loaded.
pub fn probe() -> Result<()> {
    static RESULT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            let mut missing = Vec::new();
            for (k, lib) in LIBS.iter().enumerate() {
                // SAFETY: loading a shared library runs its initialisers; these are NVIDIA's
                // libraries, loaded the same way cudarc itself would load them.
                let ok = std::panic::catch_unwind(|| unsafe { (lib.present)() }).unwrap_or(false);
                if !ok {
                    let mut names = cudarc::get_lib_name_candidates(lib.base);
                    let mut seen = std::collections::HashSet::new();
                    names.retain(|n| seen.insert(n.clone()));
                    // The file names are for whoever debugs a setup, not for every CPU run.
                    log::debug!("{} not found; searched {}", lib.what, names.join(", "));
                    missing.push(format!("{} not found", lib.what));
                    if k == 0 {
                        // Without the driver nothing else matters: no NVIDIA GPU or driver here.
                        break;
                    }
                }
            }
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "{} (RUST_LOG=mixprec=debug lists the file names searched); install the NVIDIA driver / CUDA 13 runtime libraries or set LD_LIBRARY_PATH",
                    missing.join("; ")
                ))
            }
        })
        .clone()
        .map_err(Error::Cuda)
}

/// Runs `f`, turning a panic inside cudarc (a missing symbol, say) into an error.
pub(crate) fn no_panic<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::Cuda(format!("{what}: {msg}")))
        }
    }
}
