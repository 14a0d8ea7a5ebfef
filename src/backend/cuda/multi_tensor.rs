//! The multi-tensor launcher: apex's multi_tensor_apply with the chunk→tensor table in device
//! memory. A call's entries are grouped by dtype signature; for each group a table of tensors
//! (`TEnt`, 80 bytes: six buffer addresses, length, slot, first chunk) and of chunks (`CEnt`: tensor,
//! chunk) is built once, uploaded, and cached under the list's addresses/lengths/dtypes, so a
//! training step's launch costs no host work beyond the launch itself. One block per 64K-element
//! chunk; kernels in `kernels/multi_tensor.cu` and `kernels/fused_optim.cu`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::device::{self, CudaDevice};
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::cpu::CpuStorage;
use crate::backend::{
    BufRef, MtArray, MtEntry, MtKernel, MtList, MtScalars, MultiTensorOps, MT_ROLES,
};
use crate::base::error::{Error, Result};
use crate::base::DType;

/// Elements per chunk (one block each); the kernels get it as `MT_CHUNK` (`registry.rs`).
use crate::backend::MT_CHUNK as CHUNK;
/// Threads per block of the chunk kernels.
pub(crate) const MT_THREADS: u32 = 512;
/// Words (u64) per tensor entry (`TEnt`).
const TENT_WORDS: usize = 10;
/// Cached lists per device before the cache is cleared.
const CACHE_LIMIT: usize = 256;

/// One dtype group of a cached list: its table (tensors, then chunks) on the device.
struct Group {
    /// Dtype of each role (None: absent).
    sig: [Option<DType>; MT_ROLES],
    table: CudaStorage,
    nt: usize,
    nc: usize,
}

/// A cached list: its groups, the norm scratch (per-chunk partials, per-tensor totals) and the
/// per-tensor spans (chunk0, chunks, slot) of the norm's finishing stage.
struct Cached {
    groups: Vec<Group>,
    partials: CudaStorage,
    tensor_acc: CudaStorage,
    spans: CudaStorage,
    nt: usize,
}

type Cache = Mutex<HashMap<(usize, Vec<u64>), Arc<Cached>>>;

fn cache() -> &'static Cache {
    static C: OnceLock<Cache> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

fn code(d: Option<DType>) -> u64 {
    match d {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::F16) => 2,
        Some(DType::BF16) => 3,
        Some(DType::F64) => 4,
        Some(DType::I64) => 5,
    }
}

/// The cache key of a list: every buffer's address and dtype, each entry's length and slot.
fn key(entries: &[MtEntry]) -> Vec<u64> {
    let mut k = Vec::with_capacity(entries.len() * (MT_ROLES * 2 + 2));
    for e in entries {
        for b in &e.bufs {
            k.push(b.map_or(0, |b| b.addr));
            k.push(code(b.map(|b| b.dtype)));
        }
        k.push(e.len as u64);
        k.push(e.slot as u64);
    }
    k
}

thread_local! {
    static BUILDS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Chunk tables built by calls from this thread so far: a test aid showing that steps over
/// the same lists reuse their cached tables (per thread, so parallel tests do not interfere).
pub fn tables_built_on_this_thread() -> u64 {
    BUILDS.with(|b| b.get())
}

fn build(dev: &Arc<CudaDevice>, entries: &[MtEntry]) -> Result<Cached> {
    BUILDS.with(|b| b.set(b.get() + 1));
    // Groups in order of first appearance; chunks numbered globally in entry order.
    let mut sigs: Vec<[Option<DType>; MT_ROLES]> = Vec::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    let mut chunk0 = Vec::with_capacity(entries.len());
    let mut total_chunks = 0usize;
    for (i, e) in entries.iter().enumerate() {
        let sig = e.bufs.map(|b| b.map(|b| b.dtype));
        match sigs.iter().position(|s| *s == sig) {
            Some(g) => members[g].push(i),
            None => {
                sigs.push(sig);
                members.push(vec![i]);
            }
        }
        chunk0.push(total_chunks);
        total_chunks += e.len.div_ceil(CHUNK);
    }
    let mut groups = Vec::with_capacity(sigs.len());
    for (sig, idx) in sigs.into_iter().zip(members) {
        let mut words: Vec<i64> = Vec::with_capacity(idx.len() * TENT_WORDS);
        let mut chunks: Vec<i64> = Vec::new();
        for (t, &i) in idx.iter().enumerate() {
            let e = &entries[i];
            for b in &e.bufs {
                words.push(b.map_or(0, |b| b.addr) as i64);
            }
            words.extend([e.len as i64, e.slot as i64, chunk0[i] as i64, 0]);
            for c in 0..e.len.div_ceil(CHUNK) {
                if t > u32::MAX as usize || c > u32::MAX as usize {
                    return Err(Error::invalid_arg(
                        "multi_tensor (cuda)",
                        "tensor list",
                        format!(
                            "{} tensors, tensor {t} of {} elements",
                            entries.len(),
                            e.len
                        ),
                        "fewer than 2^32 tensors and chunks per tensor",
                    ));
                }
                chunks.push(((t as u64) | ((c as u64) << 32)) as i64);
            }
        }
        let nc = chunks.len();
        words.extend(chunks);
        let table = CudaStorage::from_cpu(&CpuStorage::I64(words), dev.ordinal)?;
        groups.push(Group {
            sig,
            table,
            nt: idx.len(),
            nc,
        });
    }
    let mut spans = Vec::with_capacity(entries.len() * 3);
    for (i, e) in entries.iter().enumerate() {
        spans.extend([
            chunk0[i] as i64,
            e.len.div_ceil(CHUNK) as i64,
            e.slot as i64,
        ]);
    }
    Ok(Cached {
        groups,
        partials: CudaStorage::alloc(dev, DType::F32, total_chunks.max(1))?,
        tensor_acc: CudaStorage::alloc(dev, DType::F32, entries.len().max(1))?,
        spans: CudaStorage::from_cpu(&CpuStorage::I64(spans), dev.ordinal)?,
        nt: entries.len(),
    })
}

static CLEARS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Times the (process-wide) table cache was full and cleared: a test aid, since a clear forces
/// every thread's next step to rebuild its tables.
pub fn table_cache_clears() -> u64 {
    CLEARS.load(std::sync::atomic::Ordering::Relaxed)
}

fn cached(dev: &Arc<CudaDevice>, entries: &[MtEntry]) -> Result<Arc<Cached>> {
    let k = (dev.ordinal, key(entries));
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(v) = c.get(&k) {
        // A captured graph reads this table: it lives as long as the graph.
        super::graph::keep_alive(dev.ordinal, v.clone());
        return Ok(v.clone());
    }
    super::graph::refuse(
        dev.ordinal,
        "multi_tensor",
        "a tensor list first seen during capture (its chunk table is uploaded from the host): \
         run a warm-up step over the same tensors first",
    )?;
    if c.len() >= CACHE_LIMIT {
        c.clear();
        CLEARS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let v = Arc::new(build(dev, entries)?);
    c.insert(k, v.clone());
    Ok(v)
}

/// Number of cached lists (all devices): a test aid showing tables are reused.
pub fn cached_lists() -> usize {
    cache().lock().unwrap_or_else(|e| e.into_inner()).len()
}

fn sfx(op: &'static str, d: Option<DType>, l: MtList) -> Result<&'static str> {
    match d {
        Some(DType::F32) => Ok("f32"),
        Some(DType::F16) => Ok("f16"),
        Some(DType::BF16) => Ok("bf16"),
        None => Err(Error::invalid_arg(
            op,
            "tensor list",
            format!("no `{}` list", l.name()),
            "every list the kernel reads or writes",
        )),
        Some(d) => Err(Error::UnsupportedDType {
            op,
            got: d,
            expected: "F32, F16 or BF16",
        }),
    }
}

/// The copy-out suffix: the model copy's dtype, or f32 when absent (the kernel checks the
/// address).
fn copy_sfx(op: &'static str, sig: &[Option<DType>; MT_ROLES]) -> Result<&'static str> {
    match sig[MtList::ModelCopy.role()] {
        None => Ok("f32"),
        d => sfx(op, d, MtList::ModelCopy),
    }
}

fn addr(b: Option<BufRef>) -> u64 {
    b.map_or(0, |b| b.addr)
}

/// The CUDA backend of one device as a multi-tensor executor.
pub struct CudaMultiTensor {
    dev: Arc<CudaDevice>,
}

impl CudaMultiTensor {
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(CudaMultiTensor {
            dev: device::get(ordinal)?,
        })
    }
}

impl MultiTensorOps for CudaMultiTensor {
    fn multi_tensor(&self, kernel: &MtKernel, entries: &[MtEntry], sc: &MtScalars) -> Result<()> {
        let dev = &self.dev;
        let arr = |a: MtArray| addr(sc.get(a));
        if let MtKernel::UpdateScale(p) = *kernel {
            let g = Grid {
                blocks: 1,
                threads: 32,
            };
            launch!(dev, Family::MultiTensor, "update_scale", g;
                arr(MtArray::LossScale), arr(MtArray::Unskipped), arr(MtArray::SkippedTotal),
                arr(MtArray::FoundInf), p);
            return Ok(());
        }
        if entries.is_empty() {
            if let MtKernel::Norm { .. } = kernel {
                if let Some(t) = sc.get(MtArray::TotalNorm) {
                    // The norm of nothing is 0.
                    write_words(dev, t.addr, &[0.0])?;
                }
            }
            return Ok(());
        }
        let c = cached(dev, entries)?;
        for g in &c.groups {
            if g.nc == 0 && !matches!(kernel, MtKernel::StepIncrement | MtKernel::NovoGradMoment) {
                continue;
            }
            self.launch_group(kernel, g, &c, sc)?;
        }
        if let MtKernel::Norm { inf } = *kernel {
            let per = Grid {
                blocks: c.nt as u32,
                threads: 256,
            };
            launch!(dev, Family::MultiTensor, "mt_norm_tensor", per;
                c.spans.ptr(), c.partials.ptr(), c.tensor_acc.ptr(), arr(MtArray::Norms),
                inf as u32);
            if let Some(total) = sc.get(MtArray::TotalNorm) {
                let one = Grid {
                    blocks: 1,
                    threads: 256,
                };
                launch!(dev, Family::MultiTensor, "mt_norm_total", one;
                    c.tensor_acc.ptr(), c.nt as u64, total.addr, inf as u32);
            }
        }
        Ok(())
    }
}

impl CudaMultiTensor {
    /// One group's launch of `kernel` (one signature of operand dtypes): one match arm per
    /// kernel, each a name built from the dtypes and one launch; a new kernel is one arm here.
    fn launch_group(&self, kernel: &MtKernel, g: &Group, c: &Cached, sc: &MtScalars) -> Result<()> {
        use MtList as L;
        let op = "multi_tensor (cuda)";
        let dev = &self.dev;
        let arr = |a: MtArray| addr(sc.get(a));
        let (found, mult, steps) = (
            arr(MtArray::FoundInf),
            arr(MtArray::GradScale),
            arr(MtArray::Steps),
        );
        let hyper = arr(MtArray::Hyper);
        let tens = g.table.ptr();
        let chunks = tens + (g.nt * TENT_WORDS * 8) as u64;
        let grid = Grid {
            blocks: g.nc.max(1) as u32,
            threads: MT_THREADS,
        };
        let one = Grid {
            blocks: 1,
            threads: 256,
        };
        let s = &g.sig;
        let d = |l: MtList| s[l.role()];
        match *kernel {
            MtKernel::Scale => {
                let name = format!(
                    "mt_scale_{}_{}",
                    sfx(op, d(L::Input), L::Input)?,
                    sfx(op, d(L::Output), L::Output)?
                );
                launch!(dev, Family::MultiTensor, name, grid; tens, chunks, mult, found);
            }
            MtKernel::Check => {
                let name = format!("mt_check_{}", sfx(op, d(L::Input), L::Input)?);
                launch!(dev, Family::MultiTensor, name, grid; tens, chunks, found);
            }
            MtKernel::Zero => {
                let name = format!("mt_zero_{}", sfx(op, d(L::Output), L::Output)?);
                launch!(dev, Family::MultiTensor, name, grid; tens, chunks);
            }
            MtKernel::Axpby { a, b, check } => {
                #[repr(C)]
                #[derive(Clone, Copy)]
                struct AxpbyP {
                    a: f32,
                    b: f32,
                    check: u32,
                    pad: u32,
                }
                let name = format!(
                    "mt_axpby_{}_{}_{}",
                    sfx(op, d(L::X), L::X)?,
                    sfx(op, d(L::Y), L::Y)?,
                    sfx(op, d(L::Out), L::Out)?
                );
                let q = AxpbyP {
                    a,
                    b,
                    check,
                    pad: 0,
                };
                launch!(dev, Family::MultiTensor, name, grid; tens, chunks, found, q);
            }
            MtKernel::Norm { inf } => {
                let name = format!("mt_norm_{}", sfx(op, d(L::Input), L::Input)?);
                launch!(dev, Family::MultiTensor, name, grid;
                    tens, chunks, mult, found, c.partials.ptr(), inf as u32);
            }
            MtKernel::Sgd | MtKernel::Adam | MtKernel::NovoGrad => {
                let base = match kernel {
                    MtKernel::Sgd => "sgd",
                    MtKernel::Adam => "adam",
                    _ => "novograd",
                };
                let name = format!(
                    "{base}_{}_{}_{}",
                    sfx(op, d(L::Grad), L::Grad)?,
                    sfx(op, d(L::Param), L::Param)?,
                    copy_sfx(op, s)?
                );
                if let MtKernel::NovoGrad = kernel {
                    launch!(dev, Family::FusedOptim, name, grid;
                        tens, chunks, found, mult, steps, arr(MtArray::SecondMoments), hyper);
                } else {
                    launch!(dev, Family::FusedOptim, name, grid;
                        tens, chunks, found, mult, steps, hyper);
                }
            }
            MtKernel::LambUpdate => {
                let name = format!(
                    "lamb_update_{}_{}",
                    sfx(op, d(L::Grad), L::Grad)?,
                    sfx(op, d(L::Param), L::Param)?
                );
                launch!(dev, Family::FusedOptim, name, grid;
                    tens, chunks, found, mult, steps, arr(MtArray::GradNorm), hyper);
            }
            MtKernel::LambApply => {
                let name = format!(
                    "lamb_apply_{}_{}",
                    sfx(op, d(L::Param), L::Param)?,
                    copy_sfx(op, s)?
                );
                launch!(dev, Family::FusedOptim, name, grid;
                    tens, chunks, found, arr(MtArray::ParamNorms), arr(MtArray::UpdateNorms),
                    hyper);
            }
            MtKernel::NovoGradMoment => {
                launch!(dev, Family::FusedOptim, "novograd_moment", one;
                    tens, g.nt as u64, found, steps, arr(MtArray::SecondMoments),
                    arr(MtArray::GradNorms), hyper);
            }
            MtKernel::StepIncrement => {
                launch!(dev, Family::FusedOptim, "step_increment", one; tens, g.nt as u64, found, steps);
            }
            MtKernel::UpdateScale(_) => unreachable!("handled above"),
        }
        Ok(())
    }
}

/// Writes `words` (at most 16) into the F32 device buffer at `dst` with one small kernel: the
/// stream-ordered, sync-free way the host sets an optimizer's hyperparameter block.
pub(crate) fn write_words(dev: &Arc<CudaDevice>, dst: u64, words: &[f32]) -> Result<()> {
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Words16 {
        w: [f32; 16],
    }
    if words.len() > 16 {
        return Err(Error::invalid_arg(
            "write_words",
            "words",
            words.len(),
            "at most 16",
        ));
    }
    let mut q = Words16 { w: [0.0; 16] };
    q.w[..words.len()].copy_from_slice(words);
    let g = Grid {
        blocks: 1,
        threads: 32,
    };
    launch!(dev, Family::MultiTensor, "write_words", g; dst, q, words.len() as u32);
    Ok(())
}
