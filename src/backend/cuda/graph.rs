//! CUDA-graph capture on a device's stream, and what makes replaying the graph safe.
//!
//! A capture records the work one thread enqueues on the device's stream between [`begin`] and
//! [`end`] (stream capture, thread-local mode); nothing runs until the graph is launched.
//! A replay runs the kernels with the pointers and arguments of capture time, so:
//!
//! - **Memory private to the graph.** Buffers allocated during capture come from
//!   `cuMemAllocAsync` on the capturing stream, which CUDA turns into graph memory nodes: memory
//!   that belongs to the graph, at addresses fixed for its life, never handed to other
//!   allocations (CUDA's per-graph pool). We chose this over a pool of our own because a step's
//!   temporaries are then freed inside the graph too (free nodes), so CUDA reuses their memory
//!   within the step as the eager allocator does; a buffer reserved by a warm-up run would
//!   instead keep every temporary alive. A graph allocation must not outlive the capture (a
//!   cache filling up, a tensor kept outside the step): [`end`] counts them and refuses the graph.
//! - **Buffers the graph uses stay alive.** Every buffer from before the capture whose address a
//!   captured launch took (`CudaStorage::ptr`) is pinned for the graph's life. When such a
//!   buffer is dropped (a `set_data`, a restored optimizer state, a cast), its memory is adopted
//!   by the graph instead of freed, and the graph becomes stale: a later launch is an error, never
//!   a replay on memory that someone else owns now. Frees of older buffers during the capture
//!   (which CUDA cannot capture) are deferred the same way. Caches the graph reads (multi-tensor
//!   chunk tables) are kept alive by [`keep_alive`], workspaces replaced later by [`retire`].
//! - **What cannot be captured is an error at capture time**, recorded so that the capture
//!   fails even when the caller swallows it: host reads, host → device copies, kernels first
//!   used, cuDNN plan searches, workspace growth, CPU tensor ops ([`refuse`]). Other threads may
//!   not use the device's stream while it is captured ([`check_stream`]).
//! - **Host-side bookkeeping is replayed by hooks** ([`on_replay`]): counters that an eager step
//!   advances on the host (batch norm's `num_batches_tracked`, the loss scaler's step count)
//!   advance at every launch.
//! - **What an eager call checks before it enqueues, a launch checks too** ([`before_replay`]):
//!   a graph holding NCCL collectives is not launched once their process group has failed or
//!   released its communicator (the nodes would run on an aborted or freed communicator).

use std::any::Any;
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use cudarc::driver::sys as cu;
use cudarc::driver::{CudaGraph, CudaSlice};

use super::device::{cuda_err, CudaDevice};
use crate::base::error::{Error, Result};

/// Device ordinals with capture state (more are refused by [`begin`]).
const MAX_DEVICES: usize = 64;

/// Per device: the token of the thread capturing on it, 0 when none.
static OWNER: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// Per device: graphs alive (their pins are in [`pins`]).
static LIVE: [AtomicUsize; MAX_DEVICES] = [const { AtomicUsize::new(0) }; MAX_DEVICES];

static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static TOKEN: u64 = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
    /// The device this thread is capturing on.
    static CAPTURING: Cell<Option<usize>> = const { Cell::new(None) };
}

fn my_token() -> u64 {
    TOKEN.with(|t| *t)
}

fn owner(ordinal: usize) -> u64 {
    OWNER.get(ordinal).map_or(0, |o| o.load(Ordering::Acquire))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The graph allocations of one capture: how many are alive, and whether the capture is open.
#[derive(Debug, Default)]
pub(crate) struct CaptureMark {
    open: AtomicBool,
    live: AtomicIsize,
    live_bytes: AtomicIsize,
}

/// What a capture collects while it runs.
struct Session {
    mark: Arc<CaptureMark>,
    /// Buffers from before the capture whose addresses captured work took.
    pinned: HashSet<u64>,
    /// Buffers from before the capture dropped during it: freed with the graph.
    deferred: Vec<CudaSlice<u8>>,
    /// Cache entries the graph reads.
    keep: Vec<Arc<dyn Any + Send + Sync>>,
    hooks: Vec<Box<dyn FnMut() -> Result<()> + Send>>,
    /// Pre-launch checks with the key they were registered under (one per key).
    checks: Vec<(usize, Check)>,
    /// The first refusal: the capture fails with it even if the caller went on.
    refused: Option<Error>,
}

fn sessions() -> &'static Mutex<HashMap<usize, Session>> {
    static S: OnceLock<Mutex<HashMap<usize, Session>>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(HashMap::new()))
}

/// What a graph shares with the buffers it pins: whether one was replaced, and their memory.
#[derive(Default)]
struct GraphShared {
    stale: AtomicBool,
    /// Memory of pinned buffers dropped while the graph lives (shared when several graphs pin one).
    adopted: Mutex<Vec<Arc<CudaSlice<u8>>>>,
    /// What was replaced, for the error.
    replaced: Mutex<Vec<String>>,
}

type Pins = Mutex<HashMap<(usize, u64), Vec<Weak<GraphShared>>>>;

fn pins() -> &'static Pins {
    static P: OnceLock<Pins> = OnceLock::new();
    P.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Whether this thread is capturing (on any device).
pub fn is_capturing() -> bool {
    CAPTURING.with(|c| c.get().is_some())
}

/// The device this thread is capturing on.
pub(crate) fn capturing_device() -> Option<usize> {
    CAPTURING.with(|c| c.get())
}

fn capture_error(op: &'static str, detail: String) -> Error {
    Error::Capture { op, detail }
}

/// An error when another thread is capturing on device `ordinal`: its stream belongs to that
/// capture (work enqueued now would land in the other thread's graph).
pub(crate) fn check_stream(ordinal: usize, op: &'static str) -> Result<()> {
    let o = owner(ordinal);
    if o == 0 || o == my_token() {
        return Ok(());
    }
    Err(capture_error(
        op,
        format!(
            "cuda:{ordinal} is being captured into a CUDA graph by another thread; its stream takes \
             no other work until that capture ends"
        ),
    ))
}

/// Records `err` as the capture's failure (the first one wins) and returns it.
fn record(ordinal: usize, err: Error) -> Error {
    let mut s = lock(sessions());
    if let Some(sess) = s.get_mut(&ordinal) {
        if sess.refused.is_none() {
            sess.refused = Some(clone_error(&err));
        }
    }
    err
}

fn clone_error(e: &Error) -> Error {
    match e {
        Error::Capture { op, detail } => Error::Capture {
            op,
            detail: detail.clone(),
        },
        other => Error::Cuda(other.to_string()),
    }
}

/// An error (recorded: the capture will fail) when this thread is capturing on `ordinal`:
/// `op` cannot be captured, because of `why`. Also [`check_stream`].
pub(crate) fn refuse(ordinal: usize, op: &'static str, why: &str) -> Result<()> {
    check_stream(ordinal, op)?;
    if owner(ordinal) == 0 || capturing_device() != Some(ordinal) {
        return Ok(());
    }
    Err(record(ordinal, capture_error(op, why.to_string())))
}

/// An error (recorded) when this thread is capturing on any device: a CPU tensor op computes
/// now, on the host, and a replay would not repeat it.
pub(crate) fn refuse_host_op(op: &'static str) -> Result<()> {
    let Some(ordinal) = capturing_device() else {
        return Ok(());
    };
    Err(record(
        ordinal,
        capture_error(
            op,
            "an op on CPU tensors during capture: it runs once now and a replay would not \
             repeat it (keep every tensor of the captured step on the GPU)"
                .into(),
        ),
    ))
}

/// Called by `CudaStorage::alloc` after allocating: the capture's mark when this thread
/// captures on `ordinal` (the buffer is a graph allocation). (Other threads were refused by
/// [`check_stream`] before allocating.)
pub(crate) fn on_alloc(ordinal: usize, bytes: usize) -> Option<Arc<CaptureMark>> {
    if owner(ordinal) == 0 || capturing_device() != Some(ordinal) {
        return None;
    }
    let s = lock(sessions());
    let sess = s.get(&ordinal)?;
    sess.mark.live.fetch_add(1, Ordering::Relaxed);
    sess.mark
        .live_bytes
        .fetch_add(bytes as isize, Ordering::Relaxed);
    Some(sess.mark.clone())
}

/// Called by `CudaStorage::ptr` on this thread: pins the address of a buffer from before the
/// capture (`graph_alloc` false) for the graph being captured.
pub(crate) fn on_ptr(ordinal: usize, ptr: u64, graph_alloc: bool) {
    if graph_alloc || capturing_device() != Some(ordinal) {
        return;
    }
    if let Some(sess) = lock(sessions()).get_mut(&ordinal) {
        sess.pinned.insert(ptr);
    }
}

/// Frees a dropped buffer's memory, unless a capture or a live graph needs it: the memory of a
/// buffer from before a running capture is deferred to the graph (CUDA cannot capture its
/// free), a buffer pinned by live graphs is adopted by them (and they become stale), and a graph
/// allocation that outlived a finished capture is never freed (its address belongs to a graph).
pub(crate) fn release(ordinal: usize, ptr: u64, buf: CudaSlice<u8>, mark: Option<&CaptureMark>) {
    if let Some(m) = mark {
        if m.open.load(Ordering::Acquire) {
            // A temporary of the capture: its free becomes a free node of the graph.
            m.live.fetch_sub(1, Ordering::Relaxed);
            m.live_bytes
                .fetch_sub(buf.len() as isize, Ordering::Relaxed);
            super::side_stream::free(ordinal, buf);
        } else {
            // Leaked out of a finished capture (reported by `end`): the address is the
            // graph's, so it is neither freed nor reused.
            std::mem::forget(buf);
        }
        return;
    }
    if ordinal < MAX_DEVICES && owner(ordinal) != 0 {
        let mut s = lock(sessions());
        if let Some(sess) = s.get_mut(&ordinal) {
            sess.deferred.push(buf);
            return;
        }
    }
    if ordinal < MAX_DEVICES && LIVE[ordinal].load(Ordering::Acquire) > 0 {
        let holders = lock(pins()).remove(&(ordinal, ptr));
        if let Some(holders) = holders {
            let alive: Vec<Arc<GraphShared>> = holders.iter().filter_map(Weak::upgrade).collect();
            if !alive.is_empty() {
                let mem = Arc::new(buf);
                for g in alive {
                    g.stale.store(true, Ordering::Release);
                    lock(&g.replaced).push(format!("{} bytes at {ptr:#x}", mem.len()));
                    lock(&g.adopted).push(mem.clone());
                }
                return;
            }
        }
    }
    super::side_stream::free(ordinal, buf);
}

/// Keeps `entry` (a cache entry whose device memory captured work reads) alive as long as the
/// graph being captured on this thread.
pub(crate) fn keep_alive(ordinal: usize, entry: Arc<dyn Any + Send + Sync>) {
    if capturing_device() != Some(ordinal) {
        return;
    }
    if let Some(sess) = lock(sessions()).get_mut(&ordinal) {
        sess.keep.push(entry);
    }
}

/// A buffer that is not a `CudaStorage` (a workspace) being replaced: while graphs are alive on
/// the device it may be one they use, so they keep it; returns it when no graph is alive.
pub(crate) fn retire(ordinal: usize, buf: CudaSlice<u8>) -> Option<CudaSlice<u8>> {
    if ordinal >= MAX_DEVICES || LIVE[ordinal].load(Ordering::Acquire) == 0 {
        return Some(buf);
    }
    let mem = Arc::new(buf);
    let p = lock(pins());
    let mut seen = HashSet::new();
    for ((d, _), holders) in p.iter() {
        if *d != ordinal {
            continue;
        }
        for g in holders.iter().filter_map(Weak::upgrade) {
            if seen.insert(Arc::as_ptr(&g) as usize) {
                lock(&g.adopted).push(mem.clone());
            }
        }
    }
    None
}

/// Registers `hook` to run on the host after every launch of the graph being captured on this
/// thread: host-side bookkeeping an eager step does (counters), which the graph cannot.
/// Returns false (and drops the hook) when this thread is not capturing.
pub(crate) fn on_replay(hook: Box<dyn FnMut() -> Result<()> + Send>) -> bool {
    with_session(|sess| sess.hooks.push(hook))
}

/// A pre-launch check (see [`before_replay`]).
pub(crate) type Check = Box<dyn FnMut() -> Result<()> + Send>;

/// Registers `check` to run on the host before every launch of the graph being captured on
/// this thread: a launch is refused with its error (nothing enqueued), as the eager call would
/// have been. One check per `key` (the object checked: a graph with a hundred collectives of
/// one group checks the group once); a later one under the same key is dropped. Returns false
/// when this thread is not capturing.
pub(crate) fn before_replay(key: usize, check: Check) -> bool {
    with_session(|sess| {
        if !sess.checks.iter().any(|(k, _)| *k == key) {
            sess.checks.push((key, check));
        }
    })
}

fn with_session(f: impl FnOnce(&mut Session)) -> bool {
    let Some(ordinal) = capturing_device() else {
        return false;
    };
    match lock(sessions()).get_mut(&ordinal) {
        Some(sess) => {
            f(sess);
            true
        }
        None => false,
    }
}

/// Starts capturing this thread's work on `dev`'s stream. Needs the stream-ordered allocator
/// (graph memory nodes); refuses a second capture on the device and nested captures.
pub(crate) fn begin(dev: &Arc<CudaDevice>) -> Result<()> {
    let op = "begin capture";
    let ordinal = dev.ordinal;
    if ordinal >= MAX_DEVICES {
        return Err(capture_error(
            op,
            format!("cuda:{ordinal}: devices 0..{MAX_DEVICES} only"),
        ));
    }
    if let Some(d) = capturing_device() {
        return Err(capture_error(
            op,
            format!("this thread is already capturing on cuda:{d} (captures do not nest)"),
        ));
    }
    if !dev.ctx.has_async_alloc() {
        return Err(capture_error(
            op,
            format!(
                "cuda:{ordinal} has no stream-ordered allocator (cuMemAllocAsync), which capture \
                 needs for the graph's private memory"
            ),
        ));
    }
    // Every kernel module loaded now: loading one inside a capture is not allowed.
    dev.compile_all()?;
    // Memory the eager steps freed goes back from the stream-ordered pool, so the graph's own
    // memory can use it (else the step's working set is held twice). Once per capture.
    dev.synchronize()?;
    trim_default_pool(dev)?;
    let me = my_token();
    if OWNER[ordinal]
        .compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return Err(capture_error(
            op,
            format!("cuda:{ordinal} is already being captured by another thread"),
        ));
    }
    let mark = Arc::new(CaptureMark {
        open: AtomicBool::new(true),
        ..Default::default()
    });
    lock(sessions()).insert(
        ordinal,
        Session {
            mark,
            pinned: HashSet::new(),
            deferred: Vec::new(),
            keep: Vec::new(),
            hooks: Vec::new(),
            checks: Vec::new(),
            refused: None,
        },
    );
    CAPTURING.with(|c| c.set(Some(ordinal)));
    let started = dev
        .stream
        .begin_capture(cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| cuda_err("cuStreamBeginCapture", e));
    if let Err(e) = started {
        CAPTURING.with(|c| c.set(None));
        let removed = lock(sessions()).remove(&ordinal);
        if let Some(sess) = removed {
            sess.mark.open.store(false, Ordering::Release);
        }
        OWNER[ordinal].store(0, Ordering::Release);
        return Err(e);
    }
    Ok(())
}

/// Releases the unused memory of the device's default pool (what `cuMemAllocAsync` outside a
/// capture draws from) back to the driver.
fn trim_default_pool(dev: &Arc<CudaDevice>) -> Result<()> {
    let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid device handle and out-pointer.
    unsafe { cu::cuDeviceGetDefaultMemPool(&mut pool, dev.ctx.cu_device()) }
        .result()
        .map_err(|e| cuda_err("cuDeviceGetDefaultMemPool", e))?;
    // SAFETY: the pool handle was just returned by the driver.
    unsafe { cu::cuMemPoolTrimTo(pool, 0) }
        .result()
        .map_err(|e| cuda_err("cuMemPoolTrimTo", e))
}

/// Ends the capture this thread began on `dev` and makes the graph: an error (and no graph)
/// when anything was refused, CUDA invalidated the capture, or graph allocations outlive it.
pub(crate) fn end(dev: &Arc<CudaDevice>) -> Result<Graph> {
    let ordinal = dev.ordinal;
    if capturing_device() != Some(ordinal) {
        return Err(capture_error(
            "end capture",
            format!("this thread is not capturing on cuda:{ordinal}"),
        ));
    }
    let ended = dev
        .stream
        .end_capture(cu::CUgraphInstantiate_flags(0))
        .map_err(|e| {
            cuda_err(
                "ending the capture (cuStreamEndCapture / cuGraphInstantiate)",
                e,
            )
        });
    CAPTURING.with(|c| c.set(None));
    let sess = lock(sessions()).remove(&ordinal);
    OWNER[ordinal].store(0, Ordering::Release);
    let Some(sess) = sess else {
        return Err(capture_error(
            "end capture",
            "the capture's state is gone".into(),
        ));
    };
    sess.mark.open.store(false, Ordering::Release);
    if let Some(e) = sess.refused {
        return Err(e);
    }
    let graph = match ended {
        Ok(Some(g)) => g,
        Ok(None) => {
            return Err(capture_error(
                "end capture",
                "the capture recorded no work".into(),
            ))
        }
        Err(e) => return Err(e),
    };
    let live = sess.mark.live.load(Ordering::Acquire);
    if live != 0 {
        return Err(capture_error(
            "end capture",
            format!(
                "{live} buffer(s) ({} bytes) allocated during the capture are still alive after it: \
                 graph memory may not outlive its capture (a tensor computed in the step and kept \
                 outside it, or a cache first filled during the capture: run a warm-up step first)",
                sess.mark.live_bytes.load(Ordering::Acquire)
            ),
        ));
    }
    graph
        .upload()
        .map_err(|e| cuda_err("uploading the graph (cuGraphUpload)", e))?;
    let shared = Arc::new(GraphShared::default());
    {
        let mut p = lock(pins());
        for &ptr in &sess.pinned {
            let v = p.entry((ordinal, ptr)).or_default();
            v.retain(|w| w.strong_count() > 0);
            v.push(Arc::downgrade(&shared));
        }
    }
    LIVE[ordinal].fetch_add(1, Ordering::AcqRel);
    Ok(Graph {
        graph,
        dev: dev.clone(),
        shared,
        pinned: sess.pinned.into_iter().collect(),
        _deferred: sess.deferred,
        _keep: sess.keep,
        hooks: sess.hooks,
        checks: sess.checks.into_iter().map(|(_, c)| c).collect(),
    })
}

/// Abandons a capture after an error (its work is discarded).
pub(crate) fn abort(dev: &Arc<CudaDevice>) {
    if capturing_device() == Some(dev.ordinal) {
        let _ = end(dev);
    }
}

/// How many nodes of each kind a graph holds (see [`Graph::nodes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphNodes {
    pub kernels: usize,
    pub memsets: usize,
    pub memcpys: usize,
    /// Allocation, free, event and empty nodes.
    pub other: usize,
}

/// A captured, instantiated CUDA graph with what its replays need alive.
pub struct Graph {
    graph: CudaGraph,
    dev: Arc<CudaDevice>,
    shared: Arc<GraphShared>,
    pinned: Vec<u64>,
    _deferred: Vec<CudaSlice<u8>>,
    _keep: Vec<Arc<dyn Any + Send + Sync>>,
    hooks: Vec<Box<dyn FnMut() -> Result<()> + Send>>,
    checks: Vec<Check>,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Graph(cuda:{}, {} pinned buffers, {} replay hooks, {} pre-launch checks)",
            self.dev.ordinal,
            self.pinned.len(),
            self.hooks.len(),
            self.checks.len()
        )
    }
}

// SAFETY: the graph handles are used only through `&mut self` (launch) and drop; CUDA allows a
// graph exec to be launched and destroyed from any thread when calls are serialised, which
// `&mut` guarantees.
unsafe impl Send for Graph {}

impl Graph {
    /// Whether a buffer the graph uses was dropped since the capture (the graph may not run).
    pub fn is_stale(&self) -> bool {
        self.shared.stale.load(Ordering::Acquire)
    }

    /// Launches the graph on the device's stream (no host synchronisation), then runs the
    /// replay hooks. An error, and no launch, when the graph is stale or a pre-launch check
    /// fails (a failed process group whose collectives the graph holds).
    pub fn launch(&mut self) -> Result<()> {
        let op = "replaying a CUDA graph";
        if self.is_stale() {
            let what = lock(&self.shared.replaced).join(", ");
            return Err(capture_error(
                op,
                format!(
                    "buffers the graph uses were replaced or freed after the capture ({what}): \
                     set_data, a cast, or a restored state gives tensors new memory; capture again"
                ),
            ));
        }
        check_stream(self.dev.ordinal, op)?;
        if capturing_device().is_some() {
            return Err(capture_error(
                op,
                "launching a graph inside a capture".into(),
            ));
        }
        for c in &mut self.checks {
            c()?;
        }
        self.graph
            .launch()
            .map_err(|e| cuda_err("cuGraphLaunch", e))?;
        for h in &mut self.hooks {
            h()?;
        }
        Ok(())
    }

    /// Buffers from before the capture that the graph reads or writes.
    pub fn pinned_buffers(&self) -> usize {
        self.pinned.len()
    }

    /// The graph's nodes by kind: what a replay launches (each node costs device time of its
    /// own beyond its work, so a step's node count is part of its speed).
    pub fn nodes(&self) -> Result<GraphNodes> {
        let g = self.graph.cu_graph();
        let mut n: usize = 0;
        // SAFETY: a null node array asks only for the count.
        unsafe { cu::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) }
            .result()
            .map_err(|e| cuda_err("cuGraphGetNodes", e))?;
        let mut nodes: Vec<cu::CUgraphNode> = vec![std::ptr::null_mut(); n];
        // SAFETY: `nodes` holds `n` entries, as the driver was told.
        unsafe { cu::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) }
            .result()
            .map_err(|e| cuda_err("cuGraphGetNodes", e))?;
        let mut counts = GraphNodes::default();
        for &node in &nodes[..n] {
            let mut t = cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a node of this graph and an out-pointer.
            unsafe { cu::cuGraphNodeGetType(node, &mut t) }
                .result()
                .map_err(|e| cuda_err("cuGraphNodeGetType", e))?;
            match t {
                cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => counts.kernels += 1,
                cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => counts.memsets += 1,
                cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY => counts.memcpys += 1,
                _ => counts.other += 1,
            }
        }
        Ok(counts)
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let ordinal = self.dev.ordinal;
        let mut p = lock(pins());
        for &ptr in &self.pinned {
            if let Some(v) = p.get_mut(&(ordinal, ptr)) {
                let me = Arc::as_ptr(&self.shared);
                v.retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), me));
                if v.is_empty() {
                    p.remove(&(ordinal, ptr));
                }
            }
        }
        drop(p);
        LIVE[ordinal].fetch_sub(1, Ordering::AcqRel);
        // The exec and graph are destroyed by `CudaGraph`'s drop (a launched exec finishes
        // first); adopted and deferred memory is freed in stream order after this graph's
        // launches.
    }
}
