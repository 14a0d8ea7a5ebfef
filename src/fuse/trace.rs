//! The tracer: [`Fuser`] records the primitives a fused function's body applies to its
//! [`Var`]s into a [`Graph`], with the dtypes and broadcast dims the unfused ops would give.
//! A mistake in the body (an axis out of range, a non-float cast) is kept and returned when
//! the trace ends, so the body reads as plain arithmetic.

use std::cell::RefCell;

use super::ir::{BinaryFn, Dims, Graph, Item, Node, ReduceFn, Signature, UnaryFn, Value};
use crate::base::error::{Error, Result};
use crate::base::DType;
use crate::tensor::autocast::{self, OpKind};
use crate::tensor::{Device, Tensor};

/// A value inside a fused function's body: a handle to a node of the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Var(pub(crate) Value);

/// Records a fused function's primitives. Every method takes and returns [`Var`]s; scalars are
/// `f64` and do not change a value's dtype.
pub struct Fuser {
    graph: RefCell<Graph>,
    error: RefCell<Option<Error>>,
}

impl Fuser {
    /// A trace for `sig` whose inputs are already recorded.
    pub(crate) fn new(name: &'static str, sig: Signature) -> Fuser {
        let items = sig
            .inputs
            .iter()
            .enumerate()
            .map(|(i, s)| Item {
                node: Node::Input(i),
                dtype: s.dtype,
                weak: false,
                dims: s.dims,
                rank: s.rank,
            })
            .collect();
        Fuser {
            graph: RefCell::new(Graph {
                name,
                sig,
                items,
                outputs: vec![],
            }),
            error: RefCell::new(None),
        }
    }

    /// The inputs as variables.
    pub(crate) fn inputs(&self) -> Vec<Var> {
        (0..self.graph.borrow().sig.inputs.len()).map(Var).collect()
    }

    /// The finished graph with `outputs`, or the first mistake the body made.
    pub(crate) fn finish(self, outputs: &[Var]) -> Result<Graph> {
        if let Some(e) = self.error.into_inner() {
            return Err(e);
        }
        let mut g = self.graph.into_inner();
        if outputs.is_empty() {
            return Err(Error::invalid_arg(
                "fuse",
                "outputs",
                g.name,
                "a fused function returns at least one value",
            ));
        }
        if let Some(o) = outputs.iter().find(|o| o.0 >= g.items.len()) {
            return Err(Error::invalid_arg(
                "fuse",
                "outputs",
                o.0,
                "variables of this function's own trace",
            ));
        }
        g.outputs = outputs.iter().map(|o| o.0).collect();
        Ok(g)
    }

    fn fail(&self, e: Error) {
        let mut slot = self.error.borrow_mut();
        if slot.is_none() {
            *slot = Some(e);
        }
    }

    pub(crate) fn item(&self, v: Var) -> Item {
        self.graph.borrow().items[v.0]
    }

    /// Records `it`, or finds the same primitive on the same operands recorded before (a
    /// variance's mean and the mean the body took itself are one reduction).
    pub(crate) fn push(&self, it: Item) -> Var {
        let mut g = self.graph.borrow_mut();
        if let Some(v) = g.items.iter().position(|x| *x == it) {
            return Var(v);
        }
        g.items.push(it);
        Var(g.items.len() - 1)
    }

    /// The dtype the unfused chain gives `v`.
    pub fn dtype(&self, v: Var) -> DType {
        self.item(v).dtype
    }

    /// `v`'s rank.
    pub fn rank(&self, v: Var) -> usize {
        self.item(v).rank
    }

    /// The domain's rank (the inputs' largest).
    pub fn domain_rank(&self) -> usize {
        self.graph.borrow().sig.rank
    }

    /// A scalar constant (it takes the other operand's dtype).
    pub fn scalar(&self, x: f64) -> Var {
        self.push(Item {
            node: Node::Const(x),
            dtype: DType::F32,
            weak: true,
            dims: Dims(0),
            rank: 0,
        })
    }

    /// `v` cast to `dtype` where autocast's policy would cast an unfused `kind` op's operand:
    /// the policy is asked with a one-element tensor of each operand's dtype, at trace time.
    fn amp(&self, kind: OpKind, vs: &[Var]) -> Vec<Var> {
        // The trace's own autocast state (a backward graph's is off), which is the thread's.
        if self.graph.borrow().sig.autocast.is_none() || autocast::active().is_none() {
            return vs.to_vec();
        }
        let strong: Vec<Var> = vs.iter().copied().filter(|&v| !self.item(v).weak).collect();
        let probes: Result<Vec<Tensor>> = strong
            .iter()
            .map(|&v| Tensor::zeros(vec![1], self.dtype(v), Device::Cpu))
            .collect();
        let cast = probes.and_then(|p| match p.as_slice() {
            [a] => Ok(autocast::inputs1(kind, a)?.map(|t| vec![t.dtype()])),
            [a, b] => Ok(autocast::inputs2(kind, a, b)?.map(|(x, y)| vec![x.dtype(), y.dtype()])),
            _ => Ok(None),
        });
        let targets = match cast {
            Ok(Some(t)) => t,
            Ok(None) => return vs.to_vec(),
            Err(e) => {
                self.fail(e);
                return vs.to_vec();
            }
        };
        let mut t = targets.into_iter();
        vs.iter()
            .map(|&v| {
                if self.item(v).weak {
                    v
                } else {
                    match t.next() {
                        Some(dt) if dt != self.dtype(v) => self.cast(v, dt),
                        _ => v,
                    }
                }
            })
            .collect()
    }

    fn unary(&self, f: UnaryFn, a: Var) -> Var {
        let kind = match f {
            UnaryFn::Neg => Some(OpKind::Neg),
            UnaryFn::Exp => Some(OpKind::Exp),
            UnaryFn::Log => Some(OpKind::Log),
            UnaryFn::Sqrt => Some(OpKind::Sqrt),
            UnaryFn::Abs => Some(OpKind::Abs),
            UnaryFn::Relu => Some(OpKind::Relu),
            _ => None,
        };
        let a = match kind {
            Some(k) => self.amp(k, &[a])[0],
            None => a,
        };
        let it = self.item(a);
        self.push(Item {
            node: Node::Unary(f, a.0),
            ..it
        })
    }

    fn binary(&self, f: BinaryFn, a: Var, b: Var) -> Var {
        let kind = match f {
            BinaryFn::Add => Some(OpKind::Add),
            BinaryFn::Sub => Some(OpKind::Sub),
            BinaryFn::Mul => Some(OpKind::Mul),
            BinaryFn::Div => Some(OpKind::Div),
            BinaryFn::Max => Some(OpKind::Maximum),
            BinaryFn::Min => Some(OpKind::Minimum),
            _ => None,
        };
        let (a, b) = match kind {
            Some(k) => {
                let v = self.amp(k, &[a, b]);
                (v[0], v[1])
            }
            None => (a, b),
        };
        let (x, y) = (self.item(a), self.item(b));
        let (dtype, weak) = match (x.weak, y.weak) {
            (true, true) => (DType::F32, true),
            (true, false) => (y.dtype, false),
            (false, true) => (x.dtype, false),
            (false, false) => (DType::promote(x.dtype, y.dtype), false),
        };
        self.push(Item {
            node: Node::Binary(f, a.0, b.0),
            dtype,
            weak,
            dims: x.dims.union(y.dims),
            rank: x.rank.max(y.rank),
        })
    }

    pub fn neg(&self, a: Var) -> Var {
        self.unary(UnaryFn::Neg, a)
    }
    pub fn exp(&self, a: Var) -> Var {
        self.unary(UnaryFn::Exp, a)
    }
    pub fn log(&self, a: Var) -> Var {
        self.unary(UnaryFn::Log, a)
    }
    pub fn tanh(&self, a: Var) -> Var {
        self.unary(UnaryFn::Tanh, a)
    }
    pub fn erf(&self, a: Var) -> Var {
        self.unary(UnaryFn::Erf, a)
    }
    pub fn sqrt(&self, a: Var) -> Var {
        self.unary(UnaryFn::Sqrt, a)
    }
    /// `1/√a`.
    pub fn rsqrt(&self, a: Var) -> Var {
        self.unary(UnaryFn::Rsqrt, a)
    }
    pub fn abs(&self, a: Var) -> Var {
        self.unary(UnaryFn::Abs, a)
    }
    pub fn relu(&self, a: Var) -> Var {
        self.unary(UnaryFn::Relu, a)
    }
    /// `1/(1+e^-a)`.
    pub fn sigmoid(&self, a: Var) -> Var {
        self.unary(UnaryFn::Sigmoid, a)
    }
    /// `1/a`.
    pub fn recip(&self, a: Var) -> Var {
        self.unary(UnaryFn::Recip, a)
    }
    pub fn sin(&self, a: Var) -> Var {
        self.unary(UnaryFn::Sin, a)
    }
    pub fn cos(&self, a: Var) -> Var {
        self.unary(UnaryFn::Cos, a)
    }
    /// `a·a`.
    pub fn sqr(&self, a: Var) -> Var {
        self.mul(a, a)
    }
    /// `a^e`.
    pub fn powf(&self, a: Var, e: f64) -> Var {
        let a = self.amp(OpKind::Powf, &[a])[0];
        let it = self.item(a);
        self.push(Item {
            node: Node::Pow(a.0, e),
            ..it
        })
    }

    pub fn add(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Add, a, b)
    }
    pub fn sub(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Sub, a, b)
    }
    pub fn mul(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Mul, a, b)
    }
    pub fn div(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Div, a, b)
    }
    pub fn maximum(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Max, a, b)
    }
    pub fn minimum(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Min, a, b)
    }
    /// `a + s`.
    pub fn add_scalar(&self, a: Var, s: f64) -> Var {
        let s = self.scalar(s);
        self.add(a, s)
    }
    /// `a · s`.
    pub fn mul_scalar(&self, a: Var, s: f64) -> Var {
        let s = self.scalar(s);
        self.mul(a, s)
    }
    /// 1 where `a < b`, else 0.
    pub fn lt(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Lt, a, b)
    }
    pub fn le(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Le, a, b)
    }
    pub fn gt(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Gt, a, b)
    }
    pub fn ge(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Ge, a, b)
    }
    pub fn eq(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Eq, a, b)
    }
    pub fn ne(&self, a: Var, b: Var) -> Var {
        self.binary(BinaryFn::Ne, a, b)
    }

    /// `a` where `cond` is not 0, else `b` (the three broadcast together).
    pub fn select(&self, cond: Var, a: Var, b: Var) -> Var {
        let (c, x, y) = (self.item(cond), self.item(a), self.item(b));
        let (dtype, weak) = match (x.weak, y.weak) {
            (true, true) => (DType::F32, true),
            (true, false) => (y.dtype, false),
            (false, true) => (x.dtype, false),
            (false, false) => (DType::promote(x.dtype, y.dtype), false),
        };
        self.push(Item {
            node: Node::Select(cond.0, a.0, b.0),
            dtype,
            weak,
            dims: c.dims.union(x.dims).union(y.dims),
            rank: c.rank.max(x.rank).max(y.rank),
        })
    }

    /// `a` as `dtype` (a float dtype), rounded where it is narrower.
    pub fn cast(&self, a: Var, dtype: DType) -> Var {
        if !dtype.is_float() {
            self.fail(Error::UnsupportedDType {
                op: "fuse cast",
                got: dtype,
                expected: "a float dtype",
            });
            return a;
        }
        let it = self.item(a);
        self.push(Item {
            node: Node::Cast(a.0),
            dtype,
            weak: false,
            ..it
        })
    }

    /// The domain dims of `axes` (of `a`'s shape; negative counts from the end).
    fn axes(&self, op: &'static str, a: Var, axes: &[isize]) -> Dims {
        let (rank, r) = (self.rank(a), self.domain_rank());
        let mut m = Dims(0);
        for &ax in axes {
            let k = if ax < 0 { ax + rank as isize } else { ax };
            if k < 0 || k >= rank as isize {
                self.fail(Error::invalid_arg(
                    op,
                    "axes",
                    format!("{axes:?}"),
                    format!("axes of a rank-{rank} value, in -{rank}..{rank}"),
                ));
                return Dims(0);
            }
            let d = r - rank + k as usize;
            if m.has(d) {
                self.fail(Error::invalid_arg(
                    op,
                    "axes",
                    format!("{axes:?}"),
                    "each axis at most once",
                ));
            }
            m = m.union(Dims(1 << d));
        }
        m
    }

    fn reduce(
        &self,
        op: &'static str,
        f: ReduceFn,
        kind: Option<OpKind>,
        a: Var,
        axes: &[isize],
    ) -> Var {
        let a = match kind {
            Some(k) => self.amp(k, &[a])[0],
            None => a,
        };
        let red = self.axes(op, a, axes);
        let it = self.item(a);
        if it.dims.minus(red) == it.dims {
            // Only size-1 dims: nothing to reduce.
            return a;
        }
        self.push(Item {
            node: Node::Reduce(f, a.0),
            dims: it.dims.minus(red),
            ..it
        })
    }

    /// Sum over `axes` of `a` (they stay, size 1).
    pub fn sum(&self, a: Var, axes: &[isize]) -> Var {
        self.reduce("fuse sum", ReduceFn::Sum, Some(OpKind::Sum), a, axes)
    }
    pub fn max(&self, a: Var, axes: &[isize]) -> Var {
        self.reduce("fuse max", ReduceFn::Max, None, a, axes)
    }
    pub fn min(&self, a: Var, axes: &[isize]) -> Var {
        self.reduce("fuse min", ReduceFn::Min, None, a, axes)
    }
    /// Mean over `axes` (the count is the call's, symbolic in the trace).
    pub fn mean(&self, a: Var, axes: &[isize]) -> Var {
        let a = self.amp(OpKind::Mean, &[a])[0];
        let red = self.axes("fuse mean", a, axes);
        let s = self.reduce("fuse mean", ReduceFn::Sum, None, a, axes);
        let n = self.push(Item {
            node: Node::Size(Dims(self.item(a).dims.0 & red.0)),
            dtype: DType::F32,
            weak: true,
            dims: Dims(0),
            rank: 0,
        });
        self.div(s, n)
    }
    /// The population variance over `axes`: `mean((a - mean(a))²)`.
    pub fn var(&self, a: Var, axes: &[isize]) -> Var {
        let m = self.mean(a, axes);
        let d = self.sub(a, m);
        let d2 = self.sqr(d);
        self.mean(d2, axes)
    }
}

/// The signature of a call on `xs`: each input's dtype, rank and non-broadcast dims. Inputs
/// must be float tensors on one device, of rank at most [`MAX_RANK`](super::ir::MAX_RANK).
pub(crate) fn signature(name: &'static str, xs: &[&Tensor]) -> Result<Signature> {
    let rank = xs.iter().map(|x| x.rank()).max().unwrap_or(0);
    if rank > super::ir::MAX_RANK {
        return Err(Error::invalid_arg(
            "fuse",
            "inputs",
            format!("{name}: an input of rank {rank}"),
            format!("inputs of rank at most {}", super::ir::MAX_RANK),
        ));
    }
    let mut inputs = Vec::with_capacity(xs.len());
    for x in xs {
        x.float_only("fuse")?;
        if x.device() != xs[0].device() {
            return Err(Error::DeviceMismatch {
                op: "fuse",
                lhs: xs[0].device(),
                rhs: x.device(),
            });
        }
        let mut dims = Dims(0);
        for (k, &n) in x.dims().iter().enumerate() {
            if n != 1 {
                dims = dims.union(Dims(1 << (rank - x.rank() + k)));
            }
        }
        inputs.push(super::ir::InputSig {
            dtype: x.dtype(),
            rank: x.rank(),
            dims,
        });
    }
    Ok(Signature {
        inputs,
        rank,
        autocast: autocast::active(),
    })
}

/// The domain's sizes for a call on `xs` (whose signature is `sig`): each dim's size is that of
/// the inputs varying along it, which must agree.
pub(crate) fn domain(sig: &Signature, xs: &[&Tensor]) -> Result<Vec<usize>> {
    let r = sig.rank;
    let mut sizes = vec![1usize; r];
    let mut from: Vec<Option<usize>> = vec![None; r];
    for (i, x) in xs.iter().enumerate() {
        for (k, &n) in x.dims().iter().enumerate() {
            let d = r - x.rank() + k;
            if n == 1 {
                continue;
            }
            match from[d] {
                Some(j) if sizes[d] != n => {
                    return Err(Error::shape_mismatch(
                        "fuse",
                        xs[j].shape(),
                        x.shape(),
                        format!("inputs {j} and {i} do not broadcast (dim {d} of the domain)"),
                    ))
                }
                _ => {
                    sizes[d] = n;
                    from[d] = Some(i);
                }
            }
        }
    }
    Ok(sizes)
}
