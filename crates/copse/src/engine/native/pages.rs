//! The pages of in-page classes as the engine holds them (`Pages`): their images in the page
//! cache, the reads of pages under way with who waits for each, the pages modified since their
//! last write, and the pages with a write in flight. Then what the engine does when a page it
//! waited for arrives (`impl NativeEngine`: `wait_slot`, `page_loaded`).
//!
//! Invariants:
//! - At most one write per page is in flight (invariant 3 of `mod.rs`): a page joins
//!   `in_flight` when its write is queued and leaves it when that write completes, both
//!   asserted (`begin_write`, `end_write`). Modifications made meanwhile wait in `dirty` for the
//!   next write (`writable_runs` leaves pages in flight out).
//! - A page in `dirty` or `in_flight` is pinned in the cache (pinned by `mark_dirty`, unpinned
//!   by `end_write` or when a poisoned store drops the write), so its newest image, which only
//!   memory holds, is never evicted and never replaced by an older one read from the device
//!   (`page_loaded` asserts that a page read finds no image cached).
//! - A page has at most one read under way: the first waiter of a page starts it, later ones
//!   join `loading` (`wait`). One read may load several adjacent pages (a packed slot crossing
//!   a page boundary, both missing; a scan's run of consecutive pages, `load_page_runs`); each
//!   of them is in `loading` until it completes.
//! - A slot crossing a page is read and written only with both its pages cached. While a waiter
//!   waits for one, the other, if cached, is pinned until the waiter has run (`companions`), so
//!   that the waiter finds both and every wait makes progress however small the cache.

use std::borrow::Cow;

use super::cache::{FrameId, PageCache, PageKey};
use super::format::{Loc, SizeClass, SlotSpan};
use super::index::Entry;
use super::{IoPurpose, NativeEngine, WriteId};
use crate::device::{AlignedBuf, DeviceError, IoCompletion, IoKind};
use crate::engine::Reply;
use crate::error::{ReadError, WriteError};
use crate::hash::{HashMap, HashSet};
use crate::limits::{PAGE_BYTES, READ_PAGES_PER_IO_MAX, WRITE_PAGES_PER_IO_MAX};

/// An in-page slot's bytes from the page cache (`Pages::read_slot`).
pub(super) struct CachedSlot<'a> {
    pub(super) bytes: Cow<'a, [u8]>,
    /// The record in these bytes passed its checksums since they last changed: what a check
    /// of it would compute again is known (`PageCache`'s marks).
    pub(super) verified: bool,
    /// Where to mark it verified once checked.
    pub(super) mark: SlotMark,
}

/// A record's place among the page cache's marks (`Pages::mark_verified`).
#[derive(Clone, Copy, Debug)]
pub(super) struct SlotMark {
    frame: FrameId,
    offset: usize,
    /// The slot crosses into the next page.
    crosses: bool,
}

/// Who waits for a page image being read.
pub(super) enum PageWaiter {
    Place { write: WriteId, record: Vec<u8> },
    /// `entry`: the index's, looked up when its index `changes` count was this.
    Get { key: Vec<u8>, reply: Reply<Option<Vec<u8>>, ReadError>, entry: Entry, changes: u64 },
    ScanItem { scan: u64, item: usize },
    MultiGetItem { multi_get: u64, item: usize },
    ChainPop { class: u8, chain: usize, slot: u64 },
}

pub(super) struct Pages {
    /// For messages.
    shard_id: u32,
    pub(super) cache: PageCache,
    /// Pages being read, and who waits for each.
    loading: HashMap<PageKey, Vec<PageWaiter>>,
    /// Pages pinned until the read of a page (the key) has run its waiters: the cached pages of
    /// a slot crossing a page boundary whose other page is being read, so that the waiter
    /// finds every page of the slot when it runs (evicted meanwhile, it would read it again,
    /// and in a small cache could go on doing so for ever).
    companions: HashMap<PageKey, Vec<PageKey>>,
    /// Pages with modifications not yet submitted, and the writes those modifications carry.
    dirty: HashMap<PageKey, Vec<WriteId>>,
    /// The writes `dirty` carries, over all its pages (a write spanning two pages counts twice).
    dirty_writes: usize,
    /// Pages with a write in flight (invariant 3).
    in_flight: HashSet<PageKey>,
    /// One-page buffers of reads and writes that completed, kept for the next ones (up to
    /// `SPARE_BUFFERS_MAX`). Besides saving an allocation per I/O, this keeps the buffers with
    /// the shard: a caller running the shard's turn (flat combining) would otherwise allocate
    /// them in its own thread's heap, to be freed by the shard's thread, and an allocator that
    /// caches such frees per thread then holds far more than the store uses
    /// (docs/benchmarks.md, "Flat combining").
    spare_buffers: Vec<AlignedBuf>,
    /// Where `read_slot` joins the two parts of a slot crossing a page boundary.
    crossing_scratch: Vec<u8>,
}

/// One-page I/O buffers a shard keeps for reuse: about a round's worth (a shard has no more
/// than its I/O depth in flight).
const SPARE_BUFFERS_MAX: usize = 64;

impl Pages {
    pub(super) fn new(shard_id: u32, cache_pages: usize) -> Pages {
        Pages {
            shard_id,
            cache: PageCache::new(cache_pages),
            loading: HashMap::default(),
            companions: HashMap::default(),
            dirty: HashMap::default(),
            dirty_writes: 0,
            in_flight: HashSet::default(),
            spare_buffers: Vec::new(),
            crossing_scratch: Vec::new(),
        }
    }

    /// A zeroed page buffer for a read: a kept one (zeroed again, so that a short or failed
    /// read never shows an earlier page's bytes) or a new one.
    fn read_buffer(&mut self) -> AlignedBuf {
        match self.spare_buffers.pop() {
            Some(mut buf) => {
                buf.fill(0);
                buf
            }
            None => AlignedBuf::zeroed(PAGE_BYTES),
        }
    }

    /// A buffer holding a copy of the cached image of `page`, for its write.
    pub(super) fn write_buffer(&mut self, page: PageKey) -> AlignedBuf {
        let image = self.cache.image(page).expect("dirty pages are pinned");
        match self.spare_buffers.pop() {
            Some(mut buf) => {
                buf.copy_from_slice(image);
                buf
            }
            None => AlignedBuf::from_pages(&[image]),
        }
    }

    /// An I/O's buffer, done with: kept for a later one if it is one page and there is room.
    pub(super) fn keep_buffer(&mut self, buf: AlignedBuf) {
        if buf.len() == PAGE_BYTES && self.spare_buffers.len() < SPARE_BUFFERS_MAX {
            self.spare_buffers.push(buf);
        }
    }

    /// The page an in-page slot starts in.
    pub(super) fn page_of(loc: Loc) -> PageKey {
        let class = SizeClass::get(loc.class());
        (loc.class(), class.page_of_slot(loc.slot()))
    }

    /// The bytes of the in-page slot of `class` that lies at `span`, if every page it spans is
    /// cached, counting a cache hit or miss as a read does; else the first page missing.
    /// Borrowed from the page's image, or copied from both for a packed slot crossing a page
    /// boundary. (The reader has the span already: the read path computes it once.)
    pub(super) fn read_slot(
        &mut self,
        class: SizeClass,
        span: SlotSpan,
    ) -> Result<CachedSlot<'_>, PageKey> {
        let slot_bytes = class.slot_bytes as usize;
        let first = self.cache.find((class.id, span.first_page)).ok_or((class.id, span.first_page))?;
        let crosses = span.pages > 1;
        let mark = SlotMark { frame: first, offset: span.offset, crosses };
        let verified = self.cache.is_verified(first, span.offset, crosses);
        if !crosses {
            let image = self.cache.frame_image(first);
            let bytes = Cow::Borrowed(&image[span.offset..span.offset + slot_bytes]);
            return Ok(CachedSlot { bytes, verified, mark });
        }
        let second = (class.id, span.first_page + 1);
        let second = self.cache.find(second).ok_or(second)?;
        // The two parts joined in a buffer kept for the next crossing slot, not a new one.
        let scratch = &mut self.crossing_scratch;
        scratch.clear();
        let (head, tail) = (self.cache.frame_image(first), self.cache.frame_image(second));
        join_crossing(head, tail, span.offset, slot_bytes, scratch);
        Ok(CachedSlot { bytes: Cow::Borrowed(&scratch[..]), verified, mark })
    }

    /// Marks the slot `read_slot` gave as verified: its checksums held over its bytes as they
    /// are (the cache has not changed since).
    pub(super) fn mark_verified(&mut self, mark: SlotMark) {
        self.cache.mark_verified(mark.frame, mark.offset, mark.crosses);
    }

    /// The bytes of the in-page slot at `loc` from the cached images (no hit or miss counted),
    /// if every page it spans is cached.
    pub(super) fn slot_image(&self, loc: Loc) -> Option<Cow<'_, [u8]>> {
        let class = SizeClass::get(loc.class());
        self.span_image(class, class.span(loc.slot()))
    }

    fn span_image(&self, class: SizeClass, span: SlotSpan) -> Option<Cow<'_, [u8]>> {
        let slot_bytes = class.slot_bytes as usize;
        let first = self.cache.image((class.id, span.first_page))?;
        if span.pages == 1 {
            return Some(Cow::Borrowed(&first[span.offset..span.offset + slot_bytes]));
        }
        let second = self.cache.image((class.id, span.first_page + 1))?;
        let mut bytes = Vec::with_capacity(slot_bytes);
        join_crossing(first, second, span.offset, slot_bytes, &mut bytes);
        Some(Cow::Owned(bytes))
    }

    /// Whether the page has a write queued or in flight (its device bytes may be mid-change).
    pub(super) fn busy(&self, page: PageKey) -> bool {
        self.dirty.contains_key(&page) || self.in_flight.contains(&page)
    }

    /// No page has modifications waiting for a write.
    pub(super) fn is_clean(&self) -> bool {
        self.dirty.is_empty()
    }

    pub(super) fn is_loading(&self, page: PageKey) -> bool {
        self.loading.contains_key(&page)
    }

    /// Registers a waiter for a page being read, or to be read; returns whether it is the
    /// first (then the caller starts the read).
    fn wait(&mut self, page: PageKey, waiter: PageWaiter) -> bool {
        let first = !self.loading.contains_key(&page);
        self.loading.entry(page).or_default().push(waiter);
        first
    }

    /// Joins a read under way (`is_loading`).
    pub(super) fn join_read(&mut self, page: PageKey, waiter: PageWaiter) {
        let first = self.wait(page, waiter);
        assert!(!first, "joined a page read that is not under way");
    }

    /// A modification of `page` carried by `write` was made in its cached image: the page
    /// joins the next round's writes (pinned until written).
    pub(super) fn mark_dirty(&mut self, page: PageKey, write: WriteId) {
        self.dirty_writes += 1;
        match self.dirty.get_mut(&page) {
            Some(writes) => writes.push(write),
            None => {
                self.cache.pin(page);
                self.dirty.insert(page, vec![write]);
            }
        }
    }

    /// The dirty pages without a write in flight (invariant 3), in runs of consecutive pages of
    /// a file, each of up to `WRITE_PAGES_PER_IO_MAX` pages, to be written with one I/O each.
    pub(super) fn writable_runs(&self) -> Vec<Vec<PageKey>> {
        let mut ready: Vec<PageKey> =
            self.dirty.keys().filter(|page| !self.in_flight.contains(*page)).copied().collect();
        ready.sort_unstable();
        let mut runs = Vec::new();
        let mut start = 0;
        while start < ready.len() {
            let mut end = start + 1;
            while end < ready.len()
                && end - start < WRITE_PAGES_PER_IO_MAX
                && ready[end] == (ready[start].0, ready[start].1 + (end - start) as u64)
            {
                end += 1;
            }
            runs.push(ready[start..end].to_vec());
            start = end;
        }
        runs
    }

    /// Takes the writes a dirty page's modifications carry (the page stays pinned).
    pub(super) fn take_dirty(&mut self, page: PageKey) -> Vec<WriteId> {
        let writes = self.dirty.remove(&page).expect("listed as dirty");
        self.dirty_writes -= writes.len();
        writes
    }

    /// The writes the dirty pages carry (a write spanning two pages counts twice).
    pub(super) fn dirty_writes(&self) -> usize {
        self.dirty_writes
    }

    /// A write of `page` is being queued. Invariant 3: it has no other write in flight.
    pub(super) fn begin_write(&mut self, page: PageKey) {
        assert!(
            !self.dirty.contains_key(&page),
            "shard {}: page {page:?} written with modifications left behind",
            self.shard_id
        );
        let first_write = self.in_flight.insert(page);
        assert!(first_write, "shard {}: page {page:?} written twice at once", self.shard_id);
    }

    /// The write of `page` completed (or failed): the page may be written again, and evicted.
    pub(super) fn end_write(&mut self, page: PageKey) {
        let was_in_flight = self.in_flight.remove(&page);
        assert!(was_in_flight, "a page write completed that was not in flight");
        self.cache.unpin(page);
    }
}

/// Appends to `out` the `slot_bytes` of a slot that starts at `offset` of the page image
/// `first` and ends in the next page's, `second`.
fn join_crossing(first: &[u8], second: &[u8], offset: usize, slot_bytes: usize, out: &mut Vec<u8>) {
    out.extend_from_slice(&first[offset..]);
    out.extend_from_slice(&second[..slot_bytes - (PAGE_BYTES - offset)]);
}

impl NativeEngine {
    /// Registers a waiter for the pages of the in-page slot at `loc`, some of which are not
    /// cached: it joins a read of one under way, else one read of every missing page starts
    /// (at most two, and adjacent). The waiter runs once that page is loaded, and looks again.
    pub(super) fn wait_slot(&mut self, loc: Loc, waiter: PageWaiter) {
        let span = SizeClass::get(loc.class()).span(loc.slot());
        let missing: Vec<PageKey> = span
            .page_numbers()
            .map(|number| (loc.class(), number))
            .filter(|&page| !self.pages.cache.contains(page))
            .collect();
        assert!(!missing.is_empty(), "waited for the pages of {loc:?}, all cached");
        let awaited = match missing.iter().position(|&page| self.pages.is_loading(page)) {
            Some(loading) => {
                self.pages.join_read(missing[loading], waiter);
                for &page in &missing {
                    if !self.pages.is_loading(page) {
                        self.load_pages(page, 1, None);
                    }
                }
                missing[loading]
            }
            None => {
                self.load_pages(missing[0], missing.len() as u64, Some(waiter));
                missing[0]
            }
        };
        for page in span.page_numbers().map(|number| (loc.class(), number)) {
            if self.pages.cache.contains(page) {
                self.pages.cache.pin(page);
                self.pages.companions.entry(awaited).or_default().push(page);
            }
        }
    }

    /// Starts reads of those of `pages` that are neither cached nor being read, one read per run
    /// of consecutive pages (at most `READ_PAGES_PER_IO_MAX`), so that a scan of items lying
    /// side by side reads them with a few large reads instead of one per page. Its waiters then
    /// join the reads (`wait_slot`).
    pub(super) fn load_page_runs(&mut self, mut pages: Vec<PageKey>) {
        pages.sort_unstable();
        pages.dedup();
        pages.retain(|&page| !self.pages.cache.contains(page) && !self.pages.is_loading(page));
        let mut run_start = 0;
        for next in 1..=pages.len() {
            let run_ends = next == pages.len()
                || pages[next] != (pages[next - 1].0, pages[next - 1].1 + 1)
                || next - run_start == READ_PAGES_PER_IO_MAX;
            if run_ends {
                self.load_pages(pages[run_start], (next - run_start) as u64, None);
                run_start = next;
            }
        }
    }

    /// Starts one read of `count` consecutive pages from `first`, none cached or being read.
    fn load_pages(&mut self, first: PageKey, count: u64, waiter: Option<PageWaiter>) {
        for number in first.1..first.1 + count {
            let page = (first.0, number);
            assert!(!self.pages.is_loading(page) && !self.pages.cache.contains(page));
            self.pages.loading.insert(page, Vec::new());
        }
        if let Some(waiter) = waiter {
            self.pages.join_read(first, waiter);
        }
        let buf = if count == 1 {
            self.pages.read_buffer()
        } else {
            AlignedBuf::zeroed(count as usize * PAGE_BYTES)
        };
        let file = self.slabs.file_of(first.0);
        self.io.queue(
            IoKind::Read,
            file,
            first.1 * PAGE_BYTES as u64,
            buf,
            IoPurpose::PageLoad { page: first, pages: count },
        );
    }

    /// A read of `pages` pages from `first` completed: their images are cached, then whoever
    /// waited for any of them runs.
    pub(super) fn page_loaded(&mut self, first: PageKey, pages: u64, completion: IoCompletion) {
        let numbers = first.1..first.1 + pages;
        let mut waiters = Vec::new();
        let mut companions = Vec::new();
        for number in numbers.clone() {
            let page = (first.0, number);
            waiters.extend(self.pages.loading.remove(&page).unwrap_or_default());
            companions.extend(self.pages.companions.remove(&page).unwrap_or_default());
        }
        if let Err(err) = completion.result {
            tracing::error!(shard = self.shard_id, ?first, pages, %err, "page read failed");
            for waiter in waiters {
                self.page_waiter_failed(waiter, &err);
            }
            self.pages.keep_buffer(completion.buf);
            for page in companions {
                self.pages.cache.unpin(page);
            }
            return;
        }
        let cache = &mut self.pages.cache;
        for (index, number) in numbers.clone().enumerate() {
            let page = (first.0, number);
            assert!(!cache.contains(page), "a page was read while a newer image was cached");
            cache.insert(page, &completion.buf[index * PAGE_BYTES..(index + 1) * PAGE_BYTES]);
            // Pin while the waiters run so that a waiter's own page reads cannot evict it.
            cache.pin(page);
        }
        self.pages.keep_buffer(completion.buf);
        for waiter in waiters {
            self.run_page_waiter(waiter);
        }
        for number in numbers {
            self.pages.cache.unpin((first.0, number));
        }
        for page in companions {
            self.pages.cache.unpin(page);
        }
    }

    fn run_page_waiter(&mut self, waiter: PageWaiter) {
        match waiter {
            PageWaiter::Place { write, record } => self.place_in_pages(record, write),
            PageWaiter::Get { key, reply, entry, changes } => {
                self.get_after_pages(key, reply, entry, changes)
            }
            PageWaiter::ScanItem { scan, item } => self.scan_item(scan, item),
            PageWaiter::MultiGetItem { multi_get, item } => self.multi_get_item(multi_get, item),
            PageWaiter::ChainPop { class, chain, slot } => self.pop_chain_head(class, chain, slot),
        }
    }

    fn page_waiter_failed(&mut self, waiter: PageWaiter, err: &DeviceError) {
        match waiter {
            PageWaiter::Place { write, .. } => {
                self.write_failed(write, WriteError::from_device(err.clone()))
            }
            PageWaiter::Get { reply, .. } => {
                let _ = reply.send(Err(ReadError::Device(err.clone())));
            }
            PageWaiter::ScanItem { scan, .. } => {
                self.scan_item_failed(scan, ReadError::Device(err.clone()))
            }
            PageWaiter::MultiGetItem { multi_get, .. } => {
                self.multi_get_finished(multi_get, Err(ReadError::Device(err.clone())))
            }
            PageWaiter::ChainPop { class, chain, .. } => {
                self.slabs.free[class as usize].abort(chain)
            }
        }
    }
}
