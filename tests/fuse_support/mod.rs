//! Random fused programs for tests/fuse.rs and tests/cuda_fuse.rs: an expression over a few
//! inputs with random broadcast patterns, of random depth, holding 1-3 reductions, evaluated
//! both as a fused function and as the same chain of unfused tensor ops.
#![allow(dead_code)]

use mixprec::fuse::{Fuser, Var};
use mixprec::{DType, Device, Result, Tensor};

/// A small deterministic generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn coin(&mut self) -> bool {
        self.below(2) == 0
    }
}

#[derive(Clone, Debug)]
pub enum E {
    In(usize),
    Neg(Box<E>),
    /// exp(-|x|)
    ExpNeg(Box<E>),
    /// log(|x| + 0.5)
    LogP(Box<E>),
    /// sqrt(|x| + 0.5)
    SqrtP(Box<E>),
    Relu(Box<E>),
    /// (|x| + 0.5)^e
    PowP(Box<E>, f64),
    Scale(Box<E>, f64),
    Add(Box<E>, Box<E>),
    Sub(Box<E>, Box<E>),
    Mul(Box<E>, Box<E>),
    /// a / (|b| + 0.5)
    DivP(Box<E>, Box<E>),
    Max(Box<E>, Box<E>),
    Min(Box<E>, Box<E>),
    Sum(Box<E>, Vec<isize>),
    Mean(Box<E>, Vec<isize>),
    RMax(Box<E>, Vec<isize>),
}

/// A random program: its input shapes (the domain is rank 3) and its outputs.
#[derive(Clone, Debug)]
pub struct Program {
    pub shapes: Vec<Vec<usize>>,
    pub outputs: Vec<E>,
}

impl E {
    pub fn rank(&self, shapes: &[Vec<usize>]) -> usize {
        use E::*;
        match self {
            In(i) => shapes[*i].len(),
            Neg(a) | ExpNeg(a) | LogP(a) | SqrtP(a) | Relu(a) | PowP(a, _) | Scale(a, _) => {
                a.rank(shapes)
            }
            Sum(a, _) | Mean(a, _) | RMax(a, _) => a.rank(shapes),
            Add(a, b) | Sub(a, b) | Mul(a, b) | DivP(a, b) | Max(a, b) | Min(a, b) => {
                a.rank(shapes).max(b.rank(shapes))
            }
        }
    }

    pub fn reductions(&self) -> usize {
        use E::*;
        match self {
            In(_) => 0,
            Neg(a) | ExpNeg(a) | LogP(a) | SqrtP(a) | Relu(a) | PowP(a, _) | Scale(a, _) => {
                a.reductions()
            }
            Sum(a, _) | Mean(a, _) | RMax(a, _) => 1 + a.reductions(),
            Add(a, b) | Sub(a, b) | Mul(a, b) | DivP(a, b) | Max(a, b) | Min(a, b) => {
                a.reductions() + b.reductions()
            }
        }
    }
}

fn axes(rng: &mut Rng, rank: usize) -> Vec<isize> {
    let mut v: Vec<isize> = (0..rank as isize).filter(|_| rng.coin()).collect();
    if v.is_empty() && rank > 0 {
        v.push(rng.below(rank) as isize);
    }
    if rng.coin() {
        // Negative axes count from the end.
        for a in v.iter_mut() {
            *a -= rank as isize;
        }
    }
    v
}

/// `a` plus a thousandth of the first input (which varies along every dim): the maxima of a
/// broadcast or clipped value are then unique, so the unfused max (whose gradient goes to the
/// first maximal element) and the fused one (shared by all) agree.
fn untie(a: Box<E>) -> Box<E> {
    Box::new(E::Add(a, Box::new(E::Scale(Box::new(E::In(0)), 1e-3))))
}

fn gen(rng: &mut Rng, depth: usize, n_in: usize, shapes: &[Vec<usize>]) -> E {
    use E::*;
    if depth == 0 || rng.below(5) == 0 {
        return In(rng.below(n_in));
    }
    let sub = |rng: &mut Rng| Box::new(gen(rng, depth - 1, n_in, shapes));
    match rng.below(15) {
        0 => Neg(sub(rng)),
        1 => ExpNeg(sub(rng)),
        2 => LogP(sub(rng)),
        3 => SqrtP(sub(rng)),
        4 => Relu(sub(rng)),
        5 => PowP(sub(rng), [1.5, 2.0, 3.0, -0.5][rng.below(4)]),
        6 => Scale(sub(rng), [0.5, -2.0, 3.0][rng.below(3)]),
        7 => Add(sub(rng), sub(rng)),
        8 => Sub(sub(rng), sub(rng)),
        9 => Mul(sub(rng), sub(rng)),
        10 => DivP(sub(rng), sub(rng)),
        11 => Max(sub(rng), sub(rng)),
        12 => Min(sub(rng), sub(rng)),
        _ => {
            let a = sub(rng);
            let r = a.rank(shapes);
            let ax = axes(rng, r);
            match rng.below(3) {
                0 => Sum(a, ax),
                1 => Mean(a, ax),
                _ => RMax(untie(a), ax),
            }
        }
    }
}

/// A program of depth up to `depth` over 2-3 inputs with 1-3 reductions (`reductions`), one or
/// two outputs.
pub fn program(rng: &mut Rng, depth: usize, sizes: [usize; 3]) -> Program {
    let [a, b, c] = sizes;
    let patterns: Vec<Vec<usize>> = vec![
        vec![a, b, c],
        vec![1, b, c],
        vec![a, 1, c],
        vec![c],
        vec![b, 1],
        vec![1, 1, c],
        vec![],
        vec![a, b, 1],
    ];
    let n_in = 2 + rng.below(2);
    let mut shapes = vec![vec![a, b, c]];
    for _ in 1..n_in {
        shapes.push(patterns[rng.below(patterns.len())].clone());
    }
    let want = 1 + rng.below(3);
    let mut p = gen(rng, depth, n_in, &shapes);
    while p.reductions() < want {
        let r = p.rank(&shapes);
        if r == 0 {
            p = E::Mul(Box::new(p), Box::new(E::In(0)));
            continue;
        }
        let ax = axes(rng, r);
        let red = match rng.below(3) {
            0 => E::Sum(Box::new(p.clone()), ax),
            1 => E::Mean(Box::new(p.clone()), ax),
            _ => E::RMax(untie(Box::new(p.clone())), ax),
        };
        // Reduced values broadcast back, as a norm's statistics do.
        p = match rng.below(3) {
            0 => E::Sub(Box::new(p), Box::new(red)),
            1 => E::Mul(Box::new(p), Box::new(red)),
            _ => E::DivP(Box::new(p), Box::new(red)),
        };
    }
    let mut outputs = vec![p.clone()];
    if rng.coin() {
        let r = p.rank(&shapes);
        outputs.push(E::Mean(Box::new(p), axes(rng, r)));
    }
    Program { shapes, outputs }
}

/// The program's expression traced on a [`Fuser`].
pub fn trace(f: &Fuser, x: &[Var], e: &E) -> Var {
    use E::*;
    let half = |f: &Fuser, v: Var| f.add_scalar(f.abs(v), 0.5);
    match e {
        In(i) => x[*i],
        Neg(a) => f.neg(trace(f, x, a)),
        ExpNeg(a) => f.exp(f.neg(f.abs(trace(f, x, a)))),
        LogP(a) => f.log(half(f, trace(f, x, a))),
        SqrtP(a) => f.sqrt(half(f, trace(f, x, a))),
        Relu(a) => f.relu(trace(f, x, a)),
        PowP(a, p) => f.powf(half(f, trace(f, x, a)), *p),
        Scale(a, s) => f.mul_scalar(trace(f, x, a), *s),
        Add(a, b) => f.add(trace(f, x, a), trace(f, x, b)),
        Sub(a, b) => f.sub(trace(f, x, a), trace(f, x, b)),
        Mul(a, b) => f.mul(trace(f, x, a), trace(f, x, b)),
        DivP(a, b) => f.div(trace(f, x, a), half(f, trace(f, x, b))),
        Max(a, b) => f.maximum(trace(f, x, a), trace(f, x, b)),
        Min(a, b) => f.minimum(trace(f, x, a), trace(f, x, b)),
        Sum(a, ax) => f.sum(trace(f, x, a), ax),
        Mean(a, ax) => f.mean(trace(f, x, a), ax),
        RMax(a, ax) => f.max(trace(f, x, a), ax),
    }
}

/// The program's expression as unfused tensor ops (reductions keep their dims).
pub fn unfused(x: &[Tensor], e: &E) -> Result<Tensor> {
    use E::*;
    let half = |t: Tensor| t.abs()?.add_scalar(0.5);
    Ok(match e {
        In(i) => x[*i].clone(),
        Neg(a) => unfused(x, a)?.neg()?,
        ExpNeg(a) => unfused(x, a)?.abs()?.neg()?.exp()?,
        LogP(a) => half(unfused(x, a)?)?.log()?,
        SqrtP(a) => half(unfused(x, a)?)?.sqrt()?,
        Relu(a) => unfused(x, a)?.relu()?,
        PowP(a, p) => half(unfused(x, a)?)?.powf(*p)?,
        Scale(a, s) => unfused(x, a)?.mul_scalar(*s)?,
        Add(a, b) => unfused(x, a)?.add(&unfused(x, b)?)?,
        Sub(a, b) => unfused(x, a)?.sub(&unfused(x, b)?)?,
        Mul(a, b) => unfused(x, a)?.mul(&unfused(x, b)?)?,
        DivP(a, b) => unfused(x, a)?.div(&half(unfused(x, b)?)?)?,
        Max(a, b) => unfused(x, a)?.maximum(&unfused(x, b)?)?,
        Min(a, b) => unfused(x, a)?.minimum(&unfused(x, b)?)?,
        Sum(a, ax) => unfused(x, a)?.sum_dims(ax, true)?,
        Mean(a, ax) => {
            let t = unfused(x, a)?;
            let n: usize = ax
                .iter()
                .map(|&d| t.dims()[if d < 0 { d + t.rank() as isize } else { d } as usize])
                .product();
            t.sum_dims(ax, true)?.mul_scalar(1.0 / n as f64)?
        }
        RMax(a, ax) => {
            let mut t = unfused(x, a)?;
            for &d in ax {
                t = t.max_dim(d, true)?;
            }
            t
        }
    })
}

/// Random inputs of the program's shapes, in `dtype`, on `dev`.
pub fn inputs(p: &Program, seed: u64, dtype: DType, dev: Device) -> Result<Vec<Tensor>> {
    p.shapes
        .iter()
        .enumerate()
        .map(|(i, s)| Tensor::randn(s.clone(), 0.0, 1.0, seed + i as u64, dtype, dev))
        .collect()
}

/// The largest difference between `a` and `b`, relative to `max(|b|, 1)`, elementwise.
pub fn max_rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| {
            if x.is_nan() && y.is_nan() {
                0.0
            } else {
                (x - y).abs() / y.abs().max(1.0)
            }
        })
        .fold(0.0, f64::max)
}
