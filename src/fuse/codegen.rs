//! CUDA C source for a traced graph. The graph's reductions are grouped by level (a
//! reduction's level is one more than the deepest reduction its operand reads); each level is
//! one kernel, whose blocks each reduce one row of one of the level's reductions (a block per
//! row, `block_fold` of common.cuh) into a temporary (f32, f64 for f64 values, compact over the
//! kept dims); a last kernel computes every output from the inputs and those temporaries.
//! Everything between is recomputed in registers where it is used, never stored.
//!
//! The domain is compressed first: adjacent dims that every value varies along together (or
//! not at all) are one dim of the kernels (a batch norm's (N, C, H, W) is (N, C, H·W)), so a
//! kernel splits an index into fewer coordinates. Inputs are read through strides (0 where an
//! input is broadcast); the caller passes them dense.
//!
//! Every kernel takes one by-value `FuseParams`: the compressed sizes, each buffer's strides
//! (inputs, temporaries, outputs, in that order) and its address, all 8-byte words; the host
//! fills it in that order ([`Plan::params`]).

use std::collections::HashMap;
use std::fmt::Write;

use super::ir::{BinaryFn, Dims, Graph, Node, ReduceFn, UnaryFn, Value};
use crate::base::DType;

/// A reduction's result kept between kernels.
#[derive(Clone, Debug)]
pub(crate) struct Temp {
    pub item: Value,
    /// Its dims in the compressed domain.
    pub dims: Dims,
    pub wide: bool,
}

#[derive(Clone, Debug)]
pub(crate) struct Stage {
    pub kernel: String,
    /// The temporaries this stage's kernel fills (empty: the outputs' kernel).
    pub tasks: Vec<usize>,
}

/// What a graph compiles to.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// The module's name (its file name in errors and the disk cache).
    pub name: String,
    pub source: String,
    /// Original domain dims `[lo, hi)` of each compressed dim.
    pub groups: Vec<(usize, usize)>,
    pub temps: Vec<Temp>,
    /// Each output's dims, compressed.
    pub out_dims: Vec<Dims>,
    pub stages: Vec<Stage>,
}

impl Plan {
    /// The compressed domain's rank as the kernels see it (at least 1).
    pub fn rank(&self) -> usize {
        self.groups.len().max(1)
    }

    /// Dims `m` of the original domain, compressed.
    pub fn compress(groups: &[(usize, usize)], m: Dims) -> Dims {
        let mut c = 0u8;
        for (g, &(lo, _)) in groups.iter().enumerate() {
            if m.has(lo) {
                c |= 1 << g;
            }
        }
        Dims(c)
    }

    /// The parameter block: `sizes` (compressed), then each buffer's strides and address.
    pub fn params(&self, sizes: &[usize], buffers: &[(Vec<i64>, u64)]) -> Vec<u64> {
        let r = self.rank();
        let mut p = Vec::with_capacity(r + buffers.len() * (r + 1));
        for d in 0..r {
            p.push(sizes.get(d).copied().unwrap_or(1) as u64);
        }
        for (st, _) in buffers {
            p.extend(st.iter().map(|&s| s as u64));
        }
        p.extend(buffers.iter().map(|&(_, a)| a));
        p
    }
}

/// Row-major strides of a value compact over `dims` in a domain of `sizes`, 0 elsewhere.
pub(crate) fn compact_strides(dims: Dims, sizes: &[usize], rank: usize) -> Vec<i64> {
    let mut s = vec![0i64; rank];
    let mut acc = 1i64;
    for d in (0..sizes.len()).rev() {
        if dims.has(d) {
            s[d] = acc;
            acc *= sizes[d] as i64;
        }
    }
    s
}

fn groups_of(g: &Graph, live: &[bool]) -> Vec<(usize, usize)> {
    let r = g.sig.rank;
    let mut pats: Vec<Dims> = g.sig.inputs.iter().map(|s| s.dims).collect();
    pats.extend(g.items.iter().enumerate().filter(|(v, _)| live[*v]).map(
        |(_, it)| match it.node {
            Node::Size(d) => d,
            _ => it.dims,
        },
    ));
    let mut groups: Vec<(usize, usize)> = Vec::new();
    for d in 0..r {
        let joins = d > 0 && pats.iter().all(|p| p.has(d) == p.has(d - 1));
        match groups.last_mut() {
            Some(last) if joins => last.1 = d + 1,
            _ => groups.push((d, d + 1)),
        }
    }
    groups
}

/// A C identifier made of `name`'s letters and digits.
fn ident(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("fuse_{s}")
}

fn storage_type(dt: DType) -> &'static str {
    match dt {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => "double",
        _ => "float",
    }
}

fn literal(x: f64, t: &str) -> String {
    if x.is_nan() {
        format!("nan_of<{t}>()")
    } else if x.is_infinite() {
        format!("({}inf_of<{t}>())", if x < 0.0 { "-" } else { "" })
    } else {
        format!("(({t}){x:e})")
    }
}

/// Emits the code computing a value at the domain position `idx`: inputs read through their
/// strides, values in `temps` (their temporary's index) read from it, the rest recomputed.
struct Emitter<'a> {
    g: &'a Graph,
    groups: &'a [(usize, usize)],
    temps: &'a HashMap<Value, usize>,
    n_in: usize,
}

impl Emitter<'_> {
    fn ty(&self, v: Value) -> &'static str {
        if self.g.items[v].wide() {
            "double"
        } else {
            "float"
        }
    }

    /// `Σ idx[d] · p.st[b][d]` over the compressed dims `dims`.
    fn offset(&self, b: usize, dims: Dims) -> String {
        let mut terms: Vec<String> = (0..self.groups.len())
            .filter(|&d| dims.has(d))
            .map(|d| format!("idx[{d}] * p.st[{b}][{d}]"))
            .collect();
        if terms.is_empty() {
            terms.push("0".into());
        }
        terms.join(" + ")
    }

    /// Statements computing `target` into `out`; returns its variable's name.
    fn emit(&self, target: Value, out: &mut String) -> String {
        let n = self.g.items.len();
        let mut need = vec![false; n];
        need[target] = true;
        for v in (0..n).rev() {
            if !need[v] {
                continue;
            }
            if self.temps.contains_key(&v) {
                continue;
            }
            for o in self.g.items[v].node.operands() {
                need[o] = true;
            }
        }
        for (v, it) in self.g.items.iter().enumerate() {
            if !need[v] {
                continue;
            }
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
                    self.offset(self.n_in + k, dims)
                )
            } else {
                match it.node {
                    Node::Input(i) => {
                        let st = storage_type(it.dtype);
                        let dims = Plan::compress(self.groups, it.dims);
                        format!(
                            "({t})Num<{st}>::to(((const {st}*)p.ptr[{i}])[{}])",
                            self.offset(i, dims)
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
        format!("v{target}")
    }
}

/// Splits `lin` over the compressed dims `dims` (row-major) into `idx`: in 32-bit arithmetic
/// when the whole domain fits (`small`, the same for every thread), which divides several
/// times faster than 64-bit.
fn split(out: &mut String, lin: &str, dims: Dims, rank: usize) {
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
fn small_flag(rank: usize) -> String {
    format!(
        "    const bool small = {} <= (i64)0x7fffffff;\n",
        count(Dims(((1u16 << rank) - 1) as u8), rank)
    )
}

fn count(dims: Dims, rank: usize) -> String {
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

/// The kernels of `g` (see the module doc).
///
/// Long because it is one pass over the graph that assigns every value its level, its
/// temporary and its kernel together; the steps share that state, so they stay in one place.
pub(crate) fn plan(g: &Graph) -> Plan {
    let live = g.live();
    let groups = groups_of(g, &live);
    let rank = groups.len().max(1);
    let n_in = g.sig.inputs.len();
    // Levels: each reduction one more than the deepest it reads.
    let mut level = vec![0usize; g.items.len()];
    for (v, it) in g.items.iter().enumerate() {
        let l = it
            .node
            .operands()
            .iter()
            .map(|&o| level[o])
            .max()
            .unwrap_or(0);
        level[v] = l + usize::from(matches!(it.node, Node::Reduce(..)));
    }
    let mut temps = Vec::new();
    let mut temp_of = HashMap::new();
    for (v, it) in g.items.iter().enumerate() {
        if live[v] && matches!(it.node, Node::Reduce(..)) {
            temp_of.insert(v, temps.len());
            temps.push(Temp {
                item: v,
                dims: Plan::compress(&groups, it.dims),
                wide: it.wide(),
            });
        }
    }
    let levels = temps.iter().map(|t| level[t.item]).max().unwrap_or(0);
    let name = ident(g.name);
    let em = Emitter {
        g,
        groups: &groups,
        temps: &temp_of,
        n_in,
    };
    let nb = n_in + temps.len() + g.outputs.len();
    let mut src = String::new();
    let _ = writeln!(
        src,
        "struct FuseParams {{ i64 size[{rank}]; i64 st[{nb}][{rank}]; u64 ptr[{nb}]; }};\n"
    );
    let mut stages = Vec::new();
    for l in 1..=levels {
        let tasks: Vec<usize> = (0..temps.len())
            .filter(|&k| level[temps[k].item] == l)
            .collect();
        let kernel = format!("{name}_level{l}");
        let _ = writeln!(
            src,
            "extern \"C\" __global__ void {kernel}(const FuseParams p) {{\n    __shared__ float sh_f[32];\n    __shared__ double sh_d[32];\n    (void)sh_f; (void)sh_d;"
        );
        src += &small_flag(rank);
        let _ = writeln!(src, "    i64 start = 0;");
        let mut starts = Vec::new();
        for (j, &k) in tasks.iter().enumerate() {
            let _ = writeln!(
                src,
                "    const i64 start{j} = start; start += {};",
                count(temps[k].dims, rank)
            );
            starts.push(k);
        }
        let _ = writeln!(
            src,
            "    for (i64 gr = blockIdx.x; gr < start; gr += gridDim.x) {{"
        );
        for (j, &k) in tasks.iter().enumerate() {
            let t = &temps[k];
            let Node::Reduce(op, a) = g.items[t.item].node else {
                continue;
            };
            let ty = if t.wide { "double" } else { "float" };
            let sh = if t.wide { "sh_d" } else { "sh_f" };
            let a_dims = Plan::compress(&groups, g.items[a].dims);
            let red = a_dims.minus(t.dims);
            let (f, id) = match op {
                ReduceFn::Sum => ("a + b".to_string(), format!("({ty})0")),
                ReduceFn::Max => (
                    "(a != a || a >= b) ? a : b".to_string(),
                    format!("(-inf_of<{ty}>())"),
                ),
                ReduceFn::Min => (
                    "(a != a || a <= b) ? a : b".to_string(),
                    format!("inf_of<{ty}>()"),
                ),
            };
            let next = tasks
                .get(j + 1)
                .map(|_| format!("start{}", j + 1))
                .unwrap_or_else(|| "start".into());
            let _ = writeln!(
                src,
                "    if (gr >= start{j} && gr < {next}) {{\n      const i64 row = gr - start{j};\n      i64 base[{rank}] = {{0}};"
            );
            let mut body = String::new();
            split(&mut body, "row", t.dims, rank);
            src += &body.replace("idx[", "base[");
            let mut load = String::new();
            let _ = writeln!(
                load,
                "        i64 idx[{rank}];\n        for (int d = 0; d < {rank}; ++d) idx[d] = base[d];"
            );
            split(&mut load, "j", red, rank);
            let v = em.emit(a, &mut load);
            let _ = writeln!(
                src,
                "      const {ty} r = block_fold<{ty}>((u64){},\n        [](const {ty} a, const {ty} b) {{ return {f}; }}, {id},\n        [&](u64 j) -> {ty} {{\n{load}        return ({ty}){v};\n      }}, {sh});",
                count(red, rank)
            );
            let _ = writeln!(
                src,
                "      if (threadIdx.x == 0) (({ty}*)p.ptr[{}])[row] = r;\n    }}",
                n_in + k
            );
        }
        let _ = writeln!(src, "    }}\n}}\n");
        stages.push(Stage { kernel, tasks });
    }
    // The outputs.
    let kernel = format!("{name}_outputs");
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {kernel}(const FuseParams p) {{"
    );
    src += &small_flag(rank);
    let mut out_dims = Vec::new();
    for (k, &o) in g.outputs.iter().enumerate() {
        let it = &g.items[o];
        let dims = Plan::compress(&groups, it.dims);
        out_dims.push(dims);
        let st = storage_type(it.dtype);
        let b = n_in + temps.len() + k;
        let _ = writeln!(
            src,
            "  for (u64 i = global_tid(); i < (u64){}; i += global_stride()) {{\n        i64 idx[{rank}] = {{0}};",
            count(dims, rank)
        );
        let mut body = String::new();
        split(&mut body, "i", dims, rank);
        let v = em.emit(o, &mut body);
        src += &body;
        let acc = if it.wide() { "double" } else { "float" };
        let _ = writeln!(
            src,
            "        (({st}*)p.ptr[{b}])[i] = Num<{st}>::from(({acc}){v});\n  }}"
        );
    }
    let _ = writeln!(src, "}}");
    stages.push(Stage {
        kernel,
        tasks: vec![],
    });
    Plan {
        name,
        source: src,
        groups,
        temps,
        out_dims,
        stages,
    }
}
