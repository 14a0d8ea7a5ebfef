//! GPU benchmark (exits quietly without a GPU): fused AdamW, fused SGD (momentum) and unscale
//! (overflow check + scale in one pass) over 100M FP32 parameters in 200 tensors, then the same
//! with F16 gradients and FP32 masters writing the F16 model copy. Median time per step (rounds
//! of back-to-back steps, one synchronisation per round), effective bandwidth (the bytes each
//! step must move: every operand read once, every output written once) and its fraction of the
//! device-to-device copy bandwidth measured in the same run. PyTorch's numbers come from
//! `python3 benches/anchors/torch_anchor.py` (fused AdamW / SGD, `_amp_foreach_non_finite_check_and_unscale_`).

mod common;

use common::{copy_bandwidth, time};
use mixprec::backend::cuda::{device, CudaStorage};
use mixprec::optim::{AdamConfig, FusedAdam, FusedSgd, GradScaling, Optimizer, SgdConfig};
use mixprec::{multi_tensor, DType, Device, Tensor};

const N: usize = 100_000_000;
const TENSORS: usize = 200;

fn main() {
    common::main_with(run)
}

fn list(dt: DType, v: f64, variable: bool) -> mixprec::Result<Vec<Tensor>> {
    let dev = Device::Cuda(0);
    (0..TENSORS)
        .map(|_| {
            let t = Tensor::full([N / TENSORS], v, dt, dev)?;
            Ok(if variable { t.to_variable() } else { t })
        })
        .collect()
}

/// The AdamW of every row: weight decay 0.01, the rest default.
fn adamw(ps: &[Tensor]) -> mixprec::Result<FusedAdam> {
    FusedAdam::new(
        ps.to_vec(),
        AdamConfig {
            weight_decay: 0.01,
            ..Default::default()
        },
    )
}

/// The SGD of every row: lr 1e-3, momentum 0.9.
fn sgd_momentum(ps: &[Tensor]) -> mixprec::Result<FusedSgd> {
    FusedSgd::new(
        ps.to_vec(),
        SgdConfig {
            lr: 1e-3,
            momentum: 0.9,
            ..Default::default()
        },
    )
}

fn run() -> mixprec::Result<()> {
    let dev = device(0)?;
    let (ma, mi) = dev.compute_capability();
    println!("device cuda:0 sm_{ma}{mi}; {N} parameters in {TENSORS} tensors");
    let copy_n = 1usize << 28;
    let src = CudaStorage::full(0, DType::F32, copy_n, 1.0)?;
    let (_, copy_bw) = copy_bandwidth(&src)?;
    drop(src);
    println!("d2d copy: {:.1} GB/s", copy_bw / 1e9);
    println!("{:<44} {:>9} {:>10} {:>8}", "step", "ms", "GB/s", "vs copy");
    let row = |name: &str, t: f64, bytes_per_param: usize| {
        let bw = (bytes_per_param * N) as f64 / t;
        println!(
            "{name:<44} {:>9.3} {:>10.1} {:>8.3}",
            t * 1e3,
            bw / 1e9,
            bw / copy_bw
        );
    };
    let dev0 = Device::Cuda(0);
    let found = Tensor::scalar(0.0, DType::F32, dev0)?;
    let inv = Tensor::scalar(1.0 / 65536.0, DType::F32, dev0)?;
    let one = Tensor::scalar(1.0, DType::F32, dev0)?;
    let scaling = GradScaling {
        grad_multiplier: &one,
        found_inf: &found,
    };

    // FP32 parameters and gradients.
    {
        let ps = list(DType::F32, 0.5, true)?;
        for p in &ps {
            p.set_grad(Some(Tensor::full(
                p.dims().to_vec(),
                1e-3,
                DType::F32,
                dev0,
            )?));
        }
        let mut adam = adamw(&ps)?;
        let t = time(3, 10, || adam.step_scaled(Some(scaling)))?;
        row("FusedAdamW fp32 (g,p,m,v → p,m,v)", t, 28);
        drop(adam);
        let mut sgd = sgd_momentum(&ps)?;
        let t = time(3, 10, || sgd.step_scaled(Some(scaling)))?;
        row("FusedSgd momentum fp32 (g,p,m → p,m)", t, 20);
        drop(sgd);
        let gs: Vec<Tensor> = ps.iter().filter_map(|p| p.grad()).collect();
        let t = time(3, 20, || multi_tensor::scale(&gs, &gs, &one, &found))?;
        row("unscale fp32 in place (check + scale)", t, 8);
        let t = time(3, 20, || multi_tensor::non_finite_check(&gs, &found))?;
        row("non_finite_check fp32", t, 4);
    }
    // F16 gradients, FP32 masters, F16 model copy written in the same pass.
    {
        let ps = list(DType::F32, 0.5, true)?;
        let mut adam = adamw(&ps)?;
        adam.use_master_weights()?;
        for p in &ps {
            p.cast_in_place(DType::F16)?;
            p.set_grad(Some(Tensor::full(
                p.dims().to_vec(),
                1e-3 * 65536.0,
                DType::F16,
                dev0,
            )?));
        }
        let half_scaling = GradScaling {
            grad_multiplier: &inv,
            found_inf: &found,
        };
        let t = time(3, 10, || adam.step_scaled(Some(half_scaling)))?;
        row(
            "FusedAdamW f16 grads + masters + f16 copy",
            t,
            2 + 12 + 12 + 2,
        );
        drop(adam);
        let mut sgd = sgd_momentum(&ps)?;
        // Masters from the (now f16) params: benchmark only.
        sgd.use_master_weights()?;
        let t = time(3, 10, || sgd.step_scaled(Some(half_scaling)))?;
        row("FusedSgd f16 grads + masters + f16 copy", t, 2 + 8 + 8 + 2);
        drop(sgd);
        let gs: Vec<Tensor> = ps.iter().filter_map(|p| p.grad()).collect();
        let out = list(DType::F32, 0.0, false)?;
        let t = time(3, 20, || multi_tensor::scale(&gs, &out, &inv, &found))?;
        row("unscale f16 → fp32 master grads", t, 6);
    }
    Ok(())
}
