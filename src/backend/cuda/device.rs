//! Per-device state: the context, the main (non-default) stream, the side stream
//! (`side_stream.rs`), the stream-ordered memory pool, the compiled kernel modules and the
//! library handles. One [`CudaDevice`] per ordinal, created on
//! first use and kept for the life of the process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::sys as cu;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};

use super::probe::{no_panic, probe};
use super::registry::{module_image, Family};
use crate::base::error::{Error, Result};

pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

/// Whether f32 matmuls may use TF32 tensor cores (off unless a user turns it on).
static ALLOW_TF32: AtomicBool = AtomicBool::new(false);

/// Lets f32 matmul and convolution use TF32 tensor cores (10-bit mantissa products, f32
/// accumulation). Off by default: f32 means f32.
pub fn set_allow_tf32(on: bool) {
    ALLOW_TF32.store(on, Ordering::Relaxed);
}

pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(Ordering::Relaxed)
}

/// Whether environment variable `name` turns a switch on (set, not empty, not "0").
pub(super) fn env_on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// A process-wide switch whose first read takes its value from environment variable `var`.
fn env_flag(cell: &'static OnceLock<AtomicBool>, var: &str) -> &'static AtomicBool {
    cell.get_or_init(|| AtomicBool::new(env_on(var)))
}

static DETERMINISTIC: OnceLock<AtomicBool> = OnceLock::new();

fn deterministic_flag() -> &'static AtomicBool {
    env_flag(&DETERMINISTIC, "MIXPREC_DETERMINISTIC")
}

/// Restricts convolutions to algorithms that give bitwise the same result on every run
/// (PyTorch's `torch.backends.cudnn.deterministic`). Off by default: the timed choice may then
/// pick an engine that reduces with atomics (cuDNN notes it `NONDETERMINISTIC`), which is often
/// the fastest backward-filter and differs from run to run in the last bits. Also turned on by
/// `MIXPREC_DETERMINISTIC=1`. Plans already chosen under the other setting are kept apart, not
/// reused.
pub fn set_deterministic(on: bool) {
    deterministic_flag().store(on, Ordering::Relaxed);
}

pub fn deterministic() -> bool {
    deterministic_flag().load(Ordering::Relaxed)
}

static POISON: OnceLock<AtomicBool> = OnceLock::new();

fn poison_flag() -> &'static AtomicBool {
    env_flag(&POISON, "MIXPREC_CUDA_POISON")
}

/// Test aid: when on, every new CUDA buffer is filled with 0xFF bytes (NaN in every float dtype,
/// -1 as i64) before an op writes it, so elements an op fails to write show up. Also turned on
/// by the environment variable `MIXPREC_CUDA_POISON=1`.
pub fn set_poison_allocations(on: bool) {
    poison_flag().store(on, Ordering::Relaxed);
}

pub(crate) fn poison_allocations() -> bool {
    poison_flag().load(Ordering::Relaxed)
}

pub struct CudaDevice {
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// (major, minor) compute capability.
    pub(crate) arch: (i32, i32),
    pub(crate) sm_count: u32,
    /// The most shared memory one block may ask for (after raising its dynamic limit).
    pub(crate) smem_per_block: u32,
    modules: Mutex<HashMap<Family, Arc<CudaModule>>>,
    /// Modules loaded into this context so far: a load after [`CudaDevice::compile_all`] means a
    /// kernel reached the driver some other way, inside a timed step or a capture.
    module_loads: AtomicUsize,
    functions: Mutex<HashMap<(Family, String), CudaFunction>>,
    pub(crate) blas: Mutex<Option<super::matmul::Blas>>,
    pub(crate) dnn: Mutex<Option<super::cudnn::Dnn>>,
    /// Run after every host read (see [`CudaDevice::add_read_check`]); held weakly, so a check
    /// ends with its owner.
    read_checks: Mutex<Vec<Weak<ReadCheck>>>,
    /// The second stream, for work off the critical path (`side_stream.rs`).
    pub(crate) side: super::side_stream::SideStream,
}

/// A check made after the stream has been waited for, before a host read returns: something
/// outside the backend can make what the stream computed invalid after the fact (a collective
/// cut short by an aborted NCCL communicator lets the kernels after it run on what it left).
pub type ReadCheck = dyn Fn() -> Result<()> + Send + Sync;

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaDevice(cuda:{}, sm_{}{})",
            self.ordinal, self.arch.0, self.arch.1
        )
    }
}

fn registry() -> &'static Mutex<HashMap<usize, Arc<CudaDevice>>> {
    static R: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The device `ordinal`, created on first use (after probing the libraries).
pub fn get(ordinal: usize) -> Result<Arc<CudaDevice>> {
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = reg.get(&ordinal) {
        return Ok(d.clone());
    }
    probe()?;
    let dev = no_panic("creating the CUDA context", || CudaDevice::new(ordinal))?;
    let dev = Arc::new(dev);
    reg.insert(ordinal, dev.clone());
    Ok(dev)
}

/// How many CUDA devices this process sees (`CUDA_VISIBLE_DEVICES` applied), after probing the
/// libraries; the error says why CUDA is not usable here. Creates no context.
pub fn device_count() -> Result<usize> {
    probe()?;
    let n = no_panic("counting the CUDA devices", || {
        CudaContext::device_count().map_err(|e| cuda_err("cuDeviceGetCount", e))
    })?;
    Ok(n.max(0) as usize)
}

impl CudaDevice {
    fn new(ordinal: usize) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::Cuda(format!(
                "no CUDA device {ordinal}: {count} device(s) visible"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("creating the context", e))?;
        // SAFETY: every buffer of this backend belongs to the device's main stream, so stream
        // order is the only synchronisation needed; the side stream's work is ordered against it
        // by events of its own (`side_stream.rs`).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating a stream", e))?;
        let arch = ctx
            .compute_capability()
            .map_err(|e| cuda_err("reading the compute capability", e))?;
        let sm_count = ctx
            .attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| cuda_err("reading the SM count", e))?
            .max(1) as u32;
        let smem_per_block = ctx
            .attribute(
                cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| cuda_err("reading the shared memory per block", e))?
            .max(0) as u32;
        if ctx.has_async_alloc() {
            raise_pool_threshold(&ctx)?;
        } else {
            log::warn!("cuda:{ordinal}: no stream-ordered allocator; falling back to cuMemAlloc");
        }
        Ok(CudaDevice {
            ordinal,
            ctx,
            stream,
            arch,
            sm_count,
            smem_per_block,
            modules: Mutex::new(HashMap::new()),
            module_loads: AtomicUsize::new(0),
            functions: Mutex::new(HashMap::new()),
            blas: Mutex::new(None),
            dnn: Mutex::new(None),
            read_checks: Mutex::new(Vec::new()),
            side: Default::default(),
        })
    }

    /// The kernel `name` of family `f`, compiling the family on first use.
    pub(crate) fn function(&self, f: Family, name: &str) -> Result<CudaFunction> {
        let key = (f, name.to_string());
        if let Some(func) = self
            .functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return Ok(func.clone());
        }
        // Fetching a kernel may load it (lazy loading), which a capture cannot record.
        super::graph::refuse(
            self.ordinal,
            "kernel launch",
            &format!(
                "kernel {name} ({}.cu) first used during capture: run the same work once before \
                 capturing (a warm-up step)",
                f.name()
            ),
        )?;
        let module = self.module(f)?;
        let func = module
            .load_function(name)
            .map_err(|e| cuda_err(&format!("loading kernel {name} of {}.cu", f.name()), e))?;
        self.functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, func.clone());
        Ok(func)
    }

    fn module(&self, f: Family) -> Result<Arc<CudaModule>> {
        let mut mods = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = mods.get(&f) {
            return Ok(m.clone());
        }
        let image = module_image(f, self.arch)?;
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(image))
            .map_err(|e| cuda_err(&format!("loading module {}.cu", f.name()), e))?;
        mods.insert(f, m.clone());
        self.module_loads.fetch_add(1, Ordering::Relaxed);
        Ok(m)
    }

    /// Compiles (or loads from the disk cache) every kernel family now, instead of at first use.
    /// Returns how many families it loaded (those not loaded before).
    pub fn compile_all(&self) -> Result<usize> {
        let before = self.module_loads();
        for f in Family::ALL {
            self.module(f)?;
        }
        Ok(self.module_loads() - before)
    }

    /// How many kernel modules this device has loaded: one per family used so far, every family
    /// after [`CudaDevice::compile_all`].
    pub fn module_loads(&self) -> usize {
        self.module_loads.load(Ordering::Relaxed)
    }

    /// Waits for all work queued on the device's stream.
    pub fn synchronize(&self) -> Result<()> {
        super::graph::refuse(
            self.ordinal,
            "synchronize",
            "waiting for the device inside a capture (nothing runs until the graph is launched)",
        )?;
        HOST_SYNCS.with(|c| c.set(c.get() + 1));
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("synchronizing the stream", e))?;
        self.run_read_checks()
    }

    /// Adds a check that every later wait for the stream makes (so every host read), for as long
    /// as `check` is alive: an error from it is returned instead of the data.
    pub fn add_read_check(&self, check: &Arc<ReadCheck>) {
        let mut v = self.read_checks.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|c| c.strong_count() > 0);
        v.push(Arc::downgrade(check));
    }

    fn run_read_checks(&self) -> Result<()> {
        let live: Vec<Arc<ReadCheck>> = {
            let v = self.read_checks.lock().unwrap_or_else(|e| e.into_inner());
            v.iter().filter_map(Weak::upgrade).collect()
        };
        live.iter().try_for_each(|check| check())
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.arch
    }
}

thread_local! {
    /// Host synchronisations made by this thread (every device → host read goes through
    /// [`CudaDevice::synchronize`]). Per thread, so that a test measuring its own training step
    /// is not charged for other threads' reads.
    static HOST_SYNCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// CUDA buffers allocated by this thread (every `CudaStorage`), per thread for the same
    /// reason.
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts one buffer allocation on this thread.
pub(crate) fn count_allocation() {
    ALLOCATIONS.with(|c| c.set(c.get() + 1));
}

/// The number of CUDA buffers this thread has allocated, all devices: a debug counter for
/// proving that a replayed training step allocates nothing (a replay's memory is the graph's).
pub fn allocation_count() -> u64 {
    ALLOCATIONS.with(|c| c.get())
}

/// The number of host synchronisations this thread has made, all devices: a debug counter for
/// proving that a training step makes none (read it before and after the steps).
pub fn host_sync_count() -> u64 {
    HOST_SYNCS.with(|c| c.get())
}

/// Keeps freed memory in the device's default pool (which cuMemAllocAsync draws from) instead of
/// returning it to the driver at each synchronisation: steady-state training does no
/// cudaMalloc/cudaFree.
fn raise_pool_threshold(ctx: &Arc<CudaContext>) -> Result<()> {
    let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid device handle and out-pointer.
    unsafe { cu::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .map_err(|e| cuda_err("cuDeviceGetDefaultMemPool", e))?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the attribute takes a cuuint64_t.
    unsafe {
        cu::cuMemPoolSetAttribute(
            pool,
            cu::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
    }
    .result()
    .map_err(|e| cuda_err("cuMemPoolSetAttribute(RELEASE_THRESHOLD)", e))
}
