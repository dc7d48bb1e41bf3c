//! The online scrub: verifies what the device holds, not what the cache remembers, while the
//! shard keeps serving.
//!
//! Two passes, each paced to `SCRUB_READS_IN_FLIGHT_MAX` reads at a time so that foreground
//! requests keep the rest of the queue depth:
//! 1. Pages: every page of every slab file of an in-page class, up to the file's frontier (pages
//!    past it were never written), and every slab header. Each slot is decoded exactly as
//!    recovery decodes it; a slot that does not verify (checksum, location, reserved bits) is a
//!    problem. This finds bit rot and misdirected writes anywhere in those files, free slots and
//!    stale copies included.
//! 2. Items: every index entry, in key order, read from the device (the record's pages only) and
//!    checked as a read checks it: checksum, kind, key, and the seq the index expects. This finds
//!    rot in multi-page records and writes the device acknowledged but did not store (a lost
//!    write leaves an older record, or something else, where the index points).
//!
//! Invariants:
//! - A page with a write queued or in flight is not judged: its device bytes may be mid-change.
//!   It is read later (a page is retried until it is quiet, and a page that a write starts on
//!   while the scrub reads it is read again), so every page is judged on bytes no write touched
//!   during the read.
//! - An item is judged only if, when its read completes, the index still points at the same slot
//!   with the same seq: a live record is never overwritten (its slot is written only after the
//!   index moved away), so its bytes on the device are stable for as long as the entry stands.
//! - A scrub changes nothing: it only reads, and it never inserts into the page cache.

use std::ops::Bound;

use super::format::{decode_slot, Loc, SizeClass, CLASS_COUNT};
use super::recovery::check_slab_header;
use super::{IoPurpose, NativeEngine, PageKey};
use crate::device::{AlignedBuf, IoCompletion, IoKind};
use crate::engine::{Reply, ScrubReport};
use crate::error::ReadError;
use crate::hash::HashMap;
use crate::limits::{PAGE_BYTES, SCRUB_ITEMS_PER_STEP_MAX, SCRUB_READS_IN_FLIGHT_MAX};

pub(super) struct Scrub {
    report: ScrubReport,
    replies: Vec<Reply<ScrubReport, ReadError>>,
    /// Pass 1's cursor: the next (class, page) to read.
    next_page: Option<PageKey>,
    /// Pages that were busy (a write queued or in flight) when their turn came, or that a write
    /// started on during their read.
    retry: Vec<PageKey>,
    /// Pages being read, and whether a write started on them meanwhile.
    reading: HashMap<PageKey, bool>,
    /// Pass 2's cursor.
    next_item: ItemCursor,
    /// Items waiting for a read slot, in key order.
    items: Vec<(Box<[u8]>, Loc, u64)>,
    reads_in_flight: usize,
}

/// Where the item pass stands in the index.
enum ItemCursor {
    Start,
    After(Box<[u8]>),
    Done,
}

/// What a scrub read is for.
pub(super) enum ScrubRead {
    Page(PageKey),
    Item { key: Box<[u8]>, loc: Loc, seq: u64 },
}

impl NativeEngine {
    pub(super) fn scrub(&mut self, reply: Reply<ScrubReport, ReadError>) {
        if let Some(scrub) = &mut self.scrub {
            scrub.replies.push(reply);
            return;
        }
        self.scrub = Some(Scrub {
            report: ScrubReport::default(),
            replies: vec![reply],
            next_page: Some((0, 0)),
            retry: Vec::new(),
            reading: HashMap::default(),
            next_item: ItemCursor::Start,
            items: Vec::new(),
            reads_in_flight: 0,
        });
    }

    /// A page write is being queued: a scrub read of the page under way must not judge it.
    pub(super) fn scrub_page_written(&mut self, page: PageKey) {
        let Some(scrub) = self.scrub.as_mut() else { return };
        // A packed page's read also holds the page after it (its last slot may cross into it).
        let before = (page.0, page.1.wrapping_sub(1));
        for read in [page, before] {
            if let Some(disturbed) = scrub.reading.get_mut(&read) {
                *disturbed = true;
            }
        }
    }

    /// Queues the scrub's next reads, within its share of the queue depth. Called each round.
    pub(super) fn scrub_step(&mut self) {
        let Some(mut scrub) = self.scrub.take() else { return };
        while scrub.reads_in_flight < SCRUB_READS_IN_FLIGHT_MAX {
            let Some(read) = self.next_scrub_read(&mut scrub) else { break };
            let (file, offset, bytes) = match &read {
                ScrubRead::Page(page) => {
                    scrub.reading.insert(*page, false);
                    let file = self.slabs.file(page.0).expect("listed file").file;
                    (file, page.1 * PAGE_BYTES as u64, scrub_read_pages(*page) * PAGE_BYTES)
                }
                ScrubRead::Item { loc, .. } => {
                    let (file, offset) = self.slabs.slot_position(*loc);
                    (file, offset, self.slabs.pages_to_read(*loc) * PAGE_BYTES)
                }
            };
            scrub.reads_in_flight += 1;
            self.io.queue(
                IoKind::Read,
                file,
                offset,
                AlignedBuf::zeroed(bytes),
                IoPurpose::ScrubRead(read),
            );
        }
        let done = scrub.reads_in_flight == 0
            && scrub.next_page.is_none()
            && scrub.retry.is_empty()
            && scrub.items.is_empty()
            && matches!(scrub.next_item, ItemCursor::Done);
        if done {
            for reply in scrub.replies {
                let _ = reply.send(Ok(scrub.report.clone()));
            }
            return;
        }
        self.scrub = Some(scrub);
    }

    fn next_scrub_read(&mut self, scrub: &mut Scrub) -> Option<ScrubRead> {
        while let Some(page) = scrub.next_page {
            scrub.next_page = self.page_after(page);
            let Some(file) = self.slabs.file(page.0) else { continue };
            if page.1 >= file.frontier_page.max(1) {
                continue;
            }
            if self.scrub_page_busy(page) {
                scrub.retry.push(page);
                continue;
            }
            return Some(ScrubRead::Page(page));
        }
        // Busy pages, once their writes are done (and a rewrite of a quiet page counts once).
        if let Some(at) = scrub.retry.iter().position(|page| !self.scrub_page_busy(*page)) {
            let page = scrub.retry.swap_remove(at);
            return Some(ScrubRead::Page(page));
        }
        if !scrub.retry.is_empty() {
            return None;
        }
        if scrub.items.is_empty() && !matches!(scrub.next_item, ItemCursor::Done) {
            let start = match &scrub.next_item {
                ItemCursor::After(key) => Bound::Excluded(&key[..]),
                _ => Bound::Unbounded,
            };
            let batch = self.index.range(start, Bound::Unbounded, SCRUB_ITEMS_PER_STEP_MAX);
            scrub.next_item = match batch.last() {
                Some((key, _)) if batch.len() == SCRUB_ITEMS_PER_STEP_MAX => {
                    ItemCursor::After(key.clone())
                }
                _ => ItemCursor::Done,
            };
            // Reversed so that popping takes them in key order.
            scrub.items =
                batch.into_iter().rev().map(|(key, entry)| (key, entry.loc, entry.seq)).collect();
        }
        let (key, loc, seq) = scrub.items.pop()?;
        Some(ScrubRead::Item { key, loc, seq })
    }

    /// The page pass visits in-page classes only: a multi-page slot is one record, checked in
    /// the item pass when live (free multi-page slots are not read).
    fn page_after(&self, (class, page): PageKey) -> Option<PageKey> {
        let mut class = class as usize;
        let mut next = page + 1;
        loop {
            if let Some(file) = self.slabs.file(class as u8) {
                let in_page = !SizeClass::get(class as u8).is_multi_page();
                if next < file.frontier_page.max(1) && (in_page || next == 0) {
                    return Some((class as u8, next));
                }
            }
            class += 1;
            next = 0;
            if class >= CLASS_COUNT {
                return None;
            }
        }
    }

    pub(super) fn scrub_read_done(&mut self, read: ScrubRead, completion: IoCompletion) {
        let Some(mut scrub) = self.scrub.take() else {
            unreachable!("a scrub read completes while its scrub runs");
        };
        scrub.reads_in_flight -= 1;
        match read {
            ScrubRead::Page(page) => {
                let disturbed = scrub.reading.remove(&page).unwrap_or(false);
                match completion.result {
                    Err(err) => scrub.report.problem(format!(
                        "shard {} class {} page {}: read failed: {err}",
                        self.shard_id, page.0, page.1
                    )),
                    Ok(()) if disturbed || self.scrub_page_busy(page) => {
                        scrub.report.pages_reread += 1;
                        scrub.retry.push(page);
                    }
                    Ok(()) => {
                        scrub.report.pages_checked += 1;
                        self.scrub_judge_page(page, &completion.buf, &mut scrub.report);
                    }
                }
            }
            ScrubRead::Item { key, loc, seq } => {
                let still = self.index.entry(&key).is_some_and(|e| e.loc == loc && e.seq == seq);
                match completion.result {
                    // Rewritten or deleted meanwhile: the new record is judged by the next scrub.
                    _ if !still => {}
                    Err(err) => scrub.report.problem(format!(
                        "shard {} item at {loc:?}: read failed: {err}",
                        self.shard_id
                    )),
                    Ok(()) => {
                        scrub.report.items_checked += 1;
                        // An in-page item was read with its whole page.
                        let offset = SizeClass::get(loc.class()).offset_in_page(loc.slot());
                        let bytes = &completion.buf[offset..];
                        if let Err(err) = self.verify_item(bytes, loc, &key, seq) {
                            scrub.report.problem(format!("item {}: {err}", show_key(&key)));
                        }
                    }
                }
            }
        }
        self.scrub = Some(scrub);
    }

    fn scrub_judge_page(&self, (class, page): PageKey, bytes: &[u8], report: &mut ScrubReport) {
        let info = SizeClass::get(class);
        if page == 0 {
            if let Err(what) = check_slab_header(bytes, info, self.shard_id) {
                report
                    .problem(format!("shard {} class {class} slab header: {what}", self.shard_id));
            }
            return;
        }
        let layout = self.slabs.layout_of(class);
        for slot in info.slots_starting_in_page(page) {
            let offset = info.offset_in_page(slot);
            let loc = Loc::new(class, slot, 0);
            let slot_bytes = &bytes[offset..offset + info.slot_bytes as usize];
            if let Err(defect) =
                decode_slot(slot_bytes, layout, self.shard_id, loc, info.slot_bytes as usize)
            {
                report.problem(format!(
                    "shard {} class {class} slot {slot} (page {page}): {defect}",
                    self.shard_id
                ));
            }
        }
    }

    /// Whether a page pass read of `page` would meet a write: of the page, or of the page after
    /// it that the read also holds.
    fn scrub_page_busy(&self, page: PageKey) -> bool {
        let pages = scrub_read_pages(page) as u64;
        (page.1..page.1 + pages).any(|number| self.pages.busy((page.0, number)))
    }

    pub(super) fn scrub_running(&self) -> bool {
        self.scrub.is_some()
    }
}

/// Pages a page pass read of `page` takes: the page, and for a packed class the next page of its
/// unit too, where the page's last slot may end (the header page and a unit's last page: one).
fn scrub_read_pages((class, page): PageKey) -> usize {
    let unit_pages = SizeClass::get(class).unit_pages();
    if page == 0 || SizeClass::get(class).is_multi_page() || page % unit_pages == 0 {
        1
    } else {
        2
    }
}

/// A key as a problem report shows it: printable bytes as they are, others escaped.
fn show_key(key: &[u8]) -> String {
    key.escape_ascii().to_string()
}
