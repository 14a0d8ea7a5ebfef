//! Shared by tests/fused_optim.rs, tests/multi_tensor.rs and tests/cuda.rs: F64 reference
//! implementations of the fused optimizers' formulas and a harness that runs an optimizer and its
//! reference side by side on any device.
#![allow(dead_code, clippy::needless_range_loop, clippy::too_many_arguments)]

use mixprec::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedNovoGrad, FusedSgd, GradScaling, LambConfig,
    NovoGradConfig, NovoGradNorm, Optimizer, OptimizerState, SgdConfig,
};
use mixprec::{multi_tensor, DType, Device, Tensor};

/// A fast deterministic pseudo-normal-ish value in [-2, 2) (sum of two uniforms), per index/seed.
pub fn val(seed: u64, i: u64) -> f32 {
    let mut x = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(i.wrapping_mul(0xbf58_476d_1ce4_e5b9));
    x ^= x >> 31;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 29;
    let a = (x >> 40) as f32 / (1u64 << 24) as f32;
    let b = ((x >> 16) & 0xff_ffff) as f32 / (1u64 << 24) as f32;
    2.0 * (a + b - 1.0)
}

pub fn values(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64).map(|i| val(seed, i)).collect()
}

pub fn tensor(seed: u64, dims: &[usize], dt: DType, dev: Device) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(values(seed, n), dims.to_vec(), dev)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

pub fn round_to(dt: DType, v: f64) -> f64 {
    match dt {
        DType::F16 => half::f16::from_f32(v as f32).to_f64(),
        DType::BF16 => half::bf16::from_f32(v as f32).to_f64(),
        DType::F32 => v as f32 as f64,
        _ => v,
    }
}

#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Sgd(SgdConfig),
    Adam(AdamConfig),
    Lamb(LambConfig),
    Novo(NovoGradConfig),
}

impl Kind {
    pub fn make(&self, params: Vec<Tensor>) -> Box<dyn Optimizer> {
        match *self {
            Kind::Sgd(c) => Box::new(FusedSgd::new(params, c).unwrap()),
            Kind::Adam(c) => Box::new(FusedAdam::new(params, c).unwrap()),
            Kind::Lamb(c) => Box::new(FusedLamb::new(params, c).unwrap()),
            Kind::Novo(c) => Box::new(FusedNovoGrad::new(params, c).unwrap()),
        }
    }
}

/// The F64 reference state.
pub struct Ref {
    pub p: Vec<Vec<f64>>,
    pub m: Vec<Vec<f64>>,
    pub v: Vec<Vec<f64>>,
    pub vmax: Vec<Vec<f64>>,
    pub nv: Vec<f64>,
    pub step: u64,
}

impl Ref {
    pub fn new(p: Vec<Vec<f64>>) -> Ref {
        let z: Vec<Vec<f64>> = p.iter().map(|t| vec![0.0; t.len()]).collect();
        Ref {
            m: z.clone(),
            v: z.clone(),
            vmax: z,
            nv: vec![0.0; p.len()],
            p,
            step: 0,
        }
    }

    /// One step of `kind` with gradients `g` (already unscaled).
    pub fn step(&mut self, kind: &Kind, g: &[Vec<f64>]) {
        let t = (self.step + 1) as f64;
        match *kind {
            Kind::Sgd(c) => {
                for (k, gt) in g.iter().enumerate() {
                    for i in 0..gt.len() {
                        let w = self.p[k][i];
                        let mut gv = gt[i];
                        if c.weight_decay != 0.0 && !c.wd_after_momentum {
                            gv += c.weight_decay * w;
                        }
                        if c.momentum != 0.0 {
                            let m = if self.step == 0 {
                                gv
                            } else {
                                c.momentum * self.m[k][i] + (1.0 - c.dampening) * gv
                            };
                            self.m[k][i] = m;
                            gv = if c.nesterov { gv + c.momentum * m } else { m };
                        }
                        if c.weight_decay != 0.0 && c.wd_after_momentum {
                            gv += c.weight_decay * w;
                        }
                        self.p[k][i] = w - c.lr * gv;
                    }
                }
            }
            Kind::Adam(c) => {
                let (b1, b2) = c.betas;
                let bc1 = if c.bias_correction {
                    1.0 - b1.powf(t)
                } else {
                    1.0
                };
                let bc2 = if c.bias_correction {
                    1.0 - b2.powf(t)
                } else {
                    1.0
                };
                for (k, gt) in g.iter().enumerate() {
                    for i in 0..gt.len() {
                        let mut w = self.p[k][i];
                        let mut gv = gt[i];
                        if !c.adam_w_mode {
                            gv += c.weight_decay * w;
                        }
                        let m = b1 * self.m[k][i] + (1.0 - b1) * gv;
                        let v = b2 * self.v[k][i] + (1.0 - b2) * gv * gv;
                        self.m[k][i] = m;
                        self.v[k][i] = v;
                        let mut vd = v;
                        if c.amsgrad {
                            self.vmax[k][i] = self.vmax[k][i].max(v);
                            vd = self.vmax[k][i];
                        }
                        if c.adam_w_mode {
                            w -= c.lr * c.weight_decay * w;
                        }
                        self.p[k][i] = w - c.lr / bc1 * m / (vd.sqrt() / bc2.sqrt() + c.eps);
                    }
                }
            }
            Kind::Lamb(c) => {
                let (b1, b2) = c.betas;
                let b3 = if c.grad_averaging { 1.0 - b1 } else { 1.0 };
                let bc1 = if c.bias_correction {
                    1.0 - b1.powf(t)
                } else {
                    1.0
                };
                let bc2 = if c.bias_correction {
                    1.0 - b2.powf(t)
                } else {
                    1.0
                };
                let gn = g.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
                let clip = if c.max_grad_norm > 0.0 && gn > c.max_grad_norm {
                    gn / c.max_grad_norm
                } else {
                    1.0
                };
                for (k, gt) in g.iter().enumerate() {
                    let mut u = vec![0.0; gt.len()];
                    for i in 0..gt.len() {
                        let gv = gt[i] / clip;
                        let m = b1 * self.m[k][i] + b3 * gv;
                        let v = b2 * self.v[k][i] + (1.0 - b2) * gv * gv;
                        self.m[k][i] = m;
                        self.v[k][i] = v;
                        u[i] =
                            (m / bc1) / ((v / bc2).sqrt() + c.eps) + c.weight_decay * self.p[k][i];
                    }
                    let pn = self.p[k].iter().map(|x| x * x).sum::<f64>().sqrt();
                    let un = u.iter().map(|x| x * x).sum::<f64>().sqrt();
                    let ratio = if (c.use_nvlamb || c.weight_decay != 0.0) && pn != 0.0 && un != 0.0
                    {
                        pn / un
                    } else {
                        1.0
                    };
                    for i in 0..gt.len() {
                        self.p[k][i] -= c.lr * ratio * u[i];
                    }
                }
            }
            Kind::Novo(c) => {
                let (b1, b2) = c.betas;
                let b3 = if c.grad_averaging { 1.0 - b1 } else { 1.0 };
                let bc1 = if c.bias_correction {
                    1.0 - b1.powf(t)
                } else {
                    1.0
                };
                let bc2 = if c.bias_correction {
                    1.0 - b2.powf(t)
                } else {
                    1.0
                };
                for (k, gt) in g.iter().enumerate() {
                    let n = match c.norm_type {
                        NovoGradNorm::L2 => gt.iter().map(|x| x * x).sum::<f64>().sqrt(),
                        NovoGradNorm::Inf => gt.iter().fold(0.0f64, |a, x| a.max(x.abs())),
                    };
                    self.nv[k] = if self.step == 0 {
                        n * n
                    } else {
                        b2 * self.nv[k] + (1.0 - b2) * n * n
                    };
                    let denom = (self.nv[k] / bc2).sqrt() + c.eps;
                    for i in 0..gt.len() {
                        let w = self.p[k][i];
                        if c.reg_inside_moment {
                            let m = b1 * self.m[k][i] + b3 * (gt[i] / denom + c.weight_decay * w);
                            self.m[k][i] = m;
                            self.p[k][i] = w - c.lr * m / bc1;
                        } else {
                            let m = b1 * self.m[k][i] + b3 * gt[i];
                            self.m[k][i] = m;
                            self.p[k][i] = w - c.lr * ((m / bc1) / denom + c.weight_decay * w);
                        }
                    }
                }
            }
        }
        self.step += 1;
    }
}

pub fn tol(dt: DType) -> (f64, f64) {
    match dt {
        DType::F32 => (2e-5, 2e-5),
        DType::F16 => (4e-3, 4e-3),
        _ => (3e-2, 3e-2),
    }
}

pub fn assert_close(what: &str, got: &[f64], want: &[f64], (atol, rtol): (f64, f64)) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = (0.0, 0usize);
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let err = (a - b).abs() - (atol + rtol * b.abs());
        if err > worst.0 || err.is_nan() {
            worst = (err, i);
        }
        if a.is_nan() {
            panic!("{what}: NaN at {i} (want {b})");
        }
    }
    assert!(
        worst.0 <= 0.0,
        "{what}: element {} is {} (want {}), beyond atol {atol} + rtol {rtol}",
        worst.1,
        got[worst.1],
        want[worst.1]
    );
}

/// Runs `kind` over `steps` steps on params of `dims` in `dt` (with FP32 masters when
/// `masters`), against the F64 reference. Gradients are drawn in `dt`; with `scaled`, they are
/// multiplied by 1024 and the step gets grad_multiplier 1/1024 (exact in binary floats).
pub fn run_case(
    kind: Kind,
    dims: &[Vec<usize>],
    dt: DType,
    masters: bool,
    steps: u64,
    dev: Device,
    scaled: bool,
) {
    let what = format!("{kind:?} {dt} masters={masters} dims={dims:?} on {dev}");
    let init_dt = if masters { DType::F32 } else { dt };
    let params: Vec<Tensor> = dims
        .iter()
        .enumerate()
        .map(|(k, d)| tensor(1000 + k as u64, d, init_dt, dev).to_variable())
        .collect();
    let mut opt = kind.make(params.clone());
    if masters {
        opt.use_master_weights().unwrap();
        for p in &params {
            p.cast_in_place(dt).unwrap();
        }
    }
    let mut r = Ref::new(params.iter().map(|p| p.to_vec_f64().unwrap()).collect());
    if masters {
        // The masters were made from the F32 values before the cast.
        r.p = opt
            .master_params()
            .iter()
            .map(|p| p.to_vec_f64().unwrap())
            .collect();
    }
    let mult = Tensor::scalar(1.0 / 1024.0, DType::F32, dev).unwrap();
    let found = Tensor::scalar(0.0, DType::F32, dev).unwrap();
    for s in 0..steps {
        let mut grads = Vec::new();
        for (k, p) in params.iter().enumerate() {
            let g = tensor(7 * s + 31 * k as u64 + 5, p.dims(), dt, dev);
            grads.push(g.to_vec_f64().unwrap());
            let g = if scaled {
                g.mul_scalar(1024.0).unwrap()
            } else {
                g
            };
            p.set_grad(Some(g));
        }
        if scaled {
            opt.step_scaled(Some(GradScaling {
                grad_multiplier: &mult,
                found_inf: &found,
            }))
            .unwrap();
        } else {
            opt.step().unwrap();
        }
        r.step(&kind, &grads);
        if !masters && dt != DType::F32 {
            for t in &mut r.p {
                for x in t.iter_mut() {
                    *x = round_to(dt, *x);
                }
            }
        }
    }
    let tl = if masters { tol(DType::F32) } else { tol(dt) };
    let got: Vec<Vec<f64>> = opt
        .master_params()
        .iter()
        .map(|p| p.to_vec_f64().unwrap())
        .collect();
    for (k, (g, w)) in got.iter().zip(&r.p).enumerate() {
        assert_close(&format!("{what}: param {k}"), g, w, tl);
    }
    if masters {
        for (k, (p, m)) in params.iter().zip(opt.master_params()).enumerate() {
            assert_eq!(p.dtype(), dt);
            let want = m.to_dtype(dt).unwrap().to_vec_f64().unwrap();
            assert_eq!(
                p.to_vec_f64().unwrap(),
                want,
                "{what}: param {k} is the rounded master"
            );
        }
    }
}

/// Every tensor of a state (and the parameters), as host vectors, for bitwise comparisons.
pub fn snapshot(opt: &dyn Optimizer, params: &[Tensor]) -> Vec<(String, Vec<f64>)> {
    let st: OptimizerState = opt.state_dict().unwrap();
    let mut out = Vec::new();
    for (pos, m) in &st.state {
        for (k, t) in m {
            out.push((format!("state {pos} {k}"), t.to_vec_f64().unwrap()));
        }
    }
    for (i, p) in params.iter().enumerate() {
        out.push((format!("param {i}"), p.to_vec_f64().unwrap()));
    }
    for (i, p) in opt.master_params().iter().enumerate() {
        out.push((format!("master {i}"), p.to_vec_f64().unwrap()));
    }
    out
}

/// Two clean steps, then a gradient with `bad` planted at `at` (first/middle/last element of the
/// list), unscaled by multi_tensor::scale as AMP does: the step must change nothing, bitwise.
pub fn check_skip(kind: Kind, dt: DType, masters: bool, bad: f32, at: usize, dev: Device) {
    let dims = [vec![3, 5], vec![70_000], vec![1], vec![17]];
    let init_dt = if masters { DType::F32 } else { dt };
    let params: Vec<Tensor> = dims
        .iter()
        .enumerate()
        .map(|(k, d)| tensor(50 + k as u64, d, init_dt, dev).to_variable())
        .collect();
    let mut opt = kind.make(params.clone());
    if masters {
        opt.use_master_weights().unwrap();
        for p in &params {
            p.cast_in_place(dt).unwrap();
        }
    }
    let inv = Tensor::scalar(0.5, DType::F32, dev).unwrap();
    let found = Tensor::scalar(0.0, DType::F32, dev).unwrap();
    for s in 0..3u64 {
        let grads: Vec<Tensor> = params
            .iter()
            .enumerate()
            .map(|(k, p)| tensor(900 + 10 * s + k as u64, p.dims(), dt, dev))
            .collect();
        if s == 2 {
            // Plant: 0 → first element of the first tensor, 1 → middle of the list, 2 → last.
            let (k, i) = match at {
                0 => (0, 0),
                1 => (1, 35_000),
                _ => (3, 16),
            };
            let mut v = grads[k].to_vec_f64().unwrap();
            v[i] = bad as f64;
            let t = Tensor::from_vec(v, grads[k].dims().to_vec(), dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let grads2: Vec<Tensor> = grads
                .iter()
                .enumerate()
                .map(|(j, g)| if j == k { t.clone() } else { g.clone() })
                .collect();
            for (p, g) in params.iter().zip(&grads2) {
                p.set_grad(Some(g.clone()));
            }
        } else {
            for (p, g) in params.iter().zip(&grads) {
                p.set_grad(Some(g.clone()));
            }
        }
        let gl: Vec<Tensor> = params.iter().map(|p| p.grad().unwrap()).collect();
        multi_tensor::scale(&gl, &gl, &inv, &found).unwrap();
        let before = snapshot(opt.as_ref(), &params);
        opt.step_scaled(Some(GradScaling {
            grad_multiplier: &Tensor::scalar(1.0, DType::F32, dev).unwrap(),
            found_inf: &found,
        }))
        .unwrap();
        let after = snapshot(opt.as_ref(), &params);
        let f = found.item().unwrap();
        if s == 2 {
            assert_eq!(f, 1.0, "{kind:?}: planted {bad} at {at} not found");
            assert_eq!(before.len(), after.len());
            for ((n, a), (_, b)) in before.iter().zip(&after) {
                let (a, b): (Vec<u64>, Vec<u64>) = (
                    a.iter().map(|x| x.to_bits()).collect(),
                    b.iter().map(|x| x.to_bits()).collect(),
                );
                assert!(
                    a == b,
                    "{kind:?} {dt} masters={masters}: `{n}` changed on a skipped step"
                );
            }
        } else {
            assert_eq!(f, 0.0);
            assert_ne!(before, after, "{kind:?}: a clean step changed nothing");
        }
    }
}
