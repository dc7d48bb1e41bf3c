//! A counting global allocator for tests and benchmarks that measure the memory a structure
//! claims to use (`tests/index_memory.rs`, `examples/index_bench.rs`). A target installs it with
//! `#[global_allocator] static GLOBAL: CountingAllocator = CountingAllocator;` and reads
//! `allocated_bytes()` before and after. The count is process-wide: measurements in one process
//! must take turns. Behind the `testing` feature; the store never uses it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

static ALLOCATED_BYTES: AtomicIsize = AtomicIsize::new(0);

/// Forwards every call to the system allocator and counts the bytes outstanding.
pub struct CountingAllocator;

// SAFETY: forwards to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same layout as the caller's request.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        ALLOCATED_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Bytes allocated and not yet freed through the counting allocator, process-wide.
pub fn allocated_bytes() -> isize {
    ALLOCATED_BYTES.load(Ordering::Relaxed)
}
