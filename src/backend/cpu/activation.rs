//! GELU (exact and tanh) and SiLU with their derivatives, elementwise over dense spans.

use num_traits::{Float, FromPrimitive};
use rayon::prelude::*;

use super::elementwise::map;
use super::{map_float, map_float2, CpuStorage, Elem, PAR_THRESHOLD};
use crate::backend::{Activation, ActivationOps};
use crate::base::error::Result;
use crate::base::Layout;

/// erf in the arithmetic type: libm's f32 `erff` for f32 (as the kernels' `erff`), `erf` for f64.
fn erf<A: Float + FromPrimitive>(v: A) -> A {
    let d = v.to_f64().unwrap_or(f64::NAN);
    let r = if std::mem::size_of::<A>() == 4 {
        libm::erff(d as f32) as f64
    } else {
        libm::erf(d)
    };
    A::from_f64(r).unwrap_or_else(A::nan)
}

/// Constants of the activations, in the arithmetic type.
struct Consts<A> {
    half: A,
    one: A,
    /// 1/√2
    rsqrt2: A,
    /// 1/√(2π)
    rsqrt_2pi: A,
    /// √(2/π)
    k: A,
    /// 0.044715
    c: A,
}

impl<A: Float + FromPrimitive> Consts<A> {
    fn new() -> Self {
        let f = |v: f64| A::from_f64(v).unwrap_or_else(A::nan);
        Consts {
            half: f(0.5),
            one: A::one(),
            rsqrt2: f(std::f64::consts::FRAC_1_SQRT_2),
            rsqrt_2pi: f(0.398_942_280_401_432_7),
            k: f(0.797_884_560_802_865_4),
            c: f(0.044_715),
        }
    }
}

fn sigmoid<A: Float>(v: A) -> A {
    A::one() / (A::one() + (-v).exp())
}

/// The activation of one value.
fn value<A: Float + FromPrimitive>(act: Activation, k: &Consts<A>, x: A) -> A {
    match act {
        Activation::Gelu => k.half * x * (k.one + erf(x * k.rsqrt2)),
        Activation::GeluTanh => {
            let t = (k.k * (x + k.c * x * x * x)).tanh();
            k.half * x * (k.one + t)
        }
        Activation::Silu => x * sigmoid(x),
    }
}

/// The derivative at one value.
fn slope<A: Float + FromPrimitive>(act: Activation, k: &Consts<A>, x: A) -> A {
    match act {
        // Φ(x) + x·φ(x)
        Activation::Gelu => {
            let pdf = k.rsqrt_2pi * (-k.half * x * x).exp();
            k.half * (k.one + erf(x * k.rsqrt2)) + x * pdf
        }
        // ½(1 + t) + ½x·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²)
        Activation::GeluTanh => {
            let t = (k.k * (x + k.c * x * x * x)).tanh();
            let three = k.one + k.one + k.one;
            k.half * (k.one + t)
                + k.half * x * (k.one - t * t) * k.k * (k.one + three * k.c * x * x)
        }
        // σ(x)·(1 + x·(1 − σ(x)))
        Activation::Silu => {
            let s = sigmoid(x);
            s * (k.one + x * (A::one() - s))
        }
    }
}

/// GELU's tanh form of one value in the accumulation type (the linear layer's fused epilogue).
pub(super) fn gelu_tanh<A: Float + FromPrimitive>(x: A) -> A {
    value(Activation::GeluTanh, &Consts::new(), x)
}

pub fn forward<T: Elem>(x: &[T], act: Activation) -> Vec<T> {
    let k = Consts::<T::Acc>::new();
    map(x, |v| value(act, &k, v))
}

/// `g · act'(x)`, rounded once to `T`.
pub fn backward<T: Elem>(g: &[T], x: &[T], act: Activation) -> Vec<T> {
    let k = Consts::<T::Acc>::new();
    let f = |(g, x): (&T, &T)| T::from_acc(g.to_acc() * slope(act, &k, x.to_acc()));
    if g.len() >= PAR_THRESHOLD {
        g.par_iter().zip(x.par_iter()).map(f).collect()
    } else {
        g.iter().zip(x.iter()).map(f).collect()
    }
}

/// [`forward`] over a dense layout's span (the result keeps its strides).
pub fn activation(x: &CpuStorage, l: &Layout, act: Activation) -> Result<CpuStorage> {
    Ok(map_float!(&*x.span(l), act.name(), |v| forward(v, act)))
}

/// [`backward`] over two dense layouts with equal strides.
pub fn activation_backward(
    g: &CpuStorage,
    lg: &Layout,
    x: &CpuStorage,
    lx: &Layout,
    act: Activation,
) -> Result<CpuStorage> {
    let (g, x) = (g.span(lg), x.span(lx));
    Ok(map_float2!(&*g, &*x, act.backward_name(), |g, x| {
        backward(g, x, act)
    }))
}

impl ActivationOps for CpuStorage {
    fn activation(&self, l: &Layout, act: Activation) -> Result<Self> {
        activation(self, l, act)
    }
    fn activation_backward(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        act: Activation,
    ) -> Result<Self> {
        activation_backward(self, l, x, xl, act)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_match_known_points_and_slopes_match_finite_differences() {
        // GELU(1) = Φ(1) = 0.841344746..., GELU-tanh(1) = 0.841191990..., SiLU(1) = σ(1).
        let one = [1.0f64];
        assert!((forward(&one, Activation::Gelu)[0] - 0.841_344_746_068_542_9).abs() < 1e-15);
        assert!((forward(&one, Activation::GeluTanh)[0] - 0.841_191_990_607_402_3).abs() < 1e-12);
        assert!((forward(&one, Activation::Silu)[0] - 1.0 / (1.0 + (-1.0f64).exp())).abs() < 1e-15);
        let xs: Vec<f64> = (-40..=40).map(|i| i as f64 * 0.15 + 0.01).collect();
        for act in [Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
            let g = vec![1.0; xs.len()];
            let d = backward(&g, &xs, act);
            for (k, &x) in xs.iter().enumerate() {
                let h = 1e-6;
                let n = (forward(&[x + h], act)[0] - forward(&[x - h], act)[0]) / (2.0 * h);
                assert!((n - d[k]).abs() < 1e-8, "{act:?} at {x}: {n} vs {}", d[k]);
            }
        }
    }
}
