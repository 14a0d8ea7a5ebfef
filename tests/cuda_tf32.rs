//! The process-global TF32 switch, in a test binary of its own: toggled inside tests/cuda.rs it
//! would move the f32 precision checks that run beside it onto TF32. Ignored without a GPU.

use mixprec::backend::cpu::CpuStorage;
use mixprec::backend::cuda::{set_allow_tf32, CudaStorage};
// The backend contract: the storage trait, each op family's trait and parameter types.
use mixprec::backend::prelude::*;
use mixprec::tensor::random;
use mixprec::Device;

fn randn(n: usize, seed: u64) -> CpuStorage {
    CpuStorage::F32(
        random::normal(seed, n, 0.0, 1.0)
            .into_iter()
            .map(|x| x as f32)
            .collect(),
    )
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_tf32_switch() {
    Device::cuda(0).expect("this test needs a CUDA GPU");
    let dims = MatmulDims {
        batch: 1,
        m: 256,
        n: 256,
        k: 1024,
        trans_a: false,
        trans_b: false,
        a_batch_stride: 256 * 1024,
        b_batch_stride: 1024 * 256,
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let (a, b) = (randn(256 * 1024, seed), randn(1024 * 256, seed ^ 0x9e37));
    let whole = |n: usize| mixprec::tensor::Layout::contiguous(mixprec::Shape::new(vec![n]));
    let (la, lb) = (whole(a.len()), whole(b.len()));
    let want = a.matmul(&la, &b, &lb, &dims).unwrap().to_f64_vec();
    let (ga, gb) = (
        CudaStorage::from_cpu(&a, 0).unwrap(),
        CudaStorage::from_cpu(&b, 0).unwrap(),
    );
    let gpu = || {
        ga.matmul(&la, &gb, &lb, &dims)
            .unwrap()
            .to_cpu()
            .unwrap()
            .to_f64_vec()
    };
    set_allow_tf32(false);
    let strict = rel_err(&gpu(), &want);
    assert!(
        strict <= 1e-5,
        "matmul f32 strict: relative error {strict:e}"
    );
    set_allow_tf32(true);
    let tf32 = rel_err(&gpu(), &want);
    set_allow_tf32(false);
    assert!(tf32 <= 2e-3, "matmul tf32: relative error {tf32:e}");
    // TF32 rounds the operands to 10 mantissa bits: it must be visibly less exact than f32.
    assert!(
        tf32 > strict,
        "TF32 on: error {tf32:e} not above strict f32's {strict:e}"
    );
}
