//! ResNet structure against torchvision (names, shapes, counts, init), Module plumbing
//! (state dicts, casts, modes), and — with the conv/pool/batch-norm kernels — a training step.

use mixprec::nn::{
    self, BatchNorm2d, Linear, Module, ReLU, ResNet, ResNetConfig, Sequential, Stem, TensorKind,
};
use mixprec::{DType, Device, Error, Tensor};

const CPU: Device = Device::Cpu;

fn shapes(m: &dyn Module) -> Vec<(String, Vec<usize>)> {
    m.state_dict()
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.dims().to_vec()))
        .collect()
}

fn shape_of(m: &dyn Module, name: &str) -> Vec<usize> {
    let mut found = None;
    m.visit("", &mut |i| {
        if i.name == name {
            found = Some(i.tensor.dims().to_vec());
        }
    });
    found.unwrap_or_else(|| panic!("no tensor named {name}"))
}

#[test]
fn resnet18_matches_torchvision() {
    let m = ResNet::resnet18(1000, &CPU, 0).unwrap();
    assert_eq!(m.num_parameters(), 11_689_512);
    assert_eq!(m.named_parameters().len(), 62);
    let sd = shapes(&m);
    assert_eq!(
        sd.len(),
        122,
        "torchvision's resnet18 state_dict has 122 entries"
    );
    let names: Vec<&str> = sd.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[..8],
        &[
            "conv1.weight",
            "bn1.weight",
            "bn1.bias",
            "bn1.running_mean",
            "bn1.running_var",
            "bn1.num_batches_tracked",
            "layer1.0.conv1.weight",
            "layer1.0.bn1.weight",
        ]
    );
    assert_eq!(&names[names.len() - 2..], &["fc.weight", "fc.bias"]);
    for (name, want) in [
        ("conv1.weight", vec![64, 3, 7, 7]),
        ("layer1.0.conv1.weight", vec![64, 64, 3, 3]),
        ("layer2.0.conv1.weight", vec![128, 64, 3, 3]),
        ("layer2.0.downsample.0.weight", vec![128, 64, 1, 1]),
        ("layer2.0.downsample.1.running_var", vec![128]),
        ("layer3.1.bn2.running_var", vec![256]),
        ("layer4.1.conv2.weight", vec![512, 512, 3, 3]),
        ("fc.weight", vec![1000, 512]),
        ("fc.bias", vec![1000]),
        ("bn1.num_batches_tracked", vec![]),
    ] {
        assert_eq!(shape_of(&m, name), want, "{name}");
    }
    assert!(!names.contains(&"layer1.0.downsample.0.weight"));
    assert_eq!(m.layers[1].blocks.len(), 2);
}

#[test]
fn resnet34_and_resnet50_counts() {
    assert_eq!(
        ResNet::resnet34(1000, &CPU, 0).unwrap().num_parameters(),
        21_797_672
    );
    let m = ResNet::resnet50(1000, &CPU, 0).unwrap();
    assert_eq!(m.num_parameters(), 25_557_032);
    assert_eq!(m.named_parameters().len(), 161);
    assert_eq!(m.named_buffers().len(), 159);
    assert_eq!(m.state_dict().unwrap().len(), 320);
    for (name, want) in [
        ("layer1.0.conv1.weight", vec![64, 64, 1, 1]),
        ("layer1.0.conv2.weight", vec![64, 64, 3, 3]),
        ("layer1.0.conv3.weight", vec![256, 64, 1, 1]),
        ("layer1.0.downsample.0.weight", vec![256, 64, 1, 1]),
        ("layer2.0.conv1.weight", vec![128, 256, 1, 1]),
        ("layer3.5.bn3.running_mean", vec![1024]),
        ("layer4.0.downsample.0.weight", vec![2048, 1024, 1, 1]),
        ("layer4.2.bn3.weight", vec![2048]),
        ("fc.weight", vec![1000, 2048]),
    ] {
        assert_eq!(shape_of(&m, name), want, "{name}");
    }
    // v1.5: the stride is on the 3x3 conv, not the first 1x1.
    let nn::resnet::Block::Bottleneck(b) = &m.layers[1].blocks[0] else {
        panic!("resnet50 is made of bottlenecks")
    };
    assert_eq!(b.conv1.config.stride, (1, 1));
    assert_eq!(b.conv2.config.stride, (2, 2));
    assert_eq!(b.downsample.as_ref().unwrap().conv.config.stride, (2, 2));
}

#[test]
fn init_follows_torchvision() {
    let m = ResNet::resnet18(10, &CPU, 3).unwrap();
    // kaiming_normal_(fan_out, relu): std = sqrt(2 / (c_out·kh·kw)).
    let w = m.layers[3].blocks[1]
        .as_basic()
        .conv2
        .weight
        .to_vec_f64()
        .unwrap();
    let std = (w.iter().map(|v| v * v).sum::<f64>() / w.len() as f64).sqrt();
    let want = (2.0f64 / (512.0 * 9.0)).sqrt();
    assert!((std / want - 1.0).abs() < 0.01, "std {std} vs {want}");
    assert!(m.bn1.weight.to_vec_f64().unwrap().iter().all(|&v| v == 1.0));
    assert!(m.bn1.bias.to_vec_f64().unwrap().iter().all(|&v| v == 0.0));
    assert!(m
        .bn1
        .running_var
        .to_vec_f64()
        .unwrap()
        .iter()
        .all(|&v| v == 1.0));
    // fc: PyTorch's Linear default, U(±1/√512).
    let bound = 1.0 / 512f64.sqrt();
    let fc = m.fc.weight.to_vec_f64().unwrap();
    assert!(fc.iter().all(|v| v.abs() <= bound));
    assert!(fc.iter().any(|v| v.abs() > 0.9 * bound));
    // Every parameter is an F32 variable; buffers are not variables.
    m.visit("", &mut |i| match i.kind {
        TensorKind::Parameter => {
            assert!(
                i.tensor.is_variable() && i.tensor.dtype() == DType::F32,
                "{}",
                i.name
            )
        }
        TensorKind::Buffer => assert!(!i.tensor.is_variable(), "{}", i.name),
    });
    // Same seed, same model; another seed, another.
    let v = |m: &ResNet| m.layer_names_and_values();
    assert_eq!(v(&tiny(3)), v(&tiny(3)));
    assert_ne!(v(&tiny(3)), v(&tiny(4)));
}

trait Values {
    fn layer_names_and_values(&self) -> Vec<(String, Vec<f64>)>;
}
impl<M: Module> Values for M {
    fn layer_names_and_values(&self) -> Vec<(String, Vec<f64>)> {
        self.state_dict()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.to_vec_f64().unwrap()))
            .collect()
    }
}

trait AsBasic {
    fn as_basic(&self) -> &nn::BasicBlock;
}
impl AsBasic for nn::resnet::Block {
    fn as_basic(&self) -> &nn::BasicBlock {
        match self {
            nn::resnet::Block::Basic(b) => b,
            _ => panic!("not a basic block"),
        }
    }
}

#[test]
fn general_config_and_cifar_style() {
    let cfg = ResNetConfig {
        block: nn::BlockKind::Bottleneck,
        blocks: vec![1, 1, 1],
        widths: vec![8, 16, 32],
        in_channels: 1,
        num_classes: 5,
        stem: Stem::Small,
        zero_init_residual: true,
        seed: 1,
    };
    let m = ResNet::new(&cfg, &CPU).unwrap();
    assert_eq!(shape_of(&m, "conv1.weight"), vec![8, 1, 3, 3]);
    assert_eq!(shape_of(&m, "layer3.0.conv3.weight"), vec![128, 32, 1, 1]);
    assert_eq!(shape_of(&m, "fc.weight"), vec![5, 128]);
    assert!(m.maxpool.is_none());
    let nn::resnet::Block::Bottleneck(b) = &m.layers[0].blocks[0] else {
        panic!()
    };
    assert!(b.bn3.weight.to_vec_f64().unwrap().iter().all(|&v| v == 0.0));

    let c = ResNet::cifar_style(&[2, 2, 2, 2], 1, 10, &CPU).unwrap();
    assert_eq!(shape_of(&c, "conv1.weight"), vec![64, 1, 3, 3]);
    assert_eq!(shape_of(&c, "fc.weight"), vec![10, 512]);
    // resnet18 minus the 7x7x3 stem plus a 3x3x1 stem, and a 10-class head.
    assert_eq!(
        c.num_parameters(),
        11_689_512 - 64 * 3 * 49 + 64 * 9 - 1000 * 513 + 10 * 513
    );

    for bad in [
        ResNetConfig {
            blocks: vec![],
            widths: vec![],
            ..cfg.clone()
        },
        ResNetConfig {
            widths: vec![8, 16],
            ..cfg.clone()
        },
        ResNetConfig {
            blocks: vec![1, 0, 1],
            ..cfg.clone()
        },
        ResNetConfig {
            num_classes: 0,
            ..cfg.clone()
        },
        ResNetConfig {
            in_channels: 0,
            ..cfg.clone()
        },
    ] {
        assert!(matches!(
            ResNet::new(&bad, &CPU),
            Err(Error::InvalidArgument { .. })
        ));
    }
}

#[test]
fn cast_keeps_batchnorm_fp32_and_state_dict_is_fp32() {
    let m = tiny(0);
    m.cast(DType::F16, true).unwrap();
    m.visit("", &mut |i| {
        let want = if i.name.ends_with("num_batches_tracked") {
            DType::I64
        } else if i.batch_norm {
            DType::F32
        } else {
            DType::F16
        };
        assert_eq!(i.tensor.dtype(), want, "{}", i.name);
    });
    assert!(m
        .named_parameters()
        .iter()
        .any(|(n, p)| n == "layer2.0.downsample.1.weight" && p.dtype() == DType::F32));
    let sd = m.state_dict().unwrap();
    for (n, t) in &sd {
        let want = if n.ends_with("num_batches_tracked") {
            DType::I64
        } else {
            DType::F32
        };
        assert_eq!(t.dtype(), want, "{n}");
    }
    // O3-style: everything half.
    m.cast(DType::BF16, false).unwrap();
    assert_eq!(m.bn1.weight.dtype(), DType::BF16);
    assert_eq!(m.bn1.running_mean.dtype(), DType::BF16);
    assert_eq!(m.bn1.num_batches_tracked.dtype(), DType::I64);
    // The parameter handles keep their identity through casts.
    let ids: Vec<_> = m.parameters().iter().map(|t| t.id()).collect();
    m.cast(DType::F32, false).unwrap();
    assert_eq!(
        ids,
        m.parameters().iter().map(|t| t.id()).collect::<Vec<_>>()
    );
    assert!(m.cast(DType::I64, false).is_err());
}

/// A two-stage ResNet with the ImageNet stem and a downsample: every kind of tensor, quickly.
fn tiny(seed: u64) -> ResNet {
    let cfg = ResNetConfig {
        block: nn::BlockKind::Basic,
        blocks: vec![1, 1],
        widths: vec![4, 8],
        in_channels: 3,
        num_classes: 10,
        stem: Stem::ImageNet,
        zero_init_residual: false,
        seed,
    };
    ResNet::new(&cfg, &CPU).unwrap()
}

#[test]
fn state_dict_round_trip_and_strict_errors() {
    let a = tiny(1);
    let b = tiny(2);
    let sd = a.state_dict().unwrap();
    // The state dict is a copy: changing the model afterwards does not change it.
    a.fc.bias
        .as_ref()
        .unwrap()
        .set_data(&Tensor::zeros([10], DType::F32, CPU).unwrap())
        .unwrap();
    assert_ne!(sd.last().unwrap().1.to_vec::<f32>().unwrap(), vec![0.0; 10]);
    b.cast(DType::F16, true).unwrap();
    let fc_id = b.fc.weight.id();
    b.load_state_dict(&sd).unwrap();
    assert_eq!(b.fc.weight.id(), fc_id);
    assert_eq!(
        b.fc.weight.dtype(),
        DType::F16,
        "values take the tensor's current dtype"
    );
    assert_eq!(b.bn1.running_var.dtype(), DType::F32);
    let want: Vec<f32> = sd[0].1.to_vec().unwrap();
    let got: Vec<f32> = b
        .conv1
        .weight
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec()
        .unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-3 * w.abs().max(1e-2), "{g} vs {w}");
    }
    let fresh = tiny(2);
    fresh.load_state_dict(&sd).unwrap();
    assert_eq!(fresh.conv1.weight.to_vec::<f32>().unwrap(), want);

    let c = tiny(3);
    let before = c.conv1.weight.to_vec::<f32>().unwrap();

    let missing: Vec<_> = sd
        .iter()
        .filter(|(n, _)| n != "bn1.running_mean")
        .cloned()
        .collect();
    let e = c.load_state_dict(&missing).unwrap_err().to_string();
    assert!(
        e.contains("missing") && e.contains("bn1.running_mean"),
        "{e}"
    );

    let mut unexpected = sd.clone();
    unexpected.push((
        "head.weight".into(),
        Tensor::zeros([2], DType::F32, CPU).unwrap(),
    ));
    let e = c.load_state_dict(&unexpected).unwrap_err().to_string();
    assert!(e.contains("unexpected") && e.contains("head.weight"), "{e}");

    let mut wrong = sd.clone();
    let i = wrong.iter().position(|(n, _)| n == "fc.weight").unwrap();
    wrong[i].1 = Tensor::zeros([1000, 8], DType::F32, CPU).unwrap();
    let e = c.load_state_dict(&wrong).unwrap_err();
    assert!(matches!(e, Error::StateMismatch { .. }));
    let e = e.to_string();
    assert!(
        e.contains("fc.weight") && e.contains("[10, 8]") && e.contains("[1000, 8]"),
        "{e}"
    );

    let mut twice = sd.clone();
    twice.push(sd[0].clone());
    assert!(c.load_state_dict(&twice).is_err());
    // A failed load writes nothing.
    assert_eq!(c.conv1.weight.to_vec::<f32>().unwrap(), before);
}

#[test]
fn train_eval_flags_reach_every_module() {
    let m = tiny(0);
    assert!(m.is_training() && m.layers[1].blocks[0].as_basic().bn2.is_training());
    m.eval();
    assert!(!m.is_training());
    let mut n_bn = 0;
    fn walk(m: &dyn Module, f: &mut dyn FnMut(&dyn Module)) {
        f(m);
        m.visit_children(&mut |_, c| walk(c, f));
    }
    walk(&m, &mut |c| {
        assert!(!c.is_training());
        n_bn += 1;
    });
    assert!(n_bn > 20, "{n_bn} modules");
    assert!(!m.layers[1].blocks[0]
        .as_basic()
        .downsample
        .as_ref()
        .unwrap()
        .bn
        .is_training());
    m.set_training(true);
    assert!(m.bn1.is_training());
}

#[test]
fn sequential_names_and_linear() {
    let seq = Sequential::new()
        .with(Linear::new(4, 3, true, &CPU, 1).unwrap())
        .with(ReLU::new())
        .with(Linear::new(3, 2, false, &CPU, 2).unwrap())
        .with(BatchNorm2d::new(2, &CPU).unwrap());
    let names: Vec<String> = seq
        .state_dict()
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names,
        [
            "0.weight",
            "0.bias",
            "2.weight",
            "3.weight",
            "3.bias",
            "3.running_mean",
            "3.running_var",
            "3.num_batches_tracked"
        ]
    );
    assert_eq!(seq.num_parameters(), 12 + 3 + 6 + 4);
    let mut bn = Vec::new();
    seq.visit("net", &mut |i| {
        if i.batch_norm {
            bn.push(i.name.to_string())
        }
    });
    assert_eq!(bn.len(), 5);
    assert!(bn.iter().all(|n| n.starts_with("net.3.")));

    // Linear: y = x·Wᵀ + b, and gradients reach both parameters.
    let lin = Linear::from_tensors(
        Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], CPU).unwrap(),
        Some(Tensor::from_vec(vec![0.5f32, -1.0], [2], CPU).unwrap()),
    )
    .unwrap();
    let x = Tensor::from_vec(vec![1.0f32, 0.0, -1.0, 2.0, 1.0, 0.0], [2, 3], CPU).unwrap();
    let y = lin.forward(&x).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![-1.5, -3.0, 4.5, 12.0]);
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        lin.weight.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![3.0, 1.0, -1.0, 3.0, 1.0, -1.0]
    );
    assert_eq!(
        lin.bias
            .as_ref()
            .unwrap()
            .grad()
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![2.0, 2.0]
    );
    lin.zero_grad();
    assert!(lin.weight.grad().is_none());
    // Default init bounds: U(±1/√in).
    let l = Linear::new(100, 50, true, &CPU, 9).unwrap();
    assert!(l
        .weight
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .all(|v| v.abs() <= 0.1));
    assert!(l
        .bias
        .as_ref()
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .all(|v| v.abs() <= 0.1));
    assert!(Linear::new(0, 3, true, &CPU, 0).is_err());
    assert!(Linear::from_tensors(
        Tensor::zeros([2, 3], DType::F32, CPU).unwrap(),
        Some(Tensor::zeros([3], DType::F32, CPU).unwrap())
    )
    .is_err());
}

// ---- needs the conv / pool / batch-norm kernels ------------------------------------------------

fn small_resnet() -> ResNet {
    let cfg = ResNetConfig {
        block: nn::BlockKind::Basic,
        blocks: vec![1, 1, 1, 1],
        widths: vec![8, 16, 32, 64],
        in_channels: 1,
        num_classes: 10,
        stem: Stem::Small,
        zero_init_residual: false,
        seed: 7,
    };
    ResNet::new(&cfg, &CPU).unwrap()
}

#[test]
fn small_resnet_forward_backward() {
    let m = small_resnet();
    let x = Tensor::randn([2, 1, 28, 28], 0.0, 1.0, 11, DType::F32, CPU).unwrap();
    let y = Tensor::from_vec(vec![3i64, 7], [2], CPU).unwrap();
    let logits = m.forward(&x).unwrap();
    assert_eq!(logits.dims(), &[2, 10]);
    let loss = nn::cross_entropy(&logits, &y).unwrap();
    let l = loss.item().unwrap();
    assert!(l.is_finite() && l > 0.0, "loss {l}");
    loss.backward().unwrap();
    for (n, p) in m.named_parameters() {
        let g = p.grad().unwrap_or_else(|| panic!("{n} has no grad"));
        assert_eq!(g.dims(), p.dims(), "{n}");
        assert!(g.to_vec_f64().unwrap().iter().all(|v| v.is_finite()), "{n}");
    }
    assert_eq!(m.bn1.num_batches_tracked.to_vec::<i64>().unwrap(), vec![1]);
    // The training forward moved the running statistics.
    assert!(m
        .bn1
        .running_mean
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .any(|&v| v != 0.0));
}

#[test]
fn cifar_style_forward_shape() {
    let m = ResNet::cifar_style(&[1, 1], 1, 10, &CPU).unwrap();
    let x = Tensor::randn([2, 1, 28, 28], 0.0, 1.0, 5, DType::F32, CPU).unwrap();
    let logits = mixprec::with_no_grad(|| m.forward(&x)).unwrap();
    assert_eq!(logits.dims(), &[2, 10]);
}

#[test]
fn eval_mode_uses_running_stats() {
    let bn = BatchNorm2d::new(3, &CPU).unwrap();
    let x = Tensor::randn([4, 3, 5, 5], 2.0, 3.0, 1, DType::F32, CPU).unwrap();
    let rm = vec![0.5f32, -1.0, 2.0];
    let rv = vec![4.0f32, 0.25, 1.0];
    bn.running_mean
        .set_data(&Tensor::from_vec(rm.clone(), [3], CPU).unwrap())
        .unwrap();
    bn.running_var
        .set_data(&Tensor::from_vec(rv.clone(), [3], CPU).unwrap())
        .unwrap();
    bn.weight
        .set_data(&Tensor::from_vec(vec![1.0f32, 2.0, -1.0], [3], CPU).unwrap())
        .unwrap();
    bn.bias
        .set_data(&Tensor::from_vec(vec![0.0f32, 1.0, 0.5], [3], CPU).unwrap())
        .unwrap();
    bn.eval();
    let y = bn.forward(&x).unwrap().to_vec::<f32>().unwrap();
    let xs = x.to_vec::<f32>().unwrap();
    let (w, b) = ([1.0f32, 2.0, -1.0], [0.0f32, 1.0, 0.5]);
    for (i, (&yv, &xv)) in y.iter().zip(&xs).enumerate() {
        let c = (i / 25) % 3;
        let want = (xv - rm[c]) / (rv[c] + 1e-5).sqrt() * w[c] + b[c];
        assert!((yv - want).abs() < 1e-4, "{yv} vs {want}");
    }
    // Eval leaves the statistics and the counter alone.
    assert_eq!(bn.running_mean.to_vec::<f32>().unwrap(), rm);
    assert_eq!(bn.num_batches_tracked.to_vec::<i64>().unwrap(), vec![0]);

    // A whole model in eval mode is deterministic per sample (no batch statistics).
    let m = small_resnet();
    m.eval();
    let x = Tensor::randn([2, 1, 12, 12], 0.0, 1.0, 2, DType::F32, CPU).unwrap();
    let both = mixprec::with_no_grad(|| m.forward(&x))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let first = mixprec::with_no_grad(|| m.forward(&x.narrow(0, 0, 1).unwrap()))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    for (a, b) in first.iter().zip(&both[..10]) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
}

#[test]
fn sgd_steps_reduce_the_loss() {
    use mixprec::optim::{Optimizer, Sgd, SgdConfig};
    let m = small_resnet();
    let x = Tensor::randn([8, 1, 12, 12], 0.0, 1.0, 21, DType::F32, CPU).unwrap();
    let y = Tensor::from_vec((0..8).map(|i| i % 10).collect::<Vec<i64>>(), [8], CPU).unwrap();
    let mut opt = Sgd::new(
        m.parameters(),
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..Default::default()
        },
    )
    .unwrap();
    let mut losses = Vec::new();
    for _ in 0..8 {
        let loss = nn::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
        losses.push(loss.item().unwrap());
        opt.zero_grad();
        loss.backward().unwrap();
        opt.step().unwrap();
    }
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[7] < 0.5 * losses[0], "{losses:?}");
    assert_eq!(m.bn1.num_batches_tracked.to_vec::<i64>().unwrap(), vec![8]);
}

#[test]
fn half_model_with_fp32_batchnorm_runs_forward_and_backward() {
    // What AMP O2 does to the model: convs/fc in f16, BatchNorm kept in f32.
    let m = small_resnet();
    m.cast(DType::F16, true).unwrap();
    let x = Tensor::randn([2, 1, 12, 12], 0.0, 1.0, 4, DType::F16, CPU).unwrap();
    let logits = m.forward(&x).unwrap();
    assert_eq!(logits.dtype(), DType::F16);
    let loss =
        nn::cross_entropy(&logits, &Tensor::from_vec(vec![1i64, 2], [2], CPU).unwrap()).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    loss.backward().unwrap();
    m.visit("", &mut |i| {
        if i.kind == TensorKind::Parameter {
            let g = i
                .tensor
                .grad()
                .unwrap_or_else(|| panic!("{} has no grad", i.name));
            assert_eq!(g.dtype(), i.tensor.dtype(), "{}", i.name);
            let want = if i.batch_norm { DType::F32 } else { DType::F16 };
            assert_eq!(i.tensor.dtype(), want, "{}", i.name);
        }
    });
    assert_eq!(m.bn1.running_mean.dtype(), DType::F32);
}
