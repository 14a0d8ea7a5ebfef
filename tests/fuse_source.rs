//! The CUDA C source that `mixprec::fuse` generates, rendered for a representative set of traced
//! programs (random programs of several depths, broadcasts and 1-3 reductions in f32, f16, bf16
//! and f64; batch norms forward and backward; reductions over the inner and the outer dims),
//! forward and every backward. Needs no GPU.
//!
//! Generated sources are not pinned to a checked-in text (any deliberate change to the emitter
//! would have to rewrite it). Instead:
//! - rendering is a pure function of the program and its signature (two fresh tracings give
//!   the same text), and each source declares as many kernels as the call launches;
//! - a refactor of the emitter that must not change its output is checked against a reference
//!   rendered before it: with `MIXPREC_FUSE_SOURCE_REF=FILE`, the first run writes every
//!   source's digest (and its text, to `FILE.txt`) to `FILE`, and later runs fail on the first
//!   source whose text differs from it.

mod fuse_support;

use fuse_support::{inputs, program, trace, Program, Rng};
use mixprec::fuse::Fused;
use mixprec::{fuse, DType, Device, Tensor};

fn fused_of(p: &Program) -> Fused {
    let outs = p.outputs.clone();
    fuse("random", move |f, x| {
        outs.iter().map(|e| trace(f, x, e)).collect()
    })
}

fn batch_norm() -> Fused {
    fuse("bn", |f, x| {
        let axes = [0, 2, 3];
        let mean = f.mean(x[0], &axes);
        let var = f.var(x[0], &axes);
        let inv = f.rsqrt(f.add_scalar(var, 1e-5));
        let xhat = f.mul(f.sub(x[0], mean), inv);
        vec![
            f.cast(f.add(f.mul(xhat, x[1]), x[2]), f.dtype(x[0])),
            mean,
            var,
        ]
    })
}

fn batch_norm_two_sums() -> Fused {
    fuse("bn_two_sums", |f, x| {
        let axes = [0, 2, 3];
        let mean = f.mean(x[0], &axes);
        let var = f.sub(f.mean(f.sqr(x[0]), &axes), f.sqr(mean));
        let y = f.mul(f.sub(x[0], mean), f.rsqrt(f.add_scalar(var, 1e-5)));
        vec![f.cast(f.add(f.mul(y, x[1]), x[2]), f.dtype(x[0]))]
    })
}

fn stats(axes: Vec<isize>) -> Fused {
    fuse("stats", move |f, x| {
        let s = f.sum(x[0], &axes);
        let hi = f.max(x[0], &axes);
        let lo = f.min(f.exp(x[0]), &axes);
        let m = f.mean(f.tanh(x[0]), &axes);
        vec![s, hi, f.sub(x[0], f.add(m, f.mul(hi, lo)))]
    })
}

/// Every source `f` generates for `xs`: the forward, then each output's backward.
fn sources_of(label: &str, f: &Fused, xs: &[&Tensor], outs: usize) -> Vec<(String, String)> {
    let (name, src, kernels) = f.cuda_source(xs).unwrap();
    assert_eq!(
        src.matches("extern \"C\" __global__").count(),
        kernels,
        "{label}: {src}"
    );
    let mut all = vec![(format!("{label} forward {name}"), src)];
    for k in 0..outs {
        if let Some((name, src, kernels)) = f.cuda_backward_source(xs, k).unwrap() {
            assert_eq!(
                src.matches("extern \"C\" __global__").count(),
                kernels,
                "{label}: {src}"
            );
            all.push((format!("{label} backward{k} {name}"), src));
        }
    }
    all
}

/// The representative set, each source labelled.
fn corpus() -> Vec<(String, String)> {
    let mut all = Vec::new();
    let mut rng = Rng(0x0f05_e50c_2ce0_0041);
    let dtypes = [DType::F32, DType::F16, DType::BF16, DType::F64];
    let sizes = [[2, 3, 4], [4, 1, 8], [3, 5, 16], [1, 7, 1]];
    for case in 0..48 {
        let depth = 1 + case % 4;
        let p = program(&mut rng, depth, sizes[(case / 4) % sizes.len()]);
        let dtype = dtypes[(case / 3) % dtypes.len()];
        let xs = inputs(&p, case as u64, dtype, Device::Cpu).unwrap();
        let refs: Vec<&Tensor> = xs.iter().collect();
        let label = format!("random{case} depth{depth} {dtype:?}");
        all.extend(sources_of(&label, &fused_of(&p), &refs, p.outputs.len()));
    }
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for dims in [vec![2, 3, 4, 5], vec![8, 16, 7, 7], vec![4, 8, 1, 1]] {
            let x = Tensor::zeros(dims.clone(), dtype, Device::Cpu).unwrap();
            let w = Tensor::zeros(vec![dims[1], 1, 1], DType::F32, Device::Cpu).unwrap();
            let label = format!("batch_norm {dims:?} {dtype:?}");
            all.extend(sources_of(&label, &batch_norm(), &[&x, &w, &w], 3));
            let label = format!("batch_norm_two_sums {dims:?} {dtype:?}");
            all.extend(sources_of(&label, &batch_norm_two_sums(), &[&x, &w, &w], 1));
        }
    }
    for axes in [vec![0isize], vec![0, 2], vec![-1], vec![1], vec![1, 2]] {
        for dtype in [DType::F32, DType::F16, DType::F64] {
            let x = Tensor::zeros(vec![5, 3, 16], dtype, Device::Cpu).unwrap();
            let label = format!("stats {axes:?} {dtype:?}");
            all.extend(sources_of(&label, &stats(axes.clone()), &[&x], 3));
        }
    }
    all
}

/// FNV-1a, 64 bits: a digest of a source's text.
fn digest(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[test]
fn generated_sources_are_a_function_of_the_program() {
    let a = corpus();
    let b = corpus();
    assert!(a.len() > 100, "{} sources", a.len());
    assert_eq!(a.len(), b.len());
    for ((la, sa), (lb, sb)) in a.iter().zip(&b) {
        assert_eq!(la, lb);
        assert!(sa == sb, "{la}: two tracings generated different sources");
    }
}

#[test]
fn generated_sources_equal_a_saved_reference() {
    let Some(path) = std::env::var_os("MIXPREC_FUSE_SOURCE_REF") else {
        println!("MIXPREC_FUSE_SOURCE_REF not set: no reference to compare with");
        return;
    };
    let path = std::path::PathBuf::from(path);
    let all = corpus();
    let lines: Vec<String> = all
        .iter()
        .map(|(l, s)| format!("{:016x} {l}", digest(s)))
        .collect();
    match std::fs::read_to_string(&path) {
        Err(_) => {
            std::fs::write(&path, lines.join("\n") + "\n").unwrap();
            let mut text = String::new();
            for (l, s) in &all {
                text += &format!("==== {l}\n{s}\n");
            }
            let mut txt = path.clone().into_os_string();
            txt.push(".txt");
            std::fs::write(txt, text).unwrap();
            println!("wrote {} digests to {}", lines.len(), path.display());
        }
        Ok(saved) => {
            let saved: Vec<&str> = saved.lines().collect();
            assert_eq!(saved.len(), lines.len(), "number of sources");
            for (want, got) in saved.iter().zip(&lines) {
                assert_eq!(*want, got, "a generated source changed");
            }
            println!("{} sources equal the reference", lines.len());
        }
    }
}
