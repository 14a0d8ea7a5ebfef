//! GPU benchmark (run on a GPU machine; exits quietly without one): bandwidth of cast, add, relu
//! and batch-norm forward on large tensors as a fraction of the device-to-device copy measured in
//! the same run, plus matmul (f16, 8192³) and ResNet-50-shaped convolutions in TFLOP/s.
//! `benches/torch_ref.py` times the same operations through PyTorch for the comparison.
//!
//! Bytes are the fewest a kernel must move: each input read once, each output written once.
//! Both sides time the same way (`common::time`: warm-up, then the median of 5 rounds of
//! back-to-back calls) on the same data (uniform in [-1, 1)).
//!
//! An argument `bandwidth`, `matmul` or `conv` runs that section only (as torch_ref.py does).

mod common;

use common::{copy_bandwidth, time};
use mixprec::backend::cpu::CpuStorage;
use mixprec::backend::cuda::{device, CudaStorage};
// The backend contract: the storage trait, each op family's trait and parameter types.
use mixprec::backend::prelude::*;
use mixprec::tensor::{Layout, MemoryFormat};
use mixprec::{DType, Shape};

fn main() {
    common::main_with(run)
}

fn rand(n: usize, d: DType, seed: u64) -> mixprec::Result<CudaStorage> {
    let v: Vec<f32> = mixprec::tensor::random::uniform(seed, n, -1.0, 1.0)
        .into_iter()
        .map(|x| x as f32)
        .collect();
    let x = CudaStorage::from_cpu(&CpuStorage::F32(v), 0)?;
    x.to_dtype(&whole(&x), d)
}

/// The whole buffer as one contiguous dimension.
fn whole(s: &CudaStorage) -> Layout {
    Layout::contiguous(Shape::new(vec![s.len()]))
}

/// Whether the section `name` runs: every section without an argument.
fn section(name: &str) -> bool {
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    only.is_empty() || only.iter().any(|a| a == name)
}

/// The file a loaded library came from (`/proc/self/maps`), to tell which cuBLAS ran.
fn loaded(lib: &str) -> String {
    std::fs::read_to_string("/proc/self/maps")
        .ok()
        .and_then(|m| {
            m.lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .find(|p| p.contains(lib))
                .map(str::to_string)
        })
        .unwrap_or_else(|| format!("{lib}: not loaded"))
}

fn run() -> mixprec::Result<()> {
    let dev = device(0)?;
    println!(
        "device cuda:0 sm_{}{}",
        dev.compute_capability().0,
        dev.compute_capability().1
    );
    if section("bandwidth") {
        bandwidth()?;
    }
    if section("matmul") {
        matmul()?;
    }
    if section("conv") {
        conv()?;
    }
    Ok(())
}

fn tflops_row(name: String, t: f64, flops: f64) {
    println!("{:<34} {:>10.3} {:>12.1}", name, t * 1e3, flops / t / 1e12);
}

fn bandwidth() -> mixprec::Result<()> {
    let n: usize = 1 << 28;
    let x32 = rand(n, DType::F32, 1)?;
    let y32 = rand(n, DType::F32, 2)?;
    let l = whole(&x32);
    let x16 = x32.to_dtype(&l, DType::F16)?;
    let y16 = y32.to_dtype(&l, DType::F16)?;
    let (copy_t, copy_bw) = copy_bandwidth(&x32)?;
    println!(
        "{:<34} {:>10} {:>12} {:>9}",
        "op (2^28 elements)", "ms", "GB/s", "vs copy"
    );
    let row = |name: &str, t: f64, bytes: usize| {
        let bw = bytes as f64 / t;
        println!(
            "{:<34} {:>10.3} {:>12.1} {:>9.3}",
            name,
            t * 1e3,
            bw / 1e9,
            bw / copy_bw
        );
    };
    row("d2d copy f32", copy_t, 8 * n);
    row(
        "cast f32->f16",
        time(3, 20, || x32.to_dtype(&l, DType::F16).map(|_| ()))?,
        6 * n,
    );
    row(
        "cast f16->f32",
        time(3, 20, || x16.to_dtype(&l, DType::F32).map(|_| ()))?,
        6 * n,
    );
    row(
        "add f32",
        time(3, 20, || {
            x32.binary(&l, &y32, &l, BinaryOp::Add, &l).map(|_| ())
        })?,
        12 * n,
    );
    row(
        "add f16",
        time(3, 20, || {
            x16.binary(&l, &y16, &l, BinaryOp::Add, &l).map(|_| ())
        })?,
        6 * n,
    );
    row(
        "relu f32",
        time(3, 20, || x32.unary(&l, UnaryOp::Relu).map(|_| ()))?,
        8 * n,
    );
    row(
        "relu f16",
        time(3, 20, || x16.unary(&l, UnaryOp::Relu).map(|_| ()))?,
        4 * n,
    );
    // Batch norm over [256, 64, 128·128] (2^28 elements), training forward.
    let (bn, bc, bsp) = (256, 64, 128 * 128);
    let p = BatchNormParams {
        n: bn,
        c: bc,
        spatial: bsp,
        eps: 1e-5,
        momentum: 0.1,
        format: MemoryFormat::Contiguous,
        residual: false,
        relu: false,
    };
    let w = CudaStorage::full(0, DType::F32, bc, 1.0)?;
    let b = CudaStorage::full(0, DType::F32, bc, 0.0)?;
    let mut rm = CudaStorage::full(0, DType::F32, bc, 0.0)?;
    let mut rv = CudaStorage::full(0, DType::F32, bc, 1.0)?;
    row(
        "batch_norm fwd f32 [256,64,128,128]",
        time(2, 10, || {
            x32.batch_norm_train(
                &l,
                BatchNormTrainOperands {
                    residual: None,
                    weight: &w,
                    bias: &b,
                    running_mean: &mut rm,
                    running_var: &mut rv,
                },
                &p,
            )
            .map(|_| ())
        })?,
        8 * n,
    );
    row(
        "batch_norm fwd f16 [256,64,128,128]",
        time(2, 10, || {
            x16.batch_norm_train(
                &l,
                BatchNormTrainOperands {
                    residual: None,
                    weight: &w,
                    bias: &b,
                    running_mean: &mut rm,
                    running_var: &mut rv,
                },
                &p,
            )
            .map(|_| ())
        })?,
        4 * n,
    );
    Ok(())
}

fn matmul() -> mixprec::Result<()> {
    println!("{:<34} {:>10} {:>12}", "compute", "ms", "TFLOP/s");
    let m = 8192;
    for d in [DType::F16, DType::BF16] {
        let a = rand(m * m, d, 3)?;
        let bm = rand(m * m, d, 4)?;
        let dims = MatmulDims {
            batch: 1,
            m,
            n: m,
            k: m,
            trans_a: false,
            trans_b: false,
            a_batch_stride: m * m,
            b_batch_stride: m * m,
        };
        let t = time(10, 20, || {
            a.matmul(&whole(&a), &bm, &whole(&bm), &dims).map(|_| ())
        })?;
        tflops_row(format!("matmul {d} 8192^3"), t, 2.0 * (m as f64).powi(3));
    }
    println!("cuBLAS: {}", loaded("libcublas"));
    Ok(())
}

fn conv() -> mixprec::Result<()> {
    println!("{:<34} {:>10} {:>12}", "compute", "ms", "TFLOP/s");
    // ResNet-50 convolutions (batch 64): layer1 3x3 64→64 @56², layer3 3x3 256→256 @14², conv1 7x7/2.
    // Batch 64, square inputs, no dilation or groups.
    let conv = |c_in, hw, c_out, k, stride, pad| Conv2dParams {
        n: 64,
        c_in,
        h: hw,
        w: hw,
        c_out,
        kh: k,
        kw: k,
        stride: (stride, stride),
        padding: (pad, pad),
        dilation: (1, 1),
        groups: 1,
        format: MemoryFormat::Contiguous,
    };
    let convs = [
        (
            "resnet50 layer1 3x3 64->64 56x56",
            conv(64, 56, 64, 3, 1, 1),
        ),
        (
            "resnet50 layer3 3x3 256->256 14x14",
            conv(256, 14, 256, 3, 1, 1),
        ),
        (
            "resnet50 conv1 7x7/2 3->64 224x224",
            conv(3, 224, 64, 7, 2, 3),
        ),
    ];
    // Each in both memory formats (the buffers hold random values either way).
    let formats = [
        ("", MemoryFormat::Contiguous),
        (" nhwc", MemoryFormat::ChannelsLast),
    ];
    for ((name, p), (suffix, format)) in convs
        .iter()
        .flat_map(|c| formats.iter().map(move |f| (c, f)))
    {
        let p = Conv2dParams {
            format: *format,
            ..*p
        };
        let flops = 2.0 * (p.n * p.c_out * p.out_h() * p.out_w() * p.c_in * p.kh * p.kw) as f64;
        let x = rand(p.n * p.c_in * p.h * p.w, DType::F16, 5)?;
        let w = rand(p.c_out * p.c_in * p.kh * p.kw, DType::F16, 6)?;
        let g = rand(p.n * p.c_out * p.out_h() * p.out_w(), DType::F16, 7)?;
        let (lx, lw, lg) = (whole(&x), whole(&w), whole(&g));
        let t = time(3, 20, || x.conv2d(&lx, &w, &lw, &p).map(|_| ()))?;
        tflops_row(format!("{name}{suffix} fwd f16"), t, flops);
        let t = time(3, 20, || {
            g.conv2d_backward_input(&lg, &w, &lw, &p).map(|_| ())
        })?;
        tflops_row(format!("{name}{suffix} bwd-data f16"), t, flops);
        let t = time(3, 20, || {
            g.conv2d_backward_weight(&lg, &x, &lx, &p).map(|_| ())
        })?;
        tflops_row(format!("{name}{suffix} bwd-filter f16"), t, flops);
    }
    Ok(())
}
