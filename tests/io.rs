//! src/io on the CPU: safetensors round trips of every dtype, atomic writes, corrupt files,
//! strict weight loading, PyTorch's logits from a torch-made fixture, and checkpoints that
//! continue training bit for bit at O0 and O2 (SGD with momentum, AdamW), detect every flipped
//! byte, survive a crash at every step of a save, and still read the two-file version 1.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use mixprec::amp::{self, AmpModel, AmpOptimizer, OptLevel, Policy};
use mixprec::io::atomic::fault;
use mixprec::io::{self, safetensors, Checkpoint, TrainProgress};
use mixprec::nn::{self, BlockKind, Module, ResNet, ResNetConfig, Stem};
use mixprec::optim::{AdamConfig, FusedAdam, Optimizer, ParamGroup, Sgd, SgdConfig};
use mixprec::{DType, Device, Error, Mismatch, Tensor};

const CPU: Device = Device::Cpu;

/// A fresh directory under cargo's scratch space for this test.
fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("io").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Bit patterns of every value, whatever the dtype.
fn bits(t: &Tensor) -> Vec<u64> {
    match t.dtype() {
        DType::F16 => t
            .to_vec::<f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::BF16 => t
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::F32 => t
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::F64 => t
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        DType::I64 => t
            .to_vec::<i64>()
            .unwrap()
            .iter()
            .map(|&v| v as u64)
            .collect(),
    }
}

fn assert_same(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    let a: BTreeMap<_, _> = a.iter().map(|(n, t)| (n.clone(), t)).collect();
    let b: BTreeMap<_, _> = b.iter().map(|(n, t)| (n.clone(), t)).collect();
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}: names"
    );
    for (n, ta) in &a {
        let tb = b[n];
        assert_eq!(ta.dtype(), tb.dtype(), "{what}: {n} dtype");
        assert_eq!(ta.dims(), tb.dims(), "{what}: {n} shape");
        assert_eq!(bits(ta), bits(tb), "{what}: {n} values");
    }
}

fn small_resnet(widths: &[usize], blocks: &[usize], seed: u64) -> ResNet {
    let cfg = ResNetConfig {
        block: BlockKind::Basic,
        blocks: blocks.to_vec(),
        widths: widths.to_vec(),
        in_channels: 1,
        num_classes: 3,
        stem: Stem::Small,
        zero_init_residual: false,
        seed,
    };
    ResNet::new(&cfg, &CPU).unwrap()
}

// ---- safetensors -------------------------------------------------------------------------------

fn every_dtype() -> Vec<(String, Tensor)> {
    let f = [
        0.0,
        -0.0,
        1.5,
        -2.25,
        f64::INFINITY,
        f64::NEG_INFINITY,
        6.1e-5,
        1e-30,
    ];
    vec![
        (
            "half".into(),
            Tensor::from_vec(f.iter().map(|&v| f16::from_f64(v)).collect(), [2, 4], CPU).unwrap(),
        ),
        (
            "brain".into(),
            Tensor::from_vec(f.iter().map(|&v| bf16::from_f64(v)).collect(), [4, 2], CPU).unwrap(),
        ),
        (
            "single".into(),
            Tensor::from_vec(
                f.iter()
                    .map(|&v| v as f32)
                    .chain([f32::NAN, f32::MIN_POSITIVE / 8.0])
                    .collect(),
                [10],
                CPU,
            )
            .unwrap(),
        ),
        (
            "double".into(),
            Tensor::from_vec(
                f.iter().copied().chain([f64::NAN, 1e-310]).collect(),
                [5, 2, 1],
                CPU,
            )
            .unwrap(),
        ),
        (
            "long".into(),
            Tensor::from_vec(vec![i64::MIN, -1, 0, 1, i64::MAX], [5], CPU).unwrap(),
        ),
        (
            "layer1.0.bn1.num_batches_tracked".into(),
            Tensor::from_vec(vec![42i64], (), CPU).unwrap(),
        ),
        (
            "scalar".into(),
            Tensor::scalar(3.25, DType::F32, CPU).unwrap(),
        ),
        (
            "empty".into(),
            Tensor::zeros([0, 3], DType::F16, CPU).unwrap(),
        ),
    ]
}

#[test]
fn every_dtype_round_trips_bit_exactly_with_metadata() {
    let dir = scratch("round_trip");
    let path = dir.join("t.safetensors");
    let tensors = every_dtype();
    let meta: BTreeMap<String, String> = [("format", "pt"), ("note", "ünïcode ✓")]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    safetensors::write(&path, &tensors, &meta).unwrap();
    let (back, meta2) = safetensors::read(&path).unwrap();
    assert_eq!(meta2, meta);
    assert_same(&tensors, &back, "round trip");
    let names: Vec<&str> = back.iter().map(|(n, _)| n.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted, "read returns the tensors sorted by name");
    assert!(back.iter().all(|(_, t)| t.device() == CPU));
    // Deterministic: the same tensors give the same bytes.
    let first = std::fs::read(&path).unwrap();
    safetensors::write(&path, &tensors, &meta).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), first);
    // Written in place: nothing else left in the directory.
    assert_eq!(files_in(&dir), vec!["t.safetensors"]);
    // No metadata and no tensors are fine too.
    safetensors::write(&path, &[], &BTreeMap::new()).unwrap();
    let (none, m) = safetensors::read(&path).unwrap();
    assert!(none.is_empty() && m.is_empty());
}

#[test]
fn duplicate_names_are_an_error_and_the_old_file_stays() {
    let dir = scratch("duplicates");
    let path = dir.join("t.safetensors");
    let tensors = every_dtype();
    safetensors::write(&path, &tensors, &BTreeMap::new()).unwrap();
    let before = std::fs::read(&path).unwrap();
    let mut twice = tensors.clone();
    twice.push(("long".into(), Tensor::zeros([1], DType::F32, CPU).unwrap()));
    let e = safetensors::write(&path, &twice, &BTreeMap::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`long` given twice"), "{e}");
    let reserved = vec![(
        "__metadata__".to_string(),
        Tensor::zeros([1], DType::F32, CPU).unwrap(),
    )];
    assert!(safetensors::write(&path, &reserved, &BTreeMap::new()).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(files_in(&dir), vec!["t.safetensors"]);
}

#[test]
fn a_failing_write_leaves_the_old_file_and_no_temp_file() {
    let dir = scratch("atomic");
    let path = dir.join("t.safetensors");
    safetensors::write(&path, &every_dtype(), &BTreeMap::new()).unwrap();
    let before = std::fs::read(&path).unwrap();

    // A writer that fails half way, after some bytes went to the temporary file.
    let e = io::write_atomic(&path, |w| {
        w.write_all(b"half a file").unwrap();
        Err(Error::invalid_arg("test", "writer", "failing", "-"))
    })
    .unwrap_err();
    assert!(e.to_string().contains("failing"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(files_in(&dir), vec!["t.safetensors"]);

    // A rename that fails: the destination is a (non-empty) directory.
    let blocker = dir.join("blocked.safetensors");
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(blocker.join("keep"), b"x").unwrap();
    let e = safetensors::write(&blocker, &every_dtype(), &BTreeMap::new()).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert!(e.to_string().contains("blocked.safetensors"), "{e}");
    assert_eq!(files_in(&dir), vec!["blocked.safetensors", "t.safetensors"]);
    assert_eq!(files_in(&blocker), vec!["keep"]);

    // A directory that does not exist: nothing is created.
    let e = safetensors::write(
        &dir.join("no/such/dir/t.safetensors"),
        &[],
        &BTreeMap::new(),
    );
    assert!(matches!(e, Err(Error::Io { .. })));
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

/// A header written by hand: `{name: {dtype, shape, data_offsets}}` and `data_len` bytes.
fn hand_made(header: &str, data_len: usize) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend(h);
    b.extend(std::iter::repeat_n(0u8, data_len));
    b
}

#[test]
fn corrupt_truncated_and_foreign_files_are_errors_naming_the_file() {
    let dir = scratch("corrupt");
    let good_path = dir.join("good.safetensors");
    safetensors::write(&good_path, &every_dtype(), &BTreeMap::new()).unwrap();
    let good = std::fs::read(&good_path).unwrap();
    let p = Path::new("some/where/x.safetensors");

    // Every truncation fails, naming the file (and the reader never panics).
    for cut in 0..good.len() {
        let e = safetensors::parse(p, &good[..cut]).unwrap_err();
        assert!(
            matches!(&e, Error::DataFormat { path, .. } if path == "some/where/x.safetensors"),
            "cut at {cut}: {e}"
        );
    }
    // One byte too many.
    let mut long = good.clone();
    long.push(0);
    assert!(safetensors::parse(p, &long).is_err());

    // Flipped and replaced bytes in the header (and its length): an error or, where the change
    // is harmless (whitespace, a digit of a value), a file that still reads; never a panic.
    let header_end = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let mut errors = 0;
    for i in 0..header_end {
        for v in [good[i] ^ 0x01, good[i] ^ 0x80, b'"', b'9', b'}', 0xff] {
            let mut b = good.clone();
            b[i] = v;
            match safetensors::parse(p, &b) {
                Err(e) => {
                    errors += 1;
                    assert!(e.to_string().contains("x.safetensors"), "{e}");
                }
                Ok((ts, _)) => assert!(ts.len() <= every_dtype().len()),
            }
        }
    }
    assert!(errors > header_end, "{errors} errors");

    // Garbage, empty, a huge header length.
    let garbage: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    assert!(safetensors::parse(p, &garbage).is_err());
    assert!(safetensors::parse(p, &[]).is_err());
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend(b"{}      ");
    let e = safetensors::parse(p, &huge).unwrap_err().to_string();
    assert!(e.contains("x.safetensors"), "{e}");

    // An unsupported dtype names the tensor and the supported ones.
    let b = hand_made(
        r#"{"mask":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]}}"#,
        4,
    );
    let e = safetensors::parse(p, &b).unwrap_err().to_string();
    assert!(
        e.contains("`mask`") && e.contains("BOOL") && e.contains("F16, BF16, F32, F64, I64"),
        "{e}"
    );
    let b = hand_made(
        r#"{"w":{"dtype":"Q4","shape":[4],"data_offsets":[0,4]}}"#,
        4,
    );
    let e = safetensors::parse(p, &b).unwrap_err().to_string();
    assert!(
        e.contains("Q4") && e.contains("F16, BF16, F32, F64, I64"),
        "{e}"
    );

    // A byte range that does not hold shape × dtype names the tensor.
    let b = hand_made(
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[3],"data_offsets":[8,16]}}"#,
        16,
    );
    let e = safetensors::parse(p, &b).unwrap_err().to_string();
    assert!(
        e.contains("`w`") && e.contains("[3]") && e.contains("8..16"),
        "{e}"
    );
    // Overflowing shapes.
    let b = hand_made(
        r#"{"w":{"dtype":"F64","shape":[4294967296,4294967296,2],"data_offsets":[0,8]}}"#,
        8,
    );
    assert!(safetensors::parse(p, &b).is_err());
    let b = hand_made(
        r#"{"w":{"dtype":"F64","shape":[0,18446744073709551615],"data_offsets":[0,0]}}"#,
        0,
    );
    let (ts, _) = safetensors::parse(p, &b).unwrap();
    assert_eq!(ts[0].1.elem_count(), 0);

    // A missing file is an I/O error naming it.
    let e = safetensors::read(&dir.join("absent.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent.safetensors"), "{e}");
}

// ---- weights -----------------------------------------------------------------------------------

#[test]
fn weights_round_trip_and_strict_loading_reports_every_problem() {
    let dir = scratch("weights");
    let path = dir.join("w.safetensors");
    let a = small_resnet(&[4, 8], &[1, 1], 1);
    io::save_weights(&a, &path).unwrap();
    let (saved, meta) = safetensors::read(&path).unwrap();
    assert_eq!(meta["format"], "pt");
    assert_same(&saved, &a.state_dict().unwrap(), "saved = state_dict");
    let nbt = saved
        .iter()
        .find(|(n, _)| n == "layer2.0.downsample.1.num_batches_tracked")
        .unwrap();
    assert_eq!(nbt.1.dtype(), DType::I64);

    let b = small_resnet(&[4, 8], &[1, 1], 2);
    io::load_weights(&b, &path).unwrap();
    assert_same(&b.state_dict().unwrap(), &saved, "loaded");

    // Half models take the values in their own dtype, and save F32.
    let h = small_resnet(&[4, 8], &[1, 1], 3);
    h.cast(DType::F16, true).unwrap();
    io::load_weights(&h, &path).unwrap();
    assert_eq!(h.conv1.weight.dtype(), DType::F16);
    let hp = dir.join("half.safetensors");
    io::save_weights(&h, &hp).unwrap();
    let (hs, _) = safetensors::read(&hp).unwrap();
    assert!(hs
        .iter()
        .all(|(_, t)| t.dtype() == DType::F32 || t.dtype() == DType::I64));

    // Another architecture: one error with every missing, unexpected and mismatched tensor.
    let other = small_resnet(&[4, 6, 6], &[1, 1, 1], 4);
    let before = other.state_dict().unwrap();
    let e = io::load_weights(&other, &path).unwrap_err();
    let msg = e.to_string();
    let Error::StateMismatch { context, problems } = &e else {
        panic!("{e}")
    };
    assert!(context.contains("w.safetensors"), "{msg}");
    let has = |f: &dyn Fn(&Mismatch) -> bool| problems.iter().any(f);
    assert!(has(
        &|p| matches!(p, Mismatch::Missing { name, .. } if name == "layer3.0.conv1.weight")
    ));
    assert!(has(
        &|p| matches!(p, Mismatch::Shape { name, expected, found }
        if name == "layer2.0.conv1.weight" && expected.dims() == [6, 4, 3, 3] && found.dims() == [8, 4, 3, 3])
    ));
    assert!(has(
        &|p| matches!(p, Mismatch::Shape { name, .. } if name == "fc.weight")
    ));
    assert!(
        msg.contains("missing `layer3.0.bn2.running_var`")
            && msg.contains("`fc.weight`: shape [3, 6] expected, [3, 8] found"),
        "{msg}"
    );
    // Nothing changed.
    assert_same(&other.state_dict().unwrap(), &before, "after a failed load");

    // Unexpected names: the file has a stage that the model lacks.
    let two = dir.join("three_stages.safetensors");
    io::save_weights(&other, &two).unwrap();
    let small = small_resnet(&[4, 6], &[1, 1], 5);
    let msg = io::load_weights(&small, &two).unwrap_err().to_string();
    assert!(
        msg.contains("unexpected `layer3.0.conv1.weight` (f32 [6, 6, 3, 3])")
            && msg.contains("18 problem(s)"),
        "{msg}"
    );
    // A float where an integer counter belongs.
    let mut sd = a.state_dict().unwrap();
    for (n, t) in sd.iter_mut() {
        if n == "bn1.num_batches_tracked" {
            *t = Tensor::scalar(3.0, DType::F32, CPU).unwrap();
        }
    }
    let fp = dir.join("float_counter.safetensors");
    safetensors::write(&fp, &sd, &BTreeMap::new()).unwrap();
    let msg = io::load_weights(&b, &fp).unwrap_err().to_string();
    assert!(
        msg.contains("`bn1.num_batches_tracked`: dtype i64 expected, f32 found"),
        "{msg}"
    );
}

fn batch(i: usize) -> (Tensor, Tensor) {
    let x = Tensor::randn([4, 1, 8, 8], 0.0, 1.0, 1000 + i as u64, DType::F32, CPU).unwrap();
    let y = Tensor::from_vec(
        (0..4).map(|k| ((i + 2 * k) % 3) as i64).collect::<Vec<_>>(),
        [4],
        CPU,
    )
    .unwrap();
    (x, y)
}

fn train<M: Module, O: Optimizer>(
    m: &AmpModel<M>,
    o: &mut AmpOptimizer<O>,
    steps: std::ops::Range<usize>,
) {
    for i in steps {
        let (x, y) = batch(i);
        let loss = nn::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
        o.zero_grad().unwrap();
        o.backward(&loss).unwrap();
        o.step().unwrap();
    }
}

#[test]
fn save_weights_of_an_o2_model_holds_its_fp32_masters() {
    let dir = scratch("o2_weights");
    let m = small_resnet(&[4, 8], &[1, 1], 6);
    let o = sgd(m.parameters());
    let policy = Policy::opt_level(OptLevel::O2).with_report_interval(0);
    let (m, mut o) = amp::initialize(m, o, policy).unwrap();
    train(&m, &mut o, 0..3);
    assert_eq!(m.inner().conv1.weight.dtype(), DType::F16);
    let path = dir.join("o2.safetensors");
    io::save_weights(&m, &path).unwrap();
    let (saved, _) = safetensors::read(&path).unwrap();
    let saved: BTreeMap<_, _> = saved.into_iter().collect();
    let masters = o.master_params();
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(masters.len(), names.len());
    for (n, master) in names.iter().zip(&masters) {
        assert_eq!(master.dtype(), DType::F32);
        assert_eq!(saved[n].dtype(), DType::F32);
        assert_eq!(
            bits(&saved[n]),
            bits(master),
            "{n}: the FP32 master is saved"
        );
    }
    assert_eq!(saved["bn1.num_batches_tracked"].dtype(), DType::I64);
    // An FP32 model loads them exactly.
    let f = small_resnet(&[4, 8], &[1, 1], 7);
    io::load_weights(&f, &path).unwrap();
    for (p, master) in f.parameters().iter().zip(&masters) {
        assert_eq!(bits(p), bits(master));
    }
}

// ---- PyTorch ------------------------------------------------------------------------------------

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// `max |a - b| / max |b|` and `‖a - b‖ / ‖b‖`.
fn rel_errors(a: &[f64], b: &[f64]) -> (f64, f64) {
    let max_b = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let max_d = a
        .iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    let d2: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let b2: f64 = b.iter().map(|y| y * y).sum();
    (max_d / max_b, (d2 / b2).sqrt())
}

/// tests/fixtures/make_torch_resnet.py's net, with torch's weights and eval logits.
#[test]
fn torch_weights_give_torchs_logits() {
    let cfg = ResNetConfig {
        block: BlockKind::Basic,
        blocks: vec![1, 2],
        widths: vec![4, 8],
        in_channels: 2,
        num_classes: 5,
        stem: Stem::Small,
        zero_init_residual: false,
        seed: 99,
    };
    let model = ResNet::new(&cfg, &CPU).unwrap();
    let weights = fixture("torch_small_resnet.safetensors");
    io::load_weights(&model, &weights).unwrap();
    model.eval();
    let (io_tensors, _) = safetensors::read(&fixture("torch_small_resnet_io.safetensors")).unwrap();
    let get = |n: &str| io_tensors.iter().find(|(k, _)| k == n).unwrap().1.clone();
    let (x, want) = (get("x"), get("logits"));
    assert_eq!((x.dims(), want.dims()), (&[3, 2, 9, 9][..], &[3, 5][..]));
    let got = mixprec::with_no_grad(|| model.forward(&x)).unwrap();
    let (max_rel, l2_rel) = rel_errors(&got.to_vec_f64().unwrap(), &want.to_vec_f64().unwrap());
    println!("torch fixture: max rel error {max_rel:e}, rel L2 error {l2_rel:e}");
    assert!(
        max_rel < 1e-5 && l2_rel < 1e-5,
        "max rel {max_rel:e}, rel L2 {l2_rel:e}"
    );
    // The counters came through as I64 values.
    assert_eq!(model.bn1.num_batches_tracked.dtype(), DType::I64);

    // What save_weights writes holds exactly torch's tensors, dtypes included. The file is left
    // for `python3 tests/fixtures/make_torch_resnet.py --check FILE` (loads it into torch).
    let out = scratch("torch").join("torch_small_resnet_roundtrip.safetensors");
    io::save_weights(&model, &out).unwrap();
    assert_same(
        &safetensors::read(&out).unwrap().0,
        &safetensors::read(&weights).unwrap().0,
        "save_weights of torch's weights",
    );
}

// ---- checkpoints ---------------------------------------------------------------------------------

fn sgd(params: Vec<Tensor>) -> Sgd {
    Sgd::new(
        params,
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 1e-4,
            ..Default::default()
        },
    )
    .unwrap()
}

fn adamw(params: Vec<Tensor>) -> FusedAdam {
    FusedAdam::new(
        params,
        AdamConfig {
            lr: 3e-3,
            weight_decay: 0.01,
            adam_w_mode: true,
            ..Default::default()
        },
    )
    .unwrap()
}

fn policy(level: OptLevel) -> Policy {
    Policy::opt_level(level)
        .with_scale_window(3)
        .with_init_scale(256.0)
        .with_report_interval(0)
}

/// 10 steps in one go, against 5 steps, a checkpoint saved and loaded, a fresh model and
/// optimizer (other initial weights) restored, and 5 more steps: every bit equal.
fn continues_bitwise<O: Optimizer>(level: OptLevel, make: fn(Vec<Tensor>) -> O, tag: &str) {
    let dir = scratch(&format!("continue_{tag}"));
    let path = dir.join("ckpt.safetensors");
    let wrap = |seed| {
        let m = small_resnet(&[4, 8], &[1, 1], seed);
        let o = make(m.parameters());
        amp::initialize(m, o, policy(level)).unwrap()
    };
    let (ma, mut oa) = wrap(1);
    train(&ma, &mut oa, 0..10);

    let (mb, mut ob) = wrap(1);
    train(&mb, &mut ob, 0..5);
    let progress = TrainProgress {
        epoch: 1,
        step: 5,
        seed: u64::MAX - 1,
    };
    let extra = serde_json::json!({"config": {"lr": 0.05, "widths": [4, 8]}, "history": [{"epoch": 0, "loss": 1.25}]});
    Checkpoint::capture(&mb, &ob, progress, extra.clone())
        .unwrap()
        .save(&path)
        .unwrap();
    drop((mb, ob));
    assert_eq!(files_in(&dir), vec!["ckpt.safetensors"]);

    let ck = Checkpoint::load(&path).unwrap();
    assert_eq!(ck.progress, progress);
    assert_eq!(ck.extra, extra);
    let (mc, mut oc) = wrap(2);
    ck.restore(&mc, &mut oc).unwrap();
    train(&mc, &mut oc, 5..10);

    assert_same(
        &ma.state_dict().unwrap(),
        &mc.state_dict().unwrap(),
        &format!("{tag}: model"),
    );
    for (pa, pc) in ma.parameters().iter().zip(mc.parameters()) {
        assert_eq!(pa.dtype(), pc.dtype());
        assert_eq!(bits(pa), bits(&pc), "{tag}: model weights");
    }
    for (pa, pc) in oa.master_params().iter().zip(oc.master_params()) {
        assert_eq!(bits(pa), bits(&pc), "{tag}: master weights");
    }
    let (sa, sc) = (oa.state_dict().unwrap(), oc.state_dict().unwrap());
    assert_eq!(sa.scalers, sc.scalers, "{tag}: scalers");
    assert_eq!(sa.optimizer.param_groups, sc.optimizer.param_groups);
    assert_eq!(
        sa.optimizer.state.keys().collect::<Vec<_>>(),
        sc.optimizer.state.keys().collect::<Vec<_>>()
    );
    for (pos, ea) in &sa.optimizer.state {
        let ec = &sc.optimizer.state[pos];
        assert_eq!(ea.keys().collect::<Vec<_>>(), ec.keys().collect::<Vec<_>>());
        for (k, t) in ea {
            assert_eq!(bits(t), bits(&ec[k]), "{tag}: optimizer state {pos}.{k}");
        }
    }
    if matches!(level, OptLevel::O1 | OptLevel::O2) {
        // The window of 3 made the dynamic scale grow across the checkpoint.
        assert!(sa.scalers[0].loss_scale > 256.0, "{tag}: {:?}", sa.scalers);
    }
}

#[test]
fn checkpoint_continues_bitwise_o0_sgd() {
    continues_bitwise(OptLevel::O0, sgd, "o0_sgd");
}

#[test]
fn checkpoint_continues_bitwise_o0_adamw() {
    continues_bitwise(OptLevel::O0, adamw, "o0_adamw");
}

#[test]
fn checkpoint_continues_bitwise_o2_sgd() {
    continues_bitwise(OptLevel::O2, sgd, "o2_sgd");
}

#[test]
fn checkpoint_continues_bitwise_o2_adamw() {
    continues_bitwise(OptLevel::O2, adamw, "o2_adamw");
}

#[test]
fn checkpoint_continues_bitwise_o1_and_o3_sgd() {
    continues_bitwise(OptLevel::O1, sgd, "o1_sgd");
    continues_bitwise(OptLevel::O3, sgd, "o3_sgd");
}

#[test]
fn checkpoint_files_hold_the_layout() {
    let dir = scratch("layout");
    let path = dir.join("epoch3.safetensors");
    let m = small_resnet(&[4, 8], &[1, 1], 1);
    let o = sgd(m.parameters());
    let (m, mut o) = amp::initialize(m, o, policy(OptLevel::O2)).unwrap();
    train(&m, &mut o, 0..2);
    let progress = TrainProgress {
        epoch: 3,
        step: 2,
        seed: 7,
    };
    Checkpoint::capture(&m, &o, progress, serde_json::Value::Null)
        .unwrap()
        .save(&path)
        .unwrap();
    let (tensors, meta) = safetensors::read(&path).unwrap();
    assert_eq!(meta["format"], "mixprec-checkpoint");
    assert_eq!(meta["version"], "2");
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    for n in [
        "model.conv1.weight",
        "model.layer2.0.downsample.1.num_batches_tracked",
        "optimizer.state.0.momentum_buffer",
        "optimizer.state.0.master_param",
        "optimizer.state.0.step",
    ] {
        assert!(names.contains(&n), "{n} in {names:?}");
    }
    for (n, t) in &tensors {
        let want = if n.ends_with("num_batches_tracked") {
            DType::I64
        } else {
            DType::F32
        };
        assert_eq!(t.dtype(), want, "{n}");
    }
    // One file: the manifest is in the header, with its own CRC-32 and one per tensor.
    assert_eq!(files_in(&dir), vec!["epoch3.safetensors"]);
    let manifest = &meta["manifest"];
    assert_eq!(
        meta["manifest_crc32"],
        format!("{:08x}", crc32(manifest.as_bytes()))
    );
    let json: serde_json::Value = serde_json::from_str(manifest).unwrap();
    assert_eq!(json["progress"]["epoch"], 3);
    assert_eq!(json["param_groups"][0]["hyperparams"]["momentum"], 0.9);
    assert!(json["scalers"][0]["loss_scale"].as_f64().unwrap() >= 256.0);
    assert_eq!(json["tensors"].as_object().unwrap().len(), tensors.len());
    let (_, w) = tensors
        .iter()
        .find(|(n, _)| n == "model.conv1.weight")
        .unwrap();
    let rec = &json["tensors"]["model.conv1.weight"];
    assert_eq!(rec["dtype"], "F32");
    assert_eq!(rec["shape"], serde_json::json!(w.dims()));
    let le: Vec<u8> = w
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert_eq!(rec["crc32"], format!("{:08x}", crc32(&le)));
    assert_eq!(
        Checkpoint::peek(&path).unwrap(),
        TrainProgress {
            epoch: 3,
            step: 2,
            seed: 7
        }
    );
}

/// zlib's CRC-32, bit by bit (an independent check of the checkpoint's).
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// A small trained O0 model and its checkpoint.
fn small_checkpoint() -> (AmpModel<ResNet>, AmpOptimizer<Sgd>, Checkpoint) {
    let m = small_resnet(&[4, 8], &[1, 1], 1);
    let o = sgd(m.parameters());
    let (m, mut o) = amp::initialize(m, o, policy(OptLevel::O0)).unwrap();
    train(&m, &mut o, 0..1);
    let progress = TrainProgress {
        epoch: 1,
        step: 1,
        seed: 3,
    };
    let ck = Checkpoint::capture(&m, &o, progress, serde_json::json!({"note": "x"})).unwrap();
    (m, o, ck)
}

/// Writes `ck` as version 1 did: tensors (format, version 1, an id in the metadata) and a JSON
/// file beside them.
fn save_v1(ck: &Checkpoint, path: &Path, id: &str) {
    let tmp = path.with_extension("v2");
    ck.save(&tmp).unwrap();
    let (tensors, meta) = safetensors::read(&tmp).unwrap();
    std::fs::remove_file(&tmp).unwrap();
    let m: serde_json::Value = serde_json::from_str(&meta["manifest"]).unwrap();
    let v1_meta: BTreeMap<String, String> = [
        ("format", "mixprec-checkpoint"),
        ("version", "1"),
        ("id", id),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    safetensors::write(path, &tensors, &v1_meta).unwrap();
    let json = serde_json::json!({
        "format": "mixprec-checkpoint",
        "version": 1,
        "id": id,
        "tensors": path.file_name().unwrap().to_string_lossy(),
        "param_groups": m["param_groups"],
        "scalers": m["scalers"],
        "progress": m["progress"],
        "extra": m["extra"],
    });
    std::fs::write(path.with_extension("json"), json.to_string()).unwrap();
}

#[test]
fn checkpoint_file_errors_name_the_file() {
    let dir = scratch("ckpt_files");
    let (m, _o, ck) = small_checkpoint();
    let a = dir.join("a.safetensors");
    ck.save(&a).unwrap();

    // A weights file is not a checkpoint.
    let w = dir.join("w.safetensors");
    io::save_weights(&m, &w).unwrap();
    let e = Checkpoint::load(&w).unwrap_err().to_string();
    assert!(
        e.contains("w.safetensors") && e.contains("not a checkpoint"),
        "{e}"
    );
    // The tensors are truncated.
    let bytes = std::fs::read(&a).unwrap();
    std::fs::write(&a, &bytes[..bytes.len() / 2]).unwrap();
    let e = Checkpoint::load(&a).unwrap_err().to_string();
    assert!(e.contains("a.safetensors"), "{e}");
    // A JSON path is not a checkpoint path.
    assert!(ck.save(&dir.join("c.json")).is_err());
    // A non-finite hyperparameter (JSON has none) is refused before any file is written.
    let mut nan = ck.clone();
    nan.optimizer.optimizer.param_groups[0]
        .hyperparams
        .insert("lr".into(), f64::NAN);
    let e = nan
        .save(&dir.join("nan.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("param_groups[0].lr = NaN"), "{e}");
    assert!(!dir.join("nan.safetensors").exists());
}

/// Version 1 (two files) still loads, with its pairing checks; saving it again writes the
/// one-file version 2 and drops the JSON.
#[test]
fn version_1_checkpoints_load_and_convert() {
    let dir = scratch("ckpt_v1");
    let (_m, _o, ck) = small_checkpoint();
    let b = dir.join("b.safetensors");
    save_v1(&ck, &b, "id-b");
    let old = Checkpoint::load(&b).unwrap();
    assert_eq!(old.progress, ck.progress);
    assert_eq!(old.extra, ck.extra);
    assert_eq!(Checkpoint::peek(&b).unwrap(), ck.progress);

    // The JSON is from another save.
    save_v1(&ck, &dir.join("a.safetensors"), "id-a");
    let saved_b = std::fs::read(dir.join("b.json")).unwrap();
    std::fs::copy(dir.join("a.json"), dir.join("b.json")).unwrap();
    let e = Checkpoint::load(&b).unwrap_err().to_string();
    assert!(e.contains("b.json") && e.contains("different saves"), "{e}");
    // The JSON is missing.
    std::fs::remove_file(dir.join("b.json")).unwrap();
    let e = Checkpoint::load(&b).unwrap_err().to_string();
    assert!(e.contains("b.json"), "{e}");
    // The JSON is corrupt.
    std::fs::write(
        dir.join("b.json"),
        b"{\"format\": \"mixprec-checkpoint\", \"vers",
    )
    .unwrap();
    let e = Checkpoint::load(&b).unwrap_err();
    assert!(
        matches!(&e, Error::DataFormat { path, .. } if path.ends_with("b.json")),
        "{e}"
    );

    // Converted by a load and a save.
    std::fs::write(dir.join("b.json"), saved_b).unwrap();
    Checkpoint::load(&b).unwrap().save(&b).unwrap();
    assert!(!dir.join("b.json").exists());
    let (_, meta) = safetensors::read(&b).unwrap();
    assert_eq!(meta["version"], "2");
    assert_eq!(Checkpoint::load(&b).unwrap().progress, ck.progress);
}

/// The byte ranges of each tensor's data in a safetensors file, by name.
fn data_ranges(bytes: &[u8]) -> (usize, Vec<(String, std::ops::Range<usize>)>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = 8 + n;
    let mut v: Vec<_> = header
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let o = &v["data_offsets"];
            let (s, e) = (
                o[0].as_u64().unwrap() as usize,
                o[1].as_u64().unwrap() as usize,
            );
            (k.clone(), start + s..start + e)
        })
        .collect();
    v.sort_by_key(|(_, r)| r.start);
    (start, v)
}

/// A flipped byte anywhere in a checkpoint is an error: in a tensor's data, one naming that
/// tensor (its CRC-32); in the header, one naming the file (and the tensor or the manifest
/// when the header still parses). The length prefix, about 500 bytes spread over the header
/// (JSON structure, tensor entries, the manifest and its CRC), and the first, middle and last
/// byte of every tensor.
#[test]
fn a_flipped_byte_anywhere_is_an_error_naming_the_tensor() {
    let dir = scratch("ckpt_flip");
    let (_m, _o, ck) = small_checkpoint();
    let path = dir.join("c.safetensors");
    ck.save(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let (data_start, ranges) = data_ranges(&good);
    let flipped = dir.join("flipped.safetensors");
    let load_flipped = |at: usize| {
        let mut b = good.clone();
        b[at] ^= 0x5a;
        std::fs::write(&flipped, &b).unwrap();
        Checkpoint::load(&flipped)
    };
    let stride = (data_start / 500).max(1);
    for at in (0..16).chain((16..data_start).step_by(stride)) {
        let e = load_flipped(at).expect_err(&format!("header byte {at} flipped"));
        assert!(
            e.to_string().contains("flipped.safetensors"),
            "byte {at}: {e}"
        );
    }
    let mut data_checks = 0;
    for (name, r) in &ranges {
        let len = r.end - r.start;
        for at in [r.start, r.start + len / 2, r.end - 1] {
            let msg = load_flipped(at)
                .expect_err(&format!("data byte {at} of {name} flipped"))
                .to_string();
            assert!(
                msg.contains(&format!("tensor `{name}`")) && msg.contains("CRC-32"),
                "byte {at} of {name}: {msg}"
            );
            data_checks += 1;
        }
    }
    assert!(data_checks >= 3 * 20, "{data_checks}");
    // And the unflipped file loads.
    std::fs::write(&flipped, &good).unwrap();
    Checkpoint::load(&flipped).unwrap();
}

/// A save that fails or crashes at any step (creating the temporary file, each write, the
/// fsync, the rename, the directory's fsync) leaves a checkpoint that loads and verifies: the
/// previous one or the new one. A crash leaves its temporary file, which the next save to the
/// same name removes; an error leaves none.
#[test]
fn a_save_that_fails_at_any_step_leaves_a_verified_checkpoint() {
    let dir = scratch("ckpt_faults");
    let (m, mut o, old) = small_checkpoint();
    let path = dir.join("last.safetensors");
    old.save(&path).unwrap();
    train(&m, &mut o, 1..2);
    let new = Checkpoint::capture(
        &m,
        &o,
        TrainProgress {
            epoch: 2,
            step: 2,
            seed: 3,
        },
        serde_json::Value::Null,
    )
    .unwrap();
    // How many steps a save takes (several writes: the file is larger than the 1 MiB buffer
    // only for bigger models, so at least create, write, fsync, rename, directory fsync).
    fault::fail_at(None, fault::Mode::Error);
    new.save(&dir.join("probe.safetensors")).unwrap();
    let steps = fault::steps();
    std::fs::remove_file(dir.join("probe.safetensors")).unwrap();
    assert!(steps >= 5, "{steps}");
    for mode in [fault::Mode::Error, fault::Mode::Crash] {
        for k in 0..steps {
            old.save(&path).unwrap();
            fault::fail_at(Some(k), mode);
            let r = new.save(&path);
            fault::fail_at(None, mode);
            let e = r.expect_err(&format!("{mode:?} at step {k} of {steps}"));
            assert!(e.to_string().contains("injected"), "{e}");
            let got = Checkpoint::load(&path)
                .unwrap_or_else(|e| panic!("{mode:?} at step {k}: no loadable checkpoint: {e}"));
            assert!(
                got.progress == old.progress || got.progress == new.progress,
                "{mode:?} at step {k}: {:?}",
                got.progress
            );
            // Before the rename the old checkpoint stands; after it, the new one.
            let renamed = k + 1 >= steps;
            let want = if renamed { &new } else { &old };
            assert_eq!(got.progress, want.progress, "{mode:?} at step {k}");
            let leftovers: Vec<String> = files_in(&dir)
                .into_iter()
                .filter(|f| f.contains(".tmp-"))
                .collect();
            match mode {
                fault::Mode::Error => assert!(leftovers.is_empty(), "{k}: {leftovers:?}"),
                fault::Mode::Crash if k > 0 && !renamed => {
                    assert_eq!(leftovers.len(), 1, "{k}: {leftovers:?}")
                }
                fault::Mode::Crash => {}
            }
            // The next save cleans up after the crash.
            new.save(&path).unwrap();
            assert_eq!(
                files_in(&dir),
                vec!["last.safetensors"],
                "{mode:?} at step {k}"
            );
            assert_eq!(Checkpoint::load(&path).unwrap().progress, new.progress);
        }
    }
}

/// A checkpoint whose values are not finite (a diverged run saved it; its checksums are
/// right) is refused by `restore`, naming the tensors, and skipped by `latest`.
#[test]
fn checkpoints_of_nan_weights_are_refused() {
    let dir = scratch("ckpt_nan");
    let (m, mut o, good) = small_checkpoint();
    good.save(&dir.join("epoch-001.safetensors")).unwrap();
    let mut nan = good.clone();
    nan.progress.step += 1;
    let (name, t) = nan.model[0].clone();
    let mut v = t.to_vec_f64().unwrap();
    v[0] = f64::NAN;
    nan.model[0].1 = Tensor::from_vec(v, t.dims().to_vec(), CPU)
        .unwrap()
        .to_dtype(t.dtype())
        .unwrap();
    nan.save(&dir.join("last.safetensors")).unwrap();
    let loaded = Checkpoint::load(&dir.join("last.safetensors")).unwrap();
    let e = loaded.restore(&m, &mut o).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::NonFinite { .. }), "{msg}");
    assert!(msg.contains(&format!("`model.{name}`")), "{msg}");
    let l = io::latest(&dir).unwrap().unwrap();
    assert_eq!(l.path, dir.join("epoch-001.safetensors"));
    assert_eq!(l.skipped.len(), 1);
    assert!(
        l.skipped[0].1.to_string().contains("Inf or NaN"),
        "{:?}",
        l.skipped
    );
}

/// `latest` takes the newest checkpoint that verifies (by progress, not by name or time),
/// naming each newer one it skipped and why.
#[test]
fn latest_takes_the_newest_verified_checkpoint() {
    let dir = scratch("ckpt_latest");
    assert!(io::latest(&dir).unwrap().is_none());
    let (_m, _o, ck) = small_checkpoint();
    for (name, epoch) in [
        ("epoch-001", 1),
        ("epoch-002", 2),
        ("last", 3),
        ("epoch-003", 3),
    ] {
        let mut c = ck.clone();
        c.progress.epoch = epoch;
        c.progress.step = 10 * epoch as u64;
        c.save(&dir.join(format!("{name}.safetensors"))).unwrap();
    }
    let l = io::latest(&dir).unwrap().unwrap();
    assert_eq!(l.checkpoint.progress.epoch, 3);
    assert!(l.skipped.is_empty());
    // Corrupt both epoch-3 files: epoch-002 is taken, and the two are named with reasons.
    for name in ["last", "epoch-003"] {
        let p = dir.join(format!("{name}.safetensors"));
        let mut b = std::fs::read(&p).unwrap();
        let n = b.len();
        b[n - 3] ^= 0xff;
        std::fs::write(&p, b).unwrap();
    }
    let l = io::latest(&dir).unwrap().unwrap();
    assert_eq!(l.path, dir.join("epoch-002.safetensors"));
    let skipped: Vec<String> = l
        .skipped
        .iter()
        .map(|(p, e)| format!("{}: {e}", p.display()))
        .collect();
    assert_eq!(skipped.len(), 2, "{skipped:?}");
    assert!(skipped.iter().all(|s| s.contains("CRC-32")), "{skipped:?}");
    // None verifies: an error listing them all.
    for name in ["epoch-001", "epoch-002"] {
        std::fs::write(dir.join(format!("{name}.safetensors")), b"garbage").unwrap();
    }
    let msg = io::latest(&dir).unwrap_err().to_string();
    for name in ["last", "epoch-001", "epoch-002", "epoch-003"] {
        assert!(msg.contains(name), "{msg}");
    }
}

#[test]
fn mismatched_checkpoints_name_the_tensors_and_change_nothing() {
    let dir = scratch("mismatch");
    let path = dir.join("ckpt.safetensors");
    let m = small_resnet(&[4, 8], &[1, 1], 1);
    let o = sgd(m.parameters());
    let (m, mut o) = amp::initialize(m, o, policy(OptLevel::O2)).unwrap();
    train(&m, &mut o, 0..2);
    Checkpoint::capture(&m, &o, TrainProgress::default(), serde_json::Value::Null)
        .unwrap()
        .save(&path)
        .unwrap();
    let ck = Checkpoint::load(&path).unwrap();

    // Another width: the model's and the optimizer's tensors, with both shapes.
    let other = small_resnet(&[4, 6], &[1, 1], 2);
    let oo = sgd(other.parameters());
    let (other, mut oo) = amp::initialize(other, oo, policy(OptLevel::O2)).unwrap();
    train(&other, &mut oo, 0..1);
    let before = (other.state_dict().unwrap(), oo.state_dict().unwrap());
    let e = ck.restore(&other, &mut oo).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::StateMismatch { .. }), "{msg}");
    assert!(
        msg.contains(
            "`model.layer2.0.conv1.weight`: shape [6, 4, 3, 3] expected, [8, 4, 3, 3] found"
        ),
        "{msg}"
    );
    // layer2.0.conv1.weight is parameter 6 (conv1, bn1 ×2, layer1.0: conv1, bn1 ×2, conv2, ...).
    let pos = other
        .named_parameters()
        .iter()
        .position(|(n, _)| n == "layer2.0.conv1.weight")
        .unwrap();
    assert!(
        msg.contains(&format!(
            "`optimizer.state.{pos}.momentum_buffer`: shape [6, 4, 3, 3] expected, [8, 4, 3, 3] found"
        )),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("optimizer.state.{pos}.master_param")),
        "{msg}"
    );
    assert_same(
        &other.state_dict().unwrap(),
        &before.0,
        "model after a failed restore",
    );
    let after = oo.state_dict().unwrap();
    assert_eq!(after.scalers, before.1.scalers);
    for (p, e) in &before.1.optimizer.state {
        for (k, t) in e {
            assert_eq!(bits(t), bits(&after.optimizer.state[p][k]));
        }
    }

    // Two groups where the checkpoint has one.
    let g = small_resnet(&[4, 8], &[1, 1], 3);
    let ps = g.parameters();
    let cfg = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..Default::default()
    };
    let two = Sgd::with_groups(vec![
        ParamGroup::new(ps[..3].to_vec(), cfg),
        ParamGroup::new(ps[3..].to_vec(), cfg),
    ])
    .unwrap();
    let (g, mut two) = amp::initialize(g, two, policy(OptLevel::O2)).unwrap();
    let msg = ck.restore(&g, &mut two).unwrap_err().to_string();
    assert!(
        msg.contains("optimizer.param_groups")
            && msg.contains("1 group(s) in the checkpoint, 2 in the optimizer"),
        "{msg}"
    );

    // An O2 checkpoint (with masters) into an O0 optimizer (without).
    let z = small_resnet(&[4, 8], &[1, 1], 4);
    let zo = sgd(z.parameters());
    let (z, mut zo) = amp::initialize(z, zo, policy(OptLevel::O0)).unwrap();
    let msg = ck.restore(&z, &mut zo).unwrap_err().to_string();
    assert!(
        msg.contains("optimizer.state.0.master_param") && msg.contains("keeps none"),
        "{msg}"
    );

    // A tensor removed and one added: missing and unexpected, by their checkpoint names.
    let mut edited = ck.clone();
    edited.model.retain(|(n, _)| n != "bn1.running_var");
    edited.model.push((
        "head.weight".into(),
        Tensor::zeros([2, 2], DType::F32, CPU).unwrap(),
    ));
    let m2 = small_resnet(&[4, 8], &[1, 1], 5);
    let o2 = sgd(m2.parameters());
    let (m2, mut o2) = amp::initialize(m2, o2, policy(OptLevel::O2)).unwrap();
    let msg = edited.restore(&m2, &mut o2).unwrap_err().to_string();
    assert!(
        msg.contains("missing `model.bn1.running_var` (f32 [4])")
            && msg.contains("unexpected `model.head.weight` (f32 [2, 2])"),
        "{msg}"
    );
    // And the intact checkpoint restores into it.
    ck.restore(&m2, &mut o2).unwrap();
}
