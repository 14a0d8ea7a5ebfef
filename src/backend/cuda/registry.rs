//! The NVRTC kernel registry: `kernels/*.cu` embedded in the binary, compiled for the device's
//! architecture at first use, cached in memory (per device, in [`super::device::CudaDevice`]) and
//! on disk (`$MIXPREC_KERNEL_CACHE`, else `~/.cache/mixprec/kernels`), keyed by a hash of the
//! source, the options and the architecture.

use std::ffi::{CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use crate::error::{Error, Result};

const COMMON: &str = include_str!("../../../kernels/common.cuh");
/// Multi-tensor apply helpers, prepended (after common.cuh) to the families that use them.
const MT_COMMON: &str = include_str!("../../../kernels/mt_common.cuh");

/// One kernel family (one `.cu` file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Cast,
    Elementwise,
    Reduce,
    Index,
    Layout,
    Softmax,
    BatchNorm,
    Pool,
    MultiTensor,
    FusedOptim,
    Conv,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Cast => "cast",
            Family::Elementwise => "elementwise",
            Family::Reduce => "reduce",
            Family::Index => "index",
            Family::Layout => "layout",
            Family::Softmax => "softmax",
            Family::BatchNorm => "batch_norm",
            Family::Pool => "pool",
            Family::MultiTensor => "multi_tensor",
            Family::FusedOptim => "fused_optim",
            Family::Conv => "conv",
        }
    }

    fn source(self) -> &'static str {
        match self {
            Family::Cast => include_str!("../../../kernels/cast.cu"),
            Family::Elementwise => include_str!("../../../kernels/elementwise.cu"),
            Family::Reduce => include_str!("../../../kernels/reduce.cu"),
            Family::Index => include_str!("../../../kernels/index.cu"),
            Family::Layout => include_str!("../../../kernels/layout.cu"),
            Family::Softmax => include_str!("../../../kernels/softmax.cu"),
            Family::BatchNorm => include_str!("../../../kernels/batch_norm.cu"),
            Family::Pool => include_str!("../../../kernels/pool.cu"),
            Family::MultiTensor => include_str!("../../../kernels/multi_tensor.cu"),
            Family::FusedOptim => include_str!("../../../kernels/fused_optim.cu"),
            Family::Conv => include_str!("../../../kernels/conv.cu"),
        }
    }

    pub const ALL: [Family; 11] = [
        Family::Cast,
        Family::Elementwise,
        Family::Reduce,
        Family::Index,
        Family::Layout,
        Family::Softmax,
        Family::BatchNorm,
        Family::Pool,
        Family::MultiTensor,
        Family::FusedOptim,
        Family::Conv,
    ];
}

/// The full translation unit: common.cuh, then the family's source.
pub fn full_source(f: Family) -> String {
    let mt = if matches!(f, Family::MultiTensor | Family::FusedOptim) {
        format!(
            "#define MT_CHUNK {}ULL\n#line 1 \"mt_common.cuh\"\n{MT_COMMON}\n",
            crate::backend::MT_CHUNK
        )
    } else {
        String::new()
    };
    format!("{COMMON}\n{mt}#line 1 \"{}.cu\"\n{}", f.name(), f.source())
}

fn options(arch: (i32, i32)) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        "--std=c++17".into(),
        "--fmad=true".into(),
    ]
}

/// FNV-1a, 64 bits: stable across Rust versions (the key of files on disk).
pub(super) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MIXPREC_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/mixprec/kernels"))
}

/// A compiled module image (cubin for the device's architecture), from the disk cache when there.
pub fn module_image(f: Family, arch: (i32, i32)) -> Result<Vec<u8>> {
    let src = full_source(f);
    let opts = options(arch);
    let key = fnv1a(&[
        src.as_bytes(),
        opts.join(" ").as_bytes(),
        format!("sm_{}{}", arch.0, arch.1).as_bytes(),
    ]);
    let file = cache_dir().map(|d| {
        d.join(format!(
            "{}-sm{}{}-{key:016x}.cubin",
            f.name(),
            arch.0,
            arch.1
        ))
    });
    if let Some(path) = &file {
        if let Ok(bytes) = std::fs::read(path) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let image = compile(f, &src, &opts)?;
    if let Some(path) = &file {
        // Best effort: a read-only home directory only costs a recompile next time.
        let write = || -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, &image)?;
            std::fs::rename(&tmp, path)
        };
        if let Err(e) = write() {
            log::debug!("kernel cache: could not write {}: {e}", path.display());
        }
    }
    Ok(image)
}

/// Compiles every kernel family for compute capability `arch` with NVRTC, bypassing the caches:
/// a check of the kernel sources that needs libnvrtc but no GPU or driver (tests/kernels.rs runs
/// it wherever NVRTC loads, CI included). Returns the families compiled; an error carries the
/// NVRTC log, or says that libnvrtc is missing.
pub fn compile_all_for(arch: (i32, i32)) -> Result<usize> {
    // SAFETY: loading libnvrtc runs its initialisers, as cudarc's own loading would.
    let present =
        std::panic::catch_unwind(|| unsafe { nvrtc_sys::is_culib_present() }).unwrap_or(false);
    if !present {
        return Err(Error::Cuda(format!(
            "NVRTC not found (searched {})",
            cudarc::get_lib_name_candidates("nvrtc").join(", ")
        )));
    }
    for f in Family::ALL {
        super::probe::no_panic("NVRTC", || compile(f, &full_source(f), &options(arch)))?;
    }
    Ok(Family::ALL.len())
}

fn nvrtc_err(kernel: &str, what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Compile {
        kernel: kernel.to_string(),
        log: format!("{what}: {e:?}"),
    }
}

/// Compiles `src` with NVRTC to a cubin; a failure carries NVRTC's log.
fn compile(f: Family, src: &str, opts: &[String]) -> Result<Vec<u8>> {
    let kernel = format!("{}.cu", f.name());
    let csrc = CString::new(src).map_err(|e| nvrtc_err(&kernel, "source", e))?;
    let cname = CString::new(kernel.clone()).map_err(|e| nvrtc_err(&kernel, "name", e))?;
    let prog = nvrtc::create_program(&csrc, Some(&cname))
        .map_err(|e| nvrtc_err(&kernel, "nvrtcCreateProgram", e))?;
    struct Guard(nvrtc_sys::nvrtcProgram);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: the program was created above and is destroyed once.
            let _ = unsafe { nvrtc::destroy_program(self.0) };
        }
    }
    let guard = Guard(prog);
    // SAFETY: `prog` is a live program; options are plain strings.
    let compiled = unsafe { nvrtc::compile_program(guard.0, opts) };
    if let Err(e) = compiled {
        // SAFETY: as above.
        let log = unsafe { nvrtc::get_program_log(guard.0) }
            .ok()
            .map(|raw| {
                // SAFETY: NVRTC's log is NUL-terminated.
                unsafe { CStr::from_ptr(raw.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        return Err(Error::Compile {
            kernel,
            log: format!("{e:?} with options {opts:?}\n{log}"),
        });
    }
    let mut size = 0usize;
    // SAFETY: compiled program; `size` receives the cubin size.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(guard.0, &mut size) }
        .result()
        .map_err(|e| nvrtc_err(&kernel, "nvrtcGetCUBINSize", e))?;
    let mut image = vec![0u8; size];
    // SAFETY: `image` has the size NVRTC reported.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(guard.0, image.as_mut_ptr() as *mut std::ffi::c_char) }
        .result()
        .map_err(|e| nvrtc_err(&kernel, "nvrtcGetCUBIN", e))?;
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_embedded_and_keys_differ() {
        for f in Family::ALL {
            let s = full_source(f);
            assert!(s.contains("struct Num"), "{} lacks common.cuh", f.name());
            assert!(
                s.contains("extern \"C\" __global__"),
                "{} has no kernels",
                f.name()
            );
        }
        assert_ne!(fnv1a(&[b"a", b"bc"]), fnv1a(&[b"ab", b"c"]));
    }
}
