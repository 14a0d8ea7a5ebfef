//! The NVRTC kernel registry: `kernels/*.cu` embedded in the binary, compiled for the device's
//! architecture at first use, cached in memory (per device, in [`super::device::CudaDevice`]) and
//! on disk (`$MIXPREC_KERNEL_CACHE`, else `~/.cache/mixprec/kernels`), keyed by a hash of the
//! source, the options and the architecture. Files there are written atomically
//! ([`crate::io::write_atomic`]) and used only when they hold a whole ELF image.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

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
    module_image_in(cache_dir().as_deref(), f, arch)
}

/// [`module_image`] with the disk cache in `dir` (none: always compiled). A cached file that is
/// not a whole ELF image (a copy cut short, another file under its name) is ignored with a
/// warning and written again, as the plan cache does with its files, rather than handed to the
/// driver to fail on in every later process.
fn module_image_in(dir: Option<&Path>, f: Family, arch: (i32, i32)) -> Result<Vec<u8>> {
    let src = full_source(f);
    let opts = options(arch);
    let key = fnv1a(&[
        src.as_bytes(),
        opts.join(" ").as_bytes(),
        format!("sm_{}{}", arch.0, arch.1).as_bytes(),
    ]);
    let file = dir.map(|d| {
        d.join(format!(
            "{}-sm{}{}-{key:016x}.cubin",
            f.name(),
            arch.0,
            arch.1
        ))
    });
    if let Some(path) = &file {
        if let Ok(bytes) = std::fs::read(path) {
            match whole_elf(&bytes) {
                Ok(()) => return Ok(bytes),
                Err(why) => log::warn!(
                    "kernel cache: {} ignored ({why}); compiling {}.cu again",
                    path.display(),
                    f.name()
                ),
            }
        }
    }
    let image = compile(f, &src, &opts)?;
    if let Some(path) = &file {
        let write = || -> Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
            }
            crate::io::write_atomic(path, |w| {
                w.write_all(&image)
                    .map_err(|e| Error::io(format!("writing {}", path.display()), e))
            })
        };
        // Best effort: a read-only home directory only costs a compile next time.
        if let Err(e) = write() {
            log::debug!("kernel cache: {e}");
        }
    }
    Ok(image)
}

/// Whether `bytes` hold a whole 64-bit little-endian ELF image, as NVRTC's cubins are: the
/// header, the program and section header tables, and every section's contents inside the file.
/// A file cut short anywhere fails one of these.
fn whole_elf(bytes: &[u8]) -> std::result::Result<(), &'static str> {
    let u16_at = |o: usize| {
        bytes
            .get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as u64)
    };
    let u32_at = |o: usize| {
        bytes
            .get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u64)
    };
    let u64_at = |o: usize| {
        bytes
            .get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    };
    if bytes.len() < 64 || bytes[..4] != *b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return Err("not a 64-bit little-endian ELF file");
    }
    let len = bytes.len() as u64;
    let table_fits = |off: Option<u64>, size: Option<u64>, count: Option<u64>| {
        matches!((off, size, count), (Some(o), Some(s), Some(n))
            if s.checked_mul(n).and_then(|t| t.checked_add(o)).is_some_and(|end| end <= len))
    };
    // e_phoff, e_phentsize, e_phnum; e_shoff, e_shentsize, e_shnum.
    if !table_fits(u64_at(0x20), u16_at(0x36), u16_at(0x38)) {
        return Err("its program header table runs past its end");
    }
    let (shoff, shentsize, shnum) = (u64_at(0x28), u16_at(0x3A), u16_at(0x3C));
    if !table_fits(shoff, shentsize, shnum) {
        return Err("its section header table runs past its end");
    }
    let (shoff, shentsize, shnum) = (
        shoff.unwrap_or(0),
        shentsize.unwrap_or(0),
        shnum.unwrap_or(0),
    );
    if shnum > 0 && shentsize < 0x28 {
        return Err("its section headers are too small");
    }
    for i in 0..shnum {
        let h = (shoff + i * shentsize) as usize;
        // SHT_NOBITS (8) sections take no room in the file.
        if u32_at(h + 4) == Some(8) {
            continue;
        }
        if !table_fits(u64_at(h + 0x18), u64_at(h + 0x20), Some(1)) {
            return Err("a section runs past its end");
        }
    }
    Ok(())
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
        let image =
            super::probe::no_panic("NVRTC", || compile(f, &full_source(f), &options(arch)))?;
        // The kernel cache would refuse it, and compile it again in every process.
        whole_elf(&image).map_err(|why| Error::Compile {
            kernel: format!("{}.cu", f.name()),
            log: format!("NVRTC's image fails the kernel cache's check: {why}"),
        })?;
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

    /// Needs libnvrtc (no GPU), as tests/kernels.rs: CI installs it and sets
    /// MIXPREC_REQUIRE_NVRTC; elsewhere the test says it skipped.
    #[test]
    fn a_damaged_cached_kernel_is_compiled_again() {
        // SAFETY: loading libnvrtc runs its initialisers, as cudarc's own loading would.
        let present =
            std::panic::catch_unwind(|| unsafe { nvrtc_sys::is_culib_present() }).unwrap_or(false);
        if !present {
            assert!(
                std::env::var_os("MIXPREC_REQUIRE_NVRTC").is_none(),
                "MIXPREC_REQUIRE_NVRTC is set but NVRTC is not found"
            );
            println!("skipped: NVRTC not found");
            return;
        }
        let dir =
            std::env::temp_dir().join(format!("mixprec-kernel-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (f, arch) = (Family::Index, (9, 0));
        let fresh = module_image_in(Some(&dir), f, arch).unwrap();
        assert_eq!(whole_elf(&fresh), Ok(()));
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(files.len(), 1, "one file, no temporary left");
        let file = files[0].path();
        assert_eq!(std::fs::read(&file).unwrap(), fresh);
        // A copy cut short anywhere is not a whole image.
        for cut in 0..fresh.len() {
            assert!(
                whole_elf(&fresh[..cut]).is_err(),
                "{} bytes of {}",
                cut,
                fresh.len()
            );
        }
        for bad in [&fresh[..fresh.len() / 2], &b"not a cubin"[..], &[]] {
            std::fs::write(&file, bad).unwrap();
            let again = module_image_in(Some(&dir), f, arch).unwrap();
            assert_eq!(whole_elf(&again), Ok(()));
            assert_eq!(std::fs::read(&file).unwrap(), again, "written again");
        }
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
