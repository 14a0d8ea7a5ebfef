//! Parameter groups on the GPU: two AdamW and LAMB groups with their own lr and weight decay,
//! under a schedule that rescales each group, against the CPU (the reference).

use mixprec::optim::{
    AdamConfig, FusedAdam, FusedLamb, LambConfig, LrSchedule, Optimizer, ParamGroup,
};
use mixprec::{DType, Device, Tensor};

const SHAPES: [&[usize]; 4] = [&[300, 70], &[70], &[65_537], &[3]];

fn params(dev: Device) -> Vec<Tensor> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| {
            Tensor::randn(*s, 0.0, 1.0, 7 + i as u64, DType::F32, Device::Cpu)
                .unwrap()
                .to_device(dev)
                .unwrap()
                .to_variable()
        })
        .collect()
}

fn set_grads(ps: &[Tensor], t: u64) {
    for (i, p) in ps.iter().enumerate() {
        let g = Tensor::randn(
            p.dims(),
            0.0,
            1.0,
            100 * t + i as u64,
            DType::F32,
            Device::Cpu,
        )
        .unwrap()
        .to_device(p.device())
        .unwrap();
        p.set_grad(Some(g));
    }
}

/// Three steps of `make`'s optimizer over the same values on the CPU and the GPU, the
/// schedule applied before each; the largest relative difference.
fn cpu_against_gpu<O: Optimizer>(make: impl Fn(&[Tensor]) -> O) -> f64 {
    let gpu = Device::cuda(0).expect("this test needs a CUDA GPU");
    let sched = LrSchedule::Cosine {
        base: 0.05,
        min: 0.001,
        total: 3,
    };
    let run = |dev| {
        let ps = params(dev);
        let mut opt = make(&ps);
        for t in 0..3 {
            sched.apply(&mut opt, t).unwrap();
            set_grads(&ps, t);
            opt.step().unwrap();
        }
        assert_eq!(opt.base_lrs(), [0.05, 0.01]);
        ps.iter()
            .map(|p| p.to_device(Device::Cpu).unwrap().to_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    };
    let (c, g) = (run(Device::Cpu), run(gpu));
    let mut worst = 0.0f64;
    for (a, b) in c.iter().zip(&g) {
        for (x, y) in a.iter().zip(b) {
            let d = f64::from((x - y).abs()) / (1.0 + f64::from(x.abs()));
            worst = worst.max(d);
        }
    }
    worst
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_groups_on_the_gpu_match_the_cpu() {
    let worst = cpu_against_gpu(|ps| {
        FusedAdam::with_groups(vec![
            ParamGroup::new(
                ps[..2].to_vec(),
                AdamConfig {
                    lr: 0.05,
                    weight_decay: 0.1,
                    ..Default::default()
                },
            ),
            ParamGroup::new(
                ps[2..].to_vec(),
                AdamConfig {
                    lr: 0.01,
                    weight_decay: 0.0,
                    ..Default::default()
                },
            ),
        ])
        .unwrap()
    });
    assert!(worst < 1e-5, "largest relative difference {worst:e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn lamb_groups_on_the_gpu_match_the_cpu() {
    let worst = cpu_against_gpu(|ps| {
        FusedLamb::with_groups(vec![
            ParamGroup::new(
                ps[..2].to_vec(),
                LambConfig {
                    lr: 0.05,
                    weight_decay: 0.01,
                    max_grad_norm: 1.0,
                    ..Default::default()
                },
            ),
            ParamGroup::new(
                ps[2..].to_vec(),
                LambConfig {
                    lr: 0.01,
                    weight_decay: 0.0,
                    max_grad_norm: 1.0,
                    ..Default::default()
                },
            ),
        ])
        .unwrap()
    });
    assert!(worst < 1e-5, "largest relative difference {worst:e}");
}
