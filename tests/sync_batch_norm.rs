//! SyncBatchNorm as a layer of its own (src/distributed/sync_batch_norm.rs), in one process:
//! `convert_sync_batchnorm` swaps it into every `BatchNorm2d` of a model and keeps the model's
//! names, tensors and state dict; ranks run as threads over the CPU backend, and together they
//! compute what the plain model computes on the global batch (forward, backward, running
//! statistics). nn imports nothing of distributed. The multi-process runs (DDP with
//! SyncBatchNorm at 2 and 3 ranks, O0 and O2) are in tests/distributed.rs.

use mixprec::distributed::launch::free_port;
use mixprec::distributed::{
    convert_sync_batchnorm, Backend, GroupOptions, LaunchEnv, Launcher, ProcessGroup, SyncBatchNorm,
};
use mixprec::nn::{BatchNorm2d, BlockKind, Module, ReLU, ResNet, ResNetConfig, Sequential, Stem};
use mixprec::{DType, Device, Result, Tensor};

const CPU: Device = Device::Cpu;
const GLOBAL_BATCH: usize = 12;

fn tiny_resnet() -> ResNet {
    ResNet::new(
        &ResNetConfig {
            block: BlockKind::Basic,
            blocks: vec![1, 1],
            widths: vec![8, 16],
            in_channels: 1,
            num_classes: 4,
            stem: Stem::Small,
            zero_init_residual: false,
            seed: 3,
        },
        &CPU,
    )
    .unwrap()
}

fn single_group() -> ProcessGroup {
    ProcessGroup::new(&LaunchEnv::single(), &GroupOptions::new(Backend::Cpu)).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

/// The largest difference relative to the largest magnitude of `want`.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

#[test]
fn conversion_keeps_names_tensors_and_state_dict() {
    let model = tiny_resnet();
    let before = model.state_dict().unwrap();
    let ids: Vec<_> = model
        .named_parameters()
        .into_iter()
        .chain(model.named_buffers())
        .map(|(n, t)| (n, t.id()))
        .collect();
    let mut names = Vec::new();
    model.visit_batch_norms("", &mut |name, bn| {
        assert_eq!(bn.swapped_in(), None, "{name}");
        names.push(name.to_string());
    });
    assert_eq!(names[0], "bn1");
    assert!(
        names.contains(&"layer2.0.downsample.1".to_string()),
        "{names:?}"
    );

    let g = single_group();
    assert_eq!(convert_sync_batchnorm(&model, &g).unwrap(), names.len());
    model.visit_batch_norms("", &mut |name, bn| {
        assert_eq!(bn.swapped_in(), Some("SyncBatchNorm"), "{name}");
    });
    // The same tensors (identities, names, order) and the same state dict, so checkpoints and
    // weights files load either way.
    let after_ids: Vec<_> = model
        .named_parameters()
        .into_iter()
        .chain(model.named_buffers())
        .map(|(n, t)| (n, t.id()))
        .collect();
    assert_eq!(ids, after_ids);
    let after = model.state_dict().unwrap();
    assert_eq!(before.len(), after.len());
    for ((n0, t0), (n1, t1)) in before.iter().zip(&after) {
        assert_eq!(n0, n1);
        assert_eq!(values(t0), values(t1), "{n0}");
    }
    let plain = tiny_resnet();
    plain.load_state_dict(&after).unwrap();
    model.load_state_dict(&plain.state_dict().unwrap()).unwrap();
}

/// A converted model in eval mode is the plain model: the running statistics, no collective.
#[test]
fn eval_mode_is_the_plain_batch_norm() {
    let (plain, synced) = (tiny_resnet(), tiny_resnet());
    let g = single_group();
    convert_sync_batchnorm(&synced, &g).unwrap();
    plain.eval();
    synced.eval();
    let x = Tensor::randn([4, 1, 8, 8], 0.0, 1.0, 9, DType::F32, CPU).unwrap();
    let (a, b) = (plain.forward(&x).unwrap(), synced.forward(&x).unwrap());
    assert_eq!(values(&a), values(&b));
}

/// What one rank saw: logits, the input's gradient, the parameters' gradients, the buffers.
struct Seen {
    logits: Vec<f64>,
    dx: Vec<f64>,
    grads: Vec<(String, Vec<f64>)>,
    buffers: Vec<(String, Vec<f64>)>,
}

/// One training step (forward, `sum(logits * up)`, backward) of `model` on `x`.
fn step(model: &dyn Module, x: &Tensor, up: &Tensor) -> Seen {
    let x = x.to_variable();
    let y = model.forward(&x).unwrap();
    y.mul(up).unwrap().sum_all().unwrap().backward().unwrap();
    Seen {
        logits: values(&y),
        dx: values(&x.grad().unwrap()),
        grads: model
            .named_parameters()
            .into_iter()
            .map(|(n, p)| (n, values(&p.grad().unwrap())))
            .collect(),
        buffers: model
            .named_buffers()
            .into_iter()
            .map(|(n, b)| (n, values(&b)))
            .collect(),
    }
}

fn global_batch() -> (Tensor, Tensor) {
    let x = Tensor::randn([GLOBAL_BATCH, 1, 8, 8], 0.3, 1.5, 21, DType::F32, CPU).unwrap();
    let up = Tensor::randn([GLOBAL_BATCH, 4], 0.0, 1.0, 22, DType::F32, CPU).unwrap();
    (x, up)
}

/// `world` ranks as threads, each converting its own copy of the model and stepping on its
/// shard of the global batch.
fn ranks_step(world: usize) -> Vec<Seen> {
    let port = free_port().unwrap();
    let shard = GLOBAL_BATCH / world;
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            std::thread::spawn(move || -> Result<Seen> {
                let env = LaunchEnv {
                    rank,
                    world_size: world,
                    local_rank: rank,
                    local_world_size: world,
                    master_addr: "127.0.0.1".into(),
                    master_port: port,
                    launcher: Launcher::Torchrun,
                };
                let g = ProcessGroup::new(&env, &GroupOptions::new(Backend::Cpu))?;
                let model = tiny_resnet();
                convert_sync_batchnorm(&model, &g)?;
                let (x, up) = global_batch();
                let (x, up) = (
                    x.narrow(0, rank * shard, shard)?,
                    up.narrow(0, rank * shard, shard)?,
                );
                Ok(step(&model, &x, &up))
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().unwrap().unwrap())
        .collect()
}

/// Ranks with SyncBatchNorm compute what the plain model computes on the global batch: each
/// rank's logits and input gradient are its rows of the global ones, the parameters' gradients
/// sum to the global ones (SyncBatchNorm's own are local, as PyTorch's: DDP averages them), and
/// every rank's running statistics are the global batch's.
#[test]
fn ranks_with_sync_batch_norm_match_the_plain_model_on_the_global_batch() {
    let (x, up) = global_batch();
    let want = step(&tiny_resnet(), &x, &up);
    for world in [1, 2, 3] {
        let seen = ranks_step(world);
        let logits: Vec<f64> = seen.iter().flat_map(|s| s.logits.clone()).collect();
        let dx: Vec<f64> = seen.iter().flat_map(|s| s.dx.clone()).collect();
        let tol = 1e-4;
        let e = rel_err(&logits, &want.logits);
        assert!(e < tol, "{world} ranks: logits off by {e:e}");
        let e = rel_err(&dx, &want.dx);
        assert!(e < tol, "{world} ranks: input gradient off by {e:e}");
        for (i, (name, g)) in want.grads.iter().enumerate() {
            let mut total = vec![0.0; g.len()];
            for s in &seen {
                assert_eq!(&s.grads[i].0, name);
                for (t, v) in total.iter_mut().zip(&s.grads[i].1) {
                    *t += v;
                }
            }
            let e = rel_err(&total, g);
            assert!(e < tol, "{world} ranks: {name}'s gradient off by {e:e}");
        }
        for s in &seen {
            for ((name, got), (_, b)) in s.buffers.iter().zip(&want.buffers) {
                let e = rel_err(got, b);
                assert!(e < tol, "{world} ranks: {name} off by {e:e}");
            }
        }
        // The ranks' running statistics are combined the same way on each: equal bits.
        for s in &seen[1..] {
            assert_eq!(s.buffers, seen[0].buffers, "{world} ranks disagree");
        }
    }
}

/// `SyncBatchNorm` as a layer of a model built by hand: a batch norm's names and tensors, the
/// global statistics in training, back to a plain batch norm with `into_batch_norm`.
#[test]
fn sync_batch_norm_is_a_layer_with_a_batch_norms_names() {
    let g = single_group();
    let model = Sequential::new()
        .with(SyncBatchNorm::new(3, &g, &CPU).unwrap())
        .with(ReLU::new());
    let names: Vec<String> = model
        .state_dict()
        .unwrap()
        .into_iter()
        .map(|e| e.0)
        .collect();
    let plain = Sequential::new().with(BatchNorm2d::new(3, &CPU).unwrap());
    let want: Vec<String> = plain
        .state_dict()
        .unwrap()
        .into_iter()
        .map(|e| e.0)
        .collect();
    assert_eq!(names, want);
    let mut found = 0;
    model.visit_batch_norms("", &mut |name, bn| {
        assert_eq!((name, bn.swapped_in()), ("0", Some("SyncBatchNorm")));
        found += 1;
    });
    assert_eq!(found, 1);

    let x = Tensor::randn([4, 3, 5, 5], 1.0, 2.0, 4, DType::F32, CPU).unwrap();
    let sync = SyncBatchNorm::new(3, &g, &CPU).unwrap();
    let bn = BatchNorm2d::new(3, &CPU).unwrap();
    let e = rel_err(
        &values(&sync.forward_relu(&x).unwrap()),
        &values(&bn.forward_relu(&x).unwrap()),
    );
    assert!(e < 1e-5, "one rank's SyncBatchNorm vs BatchNorm2d: {e:e}");
    assert_eq!(values(&sync.num_batches_tracked), vec![1.0]);
    let e = rel_err(&values(&sync.running_var), &values(&bn.running_var));
    assert!(e < 1e-5, "running_var {e:e}");
    let back = sync.into_batch_norm();
    assert_eq!(back.swapped_in(), None);
    assert_eq!(values(&back.num_batches_tracked), vec![1.0]);
}

/// A layer converted for a group that was dropped fails loudly in training (never silently
/// local statistics), and still evaluates.
#[test]
fn a_dropped_group_is_an_error_not_local_statistics() {
    let bn = BatchNorm2d::new(2, &CPU).unwrap();
    let g = single_group();
    assert_eq!(convert_sync_batchnorm(&bn, &g).unwrap(), 1);
    drop(g);
    let x = Tensor::randn([2, 2, 3, 3], 0.0, 1.0, 5, DType::F32, CPU).unwrap();
    let e = bn.forward(&x).unwrap_err().to_string();
    assert!(
        e.contains("SyncBatchNorm") && e.contains("no longer exists"),
        "{e}"
    );
    bn.eval();
    bn.forward(&x).unwrap();
}

/// nn sits below distributed: no file of src/nn names it outside comments.
#[test]
fn nn_imports_nothing_of_distributed() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/nn");
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        files += 1;
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            assert!(
                !code.contains("distributed"),
                "{}:{}: {line}",
                path.display(),
                i + 1
            );
        }
    }
    assert!(files > 5, "read {files} files of {}", dir.display());
}
