//! Issue 48's experiment: ResNet-50's batch norm, (32, 256, 56, 56), training-mode forward (and
//! forward + backward), three ways: written with `mixprec::fuse`, the same math as unfused
//! tensor ops, and our hand-written batch-norm kernels (`Tensor::batch_norm`). Exits quietly
//! without a GPU.
//!
//! ```text
//! bench-fuse_batch_norm [--dtype f16|bf16|f32] [--iters 20] [--small]
//! ```
//!
//! One JSON line per (variant, pass): `gpu_ms` (device time per call, summed over the ops the
//! op profiler times: `set_op_profiling`), `ops` (timed ops per call: for the fused variant its
//! kernels are `kernels` launches under one op), `host_us` (host time to enqueue one call, the
//! queue empty: no synchronisation inside the timed span), `wall_ms` (back-to-back calls with a
//! synchronisation per round, `common::time`).

mod common;

use std::time::Instant;

use mixprec::backend::cuda::{device, op_profile, set_op_profiling};
use mixprec::fuse::Fused;
use mixprec::{fuse, BatchNormConfig, DType, Device, Result, Tensor};

struct Args {
    dtype: DType,
    iters: usize,
    small: bool,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut a = Args {
        dtype: DType::F16,
        iters: 20,
        small: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--dtype" => {
                a.dtype = match value()?.as_str() {
                    "f16" => DType::F16,
                    "bf16" => DType::BF16,
                    "f32" => DType::F32,
                    other => return Err(format!("unknown dtype {other} (f16, bf16 or f32)")),
                }
            }
            "--iters" => a.iters = value()?.parse().map_err(|_| "--iters needs a number")?,
            "--small" => a.small = true,
            "--bench" => {}
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    Ok(a)
}

/// Batch norm with batch statistics, written with `fuse`: the mean, the (biased) variance
/// and the normalised, scaled and shifted output, in the input's dtype.
fn fused_batch_norm() -> Fused {
    fuse("batch_norm", |f, x| {
        let axes = [0, 2, 3];
        let mean = f.mean(x[0], &axes);
        let var = f.var(x[0], &axes);
        let inv = f.rsqrt(f.add_scalar(var, 1e-5));
        let y = f.add(f.mul(f.mul(f.sub(x[0], mean), inv), x[1]), x[2]);
        vec![f.cast(y, f.dtype(x[0]))]
    })
}

/// The same math as unfused ops.
fn unfused_batch_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?;
    let mean = xf.mean_dim(0, true)?.mean_dim(2, true)?.mean_dim(3, true)?;
    let d = xf.sub(&mean)?;
    let var = d
        .sqr()?
        .mean_dim(0, true)?
        .mean_dim(2, true)?
        .mean_dim(3, true)?;
    let inv = var.add_scalar(1e-5)?.powf(-0.5)?;
    d.mul(&inv)?.mul(w)?.add(b)?.to_dtype(x.dtype())
}

struct Row {
    variant: &'static str,
    pass: &'static str,
    gpu_ms: f64,
    ops: f64,
    host_us: f64,
    wall_ms: f64,
    kernels: Option<usize>,
}

fn print(a: &Args, shape: &[usize], r: &Row) {
    let kernels = r
        .kernels
        .map(|k| format!(", \"kernels\": {k}"))
        .unwrap_or_default();
    println!(
        "{{\"variant\": \"{}\", \"pass\": \"{}\", \"dtype\": \"{}\", \"shape\": {shape:?}, \
         \"gpu_ms\": {:.4}, \"ops\": {:.1}, \"host_us\": {:.1}, \"wall_ms\": {:.4}{kernels}}}",
        r.variant, r.pass, a.dtype, r.gpu_ms, r.ops, r.host_us, r.wall_ms
    );
}

/// Measures `call`: device time and op count from the op profiler, host time per call with
/// the queue empty, and the synchronised wall time per call.
fn measure(a: &Args, mut call: impl FnMut() -> Result<()>) -> Result<(f64, f64, f64, f64)> {
    let dev = device(0)?;
    for _ in 0..3 {
        call()?;
    }
    dev.synchronize()?;
    let _ = op_profile()?;
    set_op_profiling(true);
    for _ in 0..a.iters {
        call()?;
    }
    set_op_profiling(false);
    let rows = op_profile()?;
    let gpu_ms = rows.iter().map(|r| r.total_ms).sum::<f64>() / a.iters as f64;
    let ops = rows.iter().map(|r| r.calls).sum::<usize>() as f64 / a.iters as f64;
    let mut host = Vec::new();
    for _ in 0..a.iters {
        dev.synchronize()?;
        let t = Instant::now();
        call()?;
        host.push(t.elapsed().as_secs_f64());
    }
    host.sort_by(|x, y| x.total_cmp(y));
    let wall = common::time(2, a.iters, &mut call)?;
    Ok((gpu_ms, ops, host[host.len() / 2] * 1e6, wall * 1e3))
}

fn run(a: &Args) -> Result<()> {
    let dev = Device::Cuda(0);
    let shape = if a.small {
        vec![4, 64, 28, 28]
    } else {
        vec![32, 256, 56, 56]
    };
    let c = shape[1];
    let x = Tensor::randn(shape.clone(), 0.1, 1.0, 1, a.dtype, dev)?.to_variable();
    let gy = Tensor::randn(shape.clone(), 0.0, 1.0, 2, a.dtype, dev)?;
    let w = Tensor::randn(vec![c, 1, 1], 1.0, 0.1, 3, DType::F32, dev)?.to_variable();
    let b = Tensor::randn(vec![c, 1, 1], 0.0, 0.1, 4, DType::F32, dev)?.to_variable();
    let (w1, b1) = (w.reshape(vec![c])?, b.reshape(vec![c])?);
    let rm = Tensor::zeros(vec![c], DType::F32, dev)?;
    let rv = Tensor::ones(vec![c], DType::F32, dev)?;
    let bn = fused_batch_norm();
    let kernels = bn.cuda_source(&[&x, &w, &b])?.2;
    let bwd_kernels = bn
        .cuda_backward_source(&[&x, &w, &b], 0)?
        .map(|s| s.2)
        .unwrap_or(0);
    type Call<'a> = Box<dyn Fn() -> Result<Tensor> + 'a>;
    type Variant<'a> = (&'static str, Call<'a>, Option<(usize, usize)>);
    let variants: Vec<Variant> = vec![
        (
            "fused",
            Box::new(|| bn.call1(&[&x, &w, &b])),
            Some((kernels, bwd_kernels)),
        ),
        ("unfused", Box::new(|| unfused_batch_norm(&x, &w, &b)), None),
        (
            "hand_written",
            Box::new(|| x.batch_norm(&w1, &b1, &rm, &rv, BatchNormConfig::default())),
            None,
        ),
    ];
    for (variant, f, k) in &variants {
        let (gpu_ms, ops, host_us, wall_ms) = measure(a, || {
            let _g = mixprec::no_grad();
            f().map(|_| ())
        })?;
        print(
            a,
            &shape,
            &Row {
                variant,
                pass: "forward",
                gpu_ms,
                ops,
                host_us,
                wall_ms,
                kernels: k.map(|k| k.0),
            },
        );
        let (gpu_ms, ops, host_us, wall_ms) = measure(a, || {
            for t in [&x, &w, &b] {
                t.zero_grad();
            }
            f()?.mul(&gy)?.sum_all()?.backward()
        })?;
        print(
            a,
            &shape,
            &Row {
                variant,
                pass: "forward_backward",
                gpu_ms,
                ops,
                host_us,
                wall_ms,
                kernels: k.map(|k| k.0 + k.1),
            },
        );
    }
    Ok(())
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    common::main_with(|| run(&args));
}
