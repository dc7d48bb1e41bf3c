//! `AlignedBuf`: an owned, zero-initialised heap buffer for O_DIRECT I/O.
//!
//! Invariants (checked at construction, with asserts that stay on in release):
//! - the start address is a multiple of `PAGE_BYTES` (O_DIRECT needs at least `SECTOR_BYTES`;
//!   page alignment also suits the page cache, which stores these buffers as pages);
//! - the length is a positive multiple of `PAGE_BYTES` and never changes;
//! - the memory is always initialised (it starts zeroed), so handing it out as `&[u8]` is sound
//!   even for a read buffer the kernel has not filled yet.
//!
//! The buffer is a raw allocation rather than a `Vec<u8>` because `Vec` cannot promise an
//! alignment larger than its element's, and the device hands the pointer to the kernel.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::limits::PAGE_BYTES;

pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len_bytes: usize,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively (no aliasing pointers are kept anywhere
// else; the device only lends the pointer to the kernel while it also owns the `AlignedBuf`), so
// moving it to another thread is like moving a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only yields `&[u8]` through `Deref`; mutation needs `&mut self`, so
// sharing references across threads is like sharing `&Vec<u8>`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zero-filled buffer of `len_bytes`, which must be a positive multiple of `PAGE_BYTES`.
    pub fn zeroed(len_bytes: usize) -> AlignedBuf {
        let layout = Self::layout(len_bytes);
        // SAFETY: `layout` has a non-zero size (asserted in `layout`).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout);
        };
        // PAGE_BYTES is a power of two (a Layout alignment must be), so a mask tests alignment.
        assert!(ptr.as_ptr() as usize & (PAGE_BYTES - 1) == 0, "allocator broke page alignment");
        AlignedBuf { ptr, len_bytes }
    }

    /// A buffer holding `pages` one after another (each `PAGE_BYTES` long), written once: the
    /// allocation is not zeroed first, as `zeroed` and then a copy would do. A page run's write
    /// (up to `WRITE_PAGES_PER_IO_MAX` pages, the engine's largest buffer) is built this way.
    pub fn from_pages(pages: &[&[u8]]) -> AlignedBuf {
        assert!(pages.iter().all(|page| page.len() == PAGE_BYTES), "a page is not PAGE_BYTES long");
        let len_bytes = pages.len() * PAGE_BYTES;
        let layout = Self::layout(len_bytes);
        // SAFETY: `layout` has a non-zero size (asserted in `layout`).
        let raw = unsafe { alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout);
        };
        assert!(ptr.as_ptr() as usize & (PAGE_BYTES - 1) == 0, "allocator broke page alignment");
        for (index, page) in pages.iter().enumerate() {
            // SAFETY: the destination, `PAGE_BYTES` from `index * PAGE_BYTES` with `index` below
            // `pages.len()`, lies inside the fresh allocation of `len_bytes`, which no one else
            // can see, so it does not overlap `page`; `page` holds `PAGE_BYTES` bytes (asserted).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    page.as_ptr(),
                    ptr.as_ptr().add(index * PAGE_BYTES),
                    PAGE_BYTES,
                )
            };
        }
        // Every byte was written above: the buffer is initialised, as `Deref` requires.
        AlignedBuf { ptr, len_bytes }
    }

    fn layout(len_bytes: usize) -> Layout {
        assert!(
            len_bytes > 0 && len_bytes & (PAGE_BYTES - 1) == 0,
            "AlignedBuf length {len_bytes} is not a positive multiple of {PAGE_BYTES}"
        );
        match Layout::from_size_align(len_bytes, PAGE_BYTES) {
            Ok(layout) => layout,
            Err(_) => panic!("AlignedBuf length {len_bytes} overflows a Layout"),
        }
    }

    pub fn len(&self) -> usize {
        self.len_bytes
    }

    /// Always false (the length is positive); present because `len` is.
    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len_bytes` initialised bytes (zeroed at allocation, or each
        // copied in by `from_pages`) that this
        // value owns for its whole life; the returned borrow is tied to `&self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len_bytes) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` guarantees the borrow is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len_bytes) }
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> AlignedBuf {
        let mut copy = AlignedBuf::zeroed(self.len_bytes);
        copy.copy_from_slice(self);
        copy
    }
}

impl fmt::Debug for AlignedBuf {
    // Only the length: page contents would flood logs and may hold user data.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf").field("len_bytes", &self.len_bytes).finish()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc_zeroed` or `alloc` with exactly this layout (the length never
        // changes after construction), and it is freed only here, once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len_bytes)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_pages_holds_the_pages_in_order() {
        let first = vec![1u8; PAGE_BYTES];
        let second: Vec<u8> = (0..PAGE_BYTES).map(|i| i as u8).collect();
        let buf = AlignedBuf::from_pages(&[&first, &second]);
        assert_eq!(buf.len(), 2 * PAGE_BYTES);
        assert_eq!(buf.as_ptr() as usize % PAGE_BYTES, 0);
        assert_eq!(&buf[..PAGE_BYTES], &first[..]);
        assert_eq!(&buf[PAGE_BYTES..], &second[..]);
    }

    #[test]
    fn zeroed_is_aligned_and_zero() {
        for pages in [1, 2, 3, 16, 257] {
            let buf = AlignedBuf::zeroed(pages * PAGE_BYTES);
            assert_eq!(buf.len(), pages * PAGE_BYTES);
            assert_eq!(buf.as_ptr() as usize % PAGE_BYTES, 0);
            assert!(buf.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn write_read_and_clone_are_independent() {
        let mut buf = AlignedBuf::zeroed(2 * PAGE_BYTES);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let mut copy = buf.clone();
        assert_eq!(&copy[..], &buf[..]);
        assert_ne!(copy.as_ptr(), buf.as_ptr());
        assert_eq!(copy.as_ptr() as usize % PAGE_BYTES, 0);
        copy[5] ^= 0xff;
        assert_eq!(buf[5], 5);
        assert_eq!(copy[5], 5 ^ 0xff);
        assert_eq!(buf[PAGE_BYTES + 7], ((PAGE_BYTES + 7) % 251) as u8);
    }

    #[test]
    fn debug_prints_only_length() {
        let mut buf = AlignedBuf::zeroed(PAGE_BYTES);
        buf[0] = 0xab;
        let text = format!("{buf:?}");
        assert_eq!(text, "AlignedBuf { len_bytes: 4096 }");
    }

    #[test]
    fn moves_across_threads() {
        let mut buf = AlignedBuf::zeroed(PAGE_BYTES);
        buf[100] = 42;
        let back = std::thread::spawn(move || {
            assert_eq!(buf[100], 42);
            buf[101] = 43;
            buf
        })
        .join()
        .unwrap();
        assert_eq!((back[100], back[101]), (42, 43));
    }

    #[test]
    #[should_panic(expected = "not a positive multiple")]
    fn rejects_unaligned_length() {
        let _ = AlignedBuf::zeroed(PAGE_BYTES + 512);
    }

    #[test]
    #[should_panic(expected = "not a positive multiple")]
    fn rejects_zero_length() {
        let _ = AlignedBuf::zeroed(0);
    }
}
