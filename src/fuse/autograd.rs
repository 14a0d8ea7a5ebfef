//! The backward of a fused function, generated from its trace: a graph (fused and run like any
//! other) whose inputs are the forward's inputs, one output's gradient and the values of the
//! forward's reductions it needs (kept from the forward call: small, and recomputing them
//! would read the inputs once more), which recomputes the other forward values it needs in
//! registers and applies each primitive's derivative rule in reverse. A gradient reaching a value from a consumer that broadcast it is summed over the
//! broadcast dims (a reduction of the backward graph); each input's gradient is cast to the
//! input's dtype and given its shape.

use super::ir::{BinaryFn, Dims, Graph, InputSig, Item, Node, ReduceFn, Signature, UnaryFn, Value};
use super::trace::{Fuser, Var};
use crate::base::error::Result;
use crate::base::DType;

/// A backward graph and, for each of its outputs, the forward input it is the gradient of.
pub(crate) struct Backward {
    pub graph: Graph,
    pub grads_of: Vec<usize>,
    /// The forward reductions (items) it takes as inputs, after the gradient, in this order.
    pub saved: Vec<Value>,
}

/// The backward of `fwd`'s output `out`: `None` when no input's gradient depends on it.
pub(crate) fn backward_graph(fwd: &Graph, out: usize) -> Result<Option<Backward>> {
    let o = fwd.outputs[out];
    let needed = fwd.live_for(&[o]);
    let (sig, saved) = backward_signature(fwd, o, &needed);
    let f = Fuser::new(fwd.name, sig);
    let map = replay_forward(&f, fwd, &needed, &saved);
    let adj = adjoints(&f, fwd, o, &needed, &map);
    let Some((outputs, grads_of)) = input_gradients(&f, fwd, &adj) else {
        return Ok(None);
    };
    Ok(Some(Backward {
        graph: f.finish(&outputs)?,
        grads_of,
        saved,
    }))
}

/// The backward's signature: the forward's inputs, output `o`'s gradient, then the forward
/// reductions it takes (`needed` ones), which it returns.
fn backward_signature(fwd: &Graph, o: Value, needed: &[bool]) -> (Signature, Vec<Value>) {
    let oi = fwd.items[o];
    let mut sig = fwd.sig.clone();
    // The forward's casts are in its items; the backward's arithmetic is not autocast again.
    sig.autocast = None;
    sig.inputs.push(InputSig {
        dtype: oi.dtype,
        rank: oi.rank,
        dims: oi.dims,
    });
    // The forward's reductions come from its call, as f32 (f64) values the way the kernels
    // keep them; everything else is recomputed.
    let saved: Vec<Value> = (0..fwd.items.len())
        .filter(|&v| needed[v] && matches!(fwd.items[v].node, Node::Reduce(..)))
        .collect();
    for &v in &saved {
        let it = fwd.items[v];
        sig.inputs.push(InputSig {
            dtype: if it.wide() { DType::F64 } else { DType::F32 },
            rank: it.rank,
            dims: it.dims,
        });
    }
    (sig, saved)
}

/// The forward's `needed` values on `f`: inputs and `saved` reductions are the backward's
/// inputs, the rest recomputed. Indexed by forward value.
fn replay_forward(f: &Fuser, fwd: &Graph, needed: &[bool], saved: &[Value]) -> Vec<Option<Var>> {
    let n_in = fwd.sig.inputs.len();
    let mut map: Vec<Option<Var>> = vec![None; fwd.items.len()];
    for (v, m) in map.iter_mut().enumerate().take(n_in) {
        *m = Some(Var(v));
    }
    for v in n_in..fwd.items.len() {
        if let Some(j) = saved.iter().position(|&s| s == v) {
            map[v] = Some(Var(n_in + 1 + j));
        } else if needed[v] {
            let it = fwd.items[v];
            let node = remap(it.node, &map);
            map[v] = Some(f.push(Item { node, ..it }));
        }
    }
    map
}

/// Each forward value's gradient (adjoint) with respect to output `o`, in reverse order of
/// the items, applying each primitive's derivative rule. `map`: the forward values on `f`.
fn adjoints(
    f: &Fuser,
    fwd: &Graph,
    o: Value,
    needed: &[bool],
    map: &[Option<Var>],
) -> Vec<Option<Var>> {
    let n_in = fwd.sig.inputs.len();
    let x = |v: Value| map[v].expect("operands come first");
    let mut adj: Vec<Option<Var>> = vec![None; fwd.items.len()];
    adj[o] = Some(Var(n_in));
    for v in (0..fwd.items.len()).rev() {
        let Some(g) = adj[v].filter(|_| needed[v]) else {
            continue;
        };
        let y = x(v);
        let mut to = |u: Value, c: Var| {
            // The contribution is broadcast over the consumer (a reduction: over its operand).
            let span = fwd.items[v].dims.union(fwd.items[u].dims);
            add_adjoint(f, fwd, &mut adj, u, c, span)
        };
        match fwd.items[v].node {
            Node::Input(_) | Node::Const(_) | Node::Size(_) => {}
            Node::Unary(op, a) => to(a, unary_rule(f, op, g, y, x(a))),
            Node::Pow(a, e) => {
                let d = f.mul_scalar(f.powf(x(a), e - 1.0), e);
                to(a, f.mul(g, d));
            }
            Node::Binary(op, a, b) => {
                let (ga, gb) = binary_rule(f, op, g, y, (x(a), x(b)));
                if let Some(ga) = ga {
                    to(a, ga);
                }
                if let Some(gb) = gb {
                    to(b, gb);
                }
            }
            Node::Select(c, a, b) => {
                let zero = f.scalar(0.0);
                to(a, f.select(x(c), g, zero));
                to(b, f.select(x(c), zero, g));
            }
            Node::Cast(a) => to(a, f.cast(g, fwd.items[a].dtype)),
            Node::Broadcast(a) => to(a, g),
            Node::Reduce(op, a) => match op {
                // `g` varies along the kept dims only: a consumer broadcasts it.
                ReduceFn::Sum => to(a, g),
                // The gradient is shared evenly by the elements equal to the extremum (one
                // more reduction: how many there are), as PyTorch's amax/amin share it.
                ReduceFn::Max | ReduceFn::Min => {
                    let hit = f.eq(x(a), y);
                    let hi = f.item(hit);
                    let ties = f.push(Item {
                        node: Node::Reduce(ReduceFn::Sum, hit.0),
                        dims: fwd.items[v].dims,
                        ..hi
                    });
                    to(a, f.mul(g, f.div(hit, ties)))
                }
            },
        }
    }
    adj
}

/// The gradient of a unary primitive's operand `xa`, given its result `y` and gradient `g`.
fn unary_rule(f: &Fuser, op: UnaryFn, g: Var, y: Var, xa: Var) -> Var {
    match op {
        UnaryFn::Neg => f.neg(g),
        UnaryFn::Exp => f.mul(g, y),
        UnaryFn::Log => f.div(g, xa),
        UnaryFn::Tanh => {
            let y2 = f.sqr(y);
            let one = f.scalar(1.0);
            let d = f.sub(one, y2);
            f.mul(g, d)
        }
        UnaryFn::Erf => {
            let x2 = f.sqr(xa);
            let e = f.exp(f.neg(x2));
            let d = f.mul_scalar(e, std::f64::consts::FRAC_2_SQRT_PI);
            f.mul(g, d)
        }
        UnaryFn::Sqrt => {
            let h = f.mul_scalar(g, 0.5);
            f.div(h, y)
        }
        UnaryFn::Rsqrt => {
            let y3 = f.mul(f.sqr(y), y);
            let d = f.mul_scalar(y3, -0.5);
            f.mul(g, d)
        }
        UnaryFn::Abs => {
            let zero = f.scalar(0.0);
            let s = f.sub(f.gt(xa, zero), f.lt(xa, zero));
            f.mul(g, s)
        }
        UnaryFn::Relu => {
            let zero = f.scalar(0.0);
            f.mul(g, f.gt(xa, zero))
        }
        UnaryFn::Sigmoid => {
            let one = f.scalar(1.0);
            let d = f.mul(y, f.sub(one, y));
            f.mul(g, d)
        }
        UnaryFn::Recip => {
            let d = f.neg(f.sqr(y));
            f.mul(g, d)
        }
        UnaryFn::Sin => f.mul(g, f.cos(xa)),
        UnaryFn::Cos => f.neg(f.mul(g, f.sin(xa))),
    }
}

/// The gradients of a binary primitive's operands `(xa, xb)`, given its result `y` and
/// gradient `g` (`None`: not differentiable, a comparison).
fn binary_rule(
    f: &Fuser,
    op: BinaryFn,
    g: Var,
    y: Var,
    (xa, xb): (Var, Var),
) -> (Option<Var>, Option<Var>) {
    match op {
        BinaryFn::Add => (Some(g), Some(g)),
        BinaryFn::Sub => (Some(g), Some(f.neg(g))),
        BinaryFn::Mul => (Some(f.mul(g, xb)), Some(f.mul(g, xa))),
        BinaryFn::Div => {
            let gb = f.neg(f.div(f.mul(g, y), xb));
            (Some(f.div(g, xb)), Some(gb))
        }
        // Ties send the whole gradient to the left operand, as the unfused ops do.
        BinaryFn::Max => (Some(f.mul(g, f.ge(xa, xb))), Some(f.mul(g, f.lt(xa, xb)))),
        BinaryFn::Min => (Some(f.mul(g, f.le(xa, xb))), Some(f.mul(g, f.gt(xa, xb)))),
        _ => (None, None),
    }
}

/// Each input's gradient from the adjoints, cast to the input's dtype and given its dims (the
/// backward's outputs), with the inputs they are of; `None` where none has one.
fn input_gradients(f: &Fuser, fwd: &Graph, adj: &[Option<Var>]) -> Option<(Vec<Var>, Vec<usize>)> {
    let mut outputs = Vec::new();
    let mut grads_of = Vec::new();
    for (i, s) in fwd.sig.inputs.iter().enumerate() {
        let Some(g) = adj[i] else { continue };
        let g = if f.dtype(g) != s.dtype {
            f.cast(g, s.dtype)
        } else {
            g
        };
        let it = f.item(g);
        let g = if it.dims != s.dims || it.rank != s.rank {
            f.push(Item {
                node: Node::Broadcast(g.0),
                dims: s.dims,
                rank: s.rank,
                ..it
            })
        } else {
            g
        };
        outputs.push(g);
        grads_of.push(i);
    }
    (!outputs.is_empty()).then_some((outputs, grads_of))
}

/// Adds `c`, a contribution to the gradient of forward value `u` that stands for every
/// element of the dims `span` (`c` is broadcast along those it lacks), to `u`'s adjoint: summed
/// first over the dims of `span` that `u` is broadcast along (a reduction where `c` varies
/// along them, a product with their size where it does not).
fn add_adjoint(f: &Fuser, fwd: &Graph, adj: &mut [Option<Var>], u: Value, c: Var, span: Dims) {
    let want = fwd.items[u];
    if want.weak || matches!(want.node, Node::Const(_) | Node::Size(_)) {
        return;
    }
    let ci = f.item(c);
    let extra = span.minus(want.dims);
    let summed = Dims(extra.0 & ci.dims.0);
    let mut c = if summed.0 != 0 {
        f.push(Item {
            node: Node::Reduce(ReduceFn::Sum, c.0),
            dims: ci.dims.minus(summed),
            ..ci
        })
    } else {
        c
    };
    let repeated = extra.minus(ci.dims);
    if repeated.0 != 0 {
        let n = f.push(Item {
            node: Node::Size(repeated),
            dtype: crate::base::DType::F32,
            weak: true,
            dims: Dims(0),
            rank: 0,
        });
        c = f.mul(c, n);
    }
    adj[u] = Some(match adj[u] {
        Some(prev) => f.add(prev, c),
        None => c,
    });
}

fn remap(node: Node, map: &[Option<Var>]) -> Node {
    let m = |v: Value| map[v].expect("operands come first").0;
    match node {
        Node::Input(_) | Node::Const(_) | Node::Size(_) => node,
        Node::Unary(op, a) => Node::Unary(op, m(a)),
        Node::Binary(op, a, b) => Node::Binary(op, m(a), m(b)),
        Node::Pow(a, e) => Node::Pow(m(a), e),
        Node::Select(c, a, b) => Node::Select(m(c), m(a), m(b)),
        Node::Cast(a) => Node::Cast(m(a)),
        Node::Broadcast(a) => Node::Broadcast(m(a)),
        Node::Reduce(op, a) => Node::Reduce(op, m(a)),
    }
}
