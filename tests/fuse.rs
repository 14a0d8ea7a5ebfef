//! `mixprec::fuse` on the CPU (the reference interpreter): random programs against the same
//! unfused ops, values and gradients, f32/f16/bf16; finite differences in f64; broadcasting,
//! signatures and errors.

mod fuse_support;

use fuse_support::{inputs, max_rel_diff, program, trace, unfused, Program, Rng};
use mixprec::fuse::Fused;
use mixprec::{fuse, DType, Device, Tensor};

fn fused_of(p: &Program) -> Fused {
    let outs = p.outputs.clone();
    fuse("random", move |f, x| {
        outs.iter().map(|e| trace(f, x, e)).collect()
    })
}

/// `sum(y · w)` over the outputs, `w` fixed random weights (unfused ops).
fn loss(ys: &[Tensor], seed: u64) -> Tensor {
    let mut total: Option<Tensor> = None;
    for (k, y) in ys.iter().enumerate() {
        let w = Tensor::randn(
            y.dims().to_vec(),
            0.0,
            1.0,
            seed + 100 + k as u64,
            DType::F32,
            Device::Cpu,
        )
        .unwrap()
        .to_dtype(y.dtype())
        .unwrap();
        let l = y
            .mul(&w)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        total = Some(match total {
            Some(t) => t.add(&l).unwrap(),
            None => l,
        });
    }
    total.unwrap()
}

/// Fused against unfused: values, then gradients (`tol` relative to max(|y|, 1)).
fn check(p: &Program, seed: u64, dtype: DType, tol: f64) {
    let f = fused_of(p);
    let xs = inputs(p, seed, dtype, Device::Cpu).unwrap();
    let vars: Vec<Tensor> = xs.iter().map(|x| x.to_variable()).collect();
    for v in &vars {
        v.set_requires_grad(true);
    }
    let refs: Vec<&Tensor> = vars.iter().collect();
    let ys = f.call(&refs).unwrap();
    // The unfused chain in f32 on the same values: the reference for every dtype (half
    // chains round at every op, the fused one only where it stores).
    let wide: Vec<Tensor> = xs
        .iter()
        .map(|x| x.to_dtype(DType::F32).unwrap().to_variable())
        .collect();
    for w in &wide {
        w.set_requires_grad(true);
    }
    let zs: Vec<Tensor> = p
        .outputs
        .iter()
        .map(|e| unfused(&wide, e).unwrap())
        .collect();
    for (k, (y, z)) in ys.iter().zip(&zs).enumerate() {
        assert_eq!(y.dims(), z.dims(), "output {k} of {p:?}");
        // The output has the unfused chain's dtype.
        let same = {
            let _g = mixprec::no_grad();
            unfused(&xs, &p.outputs[k]).unwrap().dtype()
        };
        assert_eq!(y.dtype(), same, "output {k} dtype of {p:?}");
        let d = max_rel_diff(y, z);
        assert!(d <= tol, "output {k}: {d} > {tol} for {p:?} ({dtype})");
    }
    loss(&ys, seed).backward().unwrap();
    loss(&zs, seed).backward().unwrap();
    for (i, (v, w)) in vars.iter().zip(&wide).enumerate() {
        match (v.grad(), w.grad()) {
            (Some(gv), Some(gw)) => {
                assert_eq!(gv.dtype(), dtype);
                assert_eq!(gv.dims(), v.dims());
                let d = max_rel_diff(&gv, &gw);
                assert!(d <= tol * 10.0, "grad {i}: {d} for {p:?} ({dtype})");
            }
            (None, Some(gw)) => {
                // An input the fused graph does not reach has no gradient; the unfused one
                // can only have zeros there.
                assert!(
                    gw.to_vec_f64().unwrap().iter().all(|&x| x == 0.0),
                    "grad {i}: {p:?}"
                );
            }
            (None, None) => {}
            (gv, gw) => panic!(
                "grad {i}: fused {:?} unfused {:?} for {p:?}",
                gv.is_some(),
                gw.is_some()
            ),
        }
    }
}

#[test]
fn random_programs_match_the_unfused_ops_in_f32() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for case in 0..60 {
        let sizes = [2 + rng.below(3), 2 + rng.below(3), 2 + rng.below(4)];
        let p = program(&mut rng, 1 + case % 4, sizes);
        check(&p, case as u64, DType::F32, 2e-4);
    }
}

#[test]
fn random_programs_in_half_types_compute_in_f32() {
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    for case in 0..40 {
        let sizes = [2 + rng.below(3), 2 + rng.below(3), 2 + rng.below(3)];
        let p = program(&mut rng, 1 + case % 3, sizes);
        let (dtype, tol) = if case % 2 == 0 {
            (DType::F16, 4e-3)
        } else {
            (DType::BF16, 2e-2)
        };
        check(&p, 1000 + case as u64, dtype, tol);
    }
}

/// The fused gradient against central finite differences of the fused function, in f64.
#[test]
fn gradients_match_finite_differences_in_f64() {
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    for case in 0..12 {
        let p = program(&mut rng, 2, [2, 3, 2]);
        let f = fused_of(&p);
        let xs = inputs(&p, 50 + case, DType::F64, Device::Cpu).unwrap();
        let vars: Vec<Tensor> = xs.iter().map(|x| x.to_variable()).collect();
        for v in &vars {
            v.set_requires_grad(true);
        }
        let refs: Vec<&Tensor> = vars.iter().collect();
        let l = loss(&f.call(&refs).unwrap(), case);
        l.backward().unwrap();
        let eval = |vals: &[Vec<f64>]| -> f64 {
            let _g = mixprec::no_grad();
            let ts: Vec<Tensor> = vals
                .iter()
                .zip(&p.shapes)
                .map(|(v, s)| Tensor::from_vec(v.clone(), s.clone(), Device::Cpu).unwrap())
                .collect();
            let r: Vec<&Tensor> = ts.iter().collect();
            loss(&f.call(&r).unwrap(), case).item().unwrap()
        };
        let base: Vec<Vec<f64>> = xs.iter().map(|x| x.to_vec_f64().unwrap()).collect();
        for (i, v) in vars.iter().enumerate() {
            let g = v.grad().map(|g| g.to_vec_f64().unwrap());
            for j in 0..base[i].len() {
                let h = 1e-6;
                let mut up = base.clone();
                up[i][j] += h;
                let mut dn = base.clone();
                dn[i][j] -= h;
                let num = (eval(&up) - eval(&dn)) / (2.0 * h);
                let ana = g.as_ref().map_or(0.0, |g| g[j]);
                assert!(
                    (num - ana).abs() <= 1e-4 * num.abs().max(1.0),
                    "input {i} elem {j}: numeric {num} analytic {ana} for {p:?}"
                );
            }
        }
    }
}

#[test]
fn batch_norm_written_with_fuse_matches_the_unfused_math() {
    let bn = fuse("batch_norm", |f, x| {
        let axes = [0, 2, 3];
        let mean = f.mean(x[0], &axes);
        let var = f.var(x[0], &axes);
        let inv = f.rsqrt(f.add_scalar(var, 1e-5));
        let xhat = f.mul(f.sub(x[0], mean), inv);
        vec![f.add(f.mul(xhat, x[1]), x[2]), mean, var]
    });
    let dev = Device::Cpu;
    let x = Tensor::randn(vec![3, 4, 5, 6], 0.5, 2.0, 1, DType::F32, dev).unwrap();
    let w = Tensor::randn(vec![4, 1, 1], 1.0, 0.1, 2, DType::F32, dev).unwrap();
    let b = Tensor::randn(vec![4, 1, 1], 0.0, 0.1, 3, DType::F32, dev).unwrap();
    let g = bn.graph(&[&x, &w, &b]).unwrap();
    assert_eq!(g.reductions(), 2, "the mean and the variance's sum");
    let out = bn.call(&[&x, &w, &b]).unwrap();
    assert_eq!(out[0].dims(), &[3, 4, 5, 6]);
    assert_eq!(out[1].dims(), &[1, 4, 1, 1]);
    let mean = x
        .sum_dims(&[0, 2, 3], true)
        .unwrap()
        .mul_scalar(1.0 / 90.0)
        .unwrap();
    let d = x.sub(&mean).unwrap();
    let var = d
        .sqr()
        .unwrap()
        .sum_dims(&[0, 2, 3], true)
        .unwrap()
        .mul_scalar(1.0 / 90.0)
        .unwrap();
    let y = d
        .div(&var.add_scalar(1e-5).unwrap().sqrt().unwrap())
        .unwrap()
        .mul(&w)
        .unwrap()
        .add(&b)
        .unwrap();
    assert!(max_rel_diff(&out[0], &y) < 1e-5);
    assert!(max_rel_diff(&out[1], &mean) < 1e-6);
    assert!(max_rel_diff(&out[2], &var) < 1e-5);
}

#[test]
fn one_trace_per_signature_and_sizes_are_symbolic() {
    let f = fuse("axpb", |f, x| vec![f.add(f.mul_scalar(x[0], 2.0), x[1])]);
    let dev = Device::Cpu;
    for n in [3, 5, 8] {
        let a = Tensor::randn(vec![n, 4], 0.0, 1.0, 1, DType::F32, dev).unwrap();
        let b = Tensor::randn(vec![4], 0.0, 1.0, 2, DType::F32, dev).unwrap();
        let y = f.call1(&[&a, &b]).unwrap();
        let z = a.mul_scalar(2.0).unwrap().add(&b).unwrap();
        assert_eq!(y.to_vec_f32().unwrap(), z.to_vec_f32().unwrap());
    }
    assert_eq!(f.traces(), 1, "a new batch size is the same signature");
    // A broadcast dim (size 1) is a new signature; so is a dtype.
    let a = Tensor::randn(vec![1, 4], 0.0, 1.0, 1, DType::F32, dev).unwrap();
    let b = Tensor::randn(vec![4], 0.0, 1.0, 2, DType::F32, dev).unwrap();
    f.call1(&[&a, &b]).unwrap();
    f.call1(&[&a.to_dtype(DType::F16).unwrap(), &b]).unwrap();
    assert_eq!(f.traces(), 3);
}

#[test]
fn elementwise_primitives_match_their_definitions() {
    let f = fuse("prims", |f, x| {
        let a = x[0];
        let zero = f.scalar(0.0);
        vec![
            f.tanh(a),
            f.erf(a),
            f.sigmoid(a),
            f.rsqrt(f.add_scalar(f.abs(a), 1.0)),
            f.recip(f.add_scalar(f.abs(a), 1.0)),
            f.select(f.gt(a, zero), a, f.mul_scalar(a, 0.1)),
            f.cast(a, DType::F16),
            f.sin(a),
            f.cos(a),
            f.ne(a, zero),
        ]
    });
    let x = Tensor::from_vec(vec![-1.5f32, -0.25, 0.0, 0.75, 2.0], vec![5], Device::Cpu).unwrap();
    let ys = f.call(&[&x]).unwrap();
    let v = x.to_vec_f64().unwrap();
    let want: [&dyn Fn(f64) -> f64; 10] = [
        &|x: f64| x.tanh(),
        &|x: f64| libm_erf(x),
        &|x: f64| 1.0 / (1.0 + (-x).exp()),
        &|x: f64| 1.0 / (x.abs() + 1.0).sqrt(),
        &|x: f64| 1.0 / (x.abs() + 1.0),
        &|x: f64| if x > 0.0 { x } else { 0.1 * x },
        &|x: f64| x,
        &|x: f64| x.sin(),
        &|x: f64| x.cos(),
        &|x: f64| if x != 0.0 { 1.0 } else { 0.0 },
    ];
    for (k, (y, w)) in ys.iter().zip(want).enumerate() {
        let got = y.to_vec_f64().unwrap();
        for (g, &x) in got.iter().zip(&v) {
            assert!(
                (g - w(x)).abs() < 2e-3 * w(x).abs().max(1.0),
                "prim {k} at {x}: {g}"
            );
        }
    }
    assert_eq!(ys[6].dtype(), DType::F16);
}

/// erf by its series (enough terms for |x| ≤ 2).
fn libm_erf(x: f64) -> f64 {
    let mut sum = 0.0;
    let mut term = x;
    for n in 0..60 {
        sum += term / (2 * n + 1) as f64;
        term *= -x * x / (n + 1) as f64;
    }
    sum * std::f64::consts::FRAC_2_SQRT_PI
}

#[test]
fn bad_calls_are_errors() {
    let f = fuse("bad_axis", |f, x| vec![f.sum(x[0], &[3])]);
    let a = Tensor::zeros(vec![2, 3], DType::F32, Device::Cpu).unwrap();
    let e = f.call(&[&a]).unwrap_err().to_string();
    assert!(e.contains("axes"), "{e}");
    let g = fuse("add", |f, x| vec![f.add(x[0], x[1])]);
    let b = Tensor::zeros(vec![4], DType::F32, Device::Cpu).unwrap();
    let e = g.call(&[&a, &b]).unwrap_err().to_string();
    assert!(e.contains("broadcast"), "{e}");
    let i = Tensor::zeros(vec![2, 3], DType::I64, Device::Cpu).unwrap();
    assert!(g.call(&[&a, &i]).is_err());
    let h = fuse("none", |_, _| vec![]);
    assert!(h.call(&[&a]).is_err());
}

#[test]
fn autocast_casts_as_the_unfused_ops_would() {
    use mixprec::amp;
    // exp is an f32 op under O1: a half input's exp is computed and returned in f32, as the
    // unfused exp would give it; a product of half values stays half.
    let f = fuse("amp", |f, x| vec![f.exp(x[0]), f.mul(x[0], x[0])]);
    let x = Tensor::randn(vec![4], 0.0, 1.0, 1, DType::F16, Device::Cpu).unwrap();
    let (want_exp, want_mul) = {
        let _scope = amp::autocast(DType::F16).unwrap();
        (x.exp().unwrap().dtype(), x.mul(&x).unwrap().dtype())
    };
    let ys = {
        let _scope = amp::autocast(DType::F16).unwrap();
        f.call(&[&x]).unwrap()
    };
    assert_eq!(ys[0].dtype(), want_exp);
    assert_eq!(ys[1].dtype(), want_mul);
    assert_eq!(ys[0].dtype(), DType::F32);
    // Outside the scope, a trace of its own.
    assert_eq!(f.call(&[&x]).unwrap()[0].dtype(), DType::F16);
    assert_eq!(f.traces(), 2);
}

/// The kernels generated for random programs (forward and backward) compile with NVRTC for
/// sm_90, with no GPU; where libnvrtc is missing the test says so and passes, as
/// tests/kernels.rs does (CI installs it).
#[test]
fn generated_kernels_compile_with_nvrtc() {
    let mut rng = Rng(0x5151_2727_abcd_0001);
    for case in 0..6 {
        let p = program(&mut rng, 2 + case % 2, [2, 3, 4]);
        let f = fused_of(&p);
        let dtype = [DType::F32, DType::F16, DType::BF16][case % 3];
        let xs = inputs(&p, case as u64, dtype, Device::Cpu).unwrap();
        let refs: Vec<&Tensor> = xs.iter().collect();
        let (name, src, kernels) = f.cuda_source(&refs).unwrap();
        let want = f.graph(&refs).unwrap();
        assert!(kernels <= 1 + want.reductions(), "{kernels} kernels");
        let mut sources = vec![(name, src)];
        if let Some((n, s, _)) = f.cuda_backward_source(&refs, 0).unwrap() {
            sources.push((n, s));
        }
        for (name, src) in sources {
            if !compiles_for_sm90(&name, &src) {
                return;
            }
        }
    }
}

/// A batch norm with its variance as E[x²] − E[x]²: both sums are one reduction set (one pass
/// over x), so the forward is two kernels (the statistics, the outputs) and the backward two
/// (the gradient sums, the outputs: the statistics come from the forward call); every kernel
/// compiles.
#[test]
fn two_sums_over_the_same_axes_share_one_kernel() {
    let bn = fuse("bn_two_sums", |f, x| {
        let axes = [0, 2, 3];
        let mean = f.mean(x[0], &axes);
        let var = f.sub(f.mean(f.sqr(x[0]), &axes), f.sqr(mean));
        let y = f.mul(f.sub(x[0], mean), f.rsqrt(f.add_scalar(var, 1e-5)));
        vec![f.cast(f.add(f.mul(y, x[1]), x[2]), f.dtype(x[0]))]
    });
    let x = Tensor::zeros(vec![2, 3, 4, 8], DType::F16, Device::Cpu).unwrap();
    let w = Tensor::zeros(vec![3, 1, 1], DType::F32, Device::Cpu).unwrap();
    let (name, src, kernels) = bn.cuda_source(&[&x, &w, &w]).unwrap();
    assert_eq!(kernels, 2, "{src}");
    // One pass reads x once for both sums: each sum's accumulator is in the same loop.
    assert_eq!(src.matches("_level").count(), 1, "{src}");
    let (bname, bsrc, bkernels) = bn.cuda_backward_source(&[&x, &w, &w], 0).unwrap().unwrap();
    assert_eq!(bkernels, 2, "{bsrc}");
    compiles_for_sm90(&name, &src);
    compiles_for_sm90(&bname, &bsrc);
}

/// Reductions over outer axes (the innermost dim kept: rows side by side in memory) and over
/// the innermost axis, several per kernel: the kernels compile, one per level, and the CPU
/// values match the unfused ops.
#[test]
fn reductions_over_outer_and_inner_axes_compile() {
    for axes in [vec![0isize], vec![0, 2], vec![-1]] {
        let ax = axes.clone();
        let f = fuse("stats", move |f, x| {
            let s = f.sum(x[0], &ax);
            let hi = f.max(x[0], &ax);
            let m = f.mean(f.tanh(x[0]), &ax);
            vec![s, hi, f.sub(x[0], f.add(m, hi))]
        });
        let x = Tensor::randn(vec![5, 3, 16], 0.0, 1.0, 1, DType::F32, Device::Cpu).unwrap();
        let (name, src, kernels) = f.cuda_source(&[&x]).unwrap();
        assert_eq!(kernels, 2, "{axes:?}: {src}");
        let (bname, bsrc, _) = f.cuda_backward_source(&[&x], 2).unwrap().unwrap();
        compiles_for_sm90(&name, &src);
        compiles_for_sm90(&bname, &bsrc);
        let ys = f.call(&[&x]).unwrap();
        let want = x.sum_dims(&axes, true).unwrap();
        assert!(max_rel_diff(&ys[0], &want) < 1e-5, "{axes:?}");
    }
}

/// A batch norm's forward is three kernels: the mean's sum, the variance's sum, the outputs.
#[test]
fn batch_norm_compiles_to_one_kernel_per_reduction_level() {
    let bn = fuse("bn", |f, x| {
        let axes = [0, 2, 3];
        let mean = f.mean(x[0], &axes);
        let var = f.var(x[0], &axes);
        let y = f.mul(f.sub(x[0], mean), f.rsqrt(f.add_scalar(var, 1e-5)));
        vec![f.add(f.mul(y, x[1]), x[2])]
    });
    let x = Tensor::zeros(vec![2, 3, 4, 5], DType::F16, Device::Cpu).unwrap();
    let w = Tensor::zeros(vec![3, 1, 1], DType::F32, Device::Cpu).unwrap();
    let (_, src, kernels) = bn.cuda_source(&[&x, &w, &w]).unwrap();
    println!("{src}");
    assert_eq!(kernels, 3, "{src}");
    // (N, C, H, W) is compressed to (N, C, H·W): every size array has three entries.
    assert!(src.contains("i64 size[3]"), "{src}");
}

/// The generated source compiles with NVRTC for sm_90; false where NVRTC is missing (an
/// error when MIXPREC_REQUIRE_NVRTC is set, as CI sets it). MIXPREC_PRINT_FUSE prints it.
fn compiles_for_sm90(name: &str, src: &str) -> bool {
    if std::env::var_os("MIXPREC_PRINT_FUSE").is_some() {
        println!("{src}");
    }
    match mixprec::backend::cuda::compile_generated_for(name, src, (9, 0)) {
        Ok(()) => true,
        Err(mixprec::Error::Cuda(msg)) if msg.starts_with("NVRTC not found") => {
            if std::env::var_os("MIXPREC_REQUIRE_NVRTC").is_some() {
                panic!("MIXPREC_REQUIRE_NVRTC is set but {msg}");
            }
            println!("skipped: {msg}");
            false
        }
        Err(e) => panic!("{e}\n{src}"),
    }
}
