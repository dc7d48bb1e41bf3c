//! Per-shard page cache: a fixed pool of 4 KiB frames with CLOCK eviction.
//!
//! Invariants:
//! - A frame holds the newest image of its page: the bytes on disk plus the modifications that
//!   are queued or in flight. Pages with queued or in-flight writes are pinned and never evicted,
//!   so the engine never reads a page from disk while a newer image exists only in memory.
//! - The page map is a hash table sized for the pool's capacity when the cache is made, so it
//!   does not rehash as the cache fills (KVell §5.3 saw 100 ms spikes from a growing hash
//!   table); it can grow only while every frame is pinned and the pool grows past capacity.
//!   It was a B-tree, whose lookup under a GET load cost several cache misses per level
//!   (docs/benchmarks.md, "The server's hot path").
//! - The pool holds `capacity_frames` frames; it grows past that only when every frame is pinned,
//!   and gives the extra frames back as soon as they are unpinned.
//! - A frame's `verified` marks remember which records of its image passed their checksum: bit
//!   `offset / VERIFIED_MARK_BYTES` stands for the record starting at `offset`, lying wholly in
//!   the page, and `crossing_verified` for the one record starting in the page and ending in the
//!   next (a packed class's slot crossing a page boundary). The marks are cleared whenever the
//!   bytes they cover can change: a page's own marks by `insert` and `image_mut` of it, its
//!   crossing mark by those of the next page too. So a mark always describes the bytes as they
//!   are: checking such a record again would compute the same checksums over the same bytes.
//!   The marks save that work on cache hits, as a RocksDB block cache verifies a block when it
//!   is read from its file, not on every hit; what comes from the device is verified before it
//!   is first returned (docs/durability.md, rule 9).

use std::collections::HashMap;

use crate::device::AlignedBuf;
use crate::hash::State;
use crate::limits::PAGE_BYTES;

/// (class id, page number in the class's slab file).
pub type PageKey = (u8, u64);

struct Frame {
    page: Option<PageKey>,
    image: AlignedBuf,
    referenced: bool,
    pins: u32,
    /// Records of the image verified since it last changed (module header).
    verified: u64,
    /// The record crossing into the next page, verified since either image last changed.
    crossing_verified: bool,
}

/// Bytes of a page each `verified` bit stands for. No slot is smaller, so no two records start
/// under one bit.
pub const VERIFIED_MARK_BYTES: usize = PAGE_BYTES / u64::BITS as usize;
const _: () = assert!(VERIFIED_MARK_BYTES == 64);

/// A cached page's frame, as `PageCache::find` gives it: valid until the cache next changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameId(u32);

pub struct PageCache {
    map: HashMap<PageKey, u32, State>,
    frames: Vec<Frame>,
    unused: Vec<u32>,
    capacity_frames: usize,
    clock_hand: usize,
    pub hits: u64,
    pub misses: u64,
}

impl PageCache {
    pub fn new(capacity_frames: usize) -> PageCache {
        assert!(capacity_frames > 0);
        PageCache {
            map: HashMap::with_capacity_and_hasher(capacity_frames, State::default()),
            frames: Vec::new(),
            unused: Vec::new(),
            capacity_frames,
            clock_hand: 0,
            hits: 0,
            misses: 0,
        }
    }

    pub fn contains(&self, page: PageKey) -> bool {
        self.map.contains_key(&page)
    }

    /// The frame of the page, counting a hit or a miss: one probe of the map for a reader that
    /// then wants the image and its marks.
    pub fn find(&mut self, page: PageKey) -> Option<FrameId> {
        match self.map.get(&page) {
            Some(&index) => {
                self.hits += 1;
                self.frames[index as usize].referenced = true;
                Some(FrameId(index))
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// The image of a frame `find` gave (the cache has not changed since).
    pub fn frame_image(&self, frame: FrameId) -> &[u8] {
        &self.frames[frame.0 as usize].image[..]
    }

    /// Whether the record starting at `offset` of the frame's image passed its checksum since
    /// the bytes it covers last changed: wholly inside the image, or if `crosses`, ending in the
    /// next page's.
    pub fn is_verified(&self, frame: FrameId, offset: usize, crosses: bool) -> bool {
        let frame = &self.frames[frame.0 as usize];
        if crosses {
            frame.crossing_verified
        } else {
            frame.verified & verified_bit(offset) != 0
        }
    }

    /// The record starting at `offset` of the frame's image (ending in the next page's if
    /// `crosses`) passed its checksum.
    pub fn mark_verified(&mut self, frame: FrameId, offset: usize, crosses: bool) {
        let frame = &mut self.frames[frame.0 as usize];
        if crosses {
            frame.crossing_verified = true;
        } else {
            frame.verified |= verified_bit(offset);
        }
    }

    /// The bytes of `page` may change: the marks of its records go, and the mark of the record
    /// crossing into it from the page before.
    fn forget_marks(&mut self, page: PageKey, index: u32) {
        let frame = &mut self.frames[index as usize];
        frame.verified = 0;
        frame.crossing_verified = false;
        let Some(before) = page.1.checked_sub(1) else { return };
        if let Some(&index) = self.map.get(&(page.0, before)) {
            self.frames[index as usize].crossing_verified = false;
        }
    }

    /// The page's image for modification (no hit/miss accounting). Its records' marks go: the
    /// caller may change any byte.
    pub fn image_mut(&mut self, page: PageKey) -> Option<&mut [u8]> {
        let index = *self.map.get(&page)?;
        self.forget_marks(page, index);
        let frame = &mut self.frames[index as usize];
        frame.referenced = true;
        Some(&mut frame.image[..])
    }

    pub fn image(&self, page: PageKey) -> Option<&[u8]> {
        let index = *self.map.get(&page)?;
        Some(&self.frames[index as usize].image[..])
    }

    /// Inserts (or replaces) a page image, evicting an unpinned page if the pool is full.
    pub fn insert(&mut self, page: PageKey, bytes: &[u8]) {
        assert_eq!(bytes.len(), PAGE_BYTES);
        if let Some(&index) = self.map.get(&page) {
            self.forget_marks(page, index);
            let frame = &mut self.frames[index as usize];
            frame.image.copy_from_slice(bytes);
            frame.referenced = true;
            return;
        }
        let index = self.take_frame();
        let frame = &mut self.frames[index as usize];
        frame.image.copy_from_slice(bytes);
        frame.page = Some(page);
        frame.referenced = true;
        frame.pins = 0;
        self.map.insert(page, index);
        self.forget_marks(page, index);
    }

    pub fn pin(&mut self, page: PageKey) {
        let index = *self.map.get(&page).expect("pinning a page that is not cached");
        self.frames[index as usize].pins += 1;
    }

    pub fn unpin(&mut self, page: PageKey) {
        let index = *self.map.get(&page).expect("unpinning a page that is not cached");
        let frame = &mut self.frames[index as usize];
        assert!(frame.pins > 0, "unpinning an unpinned page {page:?}");
        frame.pins -= 1;
        if frame.pins == 0 && self.map.len() > self.capacity_frames {
            self.evict_one();
        }
    }

    /// Drops a page from the cache.
    #[cfg(any(test, feature = "testing"))]
    pub fn remove(&mut self, page: PageKey) {
        if let Some(index) = self.map.remove(&page) {
            let frame = &mut self.frames[index as usize];
            frame.page = None;
            frame.pins = 0;
            self.unused.push(index);
        }
    }

    /// Drops every page that is not pinned (whose image is what the disk holds), so that the
    /// next reads of them go to the device.
    #[cfg(any(test, feature = "testing"))]
    pub fn drop_unpinned(&mut self) {
        let pages: Vec<PageKey> = self
            .map
            .iter()
            .filter(|(_, &index)| self.frames[index as usize].pins == 0)
            .map(|(&page, _)| page)
            .collect();
        for page in pages {
            self.remove(page);
        }
    }

    pub fn len_pages(&self) -> usize {
        self.map.len()
    }

    pub fn capacity_frames(&self) -> usize {
        self.capacity_frames
    }

    fn take_frame(&mut self) -> u32 {
        if let Some(index) = self.unused.pop() {
            return index;
        }
        if self.frames.len() < self.capacity_frames || !self.evict_one() {
            // Either the pool is not full yet, or every frame is pinned: grow (given back on
            // unpin).
            self.frames.push(Frame {
                page: None,
                image: AlignedBuf::zeroed(PAGE_BYTES),
                referenced: false,
                pins: 0,
                verified: 0,
                crossing_verified: false,
            });
            return self.frames.len() as u32 - 1;
        }
        self.unused.pop().expect("evict_one freed a frame")
    }

    /// CLOCK: sweep, clearing reference bits, until an unreferenced unpinned frame is found.
    /// Returns false if every frame is pinned.
    fn evict_one(&mut self) -> bool {
        let count = self.frames.len();
        for _ in 0..2 * count {
            let index = self.clock_hand;
            self.clock_hand = (self.clock_hand + 1) % count.max(1);
            let frame = &mut self.frames[index];
            let Some(page) = frame.page else { continue };
            if frame.pins > 0 {
                continue;
            }
            if frame.referenced {
                frame.referenced = false;
                continue;
            }
            frame.page = None;
            self.map.remove(&page);
            self.unused.push(index as u32);
            return true;
        }
        false
    }
}

fn verified_bit(offset: usize) -> u64 {
    assert!(offset < PAGE_BYTES, "a record's offset {offset} lies past its page");
    1 << (offset / VERIFIED_MARK_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(byte: u8) -> Vec<u8> {
        vec![byte; PAGE_BYTES]
    }

    #[test]
    fn evicts_unreferenced_pages_first_and_counts_hits() {
        let mut cache = PageCache::new(2);
        cache.insert((0, 1), &page(1));
        cache.insert((0, 2), &page(2));
        let frame = cache.find((0, 1)).unwrap();
        assert_eq!(cache.frame_image(frame)[0], 1);
        cache.insert((0, 3), &page(3));
        assert_eq!(cache.len_pages(), 2);
        assert!(cache.find((0, 99)).is_none());
        assert_eq!(cache.misses, 1);
        assert!(cache.contains((0, 3)));
    }

    #[test]
    fn pinned_pages_survive_and_the_pool_shrinks_back() {
        let mut cache = PageCache::new(1);
        cache.insert((1, 1), &page(1));
        cache.pin((1, 1));
        cache.insert((1, 2), &page(2));
        assert!(cache.contains((1, 1)), "a pinned page was evicted");
        assert_eq!(cache.len_pages(), 2);
        cache.unpin((1, 1));
        assert_eq!(cache.len_pages(), 1);
    }

    #[test]
    fn replaces_the_image_of_a_cached_page() {
        let mut cache = PageCache::new(4);
        cache.insert((2, 5), &page(1));
        cache.insert((2, 5), &page(7));
        assert_eq!(cache.image((2, 5)).unwrap()[100], 7);
        cache.image_mut((2, 5)).unwrap()[0] = 9;
        assert_eq!(cache.image((2, 5)).unwrap()[0], 9);
    }

    #[test]
    fn a_record_s_mark_lasts_until_its_page_s_image_can_change() {
        let mut cache = PageCache::new(2);
        cache.insert((3, 1), &page(1));
        let frame = cache.find((3, 1)).unwrap();
        assert!(!cache.is_verified(frame, 1088, false));
        cache.mark_verified(frame, 1088, false);
        assert!(cache.is_verified(frame, 1088, false));
        assert!(!cache.is_verified(frame, 0, false), "a mark stands for one record");
        cache.image_mut((3, 1)).unwrap();
        let frame = cache.find((3, 1)).unwrap();
        assert!(!cache.is_verified(frame, 1088, false), "a modified image kept its marks");
        cache.mark_verified(frame, 1088, false);
        cache.insert((3, 1), &page(2));
        let frame = cache.find((3, 1)).unwrap();
        assert!(!cache.is_verified(frame, 1088, false), "a replaced image kept its marks");
        cache.mark_verified(frame, 1088, false);
        // Evicted, then read again: a new image, unverified.
        cache.insert((3, 2), &page(3));
        cache.insert((3, 3), &page(4));
        cache.insert((3, 1), &page(2));
        let frame = cache.find((3, 1)).unwrap();
        assert!(!cache.is_verified(frame, 1088, false), "a reloaded image kept an old frame's marks");
    }

    #[test]
    fn a_crossing_record_s_mark_goes_when_either_of_its_pages_can_change() {
        let mut cache = PageCache::new(4);
        cache.insert((3, 1), &page(1));
        cache.insert((3, 2), &page(2));
        let mark = |cache: &mut PageCache| {
            let frame = cache.find((3, 1)).unwrap();
            cache.mark_verified(frame, 3264, true);
            assert!(cache.is_verified(frame, 3264, true));
            assert!(!cache.is_verified(frame, 3264, false), "the crossing mark is its own");
        };
        let marked = |cache: &mut PageCache| {
            let frame = cache.find((3, 1)).unwrap();
            cache.is_verified(frame, 3264, true)
        };
        mark(&mut cache);
        cache.image_mut((3, 2)).unwrap();
        assert!(!marked(&mut cache), "the next page was modified, the crossing mark stayed");
        mark(&mut cache);
        cache.insert((3, 2), &page(5));
        assert!(!marked(&mut cache), "the next page was replaced, the crossing mark stayed");
        mark(&mut cache);
        cache.image_mut((3, 1)).unwrap();
        assert!(!marked(&mut cache), "its own page was modified, the crossing mark stayed");
        mark(&mut cache);
        cache.insert((3, 3), &page(6));
        cache.insert((4, 2), &page(7));
        assert!(marked(&mut cache), "other pages' changes took the mark");
    }
}
