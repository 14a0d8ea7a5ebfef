//! The C text of single values and index arithmetic, shared by every kernel: how each
//! primitive is written, how a position's coordinates and a buffer's offset are computed, and
//! a reduction's fold.

use std::collections::HashMap;
use std::fmt::Write;

use super::Plan;
use crate::base::DType;
use crate::fuse::ir::{BinaryFn, Dims, Graph, Node, ReduceFn, UnaryFn, Value};

pub(super) fn storage_type(dt: DType) -> &'static str {
    match dt {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => "double",
        _ => "float",
    }
}

pub(super) fn literal(x: f64, t: &str) -> String {
    if x.is_nan() {
        format!("nan_of<{t}>()")
    } else if x.is_infinite() {
        format!("({}inf_of<{t}>())", if x < 0.0 { "-" } else { "" })
    } else {
        format!("(({t}){x:e})")
    }
}

/// Which of a unit's values a piece of code computes: all of them at `idx` (one element), or,
/// for [`VEC`](super::VEC) neighbours along the innermost dim (`idx` at the first), those that do not vary
/// along it (once, before the lanes' loop) or those that do (in the loop, lane `e`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Section {
    All,
    Invariant,
    Lane,
}

/// Emits the code computing values at the domain position `idx`: inputs read through their
/// strides, values in `temps` (their temporary's index) read from it, the rest recomputed.
pub(super) struct Emitter<'a> {
    pub g: &'a Graph,
    pub groups: &'a [(usize, usize)],
    pub temps: &'a HashMap<Value, usize>,
    pub n_in: usize,
}

impl Emitter<'_> {
    pub(super) fn ty(&self, v: Value) -> &'static str {
        if self.g.items[v].wide() {
            "double"
        } else {
            "float"
        }
    }

    /// The innermost compressed dim.
    pub(super) fn inner(&self) -> usize {
        self.groups.len().saturating_sub(1)
    }

    /// Whether `v` varies along the innermost compressed dim.
    pub(super) fn varies(&self, v: Value) -> bool {
        !self.groups.is_empty()
            && Plan::compress(self.groups, self.g.items[v].dims).has(self.inner())
    }

    /// `Σ idx[d] · p.st[b][d]` over the compressed dims `dims` (in a lane: `idx[inner] + e`).
    pub(super) fn offset(&self, b: usize, dims: Dims, lane: bool) -> String {
        let inner = self.inner();
        let mut terms: Vec<String> = (0..self.groups.len())
            .filter(|&d| dims.has(d))
            .map(|d| {
                if lane && d == inner {
                    format!("(idx[{d}] + e) * p.st[{b}][{d}]")
                } else {
                    format!("idx[{d}] * p.st[{b}][{d}]")
                }
            })
            .collect();
        if terms.is_empty() {
            terms.push("0".into());
        }
        terms.join(" + ")
    }

    /// The items `targets` need, computed where used (a temporary's value is read, not its
    /// operand recomputed).
    pub(super) fn needed(&self, targets: &[Value]) -> Vec<bool> {
        let n = self.g.items.len();
        let mut need = vec![false; n];
        for &t in targets {
            need[t] = true;
        }
        for v in (0..n).rev() {
            if !need[v] || self.temps.contains_key(&v) {
                continue;
            }
            for o in self.g.items[v].node.operands() {
                need[o] = true;
            }
        }
        need
    }

    /// Statements computing the `need`ed items of `section` into `out`, each as `v{item}`.
    /// Before a [`Section::Lane`] loop, the invariant section also loads each needed input that
    /// varies along the innermost dim as one [`VEC`](super::VEC)-wide vector (`xv{item}`).
    ///
    /// Long because it is the table of how each primitive is written in C, one arm each.
    pub(super) fn emit(&self, need: &[bool], section: Section, out: &mut String) {
        for (v, it) in self.g.items.iter().enumerate() {
            if !need[v] {
                continue;
            }
            let varies = self.varies(v);
            match section {
                Section::All => {}
                Section::Invariant => {
                    if varies {
                        if let (Node::Input(i), false) = (it.node, self.temps.contains_key(&v)) {
                            let st = storage_type(it.dtype);
                            let dims = Plan::compress(self.groups, it.dims);
                            let _ = writeln!(
                                out,
                                "        const FuseVec<{st}> xv{v} = *(const FuseVec<{st}>*)&((const {st}*)p.ptr[{i}])[{}];",
                                self.offset(i, dims, false)
                            );
                        }
                        continue;
                    }
                }
                Section::Lane => {
                    if !varies {
                        continue;
                    }
                }
            }
            let lane = section == Section::Lane;
            let t = self.ty(v);
            let a = |u: Value| format!("(({t})v{u})");
            let expr = if let Some(&k) = self.temps.get(&v) {
                let tt = if self.g.items[v].wide() {
                    "double"
                } else {
                    "float"
                };
                let dims = Plan::compress(self.groups, it.dims);
                format!(
                    "((const {tt}*)p.ptr[{}])[{}]",
                    self.n_in + k,
                    self.offset(self.n_in + k, dims, lane)
                )
            } else {
                match it.node {
                    Node::Input(_) if lane => {
                        let st = storage_type(it.dtype);
                        format!("({t})Num<{st}>::to(xv{v}.v[e])")
                    }
                    Node::Input(i) => {
                        let st = storage_type(it.dtype);
                        let dims = Plan::compress(self.groups, it.dims);
                        format!(
                            "({t})Num<{st}>::to(((const {st}*)p.ptr[{i}])[{}])",
                            self.offset(i, dims, false)
                        )
                    }
                    Node::Const(c) => literal(c, t),
                    Node::Size(d) => {
                        let d = Plan::compress(self.groups, d);
                        let mut f: Vec<String> = (0..self.groups.len())
                            .filter(|&k| d.has(k))
                            .map(|k| format!("p.size[{k}]"))
                            .collect();
                        if f.is_empty() {
                            f.push("1".into());
                        }
                        format!("({t})({})", f.join(" * "))
                    }
                    Node::Unary(op, u) => {
                        let x = a(u);
                        let w = t == "double";
                        let f = |name: &str| {
                            if w {
                                format!("{name}({x})")
                            } else {
                                format!("{name}f({x})")
                            }
                        };
                        match op {
                            UnaryFn::Neg => format!("(-{x})"),
                            UnaryFn::Exp => f("exp"),
                            UnaryFn::Log => f("log"),
                            UnaryFn::Tanh => f("tanh"),
                            UnaryFn::Erf => f("erf"),
                            UnaryFn::Sqrt => f("sqrt"),
                            UnaryFn::Rsqrt => format!("(({t})1 / {})", f("sqrt")),
                            UnaryFn::Abs => f("fabs"),
                            UnaryFn::Relu => format!("({x} > ({t})0 ? {x} : ({t})0)"),
                            UnaryFn::Sigmoid => {
                                let e = if w {
                                    format!("exp(-{x})")
                                } else {
                                    format!("expf(-{x})")
                                };
                                format!("(({t})1 / (({t})1 + {e}))")
                            }
                            UnaryFn::Recip => format!("(({t})1 / {x})"),
                            UnaryFn::Sin => f("sin"),
                            UnaryFn::Cos => f("cos"),
                        }
                    }
                    Node::Pow(u, e) => format!("m_pow({}, {})", a(u), literal(e, t)),
                    Node::Binary(op, x, y) => {
                        let (x, y) = (a(x), a(y));
                        let c = |s: &str| format!("(({t})({x} {s} {y}))");
                        match op {
                            BinaryFn::Add => format!("({x} + {y})"),
                            BinaryFn::Sub => format!("({x} - {y})"),
                            BinaryFn::Mul => format!("({x} * {y})"),
                            BinaryFn::Div => format!("({x} / {y})"),
                            // NaN propagates (the CPU reference's rule).
                            BinaryFn::Max => format!("(({x} != {x} || {x} >= {y}) ? {x} : {y})"),
                            BinaryFn::Min => format!("(({x} != {x} || {x} <= {y}) ? {x} : {y})"),
                            BinaryFn::Lt => c("<"),
                            BinaryFn::Le => c("<="),
                            BinaryFn::Gt => c(">"),
                            BinaryFn::Ge => c(">="),
                            BinaryFn::Eq => c("=="),
                            BinaryFn::Ne => c("!="),
                        }
                    }
                    Node::Select(c, x, y) => format!("(v{c} != 0 ? {} : {})", a(x), a(y)),
                    Node::Cast(u) => match it.dtype {
                        DType::F16 | DType::BF16 => {
                            let st = storage_type(it.dtype);
                            format!("Num<{st}>::to(Num<{st}>::from((float)v{u}))")
                        }
                        _ => a(u),
                    },
                    Node::Broadcast(u) => a(u),
                    // Reached only through its temporary.
                    Node::Reduce(..) => format!("(({t})0)"),
                }
            };
            let _ = writeln!(out, "        const {t} v{v} = {expr};");
        }
    }
}

/// Splits `lin` over the compressed dims `dims` (row-major) into `idx`: in 32-bit arithmetic
/// when the whole domain fits (`small`, the same for every thread), which divides several
/// times faster than 64-bit.
pub(super) fn split(out: &mut String, lin: &str, dims: Dims, rank: usize) {
    let _ = writeln!(
        out,
        "        if (small) {{ unsigned rem = (unsigned)({lin});"
    );
    for d in (0..rank).rev().filter(|&d| dims.has(d)) {
        let _ = writeln!(
            out,
            "          idx[{d}] = rem % (unsigned)p.size[{d}]; rem /= (unsigned)p.size[{d}];"
        );
    }
    let _ = writeln!(out, "        }} else {{ i64 rem = (i64)({lin});");
    for d in (0..rank).rev().filter(|&d| dims.has(d)) {
        let _ = writeln!(
            out,
            "          idx[{d}] = rem % p.size[{d}]; rem /= p.size[{d}];"
        );
    }
    let _ = writeln!(out, "        }}");
}

/// The kernels' first line: whether the whole domain's indices fit in 31 bits.
pub(super) fn small_flag(rank: usize) -> String {
    format!(
        "    const bool small = {} <= (i64)0x7fffffff;\n",
        count(Dims(((1u16 << rank) - 1) as u8), rank)
    )
}

pub(super) fn count(dims: Dims, rank: usize) -> String {
    let f: Vec<String> = (0..rank)
        .filter(|&d| dims.has(d))
        .map(|d| format!("p.size[{d}]"))
        .collect();
    if f.is_empty() {
        "(i64)1".into()
    } else {
        format!("(i64)({})", f.join(" * "))
    }
}

/// A reduction's fold in C: the combining expression of `a` and `b`, and its identity.
pub(super) fn fold_of(op: ReduceFn, ty: &str) -> (&'static str, String) {
    match op {
        ReduceFn::Sum => ("a + b", format!("({ty})0")),
        // NaN propagates (the CPU reference's rule).
        ReduceFn::Max => ("(a != a || a >= b) ? a : b", format!("(-inf_of<{ty}>())")),
        ReduceFn::Min => ("(a != a || a <= b) ? a : b", format!("inf_of<{ty}>()")),
    }
}
