//! Kernel launches: arguments by value (pointers travel as `u64` device addresses), a grid sized
//! for grid-stride loops, and the launch's error as an [`Error`].

use super::device::{cuda_err, CudaDevice};
use super::registry::Family;
use crate::base::error::Result;

/// Threads per block of the elementwise-style kernels.
pub(crate) const BLOCK: u32 = 256;

/// Kernel arguments, each in its own 8-byte-aligned heap cell so the pointers stay valid.
#[derive(Default)]
pub(crate) struct Args {
    cells: Vec<Box<[u64]>>,
}

impl Args {
    pub(crate) fn new() -> Self {
        Args::default()
    }

    /// Adds one argument. `T` must be the exact by-value type of the kernel parameter
    /// (`#[repr(C)]` for structs).
    pub(crate) fn push<T: Copy>(&mut self, v: T) {
        let words = std::mem::size_of::<T>().div_ceil(8).max(1);
        let mut cell = vec![0u64; words].into_boxed_slice();
        // SAFETY: the cell holds at least size_of::<T>() bytes and is 8-aligned (T needs ≤ 8 here).
        unsafe { std::ptr::write_unaligned(cell.as_mut_ptr() as *mut T, v) };
        self.cells.push(cell);
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Grid {
    pub blocks: u32,
    pub threads: u32,
}

impl Grid {
    /// A grid-stride grid for `work` independent items: enough blocks to fill the device, no more.
    pub(crate) fn for_items(dev: &CudaDevice, work: usize) -> Grid {
        let max_blocks = (dev.sm_count as usize) * 16;
        let blocks = work.div_ceil(BLOCK as usize).clamp(1, max_blocks);
        Grid {
            blocks: blocks as u32,
            threads: BLOCK,
        }
    }

    /// One block per row (grid-stride over rows beyond the limit).
    pub(crate) fn per_row(rows: usize, threads: u32) -> Grid {
        Grid {
            blocks: rows.clamp(1, 1 << 20) as u32,
            threads,
        }
    }
}

/// Looks up `name`, binds the device's context to this thread and hands `launch` the function and
/// the kernel's argument pointers: what the plain and the cooperative launch share.
fn with_kernel(
    dev: &CudaDevice,
    f: Family,
    name: &str,
    args: Args,
    launch: impl FnOnce(
        cudarc::driver::sys::CUfunction,
        &mut Vec<*mut std::ffi::c_void>,
    ) -> std::result::Result<(), cudarc::driver::DriverError>,
) -> Result<std::result::Result<(), cudarc::driver::DriverError>> {
    super::graph::check_stream(dev.ordinal, "kernel launch")?;
    let func = dev.function(f, name)?;
    let mut ptrs: Vec<*mut std::ffi::c_void> = args
        .cells
        .iter()
        .map(|c| c.as_ptr() as *mut std::ffi::c_void)
        .collect();
    dev.ctx
        .bind_to_thread()
        .map_err(|e| cuda_err("binding the context", e))?;
    Ok(launch(func.cu_function(), &mut ptrs))
}

pub(crate) fn launch_kernel(
    dev: &CudaDevice,
    f: Family,
    name: &str,
    grid: Grid,
    args: Args,
) -> Result<()> {
    with_kernel(dev, f, name, args, |func, ptrs| {
        // SAFETY: the argument list matches the kernel's parameters (each call site passes the
        // types of the kernel's signature in kernels/*.cu), and every pointer is a live buffer of
        // this device whose size covers the indices the kernel touches.
        unsafe {
            cudarc::driver::result::launch_kernel(
                func,
                (grid.blocks, 1, 1),
                (grid.threads, 1, 1),
                0,
                super::side_stream::current(dev),
                ptrs,
            )
        }
    })?
    .map_err(|e| cuda_err(&format!("launching {name} ({}.cu)", f.name()), e))
}

/// A cooperative launch (every block resident at once, or an error): for kernels whose blocks
/// wait for each other. `shared` bytes of dynamic shared memory per block.
pub(crate) fn launch_cooperative(
    dev: &CudaDevice,
    f: Family,
    name: &str,
    grid: Grid,
    shared: u32,
    args: Args,
) -> Result<()> {
    with_kernel(dev, f, name, args, |func, ptrs| {
        // SAFETY: as in `launch_kernel`; the caller raised the function's dynamic shared memory
        // limit to at least `shared`.
        unsafe {
            cudarc::driver::result::launch_cooperative_kernel(
                func,
                (grid.blocks, 1, 1),
                (grid.threads, 1, 1),
                shared,
                super::side_stream::current(dev),
                ptrs,
            )
        }
    })?
    .map_err(|e| {
        cuda_err(
            &format!(
                "launching {name} ({}.cu, cooperative: {} blocks of {}, {shared} B shared)",
                f.name(),
                grid.blocks,
                grid.threads
            ),
            e,
        )
    })
}

/// `launch!(dev, Family::X, name, grid; arg, arg, ...)`.
macro_rules! launch {
    ($dev:expr, $fam:expr, $name:expr, $grid:expr; $($arg:expr),* $(,)?) => {{
        #[allow(unused_mut)]
        let mut args = $crate::backend::cuda::launch::Args::new();
        $( args.push($arg); )*
        $crate::backend::cuda::launch::launch_kernel(&$dev, $fam, &$name, $grid, args)?;
    }};
}
pub(crate) use launch;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_keep_each_value_in_its_own_aligned_cell() {
        #[repr(C)]
        #[derive(Clone, Copy)]
        struct S {
            a: i64,
            b: [i64; 3],
        }
        let mut a = Args::new();
        a.push(7u64);
        a.push(-3i32);
        a.push(2.5f64);
        a.push(S { a: 1, b: [2, 3, 4] });
        assert_eq!(a.cells.len(), 4);
        assert_eq!(a.cells[0][0], 7);
        assert_eq!(a.cells[1][0] as u32 as i32, -3);
        assert_eq!(f64::from_bits(a.cells[2][0]), 2.5);
        assert_eq!(&a.cells[3][..], &[1, 2, 3, 4]);
        for c in &a.cells {
            assert_eq!(c.as_ptr() as usize % 8, 0);
        }
    }

    #[test]
    fn per_row_grid_is_clamped() {
        assert_eq!(Grid::per_row(0, 256).blocks, 1);
        assert_eq!(Grid::per_row(10, 256).blocks, 10);
        assert_eq!(Grid::per_row(usize::MAX, 256).blocks, 1 << 20);
    }
}
