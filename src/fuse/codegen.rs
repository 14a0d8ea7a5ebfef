//! CUDA C source for a traced graph. The graph's reductions are grouped by level (a
//! reduction's level is one more than the deepest reduction its operand reads); each level is
//! one kernel. Within a level, reductions with the same kept dims over the same operand dims
//! form a *set*, computed together in one pass over their operands (a batch norm's `Σx` and
//! `Σx²` read `x` once). A set's rows (one per kept position) are each cut into `per` chunks,
//! one block per (row, chunk), so that a few long rows still fill the GPU: each block folds its
//! chunk (f32, f64 for f64 values), writes a partial, and the last block of a row to finish
//! (a counter per row) folds the row's partials in chunk order into the row's temporary (compact
//! over the kept dims). The order of every fold depends only on the sizes, so results repeat bit
//! for bit. Where the innermost dim is kept (rows side by side in memory), a block takes a tile
//! of [`TILE`] neighbouring rows instead, a warp's lanes on neighbouring rows (coalesced), its
//! warps interleaving the chunk. A last kernel computes every output from the inputs and those
//! temporaries.
//! Everything between is recomputed in registers where it is used, never stored.
//!
//! Where the innermost (compressed) dim's size is a multiple of [`VEC`] and the buffers that
//! vary along it are 16-byte aligned (the host's `vec` flag), a thread takes [`VEC`] neighbours
//! along that dim at once: 16-byte loads and stores, the values that do not vary along it
//! computed once for the [`VEC`] lanes, one index split per [`VEC`] elements.
//!
//! The domain is compressed first: adjacent dims that every value varies along together (or
//! not at all) are one dim of the kernels (a batch norm's (N, C, H, W) is (N, C, H·W)), so a
//! kernel splits an index into fewer coordinates. Inputs are read through strides (0 where an
//! input is broadcast); the caller passes them dense.
//!
//! Every kernel takes one by-value `FuseParams` of 8-byte words: the compressed sizes, each
//! buffer's strides (inputs, temporaries, outputs, in that order) and its address, then the
//! call's [`Launch`] words; the host fills it in that order ([`Plan::params`]).

use std::collections::HashMap;
use std::fmt::Write;

use super::ir::{BinaryFn, Dims, Graph, Node, ReduceFn, UnaryFn, Value};
use crate::base::DType;

/// Elements a thread takes at once along the innermost dim (16 bytes of f16/bf16).
pub(crate) const VEC: usize = 8;

/// A reduction's result kept between kernels.
#[derive(Clone, Debug)]
pub(crate) struct Temp {
    pub item: Value,
    /// Its dims in the compressed domain.
    pub dims: Dims,
    pub wide: bool,
}

/// Reductions of one level with the same kept dims over the same operand dims: computed
/// together, in one pass over the operand dims.
#[derive(Clone, Debug)]
pub(crate) struct RedSet {
    /// The temporaries it fills.
    pub tasks: Vec<usize>,
    /// The kept dims (one row each) and the reduced ones, compressed.
    pub kept: Dims,
    pub red: Dims,
    /// Whether the innermost dim is reduced (the [`VEC`]-wide path applies when the host allows).
    pub inner: bool,
    /// Whether the innermost dim is kept: rows lie side by side in memory, so a block takes a
    /// tile of [`TILE`] neighbouring rows (a warp reads them together) instead of one row.
    pub across: bool,
}

/// The most threads a reduction's block has (the host launches at most this many).
pub(crate) const MAX_THREADS: usize = 256;

/// Rows per block of a set whose rows lie side by side in memory ([`RedSet::across`]).
pub(crate) const TILE: usize = 32;

#[derive(Clone, Debug)]
pub(crate) struct Stage {
    pub kernel: String,
    /// The sets this stage's kernel reduces (empty: the outputs' kernel).
    pub sets: Vec<usize>,
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
    pub sets: Vec<RedSet>,
    /// Each output's dims, compressed.
    pub out_dims: Vec<Dims>,
    pub stages: Vec<Stage>,
}

/// A call's words after the buffers: how its reductions are cut (see the module doc).
#[derive(Clone, Debug, Default)]
pub(crate) struct Launch {
    /// 1 when the [`VEC`]-wide paths may run (size and alignment checked by the host).
    pub vec: bool,
    /// Per set: chunks (blocks) per row.
    pub per: Vec<usize>,
    /// Per temporary: its partials' first 8-byte slot in `part`.
    pub part_at: Vec<usize>,
    /// Per set: its rows' first counter in `count`.
    pub count_at: Vec<usize>,
    /// Addresses of the partials (8-byte slots) and of the row counters (u64, zeroed).
    pub part: u64,
    pub count: u64,
}

impl Plan {
    /// The compressed domain's rank as the kernels see it (at least 1).
    pub fn rank(&self) -> usize {
        self.groups.len().max(1)
    }

    /// The innermost compressed dim, if the domain has one.
    pub fn inner(&self) -> Option<usize> {
        self.groups.len().checked_sub(1)
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

    /// How many 8-byte words the parameter block of a graph with `buffers` buffers has.
    pub fn words(&self, buffers: usize) -> usize {
        let r = self.rank();
        r + buffers * (r + 1) + 3 + 2 * self.sets.len().max(1) + self.temps.len().max(1)
    }

    /// The parameter block: `sizes` (compressed), each buffer's strides and address, then
    /// `launch`'s words (the field order of the generated `FuseParams`).
    pub fn params(
        &self,
        sizes: &[usize],
        buffers: &[(Vec<i64>, u64)],
        launch: &Launch,
    ) -> Vec<u64> {
        let r = self.rank();
        let mut p = Vec::with_capacity(self.words(buffers.len()));
        for d in 0..r {
            p.push(sizes.get(d).copied().unwrap_or(1) as u64);
        }
        for (st, _) in buffers {
            p.extend(st.iter().map(|&s| s as u64));
        }
        p.extend(buffers.iter().map(|&(_, a)| a));
        p.push(u64::from(launch.vec));
        // Each array has at least one entry (C has no empty arrays); missing ones are 0.
        for (v, n) in [
            (&launch.per, self.sets.len()),
            (&launch.part_at, self.temps.len()),
            (&launch.count_at, self.sets.len()),
        ] {
            p.extend((0..n.max(1)).map(|k| v.get(k).copied().unwrap_or(0) as u64));
        }
        p.push(launch.part);
        p.push(launch.count);
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

/// Which of a unit's values a piece of code computes: all of them at `idx` (one element), or,
/// for [`VEC`] neighbours along the innermost dim (`idx` at the first), those that do not vary
/// along it (once, before the lanes' loop) or those that do (in the loop, lane `e`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Section {
    All,
    Invariant,
    Lane,
}

/// Emits the code computing values at the domain position `idx`: inputs read through their
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

    /// The innermost compressed dim.
    fn inner(&self) -> usize {
        self.groups.len().saturating_sub(1)
    }

    /// Whether `v` varies along the innermost compressed dim.
    fn varies(&self, v: Value) -> bool {
        !self.groups.is_empty()
            && Plan::compress(self.groups, self.g.items[v].dims).has(self.inner())
    }

    /// `Σ idx[d] · p.st[b][d]` over the compressed dims `dims` (in a lane: `idx[inner] + e`).
    fn offset(&self, b: usize, dims: Dims, lane: bool) -> String {
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
    fn needed(&self, targets: &[Value]) -> Vec<bool> {
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
    /// varies along the innermost dim as one [`VEC`]-wide vector (`xv{item}`).
    ///
    /// Long because it is the table of how each primitive is written in C, one arm each.
    fn emit(&self, need: &[bool], section: Section, out: &mut String) {
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

/// A reduction's fold in C: the combining expression of `a` and `b`, and its identity.
fn fold_of(op: ReduceFn, ty: &str) -> (&'static str, String) {
    match op {
        ReduceFn::Sum => ("a + b", format!("({ty})0")),
        // NaN propagates (the CPU reference's rule).
        ReduceFn::Max => ("(a != a || a >= b) ? a : b", format!("(-inf_of<{ty}>())")),
        ReduceFn::Min => ("(a != a || a <= b) ? a : b", format!("inf_of<{ty}>()")),
    }
}

/// The kernels of `g` (see the module doc).
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
    // Sets: per level, the reductions with the same kept dims and operand dims, in order.
    let inner = groups.len().checked_sub(1);
    let mut sets: Vec<RedSet> = Vec::new();
    let mut set_level = Vec::new();
    for (k, t) in temps.iter().enumerate() {
        let Node::Reduce(_, a) = g.items[t.item].node else {
            continue;
        };
        let red = Plan::compress(&groups, g.items[a].dims).minus(t.dims);
        let l = level[t.item];
        match (0..sets.len())
            .find(|&s| set_level[s] == l && sets[s].kept == t.dims && sets[s].red == red)
        {
            Some(s) => sets[s].tasks.push(k),
            None => {
                sets.push(RedSet {
                    tasks: vec![k],
                    kept: t.dims,
                    red,
                    inner: inner.is_some_and(|d| red.has(d)),
                    across: inner.is_some_and(|d| t.dims.has(d)),
                });
                set_level.push(l);
            }
        }
    }
    let name = ident(g.name);
    let em = Emitter {
        g,
        groups: &groups,
        temps: &temp_of,
        n_in,
    };
    let nb = n_in + temps.len() + g.outputs.len();
    let (ns, nt) = (sets.len().max(1), temps.len().max(1));
    let mut src = String::new();
    let _ = writeln!(
        src,
        "struct FuseParams {{ i64 size[{rank}]; i64 st[{nb}][{rank}]; u64 ptr[{nb}]; i64 vec; \
         i64 per[{ns}]; i64 part_at[{nt}]; i64 count_at[{ns}]; u64 part; u64 count; }};\n\
         template <typename T> struct alignas(16) FuseVec {{ T v[{VEC}]; }};\n"
    );
    let mut stages = Vec::new();
    for l in 1..=levels {
        let in_level: Vec<usize> = (0..sets.len()).filter(|&s| set_level[s] == l).collect();
        let kernel = format!("{name}_level{l}");
        reduce_kernel(&em, &kernel, &sets, &in_level, &temps, rank, &mut src);
        stages.push(Stage {
            kernel,
            sets: in_level,
        });
    }
    let kernel = format!("{name}_outputs");
    let out_dims = outputs_kernel(&em, &kernel, rank, &mut src);
    stages.push(Stage {
        kernel,
        sets: vec![],
    });
    Plan {
        name,
        source: src,
        groups,
        temps,
        sets,
        out_dims,
        stages,
    }
}

/// One level's kernel: a block per (row, chunk) of each of its sets (see the module doc).
fn reduce_kernel(
    em: &Emitter,
    kernel: &str,
    sets: &[RedSet],
    in_level: &[usize],
    temps: &[Temp],
    rank: usize,
    src: &mut String,
) {
    let g = em.g;
    let n_in = em.n_in;
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {kernel}(const FuseParams p) {{\n    __shared__ float sh_f[32];\n    \
         __shared__ double sh_d[32];\n    __shared__ int last_block;\n    (void)sh_f; (void)sh_d;\n    \
         __shared__ float tile_f[{warps}][{TILE} + 1];\n    __shared__ double tile_d[{warps}][{TILE} + 1];\n    \
         (void)tile_f; (void)tile_d;",
        warps = MAX_THREADS / 32
    );
    *src += &small_flag(rank);
    let _ = writeln!(src, "    i64 start = 0;");
    for (j, &s) in in_level.iter().enumerate() {
        let _ = writeln!(
            src,
            "    const i64 start{j} = start; start += {} * p.per[{s}];",
            if sets[s].across {
                format!("(({} + {TILE} - 1) / {TILE})", count(sets[s].kept, rank))
            } else {
                count(sets[s].kept, rank)
            }
        );
    }
    let _ = writeln!(
        src,
        "    for (i64 gr = blockIdx.x; gr < start; gr += gridDim.x) {{"
    );
    for (j, &s) in in_level.iter().enumerate() {
        let set = &sets[s];
        let next = if j + 1 < in_level.len() {
            format!("start{}", j + 1)
        } else {
            "start".into()
        };
        if set.across {
            across_set(em, set, s, (j, &next), temps, rank, src);
            continue;
        }
        let _ = writeln!(
            src,
            "    if (gr >= start{j} && gr < {next}) {{\n      const i64 per = p.per[{s}];\n      \
             const i64 row = (gr - start{j}) / per, chunk = (gr - start{j}) - row * per;\n      \
             i64 base[{rank}] = {{0}};"
        );
        let mut body = String::new();
        split(&mut body, "row", set.kept, rank);
        *src += &body.replace("idx[", "base[");
        // The operands, their types and folds.
        let mut operands = Vec::new();
        for &k in &set.tasks {
            let Node::Reduce(op, a) = g.items[temps[k].item].node else {
                continue;
            };
            let ty = if temps[k].wide { "double" } else { "float" };
            let (f, id) = fold_of(op, ty);
            let _ = writeln!(
                src,
                "      {ty} acc{k} = {id};\n      const auto f{k} = [](const {ty} a, const {ty} b) -> {ty} {{ return {f}; }};"
            );
            operands.push((k, a, ty, id));
        }
        let targets: Vec<Value> = operands.iter().map(|o| o.1).collect();
        let need = em.needed(&targets);
        let fold_all = |lane: bool| {
            let mut s = String::new();
            for (k, a, ty, _) in &operands {
                let _ = writeln!(
                    s,
                    "{}        acc{k} = f{k}(acc{k}, ({ty})v{a});",
                    if lane { "  " } else { "" }
                );
            }
            s
        };
        let _ = writeln!(
            src,
            "      const i64 len = {};\n      const bool wide_units = {};\n      \
             const i64 units = wide_units ? len / {VEC} : len;\n      \
             const i64 cu = (units + per - 1) / per;\n      \
             const i64 u0 = chunk * cu, u1 = u0 + cu < units ? u0 + cu : units;",
            count(set.red, rank),
            if set.inner { "p.vec != 0" } else { "false" }
        );
        if set.inner {
            // Unrolled so that several units' loads are in flight per thread (no stores in
            // the loop to order them behind).
            let mut w = String::new();
            let _ = writeln!(
                w,
                "      if (wide_units) {{\n      #pragma unroll 4\n      for (i64 u = u0 + threadIdx.x; u < u1; u += blockDim.x) {{\n        \
                 i64 idx[{rank}];\n        for (int d = 0; d < {rank}; ++d) idx[d] = base[d];"
            );
            split(&mut w, &format!("u * {VEC}"), set.red, rank);
            em.emit(&need, Section::Invariant, &mut w);
            let _ = writeln!(
                w,
                "        #pragma unroll\n        for (int e = 0; e < {VEC}; ++e) {{"
            );
            em.emit(&need, Section::Lane, &mut w);
            w += &fold_all(true);
            let _ = writeln!(w, "        }}\n      }}\n      }} else");
            *src += &w;
        }
        let mut sc = String::new();
        let _ = writeln!(
            sc,
            "      for (i64 u = u0 + threadIdx.x; u < u1; u += blockDim.x) {{\n        \
             i64 idx[{rank}];\n        for (int d = 0; d < {rank}; ++d) idx[d] = base[d];"
        );
        split(&mut sc, "u", set.red, rank);
        em.emit(&need, Section::All, &mut sc);
        sc += &fold_all(false);
        let _ = writeln!(sc, "      }}");
        *src += &sc;
        // The block's fold, then the row's (by the last of its blocks, in chunk order).
        for (k, _, ty, id) in &operands {
            let sh = if *ty == "double" { "sh_d" } else { "sh_f" };
            let _ = writeln!(
                src,
                "      acc{k} = block_reduce(acc{k}, f{k}, {id}, {sh});"
            );
        }
        let _ = writeln!(
            src,
            "      if (per == 1) {{\n        if (threadIdx.x == 0) {{"
        );
        for (k, _, ty, _) in &operands {
            let _ = writeln!(src, "          (({ty}*)p.ptr[{}])[row] = acc{k};", n_in + k);
        }
        let _ = writeln!(
            src,
            "        }}\n      }} else {{\n        if (threadIdx.x == 0) {{"
        );
        for (k, _, ty, _) in &operands {
            let _ = writeln!(
                src,
                "          ((({ty}*)(p.part + 8 * (u64)p.part_at[{k}])))[row * per + chunk] = acc{k};"
            );
        }
        let _ = writeln!(
            src,
            "          __threadfence();\n          \
             last_block = atomicAdd((unsigned long long*)p.count + p.count_at[{s}] + row, 1ull) == (unsigned long long)(per - 1);\n        \
             }}\n        __syncthreads();\n        if (last_block) {{\n          __threadfence();"
        );
        for (k, _, ty, id) in &operands {
            let sh = if *ty == "double" { "sh_d" } else { "sh_f" };
            let _ = writeln!(
                src,
                "          {{ const volatile {ty}* q = (const volatile {ty}*)(p.part + 8 * (u64)p.part_at[{k}]) + row * per;\n            \
                 const {ty} r = block_fold<{ty}>((u64)per, f{k}, {id}, [&](u64 c) -> {ty} {{ return q[c]; }}, {sh});\n            \
                 if (threadIdx.x == 0) (({ty}*)p.ptr[{}])[row] = r; }}",
                n_in + k
            );
        }
        let _ = writeln!(
            src,
            "        }}\n        __syncthreads();\n      }}\n    }}"
        );
    }
    let _ = writeln!(src, "    }}\n}}\n");
}

/// A set whose rows lie side by side (the innermost dim kept): a block per (tile of [`TILE`]
/// rows, chunk), lane `l` of every warp on row `tile·TILE + l` (a warp reads neighbours), the
/// warps interleaving the chunk's elements; the warps' folds are folded in warp order through
/// shared memory, and the last block of a tile folds each row's partials in chunk order.
fn across_set(
    em: &Emitter,
    set: &RedSet,
    s: usize,
    (j, next): (usize, &str),
    temps: &[Temp],
    rank: usize,
    src: &mut String,
) {
    let g = em.g;
    let n_in = em.n_in;
    let _ = writeln!(
        src,
        "    if (gr >= start{j} && gr < {next}) {{\n      const i64 per = p.per[{s}];\n      \
         const i64 tile = (gr - start{j}) / per, chunk = (gr - start{j}) - tile * per;\n      \
         const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;\n      \
         const i64 rows = {}, row = tile * {TILE} + lane;\n      const bool has_row = row < rows;\n      \
         i64 base[{rank}] = {{0}};\n      if (has_row) {{",
        count(set.kept, rank)
    );
    let mut body = String::new();
    split(&mut body, "row", set.kept, rank);
    *src += &body.replace("idx[", "base[");
    let _ = writeln!(src, "      }}");
    let mut operands = Vec::new();
    for &k in &set.tasks {
        let Node::Reduce(op, a) = g.items[temps[k].item].node else {
            continue;
        };
        let ty = if temps[k].wide { "double" } else { "float" };
        let (f, id) = fold_of(op, ty);
        let _ = writeln!(
            src,
            "      {ty} acc{k} = {id};\n      const auto f{k} = [](const {ty} a, const {ty} b) -> {ty} {{ return {f}; }};"
        );
        operands.push((k, a, ty, id));
    }
    let targets: Vec<Value> = operands.iter().map(|o| o.1).collect();
    let need = em.needed(&targets);
    let _ = writeln!(
        src,
        "      const i64 units = {};\n      const i64 cu = (units + per - 1) / per;\n      \
         const i64 u0 = chunk * cu, u1 = u0 + cu < units ? u0 + cu : units;\n      \
         if (has_row) for (i64 u = u0 + warp; u < u1; u += warps) {{\n        \
         i64 idx[{rank}];\n        for (int d = 0; d < {rank}; ++d) idx[d] = base[d];",
        count(set.red, rank)
    );
    let mut sc = String::new();
    split(&mut sc, "u", set.red, rank);
    em.emit(&need, Section::All, &mut sc);
    for (k, a, ty, _) in &operands {
        let _ = writeln!(sc, "        acc{k} = f{k}(acc{k}, ({ty})v{a});");
    }
    let _ = writeln!(sc, "      }}");
    *src += &sc;
    // The warps' folds, in warp order, into warp 0's lanes.
    for (k, _, ty, _) in &operands {
        let sh = if *ty == "double" { "tile_d" } else { "tile_f" };
        let _ = writeln!(
            src,
            "      {sh}[warp][lane] = acc{k};\n      __syncthreads();\n      \
             if (warp == 0) for (int w = 1; w < warps; ++w) acc{k} = f{k}(acc{k}, {sh}[w][lane]);\n      \
             __syncthreads();"
        );
    }
    let _ = writeln!(
        src,
        "      if (per == 1) {{\n        if (warp == 0 && has_row) {{"
    );
    for (k, _, ty, _) in &operands {
        let _ = writeln!(src, "          (({ty}*)p.ptr[{}])[row] = acc{k};", n_in + k);
    }
    let _ = writeln!(
        src,
        "        }}\n      }} else {{\n        if (warp == 0 && has_row) {{"
    );
    for (k, _, ty, _) in &operands {
        let _ = writeln!(
            src,
            "          ((({ty}*)(p.part + 8 * (u64)p.part_at[{k}])))[row * per + chunk] = acc{k};"
        );
    }
    let _ = writeln!(
        src,
        "        }}\n        __threadfence();\n        __syncthreads();\n        if (threadIdx.x == 0)\n          \
         last_block = atomicAdd((unsigned long long*)p.count + p.count_at[{s}] + tile, 1ull) == (unsigned long long)(per - 1);\n        \
         __syncthreads();\n        if (last_block && warp == 0 && has_row) {{\n          __threadfence();"
    );
    for (k, _, ty, id) in &operands {
        let _ = writeln!(
            src,
            "          {{ const volatile {ty}* q = (const volatile {ty}*)(p.part + 8 * (u64)p.part_at[{k}]) + row * per;\n            \
             {ty} r = {id};\n            for (i64 c = 0; c < per; ++c) r = f{k}(r, q[c]);\n            \
             (({ty}*)p.ptr[{}])[row] = r; }}",
            n_in + k
        );
    }
    let _ = writeln!(
        src,
        "        }}\n        __syncthreads();\n      }}\n    }}"
    );
}

/// The outputs' kernel: each output's elements in turn, grid-strided; returns the outputs'
/// compressed dims.
fn outputs_kernel(em: &Emitter, kernel: &str, rank: usize, src: &mut String) -> Vec<Dims> {
    let g = em.g;
    let n_in = em.n_in;
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {kernel}(const FuseParams p) {{"
    );
    *src += &small_flag(rank);
    let mut out_dims = Vec::new();
    for (k, &o) in g.outputs.iter().enumerate() {
        let it = &g.items[o];
        let dims = Plan::compress(em.groups, it.dims);
        out_dims.push(dims);
        let st = storage_type(it.dtype);
        let b = n_in + em.temps.len() + k;
        let acc = if it.wide() { "double" } else { "float" };
        let need = em.needed(&[o]);
        if em.varies(o) {
            let mut w = String::new();
            let _ = writeln!(
                w,
                "  if (p.vec != 0) {{\n  for (u64 u = global_tid(); u < (u64){} / {VEC}; u += global_stride()) {{\n        \
                 i64 idx[{rank}] = {{0}};",
                count(dims, rank)
            );
            split(&mut w, &format!("u * {VEC}"), dims, rank);
            em.emit(&need, Section::Invariant, &mut w);
            let _ = writeln!(
                w,
                "        FuseVec<{st}> yv;\n        #pragma unroll\n        for (int e = 0; e < {VEC}; ++e) {{"
            );
            em.emit(&need, Section::Lane, &mut w);
            let _ = writeln!(
                w,
                "          yv.v[e] = Num<{st}>::from(({acc})v{o});\n        }}\n        \
                 *(FuseVec<{st}>*)&((({st}*)p.ptr[{b}])[u * {VEC}]) = yv;\n  }}\n  }} else"
            );
            *src += &w;
        }
        let _ = writeln!(
            src,
            "  for (u64 i = global_tid(); i < (u64){}; i += global_stride()) {{\n        i64 idx[{rank}] = {{0}};",
            count(dims, rank)
        );
        let mut body = String::new();
        split(&mut body, "i", dims, rank);
        em.emit(&need, Section::All, &mut body);
        *src += &body;
        let _ = writeln!(
            src,
            "        (({st}*)p.ptr[{b}])[i] = Num<{st}>::from(({acc})v{o});\n  }}"
        );
    }
    let _ = writeln!(src, "}}");
    out_dims
}
