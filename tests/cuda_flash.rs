//! GPU tests of the flash-attention kernels (`kernels/flash_attention.cu`): forward O and LSE,
//! backward dQ, dK, dV against an f64 reference computed here from the same (rounded) inputs,
//! f16 and bf16, causal and not, tails, Tq ≠ Tk, head dims 64 and 128, Q/K/V as strided views
//! of one [B, T, 3, H, D] buffer or as separate [B, T, H, D] / [B, H, T, D] buffers. Outputs are
//! poisoned (NaN-filled) at allocation, so an element left unwritten fails. Ignored on CI (no
//! GPU): `cargo test --release --test cuda_flash -- --ignored --nocapture`.
//!
//! Error bound, per tensor: max |gpu − ref| ≤ 6u · max |ref|, u the unit roundoff of the half
//! type (2⁻¹¹ for f16, 2⁻⁸ for bf16). Why: every output is an f32-accumulated sum of products
//! in which one factor (P, or dS) is rounded to the half type before the tensor-core product,
//! and the output itself is rounded once more: relative errors of u per term that mostly cancel
//! (random signs), so about u to 2u of the output's scale; the slack covers the longest (1024)
//! reductions. An indexing or fragment-layout mistake gives errors of order 1. The LSE comes
//! from f32 sums of exact half products: |Δ| ≤ 1e-3 absolute.

use mixprec::backend::cpu::CpuStorage;
use mixprec::backend::cuda::cudnn_attention::{cudnn_backward, cudnn_forward};
use mixprec::backend::cuda::flash_attention::{
    flash_backward, flash_forward, FlashDims, FlashGrads, FlashInputs, FlashView,
};
use mixprec::backend::cuda::flash_attention::{FlashInputGrads, FlashOutput};
use mixprec::backend::cuda::{set_poison_allocations, CudaStorage};
use mixprec::backend::BackendStorage;
use mixprec::tensor::random;
use mixprec::{DType, Device, Layout, Shape};

/// The GPU, one test at a time (the timing runs alone, and switches poisoning off only while
/// it holds this), with new buffers poisoned.
fn gpu() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = ONE.lock().unwrap_or_else(|e| e.into_inner());
    set_poison_allocations(true);
    Device::cuda(0).expect("these tests need a CUDA GPU");
    guard
}

/// Unit roundoff of the half type.
fn unit(dt: DType) -> f64 {
    match dt {
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => unreachable!(),
    }
}

/// `n` standard normal values rounded to `dt`, as f64 (what the GPU sees) and uploaded.
fn randn(seed: u64, n: usize, dt: DType) -> (Vec<f64>, CudaStorage) {
    let v = random::normal(seed, n, 0.0, 1.0);
    let cpu = match dt {
        DType::F16 => CpuStorage::F16(v.iter().map(|&x| half::f16::from_f64(x)).collect()),
        DType::BF16 => CpuStorage::BF16(v.iter().map(|&x| half::bf16::from_f64(x)).collect()),
        _ => unreachable!(),
    };
    let host = to_f64(&cpu);
    (host, CudaStorage::from_cpu(&cpu, 0).unwrap())
}

fn to_f64(s: &CpuStorage) -> Vec<f64> {
    match s {
        CpuStorage::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        CpuStorage::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        CpuStorage::F32(v) => v.iter().map(|&x| x as f64).collect(),
        CpuStorage::F64(v) => v.clone(),
        CpuStorage::I64(_) => unreachable!(),
    }
}

fn download(s: &CudaStorage) -> Vec<f64> {
    to_f64(&s.to_cpu().unwrap())
}

/// How Q, K and V are stored.
#[derive(Clone, Copy, Debug)]
enum Packing {
    /// One [B, T, 3, H, D] buffer (a fused QKV projection's output); needs Tq = Tk.
    Qkv,
    /// Q [B, Tq, H, D]; K and V [B, H, Tk, D], each its own buffer.
    Separate,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    h: usize,
    tq: usize,
    tk: usize,
    d: usize,
    causal: bool,
    packing: Packing,
}

/// Host copy of one operand: values and the element index of (batch, head, token, 0).
struct Host {
    v: Vec<f64>,
    offset: usize,
    strides: [usize; 3],
}

impl Host {
    fn at(&self, b: usize, h: usize, t: usize, c: usize) -> f64 {
        self.v[self.offset + b * self.strides[0] + h * self.strides[1] + t * self.strides[2] + c]
    }
}

/// The f64 reference for one (batch, head): O [Tq, D], LSE [Tq], dQ [Tq, D], dK, dV [Tk, D].
struct Reference {
    o: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn reference(c: &Case, ops: [&Host; 4], b: usize, h: usize, scale: f64) -> Reference {
    let [q, k, v, dout] = ops;
    let (tq, tk, d) = (c.tq, c.tk, c.d);
    let mut p = vec![0.0; tq * tk];
    let mut lse = vec![0.0; tq];
    for i in 0..tq {
        let row = &mut p[i * tk..(i + 1) * tk];
        for (j, s) in row.iter_mut().enumerate() {
            let dot: f64 = (0..d).map(|x| q.at(b, h, i, x) * k.at(b, h, j, x)).sum();
            *s = if c.causal && j > i {
                f64::NEG_INFINITY
            } else {
                scale * dot
            };
        }
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|s| (s - m).exp()).sum();
        for s in row.iter_mut() {
            *s = (*s - m).exp() / sum;
        }
        lse[i] = m + sum.ln();
    }
    let mut o = vec![0.0; tq * d];
    for i in 0..tq {
        for x in 0..d {
            o[i * d + x] = (0..tk).map(|j| p[i * tk + j] * v.at(b, h, j, x)).sum();
        }
    }
    // dS = P∘(dP − rowsum(dO∘O)), dP = dO·Vᵀ.
    let mut ds = vec![0.0; tq * tk];
    for i in 0..tq {
        let di: f64 = (0..d).map(|x| dout.at(b, h, i, x) * o[i * d + x]).sum();
        for j in 0..tk {
            let dp: f64 = (0..d).map(|x| dout.at(b, h, i, x) * v.at(b, h, j, x)).sum();
            ds[i * tk + j] = p[i * tk + j] * (dp - di);
        }
    }
    let mut dq = vec![0.0; tq * d];
    for i in 0..tq {
        for x in 0..d {
            dq[i * d + x] = scale
                * (0..tk)
                    .map(|j| ds[i * tk + j] * k.at(b, h, j, x))
                    .sum::<f64>();
        }
    }
    let (mut dk, mut dv) = (vec![0.0; tk * d], vec![0.0; tk * d]);
    for j in 0..tk {
        for x in 0..d {
            dk[j * d + x] = scale
                * (0..tq)
                    .map(|i| ds[i * tk + j] * q.at(b, h, i, x))
                    .sum::<f64>();
            dv[j * d + x] = (0..tq).map(|i| p[i * tk + j] * dout.at(b, h, i, x)).sum();
        }
    }
    Reference { o, lse, dq, dk, dv }
}

/// Largest |gpu − ref| and |ref| over the checked heads, per output.
#[derive(Default)]
struct MaxErr {
    diff: f64,
    scale: f64,
}

impl MaxErr {
    fn add(&mut self, got: f64, want: f64) {
        let d = (got - want).abs();
        self.diff = if d.is_nan() {
            f64::INFINITY
        } else {
            self.diff.max(d)
        };
        self.scale = self.scale.max(want.abs());
    }
    fn rel(&self) -> f64 {
        self.diff / self.scale.max(1e-30)
    }
}

/// Runs forward and backward for `c` in `dt` and checks the (batch, head) pairs `heads` (all
/// when empty) against the f64 reference.
fn check(c: Case, dt: DType, heads: &[(usize, usize)], path: Path) {
    let (b, h, tq, tk, d) = (c.b, c.h, c.tq, c.tk, c.d);
    let seed = (b * 1_000_003 + h * 1009 + tq * 31 + tk * 7 + d + c.causal as usize) as u64;
    // Q, K, V: host copies (for the reference), device buffers and views.
    let (q_h, k_h, v_h, bufs) = match c.packing {
        Packing::Qkv => {
            assert_eq!(tq, tk);
            let (host, buf) = randn(seed, b * tq * 3 * h * d, dt);
            let st = [tq * 3 * h * d, d, 3 * h * d];
            let mk = |i: usize| Host {
                v: host.clone(),
                offset: i * h * d,
                strides: st,
            };
            (mk(0), mk(1), mk(2), vec![buf])
        }
        Packing::Separate => {
            let (qv, qb) = randn(seed, b * tq * h * d, dt);
            let (kv, kb) = randn(seed + 1, b * h * tk * d, dt);
            let (vv, vb) = randn(seed + 2, b * h * tk * d, dt);
            let bhtd = [h * tk * d, tk * d, d];
            (
                Host {
                    v: qv,
                    offset: 0,
                    strides: [tq * h * d, d, h * d],
                },
                Host {
                    v: kv,
                    offset: 0,
                    strides: bhtd,
                },
                Host {
                    v: vv,
                    offset: 0,
                    strides: bhtd,
                },
                vec![qb, kb, vb],
            )
        }
    };
    let view = |host: &Host, i: usize| -> FlashView<'_> {
        let buf = &bufs[match c.packing {
            Packing::Qkv => 0,
            Packing::Separate => i,
        }];
        FlashView {
            buf,
            offset: host.offset,
            strides: host.strides,
        }
    };
    let (mut qv, mut kv, mut vv) = (view(&q_h, 0), view(&k_h, 1), view(&v_h, 2));
    if let Packing::Separate = c.packing {
        // Q through the Layout constructor of [B, T, H, D] operands.
        qv = FlashView::from_bthd(&bufs[0], &Layout::contiguous(Shape::new(vec![b, tq, h, d])))
            .unwrap();
        assert_eq!(qv.strides, q_h.strides);
        // K and V through the Layout constructor of [B, H, T, D] operands.
        let l = Layout::contiguous(Shape::new(vec![b, h, tk, d]));
        assert!(FlashView::fits_bhtd(&l));
        kv = FlashView::from_bhtd(&bufs[1], &l).unwrap();
        vv = FlashView::from_bhtd(&bufs[2], &l).unwrap();
    }
    let dims = FlashDims {
        batch: b,
        heads: h,
        seq_q: tq,
        seq_k: tk,
        head_dim: d,
        causal: c.causal,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let out = forward(
        path,
        &FlashInputs {
            q: qv,
            k: kv,
            v: vv,
        },
        &dims,
    );
    let (dout_host, dout_buf) = randn(seed + 3, b * tq * h * d, dt);
    let bthd_q = [tq * h * d, d, h * d];
    let dout_h = Host {
        v: dout_host,
        offset: 0,
        strides: bthd_q,
    };
    let grads = backward(
        path,
        &FlashGrads {
            q: qv,
            k: kv,
            v: vv,
            // O through the [B, H, T, D] presentation of the kernels' outputs.
            o: FlashView::from_bhtd(&out.o, &FlashView::bthd_as_bhtd(b, h, tq, d)).unwrap(),
            lse: &out.lse,
            grad_out: FlashView {
                buf: &dout_buf,
                offset: 0,
                strides: bthd_q,
            },
        },
        &dims,
    );
    assert_eq!(out.o.len(), b * tq * h * d);
    assert_eq!(out.lse.len(), b * h * tq);
    assert_eq!(grads.dq.len(), b * tq * h * d);
    assert_eq!(grads.dk.len(), b * tk * h * d);
    assert_eq!(grads.dv.len(), b * tk * h * d);
    for s in [&out.o, &grads.dq, &grads.dk, &grads.dv] {
        assert_eq!(s.dtype(), dt);
    }
    let (o, lse) = (download(&out.o), download(&out.lse));
    let (dq, dk, dv) = (
        download(&grads.dq),
        download(&grads.dk),
        download(&grads.dv),
    );

    let all: Vec<(usize, usize)> = (0..b).flat_map(|i| (0..h).map(move |j| (i, j))).collect();
    let heads = if heads.is_empty() { &all[..] } else { heads };
    let (mut eo, mut edq, mut edk, mut edv) = (
        MaxErr::default(),
        MaxErr::default(),
        MaxErr::default(),
        MaxErr::default(),
    );
    let mut e_lse: f64 = 0.0;
    let scale = dims.scale as f64;
    for &(bi, hi) in heads {
        let r = reference(&c, [&q_h, &k_h, &v_h, &dout_h], bi, hi, scale);
        for i in 0..tq {
            let got = lse[(bi * h + hi) * tq + i];
            let e = (got - r.lse[i]).abs();
            e_lse = if e.is_nan() {
                f64::INFINITY
            } else {
                e_lse.max(e)
            };
            for x in 0..d {
                let at = ((bi * tq + i) * h + hi) * d + x;
                MaxErr::add(&mut eo, o[at], r.o[i * d + x]);
                MaxErr::add(&mut edq, dq[at], r.dq[i * d + x]);
            }
        }
        for j in 0..tk {
            for x in 0..d {
                let at = ((bi * tk + j) * h + hi) * d + x;
                MaxErr::add(&mut edk, dk[at], r.dk[j * d + x]);
                MaxErr::add(&mut edv, dv[at], r.dv[j * d + x]);
            }
        }
    }
    let bound = 6.0 * unit(dt);
    println!(
        "{path:?} {dt} {c:?}: O {:.2e}, dQ {:.2e}, dK {:.2e}, dV {:.2e} (max err / max |ref|; bound \
         {bound:.1e}), LSE {e_lse:.1e} (abs; bound 1e-3)",
        eo.rel(),
        edq.rel(),
        edk.rel(),
        edv.rel()
    );
    for (name, e) in [("O", &eo), ("dQ", &edq), ("dK", &edk), ("dV", &edv)] {
        assert!(
            e.rel() <= bound,
            "{dt} {c:?}: {name} error {:.3e} of its scale {:.3e} exceeds {bound:.2e}",
            e.rel(),
            e.scale
        );
    }
    assert!(e_lse <= 1e-3, "{dt} {c:?}: LSE error {e_lse:.3e}");
}

const DTYPES: [DType; 2] = [DType::F16, DType::BF16];

/// Which implementation runs each direction: ours (`kernels/flash_attention.cu`), cuDNN's
/// (`cudnn_attention.rs`), or one of each way round (they save the same statistic, so either
/// backward must take either forward's O and LSE).
#[derive(Clone, Copy, Debug)]
enum Path {
    Ours,
    Cudnn,
    CudnnThenOurs,
    OursThenCudnn,
}

fn forward(path: Path, inp: &FlashInputs<'_>, dims: &FlashDims) -> FlashOutput {
    match path {
        Path::Ours | Path::OursThenCudnn => flash_forward(inp, dims).unwrap(),
        Path::Cudnn | Path::CudnnThenOurs => cudnn_forward(inp, dims)
            .unwrap()
            .unwrap_or_else(|| panic!("cuDNN builds no forward plan for {dims:?}")),
    }
}

fn backward(path: Path, g: &FlashGrads<'_>, dims: &FlashDims) -> FlashInputGrads {
    match path {
        Path::Ours | Path::CudnnThenOurs => flash_backward(g, dims).unwrap(),
        Path::Cudnn | Path::OursThenCudnn => cudnn_backward(g, dims)
            .unwrap()
            .unwrap_or_else(|| panic!("cuDNN builds no backward plan for {dims:?}")),
    }
}

/// cuDNN's fused attention against the same f64 reference as ours, on the cases above: small
/// packed QKV (causal and not), ragged tails, Tq ≠ Tk both ways, head dim 128, GPT-2's shape;
/// and each of its directions paired with ours.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cudnn_attention_matches_the_reference() {
    let _gpu = gpu();
    let case = |b, h, tq, tk, d, causal, packing| Case {
        b,
        h,
        tq,
        tk,
        d,
        causal,
        packing,
    };
    for dt in DTYPES {
        for causal in [false, true] {
            check(
                case(2, 3, 128, 128, 64, causal, Packing::Qkv),
                dt,
                &[],
                Path::Cudnn,
            );
        }
        check(
            case(1, 2, 77, 77, 64, true, Packing::Qkv),
            dt,
            &[],
            Path::Cudnn,
        );
        for (tq, tk) in [(70, 130), (150, 40)] {
            check(
                case(2, 1, tq, tk, 64, true, Packing::Separate),
                dt,
                &[],
                Path::Cudnn,
            );
        }
        check(
            case(1, 1, 100, 300, 128, false, Packing::Separate),
            dt,
            &[],
            Path::Cudnn,
        );
        check(
            case(1, 2, 200, 200, 128, true, Packing::Qkv),
            dt,
            &[],
            Path::Cudnn,
        );
        let gpt2 = case(4, 12, 1024, 1024, 64, true, Packing::Qkv);
        let heads = [(0, 0), (1, 5), (2, 7), (3, 11)];
        for path in [Path::Cudnn, Path::CudnnThenOurs, Path::OursThenCudnn] {
            check(gpt2, dt, &heads, path);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_small_packed_qkv() {
    let _gpu = gpu();
    for dt in DTYPES {
        for causal in [false, true] {
            let c = Case {
                b: 2,
                h: 3,
                tq: 128,
                tk: 128,
                d: 64,
                causal,
                packing: Packing::Qkv,
            };
            check(c, dt, &[], Path::Ours);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_ragged_tails() {
    let _gpu = gpu();
    for dt in DTYPES {
        // A length that is no multiple of the 64-row blocks, causal.
        let c = Case {
            b: 1,
            h: 2,
            tq: 77,
            tk: 77,
            d: 64,
            causal: true,
            packing: Packing::Qkv,
        };
        check(c, dt, &[], Path::Ours);
        // Fewer queries than keys and the reverse, causal (top-left aligned), separate buffers.
        for (tq, tk) in [(70, 130), (150, 40)] {
            let c = Case {
                b: 2,
                h: 1,
                tq,
                tk,
                d: 64,
                causal: true,
                packing: Packing::Separate,
            };
            check(c, dt, &[], Path::Ours);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_head_dim_128() {
    let _gpu = gpu();
    for dt in DTYPES {
        let c = Case {
            b: 1,
            h: 1,
            tq: 100,
            tk: 300,
            d: 128,
            causal: false,
            packing: Packing::Separate,
        };
        check(c, dt, &[], Path::Ours);
        let c = Case {
            b: 1,
            h: 2,
            tq: 200,
            tk: 200,
            d: 128,
            causal: true,
            packing: Packing::Qkv,
        };
        check(c, dt, &[], Path::Ours);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_gpt2_shape() {
    let _gpu = gpu();
    // Every head is computed; four of them are checked (the reference is O(T²·D) per head).
    let heads = [(0, 0), (1, 5), (2, 7), (3, 11)];
    for dt in DTYPES {
        let c = Case {
            b: 4,
            h: 12,
            tq: 1024,
            tk: 1024,
            d: 64,
            causal: true,
            packing: Packing::Qkv,
        };
        check(c, dt, &heads, Path::Ours);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_refuses_what_it_does_not_handle() {
    let _gpu = gpu();
    let (_, buf) = randn(7, 2 * 64 * 3 * 2 * 64, DType::F16);
    let dims = FlashDims {
        batch: 2,
        heads: 2,
        seq_q: 64,
        seq_k: 64,
        head_dim: 64,
        causal: true,
        scale: 0.125,
    };
    let st = [64 * 3 * 2 * 64, 64, 3 * 2 * 64];
    let v = |offset: usize| FlashView {
        buf: &buf,
        offset,
        strides: st,
    };
    let inp = FlashInputs {
        q: v(0),
        k: v(128),
        v: v(256),
    };
    assert!(flash_forward(&inp, &dims).is_ok());
    // A [B, H, T, D] view of the middle of a [B, T, 3, H, D] buffer fits; an odd offset does not.
    let qkv = |offset| {
        Layout::new(
            Shape::new(vec![2, 2, 64, 64]),
            vec![st[0], st[1], st[2], 1],
            offset,
        )
    };
    assert!(FlashView::fits_bhtd(&qkv(128)));
    assert!(!FlashView::fits_bhtd(&qkv(129)));
    let bad = |d: FlashDims, i: FlashInputs<'_>, what: &str| {
        let e = flash_forward(&i, &d).expect_err(what);
        println!("{what}: {e}");
    };
    bad(
        FlashDims {
            head_dim: 32,
            ..dims
        },
        inp,
        "head_dim 32",
    );
    bad(FlashDims { seq_k: 0, ..dims }, inp, "no keys");
    bad(dims, FlashInputs { k: v(129), ..inp }, "misaligned offset");
    bad(
        dims,
        FlashInputs {
            v: FlashView {
                buf: &buf,
                offset: 256,
                strides: [st[0], st[1], st[2] * 2],
            },
            ..inp
        },
        "out of bounds",
    );
    let (_, other) = randn(8, buf.len(), DType::BF16);
    bad(
        dims,
        FlashInputs {
            k: FlashView {
                buf: &other,
                offset: 128,
                strides: st,
            },
            ..inp
        },
        "mixed dtypes",
    );
    let f32buf = CudaStorage::from_cpu(&CpuStorage::F32(vec![0.0; buf.len()]), 0).unwrap();
    let f = |offset: usize| FlashView {
        buf: &f32buf,
        offset,
        strides: st,
    };
    bad(
        dims,
        FlashInputs {
            q: f(0),
            k: f(128),
            v: f(256),
        },
        "f32",
    );
}

/// The forward and backward time at GPT-2 small's attention shape (B 16, H 12, T 1024, D 64,
/// causal): a diagnostic, printed, not asserted.
#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_gpt2_timing() {
    let _gpu = gpu();
    // Poisoning would add a fill of every output to the times.
    set_poison_allocations(false);
    let (b, h, t, d) = (16, 12, 1024, 64);
    let dev = mixprec::backend::cuda::device(0).unwrap();
    for dt in DTYPES {
        let (_, qkv) = randn(11, b * t * 3 * h * d, dt);
        let (_, dout) = randn(12, b * t * h * d, dt);
        let st = [t * 3 * h * d, d, 3 * h * d];
        let v = |offset: usize| FlashView {
            buf: &qkv,
            offset,
            strides: st,
        };
        let inp = FlashInputs {
            q: v(0),
            k: v(h * d),
            v: v(2 * h * d),
        };
        let dims = FlashDims {
            batch: b,
            heads: h,
            seq_q: t,
            seq_k: t,
            head_dim: d,
            causal: true,
            scale: 0.125,
        };
        let out = flash_forward(&inp, &dims).unwrap();
        for path in [Path::Ours, Path::Cudnn] {
            let bthd = [t * h * d, d, h * d];
            let g = FlashGrads {
                q: inp.q,
                k: inp.k,
                v: inp.v,
                o: FlashView {
                    buf: &out.o,
                    offset: 0,
                    strides: bthd,
                },
                lse: &out.lse,
                grad_out: FlashView {
                    buf: &dout,
                    offset: 0,
                    strides: bthd,
                },
            };
            for _ in 0..3 {
                forward(path, &inp, &dims);
                backward(path, &g, &dims);
            }
            dev.synchronize().unwrap();
            let n = 20;
            let t0 = std::time::Instant::now();
            for _ in 0..n {
                forward(path, &inp, &dims);
            }
            dev.synchronize().unwrap();
            let fwd = t0.elapsed().as_secs_f64() / n as f64;
            let t0 = std::time::Instant::now();
            for _ in 0..n {
                backward(path, &g, &dims);
            }
            dev.synchronize().unwrap();
            let bwd = t0.elapsed().as_secs_f64() / n as f64;
            // Causal: half of the 4·B·H·T²·D forward multiply-adds; the backward does 2.5 times that.
            let flops = 4.0 * (b * h * t * t * d) as f64 / 2.0;
            println!(
            "{path:?} {dt} B{b} H{h} T{t} D{d} causal: forward {:.3} ms ({:.0} TFLOP/s), backward {:.3} ms \
             ({:.0} TFLOP/s), together {:.3} ms",
            fwd * 1e3,
            flops / fwd / 1e12,
            bwd * 1e3,
            2.5 * flops / bwd / 1e12,
            (fwd + bwd) * 1e3
        );
        }
    }
    set_poison_allocations(true);
}
