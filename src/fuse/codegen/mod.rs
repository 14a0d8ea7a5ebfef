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

//!
//! This file holds the plan (what the kernels are, the parameter block's layout); the code
//! they are written in comes from [`emit`] (values at a position), [`reduce`] (the
//! reductions' kernels) and [`outputs`] (the outputs' kernel).

mod emit;
mod outputs;
mod reduce;

use std::collections::HashMap;
use std::fmt::Write;

use super::ir::{Dims, Graph, Node, Value};
use emit::Emitter;
use outputs::outputs_kernel;
use reduce::reduce_kernel;

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
        reduce_kernel(&em, &kernel, &sets, &in_level, &temps, &mut src);
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
