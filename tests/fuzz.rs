//! A seeded, bounded fuzzer of random op sequences: small tensors of random shapes (empty
//! dimensions included) and dtypes, every tensor op with arguments that are valid or not, and
//! backward passes through whatever was built. Every call must return `Ok` or `Err`; a panic
//! fails the test with the seed and the op, so it can be replayed:
//!
//!     MIXPREC_FUZZ_SEED=<seed> cargo test --release --test fuzz
//!
//! `MIXPREC_FUZZ_CASES` sets how many sequences run (default: a few seconds' worth).

use std::panic::{catch_unwind, AssertUnwindSafe};

use mixprec::nn::loss::cross_entropy;
use mixprec::{BatchNormConfig, Conv2dConfig, DType, Device, Result, Shape, Tensor};

const CPU: Device = Device::Cpu;
/// Ops per sequence.
const STEPS: usize = 40;
/// Tensors larger than this are not kept for later ops (the fuzzer is about shapes, not size).
const MAX_KEEP: usize = 1 << 12;

/// SplitMix64: a seed → a stream of 64-bit values.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn int(&mut self, lo: i64, hi: i64) -> i64 {
        lo + self.below((hi - lo + 1) as usize) as i64
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len())]
    }
    /// A dimension size: mostly small, sometimes 0.
    fn dim(&mut self) -> usize {
        self.pick(&[0, 1, 1, 2, 2, 3, 3, 4, 5])
    }
    fn dims(&mut self, max_rank: usize) -> Vec<usize> {
        let r = self.below(max_rank + 1);
        (0..r).map(|_| self.dim()).collect()
    }
    fn dtype(&mut self) -> DType {
        self.pick(&[
            DType::F32,
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I64,
        ])
    }
    /// A number for a scalar argument: ordinary, extreme or not finite.
    fn number(&mut self) -> f64 {
        self.pick(&[
            0.0,
            1.0,
            -1.0,
            0.5,
            2.0,
            -3.5,
            1e30,
            -1e-30,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ])
    }
    fn idim(&mut self) -> isize {
        self.int(-5, 5) as isize
    }
    fn small(&mut self) -> usize {
        self.below(5)
    }
}

fn tensor(rng: &mut Rng, dims: Vec<usize>, dtype: DType) -> Result<Tensor> {
    let seed = rng.next();
    if dtype == DType::I64 {
        let n: usize = dims.iter().product();
        let v: Vec<i64> = (0..n).map(|_| rng.int(-2, 6)).collect();
        return Tensor::from_vec(v, dims, CPU);
    }
    let t = Tensor::randn(dims, 0.0, 1.0, seed, dtype, CPU)?;
    Ok(if rng.coin() { t.to_variable() } else { t })
}

/// One random op on the pool; returns what it made (if anything) and says what it did.
fn step(rng: &mut Rng, pool: &[Tensor], what: &mut String) -> Result<Option<Tensor>> {
    let a = &pool[rng.below(pool.len())];
    let b = &pool[rng.below(pool.len())];
    // Convolutions (the op with the most geometry) get four shares.
    let op = match rng.below(29) {
        26..=28 => 15,
        k => k,
    };
    *what = format!(
        "op {op} on {:?} {} and {:?} {}",
        a.dims(),
        a.dtype(),
        b.dims(),
        b.dtype()
    );
    let out = match op {
        0 => match rng.below(7) {
            0 => a.neg(),
            1 => a.relu(),
            2 => a.exp(),
            3 => a.log(),
            4 => a.sqrt(),
            5 => a.sqr(),
            _ => a.abs(),
        },
        1 => {
            let (x, y) = (rng.number(), rng.number());
            *what += &format!(" scalars {x} {y}");
            match rng.below(4) {
                0 => a.affine(x, y),
                1 => a.add_scalar(x),
                2 => a.mul_scalar(x),
                _ => a.powf(x),
            }
        }
        2 => match rng.below(6) {
            0 => a.add(b),
            1 => a.sub(b),
            2 => a.mul(b),
            3 => a.div(b),
            4 => a.maximum(b),
            _ => a.minimum(b),
        },
        3 => {
            let d = rng.dims(4);
            *what += &format!(" to {d:?}");
            a.broadcast_as(&Shape::new(d))
        }
        4 => {
            let d = rng.dims(4);
            *what += &format!(" to {d:?}");
            a.reshape(d)
        }
        5 => {
            let (s, e) = (rng.idim(), rng.idim());
            *what += &format!(" flatten {s}..{e}");
            a.flatten(s, e)
        }
        6 => {
            let d = rng.idim();
            *what += &format!(" dim {d}");
            if rng.coin() {
                a.unsqueeze(d.unsigned_abs())
            } else {
                a.squeeze(d)
            }
        }
        7 => {
            let mut perm: Vec<usize> = (0..a.rank()).collect();
            for i in (1..perm.len()).rev() {
                let j = rng.below(i + 1);
                perm.swap(i, j);
            }
            if rng.below(4) == 0 {
                perm.push(rng.small());
            }
            *what += &format!(" perm {perm:?}");
            a.permute(&perm)
        }
        8 => {
            let (x, y) = (rng.idim(), rng.idim());
            *what += &format!(" transpose {x} {y}");
            a.transpose(x, y)
        }
        9 => {
            let (d, s, l) = (rng.idim(), rng.small(), rng.small());
            *what += &format!(" narrow dim {d} start {s} len {l}");
            a.narrow(d, s, l)
        }
        10 => {
            let d = rng.idim();
            *what += &format!(" cat dim {d}");
            let n = rng.below(3);
            let parts: Vec<&Tensor> = [a, b, a][..n].to_vec();
            Tensor::cat(&parts, d)
        }
        11 => a.matmul(b),
        12 => {
            let bias = (rng.coin()).then(|| pool[rng.below(pool.len())].clone());
            a.linear(b, bias.as_ref())
        }
        13 => {
            let d = rng.idim();
            let keep = rng.coin();
            *what += &format!(" dim {d} keepdim {keep}");
            match rng.below(8) {
                0 => a.sum_dim(d, keep),
                1 => a.mean_dim(d, keep),
                2 => a.max_dim(d, keep),
                3 => a.min_dim(d, keep),
                4 => a.argmax(d, keep),
                5 => a.sum_all(),
                6 => a.mean_all(),
                _ => {
                    let dims: Vec<isize> = (0..rng.below(4)).map(|_| rng.idim()).collect();
                    *what += &format!(" dims {dims:?}");
                    a.sum_dims(&dims, keep)
                }
            }
        }
        14 => {
            let d = rng.idim();
            *what += &format!(" dim {d}");
            if rng.coin() {
                a.softmax(d)
            } else {
                a.log_softmax(d)
            }
        }
        15 => {
            // A convolution: mostly of valid geometry (padding, dilation and strides that leave
            // whole kernel rows or columns in the padding included), sometimes not.
            let dt = rng.pick(&[DType::F32, DType::F64, DType::F16, DType::BF16]);
            let groups = rng.pick(&[1, 1, 2, 3]);
            let (cig, cog) = (rng.pick(&[1, 1, 2]), rng.pick(&[1, 2]));
            let (n, h, w) = (rng.pick(&[1, 1, 2]), rng.dim(), rng.dim());
            let (kh, kw) = (rng.pick(&[1, 2, 3, 3]), rng.pick(&[1, 2, 3, 3]));
            let cfg = Conv2dConfig {
                stride: (rng.pick(&[1, 1, 2, 3]), rng.pick(&[1, 1, 2, 3])),
                padding: (rng.small(), rng.small()),
                dilation: (rng.pick(&[1, 1, 2, 3]), rng.pick(&[1, 1, 2, 3])),
                groups,
            };
            let (mut c, mut co, mut cw) = (groups * cig, groups * cog, cig);
            let mut cfg = cfg;
            if rng.below(5) == 0 {
                // Something invalid (or merely odd): any of the sizes or settings at random.
                match rng.below(5) {
                    0 => c = rng.dim(),
                    1 => co = rng.dim(),
                    2 => cw = rng.dim(),
                    3 => cfg.stride = (rng.small(), rng.small()),
                    _ => {
                        cfg.dilation = (rng.small(), rng.small());
                        cfg.groups = rng.small();
                    }
                }
            }
            *what =
                format!("conv2d {dt} x [{n}, {c}, {h}, {w}] w [{co}, {cw}, {kh}, {kw}] {cfg:?}");
            let x = tensor(rng, vec![n, c, h, w], dt)?;
            let wt = tensor(rng, vec![co, cw, kh, kw], dt)?;
            let bias = if rng.coin() {
                let d = if rng.below(5) == 0 { rng.dim() } else { co };
                Some(tensor(rng, vec![d], dt)?)
            } else {
                None
            };
            let y = x.conv2d(&wt, bias.as_ref(), cfg)?;
            if y.dtype().is_float() && rng.coin() {
                y.sum_all()?.backward()?;
            }
            Ok(y)
        }
        16 => {
            let k = (rng.small(), rng.small());
            let s = (rng.small(), rng.small());
            let p = (rng.small(), rng.small());
            *what += &format!(" pool kernel {k:?} stride {s:?} padding {p:?}");
            match rng.below(3) {
                0 => a.max_pool2d(k, s, p),
                1 => a.avg_pool2d(k, s, p, rng.coin()),
                _ => a.adaptive_avg_pool2d(rng.small(), rng.small()),
            }
        }
        17 => {
            let c = a.dims().get(1).copied().unwrap_or(rng.dim());
            let c2 = if rng.below(4) == 0 { rng.dim() } else { c };
            let dt = rng.pick(&[DType::F32, DType::F64, a.dtype()]);
            let params: Vec<Tensor> = (0..4)
                .map(|_| tensor(rng, vec![c2], dt))
                .collect::<Result<_>>()?;
            let cfg = BatchNormConfig {
                training: rng.coin(),
                momentum: rng.pick(&[0.1, 0.0, 1.0, -1.0, f64::NAN]),
                eps: rng.pick(&[1e-5, 0.0, -1.0, f64::NAN]),
            };
            *what += &format!(" batch_norm channels {c2} {dt} {cfg:?}");
            // A variance must not be negative: abs of the draw, as a real running_var.
            let var = params[3].abs()?;
            a.batch_norm(&params[0], &params[1], &params[2], &var, cfg)
        }
        18 => {
            let d = rng.idim();
            let d3 = rng.dims(3);
            let idx = tensor(rng, d3, DType::I64)?;
            *what += &format!(" gather dim {d} index {:?}", idx.dims());
            a.gather(d, &idx)
        }
        19 => {
            let dt = rng.dtype();
            *what += &format!(" to {dt}");
            a.to_dtype(dt)
        }
        20 => {
            *what += " backward";
            let l = if rng.coin() { a.sum_all()? } else { a.clone() };
            l.backward()?;
            return Ok(None);
        }
        21 => {
            *what += " item / to_vec";
            let _ = a.item();
            let _ = a.to_vec::<f32>();
            let _ = a.to_vec::<i64>();
            return Ok(None);
        }
        22 => {
            *what += " cross_entropy";
            cross_entropy(a, b)
        }
        23 => {
            let d = rng.dims(4);
            let dt = rng.dtype();
            let (x, y) = (rng.number(), rng.number());
            *what = format!("creation {d:?} {dt} with {x} {y}");
            match rng.below(6) {
                0 => Tensor::zeros(d, dt, CPU),
                1 => Tensor::ones(d, dt, CPU),
                2 => Tensor::full(d, x, dt, CPU),
                3 => Tensor::arange(x, y, rng.number(), dt, CPU),
                4 => Tensor::randn(d, x, y, rng.next(), dt, CPU),
                _ => Tensor::rand_uniform(d, x, y, rng.next(), dt, CPU),
            }
        }
        24 => {
            *what += " set_data / cast_in_place";
            if rng.coin() {
                a.set_data(b)?;
            } else {
                a.cast_in_place(rng.dtype())?;
            }
            return Ok(None);
        }
        _ => {
            let (d4, dt) = (rng.dims(4), rng.dtype());
            let t = tensor(rng, d4, dt)?;
            *what = format!("new tensor {:?} {}", t.dims(), t.dtype());
            Ok(t)
        }
    };
    out.map(Some)
}

/// Runs one sequence; `Err` describes a panic. Counts the ops that succeeded in `ok`.
fn sequence(seed: u64, ok: &mut usize) -> std::result::Result<(), String> {
    let mut rng = Rng(seed);
    let mut pool = Vec::new();
    for _ in 0..4 {
        let (d, dt) = (rng.dims(4), rng.dtype());
        if let Ok(t) = tensor(&mut rng, d, dt) {
            pool.push(t);
        }
    }
    if pool.is_empty() {
        pool.push(Tensor::zeros([2, 3], DType::F32, CPU).unwrap());
    }
    for i in 0..STEPS {
        let mut what = String::new();
        let r = catch_unwind(AssertUnwindSafe(|| step(&mut rng, &pool, &mut what)));
        match r {
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                return Err(format!("seed {seed}, step {i}: {what}: panicked: {msg}"));
            }
            Ok(Ok(Some(t))) if t.elem_count() <= MAX_KEEP => {
                *ok += 1;
                if pool.len() >= 8 {
                    let j = rng.below(pool.len());
                    pool[j] = t;
                } else {
                    pool.push(t);
                }
            }
            Ok(Ok(_)) => *ok += 1,
            Ok(Err(_)) => {}
        }
    }
    Ok(())
}

#[test]
fn random_op_sequences_never_panic() {
    let cases: u64 = std::env::var("MIXPREC_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8000);
    let seeds: Vec<u64> = match std::env::var("MIXPREC_FUZZ_SEED") {
        Ok(s) => vec![s.parse().expect("MIXPREC_FUZZ_SEED is a number")],
        Err(_) => (0..cases).map(|i| 0xf022_0000 + i).collect(),
    };
    // The panics are reported below with their seed; the default hook would print each twice.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut ok = 0;
    let failures: Vec<String> = seeds
        .iter()
        .filter_map(|&s| sequence(s, &mut ok).err())
        .collect();
    std::panic::set_hook(hook);
    let ops = seeds.len() * STEPS;
    eprintln!(
        "{ops} ops in {} sequences: {ok} succeeded, the rest were errors",
        seeds.len()
    );
    // A fuzzer whose ops all fail tests nothing.
    assert!(ok * 4 > ops, "only {ok} of {ops} ops succeeded");
    assert!(
        failures.is_empty(),
        "{} of {} sequences panicked (replay one with MIXPREC_FUZZ_SEED):\n{}",
        failures.len(),
        seeds.len(),
        failures[..failures.len().min(20)].join("\n")
    );
}
