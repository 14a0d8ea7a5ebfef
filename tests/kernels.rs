//! The CUDA kernel sources compile (NVRTC, for the lent GPUs' sm_90), on any machine where
//! libnvrtc loads, with or without a GPU: a kernel syntax or type error fails here, in CI, not
//! on the GPU machine. Where libnvrtc is missing the test says so and passes (CI installs it:
//! .ci/run).

#[test]
fn every_kernel_family_compiles_for_sm90() {
    match mixprec::backend::cuda::compile_all_for((9, 0)) {
        Ok(n) => println!("{n} kernel families compiled for sm_90"),
        Err(mixprec::Error::Cuda(msg)) if msg.starts_with("NVRTC not found") => {
            if std::env::var_os("MIXPREC_REQUIRE_NVRTC").is_some() {
                panic!("MIXPREC_REQUIRE_NVRTC is set but {msg}");
            }
            println!("skipped: {msg}");
        }
        Err(e) => panic!("{e}"),
    }
}

/// `CudaDevice::compile_all` (the trainer's and the captured step's pre-compilation, before the
/// first timed step) loads the registered families: a `.cu` file left out of the registry would
/// be compiled at its first use instead, inside a step, and a family without its file would not
/// build. No GPU needed.
#[test]
fn compile_all_covers_every_kernel_file() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".cu").map(str::to_string))
        .collect();
    files.sort();
    let mut families: Vec<String> = mixprec::backend::cuda::kernel_families()
        .into_iter()
        .map(str::to_string)
        .collect();
    families.sort();
    let before = families.len();
    families.dedup();
    assert_eq!(families.len(), before, "a family is registered twice");
    assert_eq!(
        files, families,
        "kernels/*.cu against the registry's families"
    );
}
