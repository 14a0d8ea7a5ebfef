//! The NVRTC kernel registry: `kernels/*.cu` embedded in the binary, compiled for the device's
//! architecture at first use, cached in memory (per device, in [`super::device::CudaDevice`]) and
//! on disk (`$MIXPREC_KERNEL_CACHE`, else `~/.cache/mixprec/kernels`), keyed by a hash of the
//! source, the options and the architecture. Files there are written atomically
//! ([`crate::io::write_atomic`]) and sealed with a CRC-32 of the image ([`seal`]); a file whose
//! seal does not match is compiled again, so the driver is never handed a damaged image.
//!
//! A first use that finds its family in neither place (a new machine, a new version) compiles every
//! family missing from the disk cache, side by side on the host's cores, longest first, and waits
//! for them all: a training step uses nearly every family, and one after another, each at its first
//! use, they made the first step take tens of seconds (`fused_optim` and `batch_norm` the longest;
//! benches/RESULTS.md has the figures). The threads end before the call returns, so none is left
//! inside NVRTC when the program exits. (NVRTC 13 also keeps its compiles in the driver's compute
//! cache, `~/.nv/ComputeCache`: a later process compiles from there in a fraction of a second, even
//! with this cache empty.)

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex, MutexGuard};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use crate::base::error::{Error, Result};

const COMMON: &str = include_str!("../../../kernels/common.cuh");
/// Multi-tensor apply helpers, prepended (after common.cuh) to the families that use them.
const MT_COMMON: &str = include_str!("../../../kernels/mt_common.cuh");

/// Declares the kernel families, one line each: the variant, the file (`kernels/<name>.cu`) and
/// its relative cold-compile cost, which orders a parallel compile (longest first, so that
/// [`in_parallel`]'s threads end about together; measured with NVRTC, benches/RESULTS.md).
macro_rules! kernel_families {
    ($($v:ident => $name:literal, $cost:literal;)*) => {
        /// One kernel family (one `.cu` file).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Family {
            $($v,)*
        }

        impl Family {
            pub fn name(self) -> &'static str {
                match self {
                    $(Family::$v => $name,)*
                }
            }

            fn source(self) -> &'static str {
                match self {
                    $(Family::$v => include_str!(concat!("../../../kernels/", $name, ".cu")),)*
                }
            }

            fn compile_cost(self) -> u32 {
                match self {
                    $(Family::$v => $cost,)*
                }
            }

            pub const ALL: [Family; [$($name),*].len()] = [$(Family::$v,)*];
        }
    };
}

kernel_families! {
    Cast => "cast", 8;
    Elementwise => "elementwise", 18;
    Reduce => "reduce", 13;
    Index => "index", 4;
    Layout => "layout", 5;
    Softmax => "softmax", 15;
    BatchNorm => "batch_norm", 83;
    Pool => "pool", 61;
    MultiTensor => "multi_tensor", 32;
    FusedOptim => "fused_optim", 122;
    Conv => "conv", 12;
    LayerNorm => "layer_norm", 10;
    Activation => "activation", 6;
    Embedding => "embedding", 4;
    Dropout => "dropout", 4;
    FlashAttention => "flash_attention", 30;
    CrossEntropy => "cross_entropy", 4;
    Attention => "attention", 8;
}

/// The kernel families' names (`kernels/<name>.cu`), each one module that
/// [`CudaDevice::compile_all`](super::CudaDevice::compile_all) loads.
pub fn kernel_families() -> Vec<&'static str> {
    Family::ALL.iter().map(|f| f.name()).collect()
}

/// The families, longest to compile first.
fn by_compile_time() -> Vec<Family> {
    let mut v = Family::ALL.to_vec();
    v.sort_by_key(|f| std::cmp::Reverse(f.compile_cost()));
    v
}

/// The full translation unit: common.cuh, then the family's source (fused_optim's preceded by
/// its hyperparameter structs, generated from their Rust definitions).
pub fn full_source(f: Family) -> String {
    let mut mt = if matches!(f, Family::MultiTensor | Family::FusedOptim) {
        format!(
            "#define MT_CHUNK {}ULL\n#line 1 \"mt_common.cuh\"\n{MT_COMMON}\n",
            crate::backend::MT_CHUNK
        )
    } else {
        String::new()
    };
    if f == Family::FusedOptim {
        mt += crate::backend::fused_optim::cuda_structs().as_str();
    }
    format!("{COMMON}\n{mt}#line 1 \"{}.cu\"\n{}", f.name(), f.source())
}

fn options(arch: (i32, i32)) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        "--std=c++17".into(),
        "--fmad=true".into(),
    ];
    opts.extend(SPEED_OPTIONS.iter().map(|o| o.to_string()));
    opts
}

/// Options that only make a compile faster. An NVRTC that refuses one (an older one than the
/// CUDA 13 this is written for: cudarc also loads libnvrtc.so.12 and .11) compiles without it.
/// `--split-compile=0`: NVRTC optimises a program's functions on as many threads as the host
/// has; the families with many kernels (fused_optim, batch_norm) are most of a cold compile.
const SPEED_OPTIONS: &[&str] = &["--split-compile=0"];

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

/// A compiled module image (cubin for the device's architecture): from the disk cache when there,
/// else compiled now, together with every other family missing from the cache (module doc).
pub fn module_image(f: Family, arch: (i32, i32)) -> Result<Vec<u8>> {
    module_image_in(cache_dir().as_deref(), f, arch, &by_compile_time())
}

/// Where a made-ahead image is kept: the cache directory (none: no disk cache), the family, the
/// architecture.
type AheadKey = (Option<PathBuf>, Family, (i32, i32));

/// Images compiled beside another family's miss and not asked for yet. Each is taken out at its
/// family's first use (the device then keeps the loaded module), so that a cache directory that
/// cannot be written does not make every later miss compile the whole set again.
fn made_ahead() -> MutexGuard<'static, HashMap<AheadKey, Vec<u8>>> {
    static AHEAD: LazyLock<Mutex<HashMap<AheadKey, Vec<u8>>>> = LazyLock::new(Default::default);
    AHEAD.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`module_image`] with the disk cache in `dir` (none: always compiled) and `together`, the
/// families compiled beside `f` when it misses. A cached file whose seal does not match (a copy
/// cut short, a changed byte, another file under its name) is ignored with a warning and
/// written again, as the plan cache does with its files, rather than handed to the driver: a
/// damaged image fails its load in every later process, or loads and runs the wrong
/// instructions.
fn module_image_in(
    dir: Option<&Path>,
    f: Family,
    arch: (i32, i32),
    together: &[Family],
) -> Result<Vec<u8>> {
    let key = |g: Family| (dir.map(Path::to_path_buf), g, arch);
    if let Some(image) = made_ahead().remove(&key(f)) {
        return Ok(image);
    }
    if let Some(image) = read_cached(dir, f, arch) {
        return Ok(image);
    }
    // One miss compiles at a time: a second (another device's, another thread's) then finds its
    // family made ahead or on disk.
    static MISS: Mutex<()> = Mutex::new(());
    let _one = MISS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(image) = made_ahead().remove(&key(f)) {
        return Ok(image);
    }
    let mut missing = vec![f];
    for &g in together {
        if g != f && !made_ahead().contains_key(&key(g)) && read_cached(dir, g, arch).is_none() {
            missing.push(g);
        }
    }
    let order = by_compile_time();
    missing.sort_by_key(|g| order.iter().position(|h| h == g));
    let mut mine = None;
    for (g, made) in in_parallel(&missing, |g| compile_and_cache(dir, g, arch)) {
        if g == f {
            mine = Some(made);
        } else if let Ok(image) = made {
            // A failure is not kept: the family's own first use reports it.
            made_ahead().insert(key(g), image);
        }
    }
    mine.unwrap_or_else(|| compile_and_cache(dir, f, arch))
}

/// `work` for each of `families` on up to one thread per core, taken in the order given; returns
/// when all are done, each family with its result.
fn in_parallel<T: Send>(
    families: &[Family],
    work: impl Fn(Family) -> T + Sync,
) -> Vec<(Family, T)> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = Mutex::new(Vec::with_capacity(families.len()));
    let worker = || loop {
        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some(&f) = families.get(i) else { break };
        let r = work(f);
        done.lock().unwrap_or_else(|e| e.into_inner()).push((f, r));
    };
    std::thread::scope(|s| {
        let worker = &worker;
        for _ in 1..cores.min(families.len()) {
            // A thread that cannot start leaves its share to the others and to this one.
            let _ = std::thread::Builder::new().spawn_scoped(s, worker);
        }
        worker();
    });
    done.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// The disk cache's file for family `f` on `arch`, named by the hash of what goes into it.
fn cache_file(dir: &Path, f: Family, arch: (i32, i32)) -> PathBuf {
    let key = fnv1a(&[
        CACHE_FORMAT,
        full_source(f).as_bytes(),
        options(arch).join(" ").as_bytes(),
        format!("sm_{}{}", arch.0, arch.1).as_bytes(),
    ]);
    dir.join(format!(
        "{}-sm{}{}-{key:016x}.cubin",
        f.name(),
        arch.0,
        arch.1
    ))
}

/// Family `f`'s image from the disk cache, when its file is there and its seal matches.
fn read_cached(dir: Option<&Path>, f: Family, arch: (i32, i32)) -> Option<Vec<u8>> {
    let path = cache_file(dir?, f, arch);
    let bytes = std::fs::read(&path).ok()?;
    match unseal(&bytes) {
        Ok(image) => Some(image.to_vec()),
        Err(why) => {
            log::warn!(
                "kernel cache: {} ignored ({why}); compiling {}.cu again",
                path.display(),
                f.name()
            );
            None
        }
    }
}

/// Compiles family `f` for `arch` and writes the image, sealed, to the disk cache (best effort:
/// a read-only home directory only costs a compile next time).
fn compile_and_cache(dir: Option<&Path>, f: Family, arch: (i32, i32)) -> Result<Vec<u8>> {
    let image = compile(f, &full_source(f), &options(arch))?;
    if let Some(path) = dir.map(|d| cache_file(d, f, arch)) {
        write_cached(&path, &image);
    }
    Ok(image)
}

/// Writes `image`, sealed, to `path` (best effort, as [`compile_and_cache`] says).
fn write_cached(path: &Path, image: &[u8]) {
    let write = || -> Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        }
        crate::util::write_atomic(path, |w| {
            w.write_all(&seal(image))
                .map_err(|e| Error::io(format!("writing {}", path.display()), e))
        })
    };
    if let Err(e) = write() {
        log::debug!("kernel cache: {e}");
    }
}

/// The image of a module generated at run time (`crate::fuse`'s kernels): `source` after
/// common.cuh, compiled for `arch` with the families' options, from the disk cache when there
/// (keyed by a hash of the source, the options and the architecture, sealed as theirs are), else
/// compiled now and written there.
pub(crate) fn generated_image(name: &str, source: &str, arch: (i32, i32)) -> Result<Vec<u8>> {
    let full = format!("{COMMON}\n#line 1 \"{name}.cu\"\n{source}");
    let opts = options(arch);
    let path = cache_dir().map(|d| {
        let key = fnv1a(&[
            CACHE_FORMAT,
            full.as_bytes(),
            opts.join(" ").as_bytes(),
            format!("sm_{}{}", arch.0, arch.1).as_bytes(),
        ]);
        d.join(format!("{name}-sm{}{}-{key:016x}.cubin", arch.0, arch.1))
    });
    if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        match unseal(&bytes) {
            Ok(image) => return Ok(image.to_vec()),
            Err(why) => log::warn!("kernel cache: {name} ignored ({why}); compiling it again"),
        }
    }
    let image = compile_named(&format!("{name}.cu"), &full, &opts, SPEED_OPTIONS)?;
    if let Some(path) = path {
        write_cached(&path, &image);
    }
    Ok(image)
}

/// Compiles a generated module's `source` (after common.cuh) for `arch`, bypassing the caches:
/// the check that the fusion engine's generated kernels compile, with NVRTC and no GPU.
pub fn compile_generated_for(name: &str, source: &str, arch: (i32, i32)) -> Result<()> {
    // SAFETY: as in `compile_all_for`.
    let present =
        std::panic::catch_unwind(|| unsafe { nvrtc_sys::is_culib_present() }).unwrap_or(false);
    if !present {
        return Err(Error::Cuda("NVRTC not found".into()));
    }
    let full = format!("{COMMON}\n#line 1 \"{name}.cu\"\n{source}");
    super::probe::no_panic("NVRTC", || {
        compile_named(&format!("{name}.cu"), &full, &options(arch), SPEED_OPTIONS)
    })
    .map(|_| ())
}

/// The kernel cache's file format, part of every file's key: files of another format are
/// simply not looked at. (1: the bare cubin; 2: the cubin and its [`seal`].)
const CACHE_FORMAT: &[u8] = b"kernel cache format 2";

/// The seal's tag; the image's length (u32 LE) and CRC-32 (u32 LE) follow it.
const SEAL_TAG: &[u8; 8] = b"mpseal01";
const SEAL_LEN: usize = 16;

/// A cache file's bytes: the image, then [`SEAL_TAG`], its length and its CRC-32. (An ELF loader
/// reads by offsets from the header, so the file is still a cubin for tools such as cuobjdump.)
fn seal(image: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(image.len() + SEAL_LEN);
    out.extend_from_slice(image);
    out.extend_from_slice(SEAL_TAG);
    out.extend_from_slice(&(image.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(image).to_le_bytes());
    out
}

/// The image inside a cache file, when its seal matches. The tag and the length catch a file cut
/// short; the CRC-32 catches every change of up to 32 consecutive bits, so any one changed byte.
/// Either is refused here, not by the driver.
fn unseal(bytes: &[u8]) -> std::result::Result<&[u8], &'static str> {
    let Some(body) = bytes.len().checked_sub(SEAL_LEN) else {
        return Err("shorter than its seal");
    };
    let (image, seal) = bytes.split_at(body);
    if seal[..8] != SEAL_TAG[..] {
        return Err("no seal at its end (cut short, or not a cache file)");
    }
    let word = |o: usize| u32::from_le_bytes([seal[o], seal[o + 1], seal[o + 2], seal[o + 3]]);
    if word(8) as usize != image.len() {
        return Err("its length is not the sealed length");
    }
    if word(12) != crc32fast::hash(image) {
        return Err("its CRC-32 does not match (a byte changed)");
    }
    Ok(image)
}

/// Compiles every kernel family for compute capability `arch` with NVRTC, side by side,
/// bypassing the caches:
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
    let mut compiled = in_parallel(&by_compile_time(), |f| {
        super::probe::no_panic("NVRTC", || compile(f, &full_source(f), &options(arch)))
    });
    // The first failure in the families' usual order, whichever thread met it first.
    compiled.sort_by_key(|(f, _)| Family::ALL.iter().position(|g| g == f));
    for (_, r) in compiled {
        r?;
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
    compile_with(f, src, opts, SPEED_OPTIONS)
}

/// [`compile`], with `speed` the options that may be dropped when NVRTC refuses one.
fn compile_with(f: Family, src: &str, opts: &[String], speed: &[&str]) -> Result<Vec<u8>> {
    compile_named(&format!("{}.cu", f.name()), src, opts, speed)
}

/// [`compile_with`] for a source named `kernel` (its file name in NVRTC's log).
fn compile_named(kernel: &str, src: &str, opts: &[String], speed: &[&str]) -> Result<Vec<u8>> {
    let kernel = kernel.to_string();
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
    if let Err(e) = &compiled {
        let optional = |o: &String| speed.contains(&o.as_str());
        if e.0 == nvrtc_sys::nvrtcResult::NVRTC_ERROR_INVALID_OPTION && opts.iter().any(optional) {
            log::debug!("NVRTC refused one of {speed:?}; compiling {kernel} without them");
            let required: Vec<String> = opts.iter().filter(|o| !optional(o)).cloned().collect();
            return compile_named(&kernel, src, &required, &[]);
        }
    }
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

    #[test]
    fn a_seal_refuses_every_cut_and_every_changed_byte() {
        let image: Vec<u8> = (0..3000u32).map(|i| (i * 7 + i / 11) as u8).collect();
        let sealed = seal(&image);
        assert_eq!(unseal(&sealed), Ok(&image[..]));
        for cut in 0..sealed.len() {
            assert!(unseal(&sealed[..cut]).is_err(), "cut at {cut}");
        }
        for at in 0..sealed.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut bad = sealed.clone();
                bad[at] ^= flip;
                assert!(unseal(&bad).is_err(), "byte {at} ^ {flip:#x}");
            }
        }
        // A bare cubin of the old format (no seal) is not taken for a sealed one.
        assert!(unseal(&image).is_err());
        assert_eq!(unseal(&seal(&[])), Ok(&[][..]));
    }

    /// An empty directory for a test that needs libnvrtc (no GPU), as tests/kernels.rs: CI
    /// installs it and sets MIXPREC_REQUIRE_NVRTC; elsewhere the test says it skipped (`None`).
    fn nvrtc_and_an_empty_dir(test: &str) -> Option<PathBuf> {
        // SAFETY: loading libnvrtc runs its initialisers, as cudarc's own loading would.
        let present =
            std::panic::catch_unwind(|| unsafe { nvrtc_sys::is_culib_present() }).unwrap_or(false);
        if !present {
            assert!(
                std::env::var_os("MIXPREC_REQUIRE_NVRTC").is_none(),
                "MIXPREC_REQUIRE_NVRTC is set but NVRTC is not found"
            );
            println!("skipped: NVRTC not found");
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "mixprec-kernel-cache-{test}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Some(dir)
    }

    #[test]
    fn a_damaged_cached_kernel_is_compiled_again() {
        let Some(dir) = nvrtc_and_an_empty_dir("damaged") else {
            return;
        };
        let (f, arch) = (Family::Index, (9, 0));
        let fresh = module_image_in(Some(&dir), f, arch, &[]).unwrap();
        assert_eq!(
            &fresh[..4],
            b"\x7fELF",
            "the image handed to the driver is the bare cubin"
        );
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(files.len(), 1, "one file, no temporary left");
        let file = files[0].path();
        let on_disk = std::fs::read(&file).unwrap();
        assert_eq!(on_disk, seal(&fresh));
        // Read back from the cache as it was written.
        assert_eq!(module_image_in(Some(&dir), f, arch, &[]).unwrap(), fresh);
        // A byte changed in the middle of the code: still a well-formed ELF file, which the
        // driver might load and run. It is compiled again instead.
        let mut flipped = on_disk.clone();
        flipped[fresh.len() / 2] ^= 0x10;
        let cut = &on_disk[..on_disk.len() / 2];
        for bad in [&flipped[..], cut, &fresh[..], &b"not a cubin"[..], &[]] {
            std::fs::write(&file, bad).unwrap();
            let again = module_image_in(Some(&dir), f, arch, &[]).unwrap();
            assert_eq!(again, fresh, "the same image as compiled");
            assert_eq!(std::fs::read(&file).unwrap(), seal(&again), "written again");
        }
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A speed option that NVRTC refuses (as one older than CUDA 13 might refuse
    /// `--split-compile`) is dropped, and the compile is the one without it; a refused option
    /// that is not a speed option stays an error naming the kernel.
    #[test]
    fn a_refused_speed_option_is_dropped() {
        if nvrtc_and_an_empty_dir("refused").is_none() {
            return;
        }
        let (f, src) = (Family::Layout, full_source(Family::Layout));
        let plain = vec!["--gpu-architecture=sm_90".to_string(), "--std=c++17".into()];
        let unknown = "--no-such-option-in-any-nvrtc";
        let mut with_unknown = plain.clone();
        with_unknown.push(unknown.into());
        let expected = compile_with(f, &src, &plain, &[]).unwrap();
        assert_eq!(
            compile_with(f, &src, &with_unknown, &[unknown]).unwrap(),
            expected
        );
        match compile_with(f, &src, &with_unknown, &[]) {
            Err(Error::Compile { kernel, log }) => {
                assert_eq!(kernel, "layout.cu");
                assert!(log.contains("INVALID_OPTION"), "{log}");
            }
            other => panic!("an unknown required option compiled: {other:?}"),
        }
    }

    /// A miss compiles the families missing from the cache together; one made ahead is handed
    /// out at its own first use without a compile, once; one already cached is not compiled.
    #[test]
    fn a_miss_compiles_the_missing_families_together() {
        let Some(dir) = nvrtc_and_an_empty_dir("together") else {
            return;
        };
        let arch = (9, 0);
        let set = [Family::Layout, Family::Index, Family::Cast];
        // Cast is cached (a stand-in image under a good seal: the cache trusts its seal).
        std::fs::create_dir_all(&dir).unwrap();
        let cast_file = cache_file(&dir, Family::Cast, arch);
        std::fs::write(&cast_file, seal(b"cast, cached")).unwrap();
        let index = module_image_in(Some(&dir), Family::Index, arch, &set).unwrap();
        assert_eq!(
            index,
            compile(Family::Index, &full_source(Family::Index), &options(arch)).unwrap()
        );
        let layout_file = cache_file(&dir, Family::Layout, arch);
        let layout = compile(Family::Layout, &full_source(Family::Layout), &options(arch)).unwrap();
        assert_eq!(
            std::fs::read(&layout_file).unwrap(),
            seal(&layout),
            "compiled beside Index"
        );
        assert_eq!(
            std::fs::read(&cast_file).unwrap(),
            seal(b"cast, cached"),
            "not compiled"
        );
        // Layout's first use takes the image made ahead: no compile, so no file written again.
        std::fs::remove_file(&layout_file).unwrap();
        assert_eq!(
            module_image_in(Some(&dir), Family::Layout, arch, &set).unwrap(),
            layout
        );
        assert!(!layout_file.exists());
        // Handed out once: the next miss compiles it (alone: the others are cached) and writes it.
        assert_eq!(
            module_image_in(Some(&dir), Family::Layout, arch, &set).unwrap(),
            layout
        );
        assert_eq!(std::fs::read(&layout_file).unwrap(), seal(&layout));
        assert_eq!(
            module_image_in(Some(&dir), Family::Cast, arch, &set).unwrap(),
            b"cast, cached"
        );
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            3,
            "no temporary left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
