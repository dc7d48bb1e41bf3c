//! A counting global allocator for tests and benchmarks that measure the memory a structure
//! claims to use (`tests/index_memory.rs`, `examples/index_bench.rs`). A target installs it with
//! `#[global_allocator] static GLOBAL: CountingAllocator = CountingAllocator;` and reads
//! `allocated_bytes()` before and after. That count is process-wide: measurements in one process
//! must take turns. `thread_allocated_bytes()` counts what the calling thread allocated minus what
//! it freed, so a unit test can measure its own structure while other tests run beside it (the
//! library's unit tests run under this allocator). Behind the `testing` feature; the store never
//! uses it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};

static ALLOCATED_BYTES: AtomicIsize = AtomicIsize::new(0);

thread_local! {
    // Const-initialised and without a destructor: usable inside the allocator (no allocation,
    // and still valid while the thread is torn down).
    static THREAD_BYTES: Cell<isize> = const { Cell::new(0) };
}

fn count_in_thread(bytes: isize) {
    // `try_with`: a thread past its locals' teardown is simply not counted.
    let _ = THREAD_BYTES.try_with(|count| count.set(count.get() + bytes));
}

/// Forwards every call to the system allocator and counts the bytes outstanding.
pub struct CountingAllocator;

// SAFETY: forwards to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        count_in_thread(layout.size() as isize);
        // SAFETY: same layout as the caller's request.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        ALLOCATED_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        count_in_thread(-(layout.size() as isize));
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Bytes allocated and not yet freed through the counting allocator, process-wide.
pub fn allocated_bytes() -> isize {
    ALLOCATED_BYTES.load(Ordering::Relaxed)
}

/// Bytes this thread allocated minus the bytes it freed (a block freed by another thread than
/// the one that allocated it counts there).
pub fn thread_allocated_bytes() -> isize {
    THREAD_BYTES.with(Cell::get)
}
