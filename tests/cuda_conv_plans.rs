//! How convolution plans are chosen, in a test binary of its own: it points the cuDNN plan cache
//! at a fresh directory and clears the chosen plans between steps, which would disturb the
//! convolution tests of tests/cuda.rs. The tests take a lock, so they run one at a time.
//! Ignored without a GPU.
//!
//! - every plan is timed, and with both APIs' candidates timed (nothing wins untimed);
//! - a second build reads the plan cache: the same choices, no timing runs;
//! - corrupt or stale cache files are ignored (re-timed and rewritten), never an error;
//! - under `set_deterministic`, plans are chosen apart, no engine noted NONDETERMINISTIC is
//!   chosen, and every direction repeats bit for bit.
//!
//! Results are checked against the CPU's NCHW convolution (channels_last operands permuted).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use mixprec::backend::cpu::CpuStorage;
use mixprec::backend::cuda::{
    clear_conv_plans, conv_plan_cache_dir, conv_plans, conv_timing_runs, deterministic,
    set_deterministic, set_poison_allocations, ConvPlanInfo, CudaStorage, PlanSource,
};
// The backend contract: the storage trait, each op family's trait and parameter types.
use mixprec::backend::prelude::*;
use mixprec::tensor::{random, Layout, MemoryFormat};
use mixprec::{DType, Device, Shape};

/// The plan cache directory of this process (fresh), set before any convolution runs.
fn setup() -> (MutexGuard<'static, ()>, PathBuf) {
    static LOCK: Mutex<()> = Mutex::new(());
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = DIR
        .get_or_init(|| {
            let d = std::env::temp_dir().join(format!(
                "mixprec-plan-cache-test-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos())
            ));
            // Only this binary's tests run here, one at a time (the lock): nothing reads the
            // environment concurrently.
            std::env::set_var("MIXPREC_CUDNN_PLAN_CACHE", &d);
            std::env::remove_var("MIXPREC_CUDNN_RETUNE");
            std::env::remove_var("MIXPREC_CUDNN_FIND");
            d
        })
        .clone();
    set_poison_allocations(true);
    Device::cuda(0).expect("these tests need a CUDA GPU");
    assert_eq!(conv_plan_cache_dir().as_deref(), Some(dir.as_path()));
    (guard, dir)
}

/// The row-major layout of `dims`.
fn lay(dims: &[usize]) -> Layout {
    Layout::contiguous(Shape::new(dims.to_vec()))
}

/// The layout of `dims` stored in `format`.
fn lay_as(dims: [usize; 4], format: MemoryFormat) -> Layout {
    Layout::with_format(Shape::new(dims.to_vec()), format)
}

fn randn(dims: [usize; 4], d: DType, seed: u64) -> CpuStorage {
    let n = dims.iter().product();
    let v = CpuStorage::F32(
        random::normal(seed, n, 0.0, 1.0)
            .into_iter()
            .map(|x| x as f32)
            .collect(),
    );
    v.to_dtype(&lay(&[n]), d).unwrap()
}

fn up(c: &CpuStorage) -> CudaStorage {
    CudaStorage::from_cpu(c, 0).unwrap()
}

#[allow(clippy::too_many_arguments)]
fn geometry(
    n: usize,
    c_in: usize,
    hw: usize,
    c_out: usize,
    k: usize,
    stride: usize,
    pad: usize,
    format: MemoryFormat,
) -> Conv2dParams {
    Conv2dParams {
        n,
        c_in,
        h: hw,
        w: hw,
        c_out,
        kh: k,
        kw: k,
        stride: (stride, stride),
        padding: (pad, pad),
        dilation: (1, 1),
        groups: 1,
        format,
    }
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if got.iter().any(|g| !g.is_finite()) {
        return f64::INFINITY;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Runs the three directions of `p` in `d` on the GPU (operands stored in `p.format`) and checks
/// them against the CPU's NCHW result.
fn run_and_check(p: &Conv2dParams, d: DType, seed: u64) {
    let xd = [p.n, p.c_in, p.h, p.w];
    let wd = [p.c_out, p.c_in, p.kh, p.kw];
    let yd = [p.n, p.c_out, p.out_h(), p.out_w()];
    let x = randn(xd, d, seed);
    let w = randn(wd, d, seed + 1);
    let w = w.affine(&lay(&wd), 0.2, 0.0).unwrap();
    let g = randn(yd, d, seed + 2);
    let nchw = Conv2dParams {
        format: MemoryFormat::Contiguous,
        ..*p
    };
    // The GPU's operands: the same values stored in p.format.
    let stored = |v: &CpuStorage, dims: [usize; 4]| {
        let l = lay_as(dims, p.format);
        (up(&v.copy_strided(&lay(&dims), &l).unwrap()), l)
    };
    let ((xg, lxg), (wg, lwg), (gg, lgg)) = (stored(&x, xd), stored(&w, wd), stored(&g, yd));
    let bound = match d {
        DType::F32 => 2e-4,
        DType::F16 => 4e-3,
        _ => 3.2e-2,
    };
    let (lx, lw, lg) = (lay(&xd), lay(&wd), lay(&yd));
    for (what, got, dims, want) in [
        (
            "forward",
            xg.conv2d(&lxg, &wg, &lwg, p).unwrap(),
            yd,
            x.conv2d(&lx, &w, &lw, &nchw).unwrap(),
        ),
        (
            "backward-data",
            gg.conv2d_backward_input(&lgg, &wg, &lwg, p).unwrap(),
            xd,
            g.conv2d_backward_input(&lg, &w, &lw, &nchw).unwrap(),
        ),
        (
            "backward-filter",
            gg.conv2d_backward_weight(&lgg, &xg, &lxg, p).unwrap(),
            wd,
            g.conv2d_backward_weight(&lg, &x, &lx, &nchw).unwrap(),
        ),
    ] {
        let got = got
            .to_cpu()
            .unwrap()
            .copy_strided(&lay_as(dims, p.format), &lay(&dims))
            .unwrap();
        let e = rel_err(&got.to_f64_vec(), &want.to_f64_vec());
        assert!(
            e <= bound,
            "{what} {d} {p:?}: relative error {e:e} > {bound:e}"
        );
    }
}

/// The plans of `p` in `d`, one per direction.
fn plans_of(p: &Conv2dParams, d: DType) -> Vec<ConvPlanInfo> {
    let mut v: Vec<ConvPlanInfo> = conv_plans(0)
        .unwrap()
        .into_iter()
        .filter(|i| i.params == *p && i.dtype == d && i.deterministic == deterministic())
        .collect();
    v.sort_by_key(|i| i.direction);
    assert_eq!(v.len(), 3, "{d} {p:?}: {v:?}");
    v
}

fn cache_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| r.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// With timing on (the default), no plan is chosen untimed: each reports its measured time, and
/// each API that had candidates had them timed. With both APIs allowed (no
/// `MIXPREC_CUDNN_API`), ResNet-shaped convolutions have candidates from both, and both are
/// timed: the choice between the APIs is always a measured one.
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_plan_is_timed() {
    let _env = setup();
    let forced = std::env::var("MIXPREC_CUDNN_API").unwrap_or_default();
    let runs_before = conv_timing_runs(0).unwrap();
    let geometries = [
        // The stem, a 3x3, a strided 1x1 downsample (ResNet-50's at batch 4), in both formats.
        geometry(4, 3, 64, 16, 7, 2, 3, MemoryFormat::Contiguous),
        geometry(4, 32, 28, 32, 3, 1, 1, MemoryFormat::Contiguous),
        geometry(4, 64, 28, 128, 1, 2, 0, MemoryFormat::Contiguous),
        geometry(4, 32, 28, 32, 3, 1, 1, MemoryFormat::ChannelsLast),
        geometry(4, 64, 28, 128, 1, 2, 0, MemoryFormat::ChannelsLast),
    ];
    for d in [DType::F32, DType::F16, DType::BF16] {
        for (k, p) in geometries.iter().enumerate() {
            run_and_check(p, d, 100 + k as u64);
            for info in plans_of(p, d) {
                let what = format!("{d} {} {p:?}: {info:?}", info.direction);
                assert_eq!(info.source, PlanSource::Timed, "{what}");
                assert!(info.time_ms.is_some_and(|t| t > 0.0), "{what}");
                assert!(info.graph_timed + info.legacy_timed >= 1, "{what}");
                assert!(info.graph_timed <= info.graph_candidates, "{what}");
                assert!(info.legacy_timed <= info.legacy_candidates, "{what}");
                if info.graph_candidates > 0 {
                    assert!(info.graph_timed > 0, "{what}");
                }
                if info.legacy_candidates > 0 {
                    assert!(info.legacy_timed > 0, "{what}");
                }
                // cuDNN's legacy API lacks some NHWC algorithms: both APIs are required to
                // offer candidates for NCHW.
                if forced.is_empty() && p.format == MemoryFormat::Contiguous {
                    assert!(
                        info.graph_candidates > 0 && info.legacy_candidates > 0,
                        "both APIs should offer candidates: {what}"
                    );
                }
                if forced == "legacy" {
                    assert!(!info.graph_api && info.graph_candidates == 0, "{what}");
                }
            }
        }
    }
    assert!(conv_timing_runs(0).unwrap() > runs_before);
}

/// A second build of the same plans (after forgetting them, as a new process would) reads them
/// from the plan cache: the same choices, no timing run, correct results.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_second_build_reads_the_plan_cache() {
    let (_env, dir) = setup();
    let geometries = [
        geometry(3, 24, 20, 40, 3, 1, 1, MemoryFormat::Contiguous),
        geometry(3, 48, 20, 96, 1, 2, 0, MemoryFormat::ChannelsLast),
    ];
    for d in [DType::F32, DType::F16, DType::BF16] {
        let files_before = cache_files(&dir).len();
        for p in &geometries {
            run_and_check(p, d, 200);
        }
        let first: Vec<Vec<ConvPlanInfo>> = geometries.iter().map(|p| plans_of(p, d)).collect();
        assert!(first
            .iter()
            .flatten()
            .all(|i| i.source == PlanSource::Timed));
        assert_eq!(
            cache_files(&dir).len(),
            files_before + 3 * geometries.len(),
            "one cache file per plan in {}",
            dir.display()
        );
        clear_conv_plans(0).unwrap();
        let runs = conv_timing_runs(0).unwrap();
        for p in &geometries {
            run_and_check(p, d, 300);
        }
        assert_eq!(
            conv_timing_runs(0).unwrap(),
            runs,
            "{d}: the second build timed candidates"
        );
        for (p, before) in geometries.iter().zip(&first) {
            for (again, was) in plans_of(p, d).iter().zip(before) {
                assert_eq!(again.source, PlanSource::Cache, "{d} {again:?}");
                assert_eq!(again.algorithm, was.algorithm, "{d} {p:?}");
                assert_eq!(again.workspace, was.workspace);
                assert_eq!(again.graph_api, was.graph_api);
                assert_eq!(again.time_ms, was.time_ms);
                assert_eq!(
                    (again.graph_timed, again.legacy_timed),
                    (was.graph_timed, was.legacy_timed)
                );
            }
        }
    }
}

/// Cache files that are garbage, truncated, of another plan, or that name an engine or
/// algorithm cuDNN does not have are ignored: the plans are timed again, the results are right,
/// and the files are rewritten (a third build reads them).
#[test]
#[ignore = "needs a CUDA GPU"]
fn corrupt_or_stale_cache_files_are_ignored() {
    let (_env, dir) = setup();
    let p = geometry(2, 40, 18, 24, 3, 1, 1, MemoryFormat::Contiguous);
    let q = geometry(2, 40, 18, 80, 1, 2, 0, MemoryFormat::Contiguous);
    let d = DType::F16;
    let before = cache_files(&dir);
    run_and_check(&p, d, 400);
    run_and_check(&q, d, 401);
    let ours: Vec<PathBuf> = cache_files(&dir)
        .into_iter()
        .filter(|f| !before.contains(f))
        .collect();
    assert_eq!(ours.len(), 6, "{ours:?}");
    let entries: Vec<mixprec::io::serde_json::Value> = ours
        .iter()
        .map(|f| mixprec::io::serde_json::from_slice(&std::fs::read(f).unwrap()).unwrap())
        .collect();
    // Garbage; a truncated file; another file's entry; a graph engine or a legacy algorithm
    // that does not exist (stale), whichever the entry holds; an empty file.
    std::fs::write(&ours[0], b"\x00\x01 not json").unwrap();
    let whole = std::fs::read(&ours[1]).unwrap();
    std::fs::write(&ours[1], &whole[..whole.len() / 2]).unwrap();
    std::fs::write(&ours[2], std::fs::read(&ours[3]).unwrap()).unwrap();
    for (file, entry) in ours[3..5].iter().zip(&entries[3..5]) {
        let mut stale = entry.clone();
        let choice = &mut stale["choice"];
        if choice["api"] == "graph" {
            choice["engine"] = 987_654.into();
        } else {
            choice["algo"] = 97.into();
        }
        std::fs::write(file, mixprec::io::serde_json::to_vec(&stale).unwrap()).unwrap();
    }
    std::fs::write(&ours[5], b"").unwrap();

    clear_conv_plans(0).unwrap();
    let runs = conv_timing_runs(0).unwrap();
    run_and_check(&p, d, 402);
    run_and_check(&q, d, 403);
    assert!(
        conv_timing_runs(0).unwrap() > runs,
        "corrupt entries were not re-timed"
    );
    for info in plans_of(&p, d).iter().chain(&plans_of(&q, d)) {
        assert_eq!(info.source, PlanSource::Timed, "{info:?}");
    }
    // Rewritten whole: a third build reads every one of them.
    clear_conv_plans(0).unwrap();
    let runs = conv_timing_runs(0).unwrap();
    run_and_check(&p, d, 404);
    run_and_check(&q, d, 405);
    assert_eq!(conv_timing_runs(0).unwrap(), runs);
    for info in plans_of(&p, d).iter().chain(&plans_of(&q, d)) {
        assert_eq!(info.source, PlanSource::Cache, "{info:?}");
    }
}

/// Under `set_deterministic(true)` every direction gives bitwise the same result when run again
/// on the same operands (backward-filter is where cuDNN's atomics-reducing engines are often
/// fastest), no chosen graph engine carries the NONDETERMINISTIC note, and the plans are kept
/// apart from those chosen without it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn deterministic_plans_repeat_bitwise() {
    let _env = setup();
    set_deterministic(true);
    let geometries = [
        geometry(64, 64, 28, 64, 3, 1, 1, MemoryFormat::Contiguous),
        geometry(64, 64, 28, 64, 3, 1, 1, MemoryFormat::ChannelsLast),
        geometry(32, 3, 32, 16, 3, 1, 1, MemoryFormat::Contiguous),
        geometry(64, 256, 14, 128, 1, 1, 0, MemoryFormat::ChannelsLast),
    ];
    for d in [DType::F32, DType::F16, DType::BF16] {
        for p in &geometries {
            let xd = [p.n, p.c_in, p.h, p.w];
            let wd = [p.c_out, p.c_in, p.kh, p.kw];
            let yd = [p.n, p.c_out, p.out_h(), p.out_w()];
            let (lx, lw, lg) = (
                lay_as(xd, p.format),
                lay_as(wd, p.format),
                lay_as(yd, p.format),
            );
            let (x, w, g) = (
                up(&randn(xd, d, 500)),
                up(&randn(wd, d, 501)),
                up(&randn(yd, d, 502)),
            );
            let bits = |s: CudaStorage| s.to_cpu().unwrap().to_f64_vec();
            let runs = |what: &str| -> Vec<Vec<f64>> {
                (0..3)
                    .map(|_| match what {
                        "forward" => bits(x.conv2d(&lx, &w, &lw, p).unwrap()),
                        "backward-data" => bits(g.conv2d_backward_input(&lg, &w, &lw, p).unwrap()),
                        _ => bits(g.conv2d_backward_weight(&lg, &x, &lx, p).unwrap()),
                    })
                    .collect()
            };
            for what in ["forward", "backward-data", "backward-filter"] {
                let r = runs(what);
                assert!(
                    r.iter().all(|v| v.iter().all(|e| e.is_finite())),
                    "{what} {d} {p:?}: non-finite"
                );
                for again in &r[1..] {
                    let same = again
                        .iter()
                        .zip(&r[0])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{what} {d} {p:?}: a second run differs");
                }
            }
            for plan in plans_of(p, d) {
                assert!(plan.deterministic);
                assert!(
                    !plan.algorithm.contains("NONDETERMINISTIC"),
                    "{d} {p:?}: {}",
                    plan.algorithm
                );
            }
            println!("{d} {p:?}: 3 directions x 3 runs bitwise equal");
        }
    }
    // The same geometry without the switch gets plans of its own.
    set_deterministic(false);
    let p = &geometries[0];
    run_and_check(p, DType::F32, 503);
    assert_eq!(plans_of(p, DType::F32).len(), 3);
    assert!(plans_of(p, DType::F32).iter().all(|i| !i.deterministic));
}

/// Our own weight-gradient kernel (`MIXPREC_CONV_DIRECT=only` forces it where it applies):
/// the CPU's result for stems and 1x1 shortcuts of channels_last nets, odd channel counts,
/// strides, padding and dilation; the same bits on a second run; cuDNN keeps the other
/// directions. Then the variable is cleared and the plans forgotten.
#[test]
#[ignore = "needs a CUDA GPU"]
fn direct_weight_gradient_matches_the_cpu_and_repeats() {
    let _env = setup();
    clear_conv_plans(0).unwrap();
    std::env::set_var("MIXPREC_CONV_DIRECT", "only");
    let cl = MemoryFormat::ChannelsLast;
    let dilated = Conv2dParams {
        dilation: (2, 2),
        ..geometry(6, 7, 15, 24, 3, 1, 2, cl)
    };
    let geometries = [
        // The main job's stem (1 channel, 144 weights) and its 1x1 shortcut.
        geometry(128, 1, 28, 16, 3, 1, 1, cl),
        geometry(128, 16, 28, 32, 1, 2, 0, cl),
        // A CIFAR stem (3 channels), 20 filters (a partial channel tile), a strided 5x5.
        geometry(32, 3, 32, 64, 3, 1, 1, cl),
        geometry(8, 5, 12, 20, 3, 2, 1, cl),
        geometry(4, 2, 17, 8, 5, 2, 2, cl),
        dilated,
    ];
    for d in [DType::F32, DType::F16, DType::BF16] {
        for (k, p) in geometries.iter().enumerate() {
            run_and_check(p, d, 600 + k as u64);
            for info in plans_of(p, d) {
                assert_eq!(
                    info.direct,
                    info.direction == "backward-filter",
                    "{d} {p:?}: {info:?}"
                );
            }
            let (yd, xd) = (
                [p.n, p.c_out, p.out_h(), p.out_w()],
                [p.n, p.c_in, p.h, p.w],
            );
            let (lg, lx) = (lay_as(yd, p.format), lay_as(xd, p.format));
            let (g, x) = (up(&randn(yd, d, 700)), up(&randn(xd, d, 701)));
            let bits = || -> Vec<u64> {
                let dw = g.conv2d_backward_weight(&lg, &x, &lx, p).unwrap();
                dw.to_cpu()
                    .unwrap()
                    .to_f64_vec()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(), bits(), "{d} {p:?}: a second run differs");
        }
    }
    std::env::remove_var("MIXPREC_CONV_DIRECT");
    clear_conv_plans(0).unwrap();
}

/// An input read by two convolutions (a downsampling residual block): the second data gradient
/// is added into the first by the convolution itself (a `backward-data-add` plan, cuDNN's
/// beta = 1), and the input's gradient matches the CPU's (where the engine adds the two) in
/// every dtype and both memory formats.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_data_gradient_is_added_into_the_other_consumers() {
    use mixprec::autograd::gradients_added_in_place;
    use mixprec::{Conv2dConfig, Tensor};
    let _lock = setup();
    let gpu = Device::cuda(0).unwrap();
    let pad1 = Conv2dConfig {
        padding: (1, 1),
        ..Conv2dConfig::default()
    };
    for d in [DType::F32, DType::F16, DType::BF16] {
        for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
            let rand = |dims: &[usize], seed: u64| {
                Tensor::randn(dims, 0.0, 1.0, seed, DType::F32, Device::Cpu)
                    .and_then(|t| t.to_dtype(d))
                    .unwrap()
            };
            let (x, w1, w2) = (
                rand(&[4, 16, 12, 12], 1),
                rand(&[32, 16, 3, 3], 2),
                rand(&[32, 16, 1, 1], 3),
            );
            let gy = rand(&[4, 32, 12, 12], 4);
            let grad_of_x = |dev: Device| {
                let on = |t: &Tensor| {
                    t.to_device(dev)
                        .and_then(|t| t.to_memory_format(format))
                        .unwrap()
                };
                let (x, w1, w2, gy) = (on(&x).to_variable(), on(&w1), on(&w2), on(&gy));
                let before = gradients_added_in_place();
                let a = x.affine(0.5, 0.25).unwrap();
                let y = a
                    .conv2d(&w1, None, pad1)
                    .unwrap()
                    .add(&a.conv2d(&w2, None, Conv2dConfig::default()).unwrap())
                    .unwrap();
                y.mul(&gy).unwrap().sum_all().unwrap().backward().unwrap();
                let added = gradients_added_in_place() - before;
                (x.grad().unwrap(), added)
            };
            let (want, _) = grad_of_x(Device::Cpu);
            let (got, added) = grad_of_x(gpu);
            let what = format!("{d} {format:?}");
            assert_eq!(added, 1, "{what}: data gradients added in place");
            let e = rel_err(
                &got.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(),
                &want.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(),
            );
            let bound = match d {
                DType::F32 => 1e-5,
                DType::F16 => 4e-3,
                _ => 3e-2,
            };
            assert!(e <= bound, "{what}: relative error {e:e} > {bound:e}");
            let p = geometry(4, 16, 12, 32, 3, 1, 1, format);
            let p1 = geometry(4, 16, 12, 32, 1, 1, 0, format);
            let add_plans = conv_plans(0)
                .unwrap()
                .into_iter()
                .filter(|i| (i.params == p || i.params == p1) && i.dtype == d)
                .filter(|i| i.direction == "backward-data-add")
                .count();
            assert_eq!(add_plans, 1, "{what}: backward-data-add plans");
        }
    }
}
