//! Reads: gets and scans. A read looks the key up in the index, then takes the record from the
//! page cache or reads it (one page for in-page classes, exactly the record's pages for
//! multi-page classes). Every record is verified (checksum, kind, key) before its value is
//! returned; a record that does not verify is reported as corrupt, never returned.
//!
//! Between the lookup and the read's completion the key may be rewritten; the completion looks
//! the key up again and starts over if its location moved, so a read returns the value that was
//! live at some moment between its start and its answer.
//!
//! The checks of a decoded record (checksum, kind, key, seq) answer `Corrupt` rather than assert:
//! the device can break them (rot, lost or misdirected writes). What only an engine bug can
//! break is asserted: an indexed in-page record lies in a page below its file's frontier (the
//! collector and the scrub read nothing past it), checked in `resolve`.
//!
//! A multi-get (`Request::MultiGet`) is one snapshot: its keys are looked up together, at one
//! moment, and each value is taken from the record its entry named then, checked to carry that
//! entry's seq (a key's (key, seq) names one version). A slot freed and reused meanwhile fails
//! that check; if the key's entry has changed since, the multi-get starts over at a new moment,
//! else the record is corrupt and reported.
//!
//! `Scans` holds the scans under way: a scan is in it from its start until it is answered, once,
//! when the last of its items is resolved (`waiting` counts those still out).

use super::numbered::Numbered;
use std::ops::Bound;

use super::format::{
    decode_slot, decode_verified_slot, Loc, RecordKind, SizeClass, Slot, SlotDefect,
};
use super::index::Entry;
use super::pages::{PageWaiter, Pages};
use super::{IoPurpose, NativeEngine};
use crate::device::{AlignedBuf, IoCompletion, IoKind};
use crate::engine::{KeyValue, Reply};
use crate::error::ReadError;
use crate::limits::PAGE_BYTES;

/// Cache lines of a cached record `get_run` prefetches before verifying it (the rest stream in
/// as the checksum reads on).
const RECORD_LINES_PREFETCHED: usize = 4;

/// Where a get's answer goes.
pub(super) type GetReply = Reply<Option<Vec<u8>>, ReadError>;

/// A scanned key and, once read, its value (`None` if it was deleted meanwhile).
pub(super) type ScanItem = (Box<[u8]>, Option<Vec<u8>>);

pub(super) struct ScanState {
    items: Vec<ScanItem>,
    /// Where each item's value was read and verified, for clustering (`cluster.rs`); `None`
    /// until then, and for an item read directly from a multi-page slot.
    read_at: Vec<Option<Entry>>,
    waiting: usize,
    error: Option<ReadError>,
    reply: Option<Reply<Vec<KeyValue>, ReadError>>,
}

/// Where a multi-get's answer goes: one value per key, in the keys' order.
pub(super) type MultiGetReply = Reply<Vec<Option<Vec<u8>>>, ReadError>;

/// A multi-get under way: in `MultiGets` from its start (or restart) until it is answered.
pub(super) struct MultiGetState {
    keys: Vec<Vec<u8>>,
    /// Each key's index entry at the moment the multi-get was looked up.
    entries: Vec<Option<Entry>>,
    values: Vec<Option<Vec<u8>>>,
    /// Keys whose value is not read yet.
    waiting: usize,
    reply: MultiGetReply,
}

/// The multi-gets under way, by id.
pub(super) type MultiGets = Numbered<MultiGetState>;

/// A read of exactly a record's pages (multi-page classes), or of a free chain's head.
pub(super) enum DirectRead {
    Get { key: Vec<u8>, loc: Loc, reply: Reply<Option<Vec<u8>>, ReadError> },
    MultiGetItem { multi_get: u64, item: usize, loc: Loc },
    ScanItem { scan: u64, item: usize, loc: Loc },
    ChainPop { class: u8, chain: usize, slot: u64 },
}

/// Where a key's value is.
enum Resolved {
    Missing,
    Value(Vec<u8>),
    Failed(ReadError),
    /// The record's pages (some not cached) must be read first; the index's entry, and its
    /// `changes` count when it was looked up.
    NeedPages(Entry, u64),
    NeedRead(Loc),
}

/// The scans under way, by id.
pub(super) type Scans = Numbered<ScanState>;

impl NativeEngine {
    fn resolve(&mut self, key: &[u8]) -> Resolved {
        let entry = self.index.entry(key);
        self.resolve_entry(key, entry)
    }

    /// `resolve` of a key whose index entry is `entry` (looked up by the caller).
    fn resolve_entry(&mut self, key: &[u8], entry: Option<Entry>) -> Resolved {
        let Some(Entry { loc, seq }) = entry else { return Resolved::Missing };
        let class = SizeClass::get(loc.class());
        if class.is_multi_page() {
            return Resolved::NeedRead(loc);
        }
        let shard_id = self.shard_id;
        let file = self.slabs.file(loc.class()).expect("an indexed class has a file");
        let span = class.span(loc.slot());
        assert!(
            span.first_page + span.pages <= file.frontier_page,
            "shard {shard_id}: the index points at {loc:?}, in pages {:?} past the frontier {} \
             (never written, as far as the engine knows)",
            span.page_numbers(),
            file.frontier_page
        );
        let layout = file.layout;
        let slot = match self.pages.read_slot(class, span) {
            Ok(slot) => slot,
            Err(_) => return Resolved::NeedPages(Entry { loc, seq }, self.index.changes()),
        };
        let slot_bytes = class.slot_bytes as usize;
        let decoded = if slot.verified {
            decode_verified_slot(&slot.bytes, layout, shard_id, loc, slot_bytes)
        } else {
            decode_slot(&slot.bytes, layout, shard_id, loc, slot_bytes)
        };
        let (verified, mark) = (slot.verified, slot.mark);
        match value_of(decoded, shard_id, loc, key, seq) {
            Ok(value) => {
                // Its checksums held (a value comes only from a record that decoded): not
                // checked again on every hit while its page's image is unchanged.
                if !verified {
                    self.pages.mark_verified(mark);
                }
                Resolved::Value(value)
            }
            Err(err) => Resolved::Failed(err),
        }
    }

    pub(super) fn get(&mut self, key: Vec<u8>, reply: GetReply) {
        let resolved = self.resolve(&key);
        self.answer_get(key, reply, resolved);
    }

    /// A get whose record's pages were read: answered from `entry` if the index has not
    /// changed since it was looked up (`CompactIndex::changes`), else looked up again.
    pub(super) fn get_after_pages(
        &mut self,
        key: Vec<u8>,
        reply: GetReply,
        entry: Entry,
        changes: u64,
    ) {
        if self.index.changes() != changes {
            return self.get(key, reply);
        }
        let resolved = self.resolve_entry(&key, Some(entry));
        self.answer_get(key, reply, resolved);
    }

    /// A run of gets (a round's, or a wave of execs' reads): the same answers as one `get`
    /// each, with their memory accesses overlapped. The index looks every key up together
    /// (`CompactIndex::entries` prefetches slots and blocks for all before searching any), then
    /// the cached records are prefetched before any is verified: a get's cost is its chain of
    /// cache misses, which one at a time are paid in series (docs/benchmarks.md, step 4).
    pub(super) fn get_run(&mut self, gets: Vec<(Vec<u8>, GetReply)>) {
        let keys: Vec<&[u8]> = gets.iter().map(|(key, _)| key.as_slice()).collect();
        let mut entries = Vec::with_capacity(keys.len());
        self.index.entries(&keys, &mut entries);
        for entry in entries.iter().flatten() {
            let class = SizeClass::get(entry.loc.class());
            if class.is_multi_page() {
                continue;
            }
            if let Some(image) = self.pages.cache.image(Pages::page_of(entry.loc)) {
                // The record's first lines, which lie in its first page.
                let offset = class.offset_in_page(entry.loc.slot());
                let record = &image[offset..(offset + class.slot_bytes as usize).min(PAGE_BYTES)];
                for line in record.chunks(64).take(RECORD_LINES_PREFETCHED) {
                    crate::engine::native::index::prefetch(&line[0]);
                }
            }
        }
        for ((key, reply), entry) in gets.into_iter().zip(entries) {
            let resolved = self.resolve_entry(&key, entry);
            self.answer_get(key, reply, resolved);
        }
    }

    fn answer_get(&mut self, key: Vec<u8>, reply: GetReply, resolved: Resolved) {
        match resolved {
            Resolved::Missing => {
                let _ = reply.send(Ok(None));
            }
            Resolved::Value(value) => {
                let _ = reply.send(Ok(Some(value)));
            }
            Resolved::Failed(err) => {
                let _ = reply.send(Err(err));
            }
            Resolved::NeedPages(entry, changes) => {
                self.wait_slot(entry.loc, PageWaiter::Get { key, reply, entry, changes })
            }
            Resolved::NeedRead(loc) => self.read_record(loc, DirectRead::Get { key, loc, reply }),
        }
    }

    /// Several keys' values as of one moment (see the module's header).
    pub(super) fn multi_get(&mut self, keys: Vec<Vec<u8>>, reply: MultiGetReply) {
        let mut entries = Vec::with_capacity(keys.len());
        {
            let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            self.index.entries(&keys, &mut entries);
        }
        let count = keys.len();
        let id = self.multi_gets.insert(MultiGetState {
            keys,
            entries,
            values: vec![None; count],
            waiting: count,
            reply,
        });
        if count == 0 {
            return self.multi_get_finished(id, Ok(()));
        }
        for item in 0..count {
            // A failure or a restart ends the multi-get at once.
            if self.multi_gets.get(id).is_none() {
                return;
            }
            self.multi_get_item(id, item);
        }
    }

    /// Reads one key of a multi-get from the record its entry named (again, after its pages
    /// were read).
    pub(super) fn multi_get_item(&mut self, multi_get: u64, item: usize) {
        // Ended (failed or restarted) while this key's pages were read.
        let Some(state) = self.multi_gets.get_mut(multi_get) else { return };
        let entry = state.entries[item];
        // Lent out of the state while it is resolved (an empty key costs no allocation).
        let key = std::mem::take(&mut state.keys[item]);
        let resolved = self.resolve_entry(&key, entry);
        self.multi_gets.get_mut(multi_get).expect("resolving keeps it").keys[item] = key;
        match resolved {
            Resolved::Missing => self.multi_get_item_done(multi_get, item, None),
            Resolved::Value(value) => self.multi_get_item_done(multi_get, item, Some(value)),
            Resolved::Failed(err) => self.multi_get_item_failed(multi_get, item, err),
            Resolved::NeedPages(entry, _) => {
                self.wait_slot(entry.loc, PageWaiter::MultiGetItem { multi_get, item })
            }
            Resolved::NeedRead(loc) => {
                self.read_record(loc, DirectRead::MultiGetItem { multi_get, item, loc })
            }
        }
    }

    fn direct_multi_get_item_done(&mut self, multi_get: u64, item: usize, loc: Loc, bytes: &[u8]) {
        let Some(state) = self.multi_gets.get(multi_get) else { return };
        let entry = state.entries[item].expect("a key read directly has an entry");
        let key = state.keys[item].clone();
        if self.index.entry(&key) != Some(entry) {
            // Its slot may have been rewritten while the read was in flight (a torn image is
            // no proof of corruption): start over.
            return self.multi_get_restart(multi_get);
        }
        match self.verify_item(bytes, loc, &key, entry.seq) {
            Ok(value) => self.multi_get_item_done(multi_get, item, Some(value)),
            Err(err) => self.multi_get_finished(multi_get, Err(err)),
        }
    }

    fn multi_get_item_done(&mut self, multi_get: u64, item: usize, value: Option<Vec<u8>>) {
        let state = self.multi_gets.get_mut(multi_get).expect("an item of a live multi-get");
        state.values[item] = value;
        state.waiting -= 1;
        if state.waiting == 0 {
            self.multi_get_finished(multi_get, Ok(()));
        }
    }

    /// A key's record did not hold the version its entry named: its slot was reused if the
    /// key has changed since (then the multi-get starts over), else the record is corrupt.
    fn multi_get_item_failed(&mut self, multi_get: u64, item: usize, err: ReadError) {
        let state = self.multi_gets.get(multi_get).expect("an item of a live multi-get");
        let moved = matches!(err, ReadError::Corrupt { .. })
            && self.index.entry(&state.keys[item]) != state.entries[item];
        if moved {
            self.multi_get_restart(multi_get);
        } else {
            self.multi_get_finished(multi_get, Err(err));
        }
    }

    /// Starts a multi-get over at a new moment; its reads still in flight find it gone.
    fn multi_get_restart(&mut self, multi_get: u64) {
        let state = self.multi_gets.remove(multi_get).expect("restarting a live multi-get");
        self.multi_get(state.keys, state.reply);
    }

    /// Answers a multi-get with its values, or with `outcome`'s error; its reads still in
    /// flight find it gone.
    pub(super) fn multi_get_finished(&mut self, multi_get: u64, outcome: Result<(), ReadError>) {
        let Some(state) = self.multi_gets.remove(multi_get) else { return };
        let _ = state.reply.send(outcome.map(|()| state.values));
    }

    /// Reads a multi-page record: exactly the pages it uses, in one I/O.
    fn read_record(&mut self, loc: Loc, read: DirectRead) {
        let (file, offset) = self.slabs.slot_position(loc);
        let pages = loc.pages_used().max(1) as usize;
        self.io.queue(
            IoKind::Read,
            file,
            offset,
            AlignedBuf::zeroed(pages * PAGE_BYTES),
            IoPurpose::DirectRead(read),
        );
    }

    pub(super) fn direct_get_done(
        &mut self,
        key: Vec<u8>,
        loc: Loc,
        reply: Reply<Option<Vec<u8>>, ReadError>,
        bytes: &[u8],
    ) {
        let Some(entry) = self.index.entry(&key).filter(|entry| entry.loc == loc) else {
            // Rewritten or deleted while the read was in flight: start over.
            return self.get(key, reply);
        };
        let _ = reply.send(self.verify_item(bytes, loc, &key, entry.seq).map(Some));
    }

    pub(super) fn scan(
        &mut self,
        start: Bound<Vec<u8>>,
        end: Bound<Vec<u8>>,
        limit: usize,
        reply: Reply<Vec<KeyValue>, ReadError>,
    ) {
        let keys = self.index.range(
            start.as_ref().map(|key| &key[..]),
            end.as_ref().map(|key| &key[..]),
            limit,
        );
        let count = keys.len();
        let entries: Vec<Entry> = keys.iter().map(|&(_, entry)| entry).collect();
        let id = self.scans.insert(ScanState {
            items: keys.into_iter().map(|(key, _)| (key, None)).collect(),
            read_at: vec![None; count],
            waiting: count,
            error: None,
            reply: Some(reply),
        });
        if count == 0 {
            self.scan_finished(id);
            return;
        }
        let mut waiting = Vec::new();
        // The range's own entries: nothing changed the index since it was walked.
        for (item, entry) in entries.into_iter().enumerate() {
            if let Some(loc) = self.scan_item_at(id, item, Some(entry)) {
                waiting.push((item, loc));
            }
        }
        // The missing pages of all the items, read with one I/O per run of consecutive pages:
        // items a scan clustered (`cluster.rs`) lie side by side.
        let pages = waiting
            .iter()
            .flat_map(|&(_, loc)| {
                let span = SizeClass::get(loc.class()).span(loc.slot());
                span.page_numbers().map(move |number| (loc.class(), number))
            })
            .collect();
        self.load_page_runs(pages);
        for (item, loc) in waiting {
            self.wait_slot(loc, PageWaiter::ScanItem { scan: id, item });
        }
    }

    pub(super) fn scan_item(&mut self, scan: u64, item: usize) {
        if let Some(loc) = self.scan_item_unless_paged(scan, item) {
            self.wait_slot(loc, PageWaiter::ScanItem { scan, item });
        }
    }

    /// Resolves a scan's item, or returns where it lies if some of its pages must be read first.
    fn scan_item_unless_paged(&mut self, scan: u64, item: usize) -> Option<Loc> {
        let state = self.scans.get(scan).expect("item of an unknown scan");
        let entry = self.index.entry(&state.items[item].0);
        self.scan_item_at(scan, item, entry)
    }

    /// `scan_item_unless_paged`, given the item's index entry now.
    fn scan_item_at(&mut self, scan: u64, item: usize, entry: Option<Entry>) -> Option<Loc> {
        // Lent out of the scan while it is resolved (an empty box costs no allocation).
        let key = std::mem::take(&mut self.scans.get_mut(scan).expect("item of a scan").items[item].0);
        let resolved = self.resolve_entry(&key, entry);
        self.scans.get_mut(scan).expect("item of a scan").items[item].0 = key;
        match resolved {
            Resolved::Missing => self.scan_item_done(scan, item, None),
            Resolved::Value(value) => {
                self.scans.get_mut(scan).expect("item of an unknown scan").read_at[item] = entry;
                self.scan_item_done(scan, item, Some(value))
            }
            Resolved::Failed(err) => self.scan_item_failed(scan, err),
            Resolved::NeedPages(entry, _) => return Some(entry.loc),
            Resolved::NeedRead(loc) => {
                self.read_record(loc, DirectRead::ScanItem { scan, item, loc })
            }
        }
        None
    }

    pub(super) fn direct_scan_item_done(&mut self, scan: u64, item: usize, loc: Loc, bytes: &[u8]) {
        let key = self.scans.get(scan).expect("item of an unknown scan").items[item].0.clone();
        let Some(entry) = self.index.entry(&key).filter(|entry| entry.loc == loc) else {
            return self.scan_item(scan, item);
        };
        match self.verify_item(bytes, loc, &key, entry.seq) {
            Ok(value) => self.scan_item_done(scan, item, Some(value)),
            Err(err) => self.scan_item_failed(scan, err),
        }
    }

    fn scan_item_done(&mut self, scan: u64, item: usize, value: Option<Vec<u8>>) {
        let state = self.scans.get_mut(scan).expect("item of an unknown scan");
        state.items[item].1 = value;
        state.waiting -= 1;
        if state.waiting == 0 {
            self.scan_finished(scan);
        }
    }

    pub(super) fn scan_item_failed(&mut self, scan: u64, err: ReadError) {
        let state = self.scans.get_mut(scan).expect("item of an unknown scan");
        state.error.get_or_insert(err);
        state.waiting -= 1;
        if state.waiting == 0 {
            self.scan_finished(scan);
        }
    }

    fn scan_finished(&mut self, scan: u64) {
        let mut state = self.scans.remove(scan).expect("unknown scan");
        let reply = state.reply.take().expect("a scan is answered once");
        if state.error.is_none() {
            self.consider_cluster(&state.items, &state.read_at);
        }
        let result = match state.error {
            Some(err) => Err(err),
            // Keys deleted while the scan ran are left out.
            None => Ok(state
                .items
                .into_iter()
                .filter_map(|(key, value)| value.map(|value| (key.into_vec(), value)))
                .collect()),
        };
        let _ = reply.send(result);
    }

    pub(super) fn direct_read_done(&mut self, read: DirectRead, completion: IoCompletion) {
        if let Err(err) = completion.result {
            match read {
                DirectRead::Get { reply, .. } => {
                    let _ = reply.send(Err(ReadError::Device(err)));
                }
                DirectRead::MultiGetItem { multi_get, .. } => {
                    self.multi_get_finished(multi_get, Err(ReadError::Device(err)))
                }
                DirectRead::ScanItem { scan, .. } => {
                    self.scan_item_failed(scan, ReadError::Device(err))
                }
                DirectRead::ChainPop { class, chain, .. } => {
                    self.slabs.free[class as usize].abort(chain)
                }
            }
            return;
        }
        match read {
            DirectRead::Get { key, loc, reply } => {
                self.direct_get_done(key, loc, reply, &completion.buf)
            }
            DirectRead::MultiGetItem { multi_get, item, loc } => {
                self.direct_multi_get_item_done(multi_get, item, loc, &completion.buf)
            }
            DirectRead::ScanItem { scan, item, loc } => {
                self.direct_scan_item_done(scan, item, loc, &completion.buf)
            }
            DirectRead::ChainPop { class, chain, slot } => {
                self.chain_head_read(class, chain, slot, &completion.buf)
            }
        }
    }
}

impl NativeEngine {
    /// The value of `key` (which the index says carries `seq`) from the slot bytes `bytes` read
    /// from this shard at `loc`, checked in full (a direct read or the scrub; `resolve` decodes
    /// the cache's image itself, through its marks), or why it cannot be had.
    pub(super) fn verify_item(
        &self,
        bytes: &[u8],
        loc: Loc,
        key: &[u8],
        seq: u64,
    ) -> Result<Vec<u8>, ReadError> {
        let slot_bytes = SizeClass::get(loc.class()).slot_bytes as usize;
        let layout = self.slabs.layout_of(loc.class());
        let decoded = decode_slot(bytes, layout, self.shard_id, loc, slot_bytes);
        value_of(decoded, self.shard_id, loc, key, seq)
    }
}

/// The value of `key`'s record at `loc` as decoded, checked to be the put of that key with the
/// seq the index expects (`seq`), or why it is not.
fn value_of(
    decoded: Result<Slot<'_>, SlotDefect>,
    shard_id: u32,
    loc: Loc,
    key: &[u8],
    seq: u64,
) -> Result<Vec<u8>, ReadError> {
    let corrupt = |defect: String| ReadError::Corrupt {
        shard: shard_id,
        location: format!("{loc:?}"),
        defect,
    };
    match decoded {
        Ok(Slot::Record { header, key: stored_key, value }) => {
            if header.kind != RecordKind::Put {
                return Err(corrupt(format!("indexed slot holds a {:?} record", header.kind)));
            }
            if stored_key != key {
                return Err(corrupt("indexed slot holds another key".into()));
            }
            if header.seq != seq {
                // An older record of the key: the device lost (or misdirected) the newer write.
                return Err(corrupt(format!(
                    "indexed slot holds the key's record seq {}, the index expects seq {seq} \
                     (a write was lost or misdirected)",
                    header.seq
                )));
            }
            Ok(value.to_vec())
        }
        Ok(Slot::Empty) => Err(corrupt("indexed slot is empty".into())),
        Err(defect) => {
            tracing::error!(shard = shard_id, ?loc, %defect, "corrupt item");
            Err(corrupt(defect.to_string()))
        }
    }
}
