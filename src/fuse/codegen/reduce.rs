//! A level's kernel: its reduction sets' blocks, each folding one chunk of a row (or of a tile
//! of [`TILE`] rows) and writing a partial, the last block of a row folding the partials in
//! chunk order into the row's temporary (see the parent module's doc).

use std::fmt::Write;

use super::emit::{count, fold_of, small_flag, split, Emitter, Section};
use super::{RedSet, Temp, MAX_THREADS, TILE, VEC};
use crate::fuse::ir::{Node, Value};

/// One level's kernel: a block per (row, chunk) of each of its sets (see the module doc).
pub(super) fn reduce_kernel(
    em: &Emitter,
    kernel: &str,
    sets: &[RedSet],
    in_level: &[usize],
    temps: &[Temp],
    src: &mut String,
) {
    let rank = em.groups.len().max(1);
    kernel_prologue(kernel, sets, in_level, rank, src);
    for (j, &s) in in_level.iter().enumerate() {
        let next = if j + 1 < in_level.len() {
            format!("start{}", j + 1)
        } else {
            "start".into()
        };
        let code = SetCode {
            em,
            set: &sets[s],
            s,
            j,
            next: &next,
            temps,
            rank,
        };
        if code.set.across {
            code.across_set(src);
        } else {
            code.along_set(src);
        }
    }
    let _ = writeln!(src, "    }}\n}}\n");
}

/// The kernel's signature, its shared memory, and where each set's blocks start in the grid
/// (`start{j}`), up to the grid-strided loop's head over all of them.
fn kernel_prologue(
    kernel: &str,
    sets: &[RedSet],
    in_level: &[usize],
    rank: usize,
    src: &mut String,
) {
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
}

/// One reduction of a set: its temporary `k`, its operand `a`, the C type it folds in and
/// the fold's identity.
struct Operand {
    k: usize,
    a: Value,
    ty: &'static str,
    id: String,
}

/// How a set's blocks share out a row's writes: which threads hold a row's fold, how the last
/// block of a row (or tile) is found, and how it folds the partials.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowLayout {
    /// A block per row: thread 0 holds the block's fold; the last block folds the partials
    /// with all its threads (`block_fold`).
    Along,
    /// A block per tile of [`TILE`] rows: warp 0's lane `l` holds row `l`'s fold; in the last
    /// block, that lane folds its row's partials serially.
    Across,
}

/// The code of one set of a level's kernel: set `s`, the `j`th of its level, whose blocks are
/// the grid's `[start{j}, next)`.
struct SetCode<'a> {
    em: &'a Emitter<'a>,
    set: &'a RedSet,
    s: usize,
    j: usize,
    next: &'a str,
    temps: &'a [Temp],
    rank: usize,
}

impl SetCode<'_> {
    /// A set whose rows lie along the innermost dim (or outer ones): a block per (row, chunk).
    fn along_set(&self, src: &mut String) {
        let (j, s, rank) = (self.j, self.s, self.rank);
        let next = self.next;
        let _ = writeln!(
            src,
            "    if (gr >= start{j} && gr < {next}) {{\n      const i64 per = p.per[{s}];\n      \
             const i64 row = (gr - start{j}) / per, chunk = (gr - start{j}) - row * per;\n      \
             i64 base[{rank}] = {{0}};"
        );
        let mut body = String::new();
        split(&mut body, "row", self.set.kept, rank);
        *src += &body.replace("idx[", "base[");
        let operands = self.declare_operands(src);
        self.along_loops(&operands, src);
        // The block's fold, then the row's (by the last of its blocks, in chunk order).
        for Operand { k, ty, id, .. } in &operands {
            let sh = if *ty == "double" { "sh_d" } else { "sh_f" };
            let _ = writeln!(
                src,
                "      acc{k} = block_reduce(acc{k}, f{k}, {id}, {sh});"
            );
        }
        self.write_rows(&operands, RowLayout::Along, src);
    }

    /// The loops of [`SetCode::along_set`] over a chunk's units: [`VEC`] elements a unit where
    /// the innermost dim is reduced and the host allows, else one.
    fn along_loops(&self, operands: &[Operand], src: &mut String) {
        let (set, rank, em) = (self.set, self.rank, self.em);
        let need = self.need(operands);
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
            w += &fold_all(operands, true);
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
        sc += &fold_all(operands, false);
        let _ = writeln!(sc, "      }}");
        *src += &sc;
    }

    /// A set whose rows lie side by side (the innermost dim kept): a block per (tile of
    /// [`TILE`] rows, chunk), lane `l` of every warp on row `tile·TILE + l` (a warp reads
    /// neighbours), the warps interleaving the chunk's elements; the warps' folds are folded in
    /// warp order through shared memory, and the last block of a tile folds each row's
    /// partials in chunk order.
    fn across_set(&self, src: &mut String) {
        let (j, s, rank, set) = (self.j, self.s, self.rank, self.set);
        let next = self.next;
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
        let operands = self.declare_operands(src);
        let need = self.need(&operands);
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
        self.em.emit(&need, Section::All, &mut sc);
        sc += &fold_all(&operands, false);
        let _ = writeln!(sc, "      }}");
        *src += &sc;
        // The warps' folds, in warp order, into warp 0's lanes.
        for Operand { k, ty, .. } in &operands {
            let sh = if *ty == "double" { "tile_d" } else { "tile_f" };
            let _ = writeln!(
                src,
                "      {sh}[warp][lane] = acc{k};\n      __syncthreads();\n      \
                 if (warp == 0) for (int w = 1; w < warps; ++w) acc{k} = f{k}(acc{k}, {sh}[w][lane]);\n      \
                 __syncthreads();"
            );
        }
        self.write_rows(&operands, RowLayout::Across, src);
    }

    /// Declares each of the set's reductions' accumulator (`acc{k}`) and fold (`f{k}`).
    fn declare_operands(&self, src: &mut String) -> Vec<Operand> {
        let mut operands = Vec::new();
        for &k in &self.set.tasks {
            let Node::Reduce(op, a) = self.em.g.items[self.temps[k].item].node else {
                continue;
            };
            let ty = if self.temps[k].wide {
                "double"
            } else {
                "float"
            };
            let (f, id) = fold_of(op, ty);
            let _ = writeln!(
                src,
                "      {ty} acc{k} = {id};\n      const auto f{k} = [](const {ty} a, const {ty} b) -> {ty} {{ return {f}; }};"
            );
            operands.push(Operand { k, a, ty, id });
        }
        operands
    }

    /// The items the operands' values need.
    fn need(&self, operands: &[Operand]) -> Vec<bool> {
        let targets: Vec<Value> = operands.iter().map(|o| o.a).collect();
        self.em.needed(&targets)
    }

    /// The set's epilogue, once its blocks hold their folds: with one chunk a row, the folds
    /// are the rows' values; else each block writes its partials, and the last block of a row
    /// (a counter per row, or per tile in [`RowLayout::Across`]) folds them in chunk order.
    /// Closes the set's `if`.
    fn write_rows(&self, operands: &[Operand], layout: RowLayout, src: &mut String) {
        let n_in = self.em.n_in;
        let s = self.s;
        let holder = match layout {
            RowLayout::Along => "threadIdx.x == 0",
            RowLayout::Across => "warp == 0 && has_row",
        };
        let _ = writeln!(src, "      if (per == 1) {{\n        if ({holder}) {{");
        for Operand { k, ty, .. } in operands {
            let _ = writeln!(src, "          (({ty}*)p.ptr[{}])[row] = acc{k};", n_in + k);
        }
        let _ = writeln!(
            src,
            "        }}\n      }} else {{\n        if ({holder}) {{"
        );
        for Operand { k, ty, .. } in operands {
            let _ = writeln!(
                src,
                "          ((({ty}*)(p.part + 8 * (u64)p.part_at[{k}])))[row * per + chunk] = acc{k};"
            );
        }
        match layout {
            RowLayout::Along => {
                let _ = writeln!(
                    src,
                    "          __threadfence();\n          \
                     last_block = atomicAdd((unsigned long long*)p.count + p.count_at[{s}] + row, 1ull) == (unsigned long long)(per - 1);\n        \
                     }}\n        __syncthreads();\n        if (last_block) {{\n          __threadfence();"
                );
            }
            RowLayout::Across => {
                let _ = writeln!(
                    src,
                    "        }}\n        __threadfence();\n        __syncthreads();\n        if (threadIdx.x == 0)\n          \
                     last_block = atomicAdd((unsigned long long*)p.count + p.count_at[{s}] + tile, 1ull) == (unsigned long long)(per - 1);\n        \
                     __syncthreads();\n        if (last_block && warp == 0 && has_row) {{\n          __threadfence();"
                );
            }
        }
        for Operand { k, ty, id, .. } in operands {
            let out = n_in + k;
            let partials = format!(
                "          {{ const volatile {ty}* q = (const volatile {ty}*)(p.part + 8 * (u64)p.part_at[{k}]) + row * per;\n            "
            );
            let _ = match layout {
                RowLayout::Along => {
                    let sh = if *ty == "double" { "sh_d" } else { "sh_f" };
                    writeln!(
                        src,
                        "{partials}const {ty} r = block_fold<{ty}>((u64)per, f{k}, {id}, [&](u64 c) -> {ty} {{ return q[c]; }}, {sh});\n            \
                         if (threadIdx.x == 0) (({ty}*)p.ptr[{out}])[row] = r; }}"
                    )
                }
                RowLayout::Across => writeln!(
                    src,
                    "{partials}{ty} r = {id};\n            for (i64 c = 0; c < per; ++c) r = f{k}(r, q[c]);\n            \
                     (({ty}*)p.ptr[{out}])[row] = r; }}"
                ),
            };
        }
        let _ = writeln!(
            src,
            "        }}\n        __syncthreads();\n      }}\n    }}"
        );
    }
}

/// Each operand's value folded into its accumulator (`lane`: inside the [`VEC`] lanes' loop,
/// indented one more step).
fn fold_all(operands: &[Operand], lane: bool) -> String {
    let mut s = String::new();
    for Operand { k, a, ty, .. } in operands {
        let _ = writeln!(
            s,
            "{}        acc{k} = f{k}(acc{k}, ({ty})v{a});",
            if lane { "  " } else { "" }
        );
    }
    s
}
