//! Per-op speed against PyTorch (issue 42's diagnostic): layer norm forward and
//! forward+backward at [16384, 768] and causal scaled-dot-product attention at
//! [16, 12, 1024, 64] (q, k, v views of [B, T, H, D] projections), in bf16 and f16; `benches/torch_op_speed.py` prints the same fields for
//! `F.layer_norm` / `F.scaled_dot_product_attention` and `benches/op_speed.sh` runs both and the
//! table. Exits quietly without a GPU.
//!
//! ```text
//! bench-op_speed [--dtypes bf16,f16] [--iters 50] [--warmup 10] [--small] [--profile]
//! ```
//!
//! Each row times `iters` back-to-back calls after `warmup` untimed ones, with a device
//! synchronisation per round (the median of 5 rounds, `common::time`). Forward+backward is
//! `(y·gy).sum()` then its backward, the input's gradient dropped before each call (PyTorch's
//! side does the same, so the seed's multiply and sum are in both). Layer norm runs twice: its
//! parameters in the input's dtype, and f32 (what O2 keeps, `keep_norm_fp32`). One JSON line a
//! row. `--profile` prints, after each forward+backward row, the per-op device times of ten more
//! calls (to stderr; what the row's time is spent on).

mod common;

use mixprec::tensor::SdpaOptions;
use mixprec::{DType, Device, Result, Tensor};

struct Args {
    dtypes: Vec<DType>,
    iters: usize,
    warmup: usize,
    small: bool,
    profile: bool,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut a = Args {
        dtypes: vec![DType::BF16, DType::F16],
        iters: 50,
        warmup: 10,
        small: false,
        profile: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--dtypes" => {
                a.dtypes = value()?
                    .split(',')
                    .map(|d| match d {
                        "bf16" => Ok(DType::BF16),
                        "f16" => Ok(DType::F16),
                        "f32" => Ok(DType::F32),
                        other => Err(format!("unknown dtype {other} (bf16, f16 or f32)")),
                    })
                    .collect::<std::result::Result<_, _>>()?
            }
            "--iters" => a.iters = value()?.parse().map_err(|_| "--iters needs a number")?,
            "--warmup" => a.warmup = value()?.parse().map_err(|_| "--warmup needs a number")?,
            "--small" => a.small = true,
            "--profile" => a.profile = true,
            "--bench" => {}
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    Ok(a)
}

/// With `--profile`: ten more calls of `f` with per-op timing on, the op table to stderr.
fn profile(a: &Args, what: &str, mut f: impl FnMut() -> Result<()>) -> Result<()> {
    if !a.profile {
        return Ok(());
    }
    use mixprec::backend::cuda;
    cuda::set_op_profiling(true);
    for _ in 0..10 {
        f()?;
    }
    cuda::set_op_profiling(false);
    eprintln!("{what}: device ms per call by op (10 calls)");
    for r in cuda::op_profile()? {
        eprintln!(
            "  {:<24} {:>5}x {:>8.4} ms  {}",
            r.op,
            r.calls / 10,
            r.total_ms / 10.0,
            r.detail.chars().take(90).collect::<String>()
        );
    }
    Ok(())
}

fn name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}

/// `(y·gy).sum()` backward, `x`'s gradients dropped first.
fn backward(y: &Tensor, gy: &Tensor) -> Result<()> {
    y.mul(gy)?.sum_all()?.backward()
}

fn row(op: &str, dt: DType, shape: &[usize], fwd: f64, fwd_bwd: f64, extra: &str) {
    println!(
        "{{\"side\": \"mixprec\", \"op\": \"{op}\", \"dtype\": \"{}\", \"shape\": {shape:?}, \
         \"fwd_ms\": {:.4}, \"fwd_bwd_ms\": {:.4}{extra}}}",
        name(dt),
        fwd * 1e3,
        fwd_bwd * 1e3
    );
}

fn layer_norm(a: &Args, dt: DType, param_dt: DType, dev: Device) -> Result<()> {
    let (rows, c) = if a.small { (256, 768) } else { (16384, 768) };
    let x = Tensor::randn(vec![rows, c], 0.0, 1.0, 1, dt, dev)?.to_variable();
    let gy = Tensor::randn(vec![rows, c], 0.0, 1.0, 2, dt, dev)?;
    let w = Tensor::randn(vec![c], 1.0, 0.1, 3, param_dt, dev)?.to_variable();
    let b = Tensor::randn(vec![c], 0.0, 0.1, 4, param_dt, dev)?.to_variable();
    let fwd = common::time(a.warmup, a.iters, || {
        let _g = mixprec::no_grad();
        x.layer_norm(&[c], Some(&w), Some(&b), 1e-5).map(|_| ())
    })?;
    let fwd_bwd = common::time(a.warmup, a.iters, || {
        for t in [&x, &w, &b] {
            t.zero_grad();
        }
        let y = x.layer_norm(&[c], Some(&w), Some(&b), 1e-5)?;
        backward(&y, &gy)
    })?;
    let op = if param_dt == dt {
        "layer_norm"
    } else {
        "layer_norm_f32_params"
    };
    row(op, dt, &[rows, c], fwd, fwd_bwd, "");
    Ok(())
}

fn sdpa(a: &Args, dt: DType, dev: Device) -> Result<()> {
    let shape = if a.small {
        vec![2, 12, 256, 64]
    } else {
        vec![16, 12, 1024, 64]
    };
    // q, k and v as a model holds them: [B, T, H, D] projections seen as [B, H, T, D] (PyTorch's
    // side the same), so neither side's gradients need a change of layout.
    let bthd = vec![shape[0], shape[2], shape[1], shape[3]];
    let input = |seed| -> Result<Tensor> {
        Ok(Tensor::randn(bthd.clone(), 0.0, 1.0, seed, dt, dev)?
            .permute(&[0, 2, 1, 3])?
            .to_variable())
    };
    let (q, k, v) = (input(1)?, input(2)?, input(3)?);
    let gy = Tensor::randn(shape.clone(), 0.0, 1.0, 4, dt, dev)?;
    let opts = SdpaOptions {
        causal: true,
        ..Default::default()
    };
    let path = q.attention_path(&k, &v, &opts);
    let fwd = common::time(a.warmup, a.iters, || {
        let _g = mixprec::no_grad();
        q.scaled_dot_product_attention(&k, &v, &opts).map(|_| ())
    })?;
    let step = || {
        for t in [&q, &k, &v] {
            t.zero_grad();
        }
        let y = q.scaled_dot_product_attention(&k, &v, &opts)?;
        backward(&y, &gy)
    };
    let fwd_bwd = common::time(a.warmup, a.iters, step)?;
    profile(
        a,
        &format!("sdpa_causal {} forward+backward", name(dt)),
        step,
    )?;
    row(
        "sdpa_causal",
        dt,
        &shape,
        fwd,
        fwd_bwd,
        &format!(", \"path\": \"{path:?}\""),
    );
    Ok(())
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("op_speed: {e}");
            std::process::exit(2);
        }
    };
    common::main_with(|| {
        let dev = Device::cuda(0)?;
        for &dt in &args.dtypes {
            layer_norm(&args, dt, dt, dev)?;
            if dt != DType::F32 {
                layer_norm(&args, dt, DType::F32, dev)?;
            }
            sdpa(&args, dt, dev)?;
        }
        Ok(())
    })
}
