//! Strided layouts: every op on channels_last inputs and on non-contiguous views (permuted,
//! narrowed, broadcast) gives the contiguous result, keeps its input's format, and sends back
//! gradients laid out as the variables; the fused batch-norm ops against the unfused
//! composition; `Module::to_memory_format`.

mod common;

use common::{assert_close_named, check_gradients, randn, vals};
use mixprec::nn::{self, Module};
use mixprec::optim::{FusedSgd, Optimizer, SgdConfig};
use mixprec::{BatchNormConfig, Conv2dConfig, DType, Device, MemoryFormat, Result, Tensor};

const CL: MemoryFormat = MemoryFormat::ChannelsLast;
const TRAIN: BatchNormConfig = BatchNormConfig {
    training: true,
    momentum: 0.1,
    eps: 1e-5,
};

/// A variable with `x`'s values laid out in `format`.
fn in_format(x: &Tensor, format: MemoryFormat) -> Tensor {
    let v = x.detach().to_variable();
    v.to_memory_format_(format).unwrap();
    v
}

/// Runs `f` on contiguous and on channels_last copies of `inputs` (4-D ones converted): the
/// values and every input's gradient must agree exactly (the CPU computes channels_last on
/// contiguous copies, so the arithmetic is the same), the output must be channels_last when
/// `keeps_format`, and each gradient must be laid out as its variable.
#[track_caller]
fn same_in_both_formats(
    what: &str,
    inputs: &[Tensor],
    keeps_format: bool,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let run = |format: MemoryFormat| {
        let xs: Vec<Tensor> = inputs.iter().map(|x| in_format(x, format)).collect();
        let y = f(&xs).unwrap();
        let w = Tensor::randn(y.shape().clone(), 0.0, 1.0, 99, y.dtype(), Device::Cpu).unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        (xs, y)
    };
    let (xc, yc) = run(MemoryFormat::Contiguous);
    let (xl, yl) = run(CL);
    assert_eq!(vals(&yl), vals(&yc), "{what}: values");
    if keeps_format {
        assert!(
            yl.is_contiguous_for(CL),
            "{what}: output is not channels_last"
        );
    }
    for (k, (a, b)) in xc.iter().zip(&xl).enumerate() {
        let (ga, gb) = (a.grad().unwrap(), b.grad().unwrap());
        assert_eq!(vals(&gb), vals(&ga), "{what}: gradient of input {k}");
        assert_eq!(
            gb.layout().strides(),
            b.layout().strides(),
            "{what}: gradient {k} is not laid out as its variable"
        );
    }
}

fn x4(seed: u64, dt: DType) -> Tensor {
    randn(&[2, 8, 5, 6], seed, dt)
}

#[test]
fn four_d_ops_keep_channels_last_and_match_contiguous() {
    for dt in [DType::F32, DType::F64] {
        let w = randn(&[16, 8, 3, 3], 2, dt);
        same_in_both_formats("conv2d", &[x4(1, dt), w], true, |t| {
            let cfg = Conv2dConfig {
                stride: (2, 1),
                padding: (1, 1),
                ..Default::default()
            };
            t[0].conv2d(&t[1], None, cfg)
        });
        let (c8w, c8b) = (randn(&[8], 3, dt), randn(&[8], 4, dt));
        let stats = || {
            (
                Tensor::zeros([8], DType::F32, Device::Cpu).unwrap(),
                Tensor::ones([8], DType::F32, Device::Cpu).unwrap(),
            )
        };
        for (name, kind) in [("bn", 0), ("bn+relu", 1), ("bn+add+relu", 2)] {
            let mut inputs = vec![x4(5, dt), c8w.clone(), c8b.clone()];
            if kind == 2 {
                inputs.push(x4(6, dt));
            }
            same_in_both_formats(name, &inputs, true, |t| {
                let (rm, rv) = stats();
                match kind {
                    0 => t[0].batch_norm(&t[1], &t[2], &rm, &rv, TRAIN),
                    1 => t[0].batch_norm_relu(&t[1], &t[2], &rm, &rv, TRAIN),
                    _ => t[0].batch_norm_add_relu(&t[3], &t[1], &t[2], &rm, &rv, TRAIN),
                }
            });
        }
        same_in_both_formats("relu", &[x4(7, dt)], true, |t| t[0].relu());
        same_in_both_formats("add", &[x4(8, dt), x4(9, dt)], true, |t| t[0].add(&t[1]));
        same_in_both_formats("mul + exp", &[x4(10, dt), x4(11, dt)], true, |t| {
            t[0].mul(&t[1])?.exp()
        });
        same_in_both_formats("max_pool2d", &[x4(12, dt)], true, |t| {
            t[0].max_pool2d((3, 3), (2, 2), (1, 1))
        });
        same_in_both_formats("avg_pool2d", &[x4(13, dt)], true, |t| {
            t[0].avg_pool2d((2, 2), (2, 2), (0, 0), true)
        });
        same_in_both_formats("adaptive_avg_pool2d", &[x4(14, dt)], false, |t| {
            t[0].adaptive_avg_pool2d(1, 1)?.flatten(1, -1)
        });
        // A bias broadcast over a channels_last tensor.
        same_in_both_formats("add bias", &[x4(15, dt)], false, |t| {
            t[0].add(&Tensor::ones([1, 8, 1, 1], dt, Device::Cpu)?)
        });
    }
}

/// Every op on a view (transposed, narrowed, broadcast) against the same op on a contiguous
/// copy of the view.
#[test]
fn ops_on_views_match_contiguous_copies() {
    let base = randn(&[4, 6, 5], 20, DType::F64);
    let views: Vec<(&str, Tensor)> = vec![
        ("transposed", base.transpose(0, 2).unwrap()),
        ("narrowed", base.narrow(1, 1, 4).unwrap()),
        ("permuted", base.permute(&[1, 2, 0]).unwrap()),
        (
            "broadcast",
            base.narrow(0, 0, 1)
                .unwrap()
                .broadcast_as(&[3, 6, 5].into())
                .unwrap(),
        ),
    ];
    type Op = fn(&Tensor) -> Result<Tensor>;
    let ops: Vec<(&str, Op)> = vec![
        ("exp", |t| t.exp()),
        ("affine", |t| t.affine(2.0, -1.0)),
        ("add itself", |t| t.add(&t.sqr()?)),
        ("sum dim 1", |t| t.sum_dim(1, false)),
        ("max dim 0", |t| t.max_dim(0, true)),
        ("softmax", |t| t.log_softmax(-1)),
        ("matmul", |t| t.matmul(&t.transpose(1, 2)?)),
        ("reshape", |t| t.reshape(vec![t.elem_count()])),
        ("cast", |t| t.to_dtype(DType::F32)?.to_dtype(DType::F64)),
        ("cat", |t| Tensor::cat(&[t, t], 1)),
    ];
    for (vname, v) in &views {
        let c = v.contiguous().unwrap();
        assert!(c.layout().is_contiguous());
        for (oname, op) in &ops {
            let (a, b) = (op(v).unwrap(), op(&c).unwrap());
            assert_eq!(vals(&a), vals(&b), "{oname} on a {vname} view");
        }
    }
    // Gradients through views reach the base.
    check_gradients(&[randn(&[3, 4, 5], 21, DType::F64)], |t| {
        let v = t[0].transpose(0, 2)?.narrow(1, 1, 2)?;
        v.mul(&v.exp()?)?
            .sum_dim(0, true)?
            .broadcast_as(&[2, 2, 3].into())
    });
    // A channels_last conv input built by permuting an NHWC tensor.
    let nhwc = randn(&[2, 5, 6, 4], 22, DType::F64);
    let x = nhwc.permute(&[0, 3, 1, 2]).unwrap();
    assert!(x.is_contiguous_for(CL));
    let w = randn(&[3, 4, 3, 3], 23, DType::F64);
    let a = x.conv2d(&w, None, Conv2dConfig::default()).unwrap();
    let b = x
        .contiguous()
        .unwrap()
        .conv2d(&w, None, Conv2dConfig::default())
        .unwrap();
    assert_eq!(vals(&a), vals(&b));
    assert!(a.is_contiguous_for(CL), "conv keeps its input's format");
}

#[test]
fn fused_batch_norm_matches_the_composition() {
    for dt in [DType::F32, DType::F64] {
        for format in [MemoryFormat::Contiguous, CL] {
            for residual in [false, true] {
                let x = in_format(&randn(&[4, 6, 3, 5], 30, dt), format);
                let r = in_format(&randn(&[4, 6, 3, 5], 31, dt), format);
                let (w, b) = (
                    randn(&[6], 32, dt).to_variable(),
                    randn(&[6], 33, dt).to_variable(),
                );
                let stats = || {
                    (
                        Tensor::zeros([6], DType::F32, Device::Cpu).unwrap(),
                        Tensor::ones([6], DType::F32, Device::Cpu).unwrap(),
                    )
                };
                let run = |fused: bool| {
                    for t in [&x, &r, &w, &b] {
                        t.zero_grad();
                    }
                    let (rm, rv) = stats();
                    let y = match (fused, residual) {
                        (true, false) => x.batch_norm_relu(&w, &b, &rm, &rv, TRAIN),
                        (true, true) => x.batch_norm_add_relu(&r, &w, &b, &rm, &rv, TRAIN),
                        (false, false) => {
                            x.batch_norm(&w, &b, &rm, &rv, TRAIN).and_then(|y| y.relu())
                        }
                        (false, true) => x
                            .batch_norm(&w, &b, &rm, &rv, TRAIN)
                            .and_then(|y| y.add(&r))
                            .and_then(|y| y.relu()),
                    }
                    .unwrap();
                    let g =
                        Tensor::randn(y.shape().clone(), 0.0, 1.0, 34, dt, Device::Cpu).unwrap();
                    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
                    let mut out = vec![vals(&y), vals(&rm), vals(&rv)];
                    for t in [&x, &w, &b] {
                        out.push(vals(&t.grad().unwrap()));
                    }
                    if residual {
                        out.push(vals(&r.grad().unwrap()));
                    }
                    out
                };
                let (fused, composed) = (run(true), run(false));
                let tol = if dt == DType::F32 { 1e-5 } else { 1e-12 };
                for (k, (a, b)) in fused.iter().zip(&composed).enumerate() {
                    assert_close_named(
                        &format!("{dt} {format:?} residual={residual} output {k}"),
                        a,
                        b,
                        tol,
                        tol,
                    );
                }
            }
        }
    }
}

#[test]
fn fused_batch_norm_gradients() {
    let stats = || {
        (
            Tensor::zeros([3], DType::F64, Device::Cpu).unwrap(),
            Tensor::ones([3], DType::F64, Device::Cpu).unwrap(),
        )
    };
    let inputs = [
        randn(&[2, 3, 2, 3], 40, DType::F64),
        randn(&[3], 41, DType::F64),
        randn(&[3], 42, DType::F64),
        randn(&[2, 3, 2, 3], 43, DType::F64),
    ];
    check_gradients(&inputs[..3], |t| {
        let (rm, rv) = stats();
        t[0].batch_norm_relu(&t[1], &t[2], &rm, &rv, TRAIN)
    });
    check_gradients(&inputs, |t| {
        let (rm, rv) = stats();
        t[0].batch_norm_add_relu(&t[3], &t[1], &t[2], &rm, &rv, TRAIN)
    });
    // In channels_last too.
    check_gradients(&inputs, |t| {
        let (rm, rv) = stats();
        let x = t[0].to_memory_format(CL)?;
        let r = t[3].to_memory_format(CL)?;
        x.batch_norm_add_relu(&r, &t[1], &t[2], &rm, &rv, TRAIN)
    });
}

#[test]
fn fused_batch_norm_rejects_bad_residuals() {
    let x = randn(&[2, 3, 4, 4], 50, DType::F32);
    let (w, b) = (randn(&[3], 51, DType::F32), randn(&[3], 52, DType::F32));
    let (rm, rv) = (
        Tensor::zeros([3], DType::F32, Device::Cpu).unwrap(),
        Tensor::ones([3], DType::F32, Device::Cpu).unwrap(),
    );
    let bad = randn(&[2, 3, 4, 5], 53, DType::F32);
    let e = x
        .batch_norm_add_relu(&bad, &w, &b, &rm, &rv, TRAIN)
        .unwrap_err();
    assert!(format!("{e}").contains("batch_norm_add_relu"), "{e}");
    // Nothing was updated.
    assert_eq!(vals(&rm), vec![0.0; 3]);
}

/// Where dims of size 1 make both formats fit (a one-channel image, a pooled `[n, c, 1, 1]`),
/// the format asked for is kept, as in PyTorch: `to_memory_format` lays a one-channel image
/// out channels_last, a convolution runs channels_last when its input or its weight is, and
/// the ops after it keep it (else a channels_last net fed one-channel images ran NCHW).
#[test]
fn one_channel_images_keep_channels_last() {
    let x = randn(&[4, 1, 12, 12], 70, DType::F32);
    assert_eq!(x.memory_format(), Some(MemoryFormat::Contiguous));
    let xl = x.to_memory_format(CL).unwrap();
    assert_eq!(xl.memory_format(), Some(CL));
    assert_eq!(xl.layout().strides(), &[144, 1, 12, 1]);
    assert!(
        xl.to_memory_format(CL).unwrap().same_storage(&xl),
        "already channels_last"
    );
    let w = randn(&[8, 1, 3, 3], 71, DType::F32);
    let wl = in_format(&w, CL);
    assert_eq!(wl.memory_format(), Some(CL));
    let cfg = Conv2dConfig {
        padding: (1, 1),
        ..Default::default()
    };
    let reference = vals(&x.conv2d(&w, None, cfg).unwrap());
    for (what, xi, wi, want) in [
        ("both contiguous", &x, &w, MemoryFormat::Contiguous),
        ("input channels_last", &xl, &w, CL),
        ("weight channels_last", &x, &wl, CL),
        ("both channels_last", &xl, &wl, CL),
    ] {
        let y = xi.conv2d(wi, None, cfg).unwrap();
        assert_eq!(y.memory_format(), Some(want), "{what}");
        assert_eq!(vals(&y), reference, "{what}: values");
    }
    // A pooled [n, c, 1, 1] activation keeps channels_last through batch norm.
    let p = xl
        .conv2d(&wl, None, cfg)
        .unwrap()
        .adaptive_avg_pool2d(1, 1)
        .unwrap();
    assert_eq!(p.memory_format(), Some(CL));
    let ones = || Tensor::ones([8], DType::F32, Device::Cpu).unwrap();
    let zeros = || Tensor::zeros([8], DType::F32, Device::Cpu).unwrap();
    let n = p
        .batch_norm(&ones(), &zeros(), &zeros(), &ones(), TRAIN)
        .unwrap();
    assert_eq!(n.memory_format(), Some(CL));
}

#[test]
fn module_to_memory_format_converts_weights_in_place() {
    let dev = Device::Cpu;
    let a = nn::resnet::ResNet::cifar_style(&[1, 1], 3, 10, &dev).unwrap();
    let b = nn::resnet::ResNet::cifar_style(&[1, 1], 3, 10, &dev).unwrap();
    let held = b.parameters(); // as an optimizer holds them
    b.to_memory_format(CL).unwrap();
    for ((name, p), q) in b.named_parameters().into_iter().zip(&held) {
        assert!(
            p.same_storage(q),
            "{name}: the parameter's identity is kept"
        );
        if p.rank() == 4 {
            assert!(q.is_contiguous_for(CL), "{name} is not channels_last");
        }
    }
    // State dicts hold logical tensors: equal to the contiguous twin's (same seed).
    let (sa, sb) = (a.state_dict().unwrap(), b.state_dict().unwrap());
    for ((n1, t1), (n2, t2)) in sa.iter().zip(sb.iter()) {
        assert_eq!(n1, n2);
        assert_eq!(vals(t1), vals(t2), "{n1}");
    }
    // Same forward, channels_last inside; an optimizer step runs over channels_last buffers.
    let x = randn(&[4, 3, 12, 12], 60, DType::F32);
    let ya = a.forward(&x).unwrap();
    let yb = b.forward(&x.to_memory_format(CL).unwrap()).unwrap();
    assert_close_named("logits", &vals(&yb), &vals(&ya), 1e-5, 1e-5);
    let y = Tensor::from_vec(vec![1i64, 2, 3, 4], [4], dev).unwrap();
    let mut opt = FusedSgd::new(
        b.parameters(),
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        },
    )
    .unwrap();
    nn::loss::cross_entropy(&yb, &y)
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    for (name, p) in b.named_parameters() {
        if p.rank() == 4 {
            assert!(p.is_contiguous_for(CL), "{name} after a step");
        }
    }
}
