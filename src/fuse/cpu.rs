//! The reference: a traced graph interpreted on the host, node by node. Each value is held
//! compactly over its dims (in f64 storage), computed in f64 for f64 values and rounded to f32
//! after every primitive otherwise (f32 arithmetic: half values compute in f32, as the kernels
//! do); casts to a half type round to it; outputs are stored in their dtype.

use super::ir::{BinaryFn, Dims, Graph, Node, ReduceFn, UnaryFn};
use super::Ran;
use crate::base::error::Result;
use crate::base::DType;
use crate::tensor::{Device, Tensor};

/// Runs `g` on `xs` (host tensors) over a domain of `sizes`; the outputs are host tensors,
/// and so are its reductions' values (f32, f64 for f64 values, as the kernels keep them).
pub(crate) fn run(g: &Graph, xs: &[&Tensor], sizes: &[usize]) -> Result<Ran> {
    let values = eval(g, xs, sizes)?;
    let outputs = g
        .outputs
        .iter()
        .map(|&o| {
            let it = &g.items[o];
            let data = values[o].clone().unwrap_or_default();
            Tensor::from_vec(data, g.shape_of(o, sizes), Device::Cpu)?.to_dtype(it.dtype)
        })
        .collect::<Result<_>>()?;
    let mut reductions = Vec::new();
    for (v, it) in g.items.iter().enumerate() {
        if let (Node::Reduce(..), Some(data)) = (it.node, &values[v]) {
            let dt = if it.wide() { DType::F64 } else { DType::F32 };
            let t = Tensor::from_vec(data.clone(), g.shape_of(v, sizes), Device::Cpu)?;
            reductions.push((v, t.to_dtype(dt)?));
        }
    }
    Ok(Ran {
        outputs,
        reductions,
    })
}

/// Every live value of `g`, compact over its dims.
pub(crate) fn eval(g: &Graph, xs: &[&Tensor], sizes: &[usize]) -> Result<Vec<Option<Vec<f64>>>> {
    let live = g.live();
    let mut vals: Vec<Option<Vec<f64>>> = vec![None; g.items.len()];
    for (v, it) in g.items.iter().enumerate() {
        if !live[v] {
            continue;
        }
        let round = |x: f64| if it.wide() { x } else { x as f32 as f64 };
        // An operand made to vary along this item's dims.
        let at = |u: usize, vals: &[Option<Vec<f64>>]| {
            let src = vals[u].as_deref().unwrap_or(&[]);
            expand(src, g.items[u].dims, it.dims, sizes)
        };
        let out: Vec<f64> = match it.node {
            Node::Input(i) => xs[i].to_vec_f64()?.into_iter().map(round).collect(),
            // Scalars stay exact: the primitive using one rounds its own result.
            Node::Const(c) => vec![c],
            Node::Size(d) => vec![d.count(sizes) as f64],
            Node::Unary(f, a) => at(a, &vals)
                .into_iter()
                .map(|x| round(unary(f, x)))
                .collect(),
            Node::Pow(a, e) => at(a, &vals).into_iter().map(|x| round(x.powf(e))).collect(),
            Node::Binary(f, a, b) => {
                let (x, y) = (at(a, &vals), at(b, &vals));
                x.iter()
                    .zip(&y)
                    .map(|(&x, &y)| round(binary(f, x, y)))
                    .collect()
            }
            Node::Select(c, a, b) => {
                let (c, x, y) = (at(c, &vals), at(a, &vals), at(b, &vals));
                (0..c.len())
                    .map(|k| if c[k] != 0.0 { x[k] } else { y[k] })
                    .collect()
            }
            Node::Cast(a) => at(a, &vals)
                .into_iter()
                .map(|x| to_dtype(x, it.dtype))
                .collect(),
            Node::Broadcast(a) => at(a, &vals),
            Node::Reduce(f, a) => {
                let src = vals[a].as_deref().unwrap_or(&[]);
                reduce(f, src, g.items[a].dims, it.dims, sizes)
                    .into_iter()
                    .map(round)
                    .collect()
            }
        };
        vals[v] = Some(out);
    }
    Ok(vals)
}

/// `x` rounded to `dtype` (and widened back).
fn to_dtype(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F64 => x,
        DType::F16 => half::f16::from_f64(x).to_f64(),
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
        _ => x as f32 as f64,
    }
}

pub(crate) fn unary(f: UnaryFn, x: f64) -> f64 {
    match f {
        UnaryFn::Neg => -x,
        UnaryFn::Exp => x.exp(),
        UnaryFn::Log => x.ln(),
        UnaryFn::Tanh => x.tanh(),
        UnaryFn::Erf => libm::erf(x),
        UnaryFn::Sqrt => x.sqrt(),
        UnaryFn::Rsqrt => 1.0 / x.sqrt(),
        UnaryFn::Abs => x.abs(),
        UnaryFn::Relu => {
            if x > 0.0 {
                x
            } else {
                0.0
            }
        }
        UnaryFn::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        UnaryFn::Recip => 1.0 / x,
        UnaryFn::Sin => x.sin(),
        UnaryFn::Cos => x.cos(),
    }
}

pub(crate) fn binary(f: BinaryFn, x: f64, y: f64) -> f64 {
    let b = |c: bool| if c { 1.0 } else { 0.0 };
    match f {
        BinaryFn::Add => x + y,
        BinaryFn::Sub => x - y,
        BinaryFn::Mul => x * y,
        BinaryFn::Div => x / y,
        // NaN propagates, as in the kernels (fmaxf would drop it).
        BinaryFn::Max => {
            if x.is_nan() || x >= y {
                x
            } else {
                y
            }
        }
        BinaryFn::Min => {
            if x.is_nan() || x <= y {
                x
            } else {
                y
            }
        }
        BinaryFn::Lt => b(x < y),
        BinaryFn::Le => b(x <= y),
        BinaryFn::Gt => b(x > y),
        BinaryFn::Ge => b(x >= y),
        BinaryFn::Eq => b(x == y),
        BinaryFn::Ne => b(x != y),
    }
}

/// Row-major strides of a value compact over `dims`, one per domain dim (0 outside `dims`).
fn strides(dims: Dims, sizes: &[usize]) -> Vec<usize> {
    let mut s = vec![0; sizes.len()];
    let mut acc = 1;
    for d in (0..sizes.len()).rev() {
        if dims.has(d) {
            s[d] = acc;
            acc *= sizes[d];
        }
    }
    s
}

/// Calls `f(i, j)` for every element `i` of a value over `to`, with `j` the element of a value
/// over `from` at the same domain position (its other dims broadcast).
fn walk(from: Dims, to: Dims, sizes: &[usize], mut f: impl FnMut(usize, usize)) {
    let n = to.count(sizes);
    let sf = strides(from, sizes);
    let r = sizes.len();
    let mut idx = vec![0usize; r];
    let mut j = 0usize;
    for i in 0..n {
        f(i, j);
        // Next position of `to`, innermost dim first; `j` follows.
        for d in (0..r).rev() {
            if !to.has(d) {
                continue;
            }
            idx[d] += 1;
            j += sf[d];
            if idx[d] < sizes[d] {
                break;
            }
            j -= sf[d] * idx[d];
            idx[d] = 0;
        }
    }
}

/// A value over `from` as one over `to` (a superset: broadcast along the new dims).
fn expand(src: &[f64], from: Dims, to: Dims, sizes: &[usize]) -> Vec<f64> {
    if from == to {
        return src.to_vec();
    }
    let mut out = vec![0.0; to.count(sizes)];
    walk(from, to, sizes, |i, j| out[i] = src[j]);
    out
}

/// A reduction of a value over `from` to one over `to` (a subset), accumulated in f64.
fn reduce(f: ReduceFn, src: &[f64], from: Dims, to: Dims, sizes: &[usize]) -> Vec<f64> {
    let init = match f {
        ReduceFn::Sum => 0.0,
        ReduceFn::Max => f64::NEG_INFINITY,
        ReduceFn::Min => f64::INFINITY,
    };
    let mut out = vec![init; to.count(sizes)];
    // Walk the source; `j` is then the output's element.
    walk(to, from, sizes, |i, j| {
        let x = src[i];
        out[j] = match f {
            ReduceFn::Sum => out[j] + x,
            ReduceFn::Max => binary(BinaryFn::Max, x, out[j]),
            ReduceFn::Min => binary(BinaryFn::Min, x, out[j]),
        };
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expand_and_reduce_follow_the_domain() {
        let sizes = [2, 3];
        // A value along dim 1 ([3]) broadcast to both dims.
        let e = expand(&[1.0, 2.0, 3.0], Dims(0b10), Dims(0b11), &sizes);
        assert_eq!(e, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
        let e = expand(&[1.0, 2.0], Dims(0b01), Dims(0b11), &sizes);
        assert_eq!(e, vec![1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(
            reduce(ReduceFn::Sum, &x, Dims(0b11), Dims(0b01), &sizes),
            vec![6.0, 15.0]
        );
        assert_eq!(
            reduce(ReduceFn::Max, &x, Dims(0b11), Dims(0b10), &sizes),
            vec![4.0, 5.0, 6.0]
        );
        assert_eq!(
            reduce(ReduceFn::Sum, &x, Dims(0b11), Dims(0), &sizes),
            vec![21.0]
        );
    }
}
