//! Reads the CUDA libraries ahead of their use. On a machine whose page cache is cold (a fresh
//! cloud instance or container), cuDNN and cuBLAS (about 1 GB of files, half of it used) are
//! paged in by faults, a few pages at a time, as their kernels are first launched, which
//! stretched a ResNet-18's first step from 9 s to 42 s on a fresh H200 host (RESULTS.md, call
//! A12). Once the probe has found the libraries, a background thread asks the kernel to read
//! their files ahead (`posix_fadvise(WILLNEED)`), which costs nothing when they are cached.
//!
//! `MIXPREC_PREFETCH_LIBS=0` turns it off.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The parts of cuDNN that its convolution and normalization engines load at first use, beside
/// the `libcudnn.so` that the probe loads (not `adv`: RNNs and attention, which mixprec never
/// calls).
const CUDNN_PARTS: &[&str] = &[
    "graph",
    "ops",
    "cnn",
    "heuristic",
    "engines_precompiled",
    "engines_runtime_compiled",
];

/// Starts the read-ahead once per process (after a successful probe).
pub(super) fn start() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        if std::env::var("MIXPREC_PREFETCH_LIBS").is_ok_and(|v| v == "0") {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("mixprec-prefetch".into())
            .spawn(|| {
                // Their files are found where the loader finds them: mapped into this process.
                for base in ["cublasLt", "cublas", "cudnn"] {
                    keep_loaded(base);
                }
                if let Ok(maps) = std::fs::read_to_string("/proc/self/maps") {
                    read_ahead(&library_files(&maps, |p| p.is_file()));
                }
            });
        if let Err(e) = spawned {
            log::debug!("library read-ahead not started: {e}");
        }
    });
}

/// Loads library `base` as cudarc does (its first candidate name that loads) and keeps it
/// loaded: cudarc loads it at its first call and keeps it for the process anyway, while the
/// probe's check unloaded it again.
#[cfg(target_os = "linux")]
fn keep_loaded(base: &str) {
    for name in cudarc::get_lib_name_candidates(base) {
        let Ok(c) = std::ffi::CString::new(name) else {
            continue;
        };
        // SAFETY: loading one of NVIDIA's libraries runs its initialisers, as the probe and
        // cudarc do; the handle is never closed.
        if !unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY) }.is_null() {
            return;
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn keep_loaded(_base: &str) {}

/// The cuBLAS and cuDNN files mapped into this process (from `/proc/self/maps`), with the cuDNN
/// parts beside the loaded `libcudnn.so.VERSION` of the same version that `exists`.
fn library_files(maps: &str, exists: impl Fn(&Path) -> bool) -> Vec<PathBuf> {
    let mut files = BTreeSet::new();
    for line in maps.lines() {
        // address perms offset dev inode [path]; the path is the sixth field and may hold spaces.
        let Some(path) = line.splitn(6, ' ').nth(5).map(str::trim_start) else {
            continue;
        };
        let path = Path::new(path);
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !(name.starts_with("libcublas") || name.starts_with("libcudnn")) {
            continue;
        }
        files.insert(path.to_path_buf());
        if let (Some(version), Some(dir)) = (name.strip_prefix("libcudnn.so"), path.parent()) {
            for part in CUDNN_PARTS {
                let sibling = dir.join(format!("libcudnn_{part}.so{version}"));
                if exists(&sibling) {
                    files.insert(sibling);
                }
            }
        }
    }
    files.into_iter().collect()
}

/// Asks the kernel to read each file into the page cache; it returns once the reads are queued.
fn read_ahead(files: &[PathBuf]) {
    let started = std::time::Instant::now();
    let mut bytes = 0u64;
    for f in files {
        let Ok(file) = std::fs::File::open(f) else {
            continue;
        };
        bytes += file.metadata().map(|m| m.len()).unwrap_or(0);
        advise_will_need(&file);
    }
    log::debug!(
        "library read-ahead: {} files, {} MiB queued in {:.2} s",
        files.len(),
        bytes >> 20,
        started.elapsed().as_secs_f64()
    );
}

#[cfg(target_os = "linux")]
fn advise_will_need(file: &std::fs::File) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid open descriptor; the advice only schedules reads of the file's pages.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED) };
    if rc != 0 {
        log::debug!("posix_fadvise(WILLNEED): error {rc}");
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_will_need(_file: &std::fs::File) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mapped_libraries_and_the_cudnn_parts_of_their_version() {
        let maps = "\
7f00-7f10 r--p 00000000 08:01 11 /usr/lib/x86_64-linux-gnu/libcudnn.so.9.14.0
7f10-7f20 r-xp 00010000 08:01 11 /usr/lib/x86_64-linux-gnu/libcudnn.so.9.14.0
7f20-7f30 r--p 00000000 08:01 12 /opt/cuda dir/lib/libcublasLt.so.13.1.0.3
7f30-7f40 r--p 00000000 08:01 13 /opt/cuda dir/lib/libcublas.so.13.1.0.3
7f40-7f50 r--p 00000000 08:01 14 /usr/lib/x86_64-linux-gnu/libc.so.6
7f50-7f60 rw-p 00000000 00:00 0
7f60-7f70 r--p 00000000 00:00 0    [vdso]
";
        let present = |p: &Path| {
            let n = p.file_name().unwrap().to_str().unwrap();
            n != "libcudnn_heuristic.so.9.14.0"
        };
        let got = library_files(maps, present);
        let d = "/usr/lib/x86_64-linux-gnu";
        let mut want: Vec<PathBuf> = vec![
            "/opt/cuda dir/lib/libcublas.so.13.1.0.3".into(),
            "/opt/cuda dir/lib/libcublasLt.so.13.1.0.3".into(),
            format!("{d}/libcudnn.so.9.14.0").into(),
        ];
        for part in [
            "graph",
            "ops",
            "cnn",
            "engines_precompiled",
            "engines_runtime_compiled",
        ] {
            want.push(format!("{d}/libcudnn_{part}.so.9.14.0").into());
        }
        want.sort();
        assert_eq!(got, want);
        assert!(library_files("", present).is_empty());
    }
}
