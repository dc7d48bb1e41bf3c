//! Clustering: a scan that finds its items scattered over an append class has them rewritten
//! side by side, so that the next scan of that range reads a few consecutive pages instead of one
//! page per item (issue 22, YCSB E; the guide is docs/placement.md, "What it means for scans: clustering").
//!
//! Items are unsorted on disk (KVell): a scan of 50 one-KiB items reads ~50 pages where a sorted
//! store reads ~13. The scan has just read and verified every item, in key order, so rewriting
//! the scattered ones (those outside stretches of a page's worth already side by side,
//! `scattered_members`) through the append path costs no read: they take consecutive slots of the
//! class's open block, and the collector later frees the slots they left, like any other dead
//! slot. A range read once scattered is then clustered for every later scan, until its items are
//! updated (each update appends where the writes of its round go).
//!
//! Invariants:
//! - A clustering move is a collector move (`gc.rs`): it keeps the record's key, value and seq,
//!   is issued only if the index still points at the slot and seq the scan read, is applied
//!   only if it still does once the move is durable, and the old slot is freed only then. So an
//!   item written again between the scan and the move keeps its newer version, and a crash
//!   leaves at least one valid copy of every live record.
//! - The value moved is the one the scan verified at that slot and seq (`ScanState::read_at`).
//! - At most `CLUSTER_QUEUED_BYTES_MAX` bytes of queued moves (records and their bookkeeping)
//!   wait (asserted when queued), and a run holds at most `CLUSTER_MOVES_PER_ROUND_MAX` moves,
//!   which is all a round issues; nothing is queued or issued while the store is poisoned or
//!   closing.
//! - A record is not moved while a write of its key is in flight (a put or delete replaces it
//!   anyway; an earlier move of it would leave a second copy), so one scan after another over
//!   the same range does not write its records twice.
//! - Clustering moves do not hold a collection open (`Collector::move_started`): under steady
//!   scanning a collection still ends and the next one starts.

use std::collections::VecDeque;

use super::format::{record_bytes, Loc, SizeClass};
use super::gc::Candidate;
use super::index::Entry;
use super::placement::Placement;
use super::read::ScanItem;
use super::write::MoveCause;
use super::NativeEngine;
use crate::limits::{
    CLUSTER_ITEMS_MIN, CLUSTER_MOVES_PER_ROUND_MAX, CLUSTER_QUEUED_BYTES_MAX, CLUSTER_SCATTER_MAX,
    PAGE_BYTES,
};

/// What a queued move holds besides its record's bytes: the candidate and its two allocations'
/// headers (counted against `CLUSTER_QUEUED_BYTES_MAX`).
const CANDIDATE_BYTES: usize = std::mem::size_of::<Candidate>() + 32;

/// One scan's items of one class, to be rewritten side by side, in key order.
struct Run {
    class: u8,
    moves: Vec<Candidate>,
    bytes: usize,
}

/// The runs waiting for the end of a round.
pub(super) struct Clusters {
    runs: VecDeque<Run>,
    queued_bytes: usize,
}

impl Clusters {
    pub(super) fn new() -> Clusters {
        Clusters { runs: VecDeque::new(), queued_bytes: 0 }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    fn clear(&mut self) {
        self.runs.clear();
        self.queued_bytes = 0;
    }

    /// Whether a run that `queued_bytes_of` counts at `bytes` fits under
    /// `CLUSTER_QUEUED_BYTES_MAX` (asked before its values are copied).
    fn fits(&self, bytes: usize) -> bool {
        self.queued_bytes + bytes <= CLUSTER_QUEUED_BYTES_MAX
    }

    /// Queues one run of `moves` (one class) counted at `bytes`, which `fits`.
    fn queue(&mut self, class: u8, moves: Vec<Candidate>, bytes: usize) {
        assert!(self.fits(bytes), "a clustering run queued past CLUSTER_QUEUED_BYTES_MAX");
        self.queued_bytes += bytes;
        self.runs.push_back(Run { class, moves, bytes });
    }
}

/// What one queued move of a `key_bytes` key and a `value_bytes` value counts against
/// `CLUSTER_QUEUED_BYTES_MAX`: its record's size (the key and value it holds, plus the header it
/// does not, which covers the allocator's rounding) and its bookkeeping. Checked against the
/// bytes actually allocated by a unit test.
fn queued_bytes_of(key_bytes: usize, value_bytes: usize) -> usize {
    record_bytes(key_bytes, value_bytes) + CANDIDATE_BYTES
}

/// The first page of each of `locs` (one class's slots).
fn pages_of(class: SizeClass, locs: impl Iterator<Item = Loc>) -> Vec<u64> {
    locs.map(|loc| class.page_of_slot(loc.slot())).collect()
}

/// Whether items of `class` lying on `pages` (at least `CLUSTER_ITEMS_MIN`) lie on more than
/// `CLUSTER_SCATTER_MAX` times the pages they would fill side by side.
fn scattered(class: SizeClass, pages: &[u64]) -> bool {
    let mut distinct = pages.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let packed_pages = (pages.len() * class.slot_bytes as usize).div_ceil(PAGE_BYTES);
    distinct.len() > CLUSTER_SCATTER_MAX * packed_pages
}

/// The members (member `members[i]` lies on page `pages[i]`, in key order) that lie outside every
/// stretch of at least a page's worth of them side by side (each on the same page as the one
/// before or the next): those stretches already read as a run of pages, and stay.
fn scattered_members(class: SizeClass, members: &[usize], pages: &[u64]) -> Vec<usize> {
    let stretch_min = (PAGE_BYTES / class.slot_bytes as usize).max(2);
    let mut out = Vec::new();
    let mut start = 0;
    for end in 1..=members.len() {
        let breaks = end == members.len() || !(pages[end - 1]..=pages[end - 1] + 1).contains(&pages[end]);
        if breaks {
            if end - start < stretch_min {
                out.extend_from_slice(&members[start..end]);
            }
            start = end;
        }
    }
    out
}

impl NativeEngine {
    /// A scan read `items` of one range in key order, item `i` verified at `read_at[i]` (`None`:
    /// absent, or read directly from a multi-page slot). Queues, per append class, the items
    /// that lie scattered.
    pub(super) fn consider_cluster(
        &mut self,
        items: &[ScanItem],
        read_at: &[Option<Entry>],
    ) {
        if self.is_poisoned() || self.closing || items.len() < CLUSTER_ITEMS_MIN {
            return;
        }
        let mut classes: Vec<u8> = read_at.iter().flatten().map(|entry| entry.loc.class()).collect();
        classes.sort_unstable();
        classes.dedup();
        for class in classes {
            let info = SizeClass::get(class);
            if info.is_multi_page()
                || self.collector.placement(class) != Placement::Append
                || self.collector.append(class).is_none()
            {
                continue;
            }
            let members: Vec<usize> = (0..items.len())
                .filter(|&i| {
                    items[i].1.is_some() && read_at[i].is_some_and(|at| at.loc.class() == class)
                })
                .collect();
            if members.len() < CLUSTER_ITEMS_MIN {
                continue;
            }
            let pages =
                pages_of(info, members.iter().map(|&i| read_at[i].expect("a member was read").loc));
            if !scattered(info, &pages) {
                continue;
            }
            // Only the items not already side by side move; a long scan is clustered in its
            // first `CLUSTER_MOVES_PER_ROUND_MAX` of them: one round's moves.
            let members = scattered_members(info, &members, &pages);
            let members = &members[..members.len().min(CLUSTER_MOVES_PER_ROUND_MAX)];
            if members.is_empty() {
                continue;
            }
            let bytes: usize = members
                .iter()
                .map(|&i| queued_bytes_of(items[i].0.len(), items[i].1.as_ref().map_or(0, Vec::len)))
                .sum();
            if !self.clusters.fits(bytes) {
                continue;
            }
            let moves: Vec<Candidate> = members
                .iter()
                .map(|&i| {
                    let Entry { loc, seq } = read_at[i].expect("a member was read");
                    let value = items[i].1.clone().expect("a member has its value");
                    Candidate::put(loc.slot(), items[i].0.clone(), value, seq)
                })
                .collect();
            self.clusters.queue(class, moves, bytes);
            let append = self.collector.append_mut(class).expect("an append class");
            append.figures.cluster_runs += 1;
        }
    }

    /// Starts the queued runs' moves, whole runs, at most `CLUSTER_MOVES_PER_ROUND_MAX` moves
    /// (a run holds no more). Called at the end of every round, before the collector's step, so
    /// a run's records take consecutive slots.
    pub(super) fn cluster_step(&mut self) {
        if self.is_poisoned() || self.closing {
            self.clusters.clear();
            return;
        }
        let mut issued = 0;
        while let Some(run) = self.clusters.runs.front() {
            if issued > 0 && issued + run.moves.len() > CLUSTER_MOVES_PER_ROUND_MAX {
                break;
            }
            let Run { class, moves, bytes } = self.clusters.runs.pop_front().expect("a front run");
            self.clusters.queued_bytes -= bytes;
            issued += moves.len();
            for candidate in moves {
                // A write of the key is in flight (a put, a delete, or a move of this record
                // issued by an earlier scan): it replaces the record, or moves it, anyway.
                if self.seqs.in_flight(candidate.key()) {
                    continue;
                }
                if self.move_record(class, candidate, MoveCause::Cluster).is_err() {
                    // No slot to move to (the file could not grow): clustering waits for space.
                    self.clusters.clear();
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc_count::thread_allocated_bytes;

    /// `CLUSTER_QUEUED_BYTES_MAX` bounds the memory the queue holds: filled with runs (built as
    /// `consider_cluster` builds them) until the next would not fit, the queue, its runs, their
    /// candidates, keys and values take no more than the bound, as the allocator counts them.
    #[test]
    fn the_queue_holds_no_more_memory_than_its_bound() {
        let cases = [
            (23, 1024, CLUSTER_ITEMS_MIN),
            (23, 1024, CLUSTER_MOVES_PER_ROUND_MAX),
            (8, 16, CLUSTER_ITEMS_MIN),
            (200, 4000, CLUSTER_ITEMS_MIN),
        ];
        for (key_bytes, value_bytes, run_moves) in cases {
            let key: Box<[u8]> = vec![b'k'; key_bytes].into();
            let value = vec![7u8; value_bytes];
            let before = thread_allocated_bytes();
            let mut clusters = Clusters::new();
            let mut queued = 0;
            let bytes = run_moves * queued_bytes_of(key_bytes, value_bytes);
            while clusters.fits(bytes) {
                let moves: Vec<Candidate> = (0..run_moves)
                    .map(|slot| Candidate::put(slot as u64, key.clone(), value.clone(), 1))
                    .collect();
                clusters.queue(3, moves, bytes);
                queued += run_moves;
            }
            let held = (thread_allocated_bytes() - before) as usize;
            assert!(queued > 0);
            assert!(
                held <= CLUSTER_QUEUED_BYTES_MAX,
                "{queued} queued moves of {key_bytes}-byte keys and {value_bytes}-byte values \
                 hold {held} bytes, past the bound of {CLUSTER_QUEUED_BYTES_MAX}"
            );
            if value_bytes >= 1024 {
                // Large records: the count is close to what they hold, so the bound is real.
                assert!(held * 10 >= CLUSTER_QUEUED_BYTES_MAX * 8, "held only {held} bytes");
            }
            drop(clusters);
        }
    }

    #[test]
    fn stretches_of_a_page_or_more_side_by_side_stay_and_the_rest_moves() {
        let class = SizeClass::for_record(1_079); // 1 KiB items: 1,088-byte slots, ~3.8 a page
        assert_eq!(PAGE_BYTES / class.slot_bytes as usize, 3);
        let slots = [0, 1, 2, 3, 4, 100, 200, 201, 400, 401, 402, 900];
        let pages = pages_of(class, slots.iter().map(|&slot| Loc::new(class.id, slot, 0)));
        let members: Vec<usize> = (0..slots.len()).collect();
        // 0..=4 lie on two adjacent pages and 400..=402 on one or two: both stay. 100 is alone,
        // 200 and 201 are two (under a page's worth), 900 is alone: they move.
        assert_eq!(scattered_members(class, &members, &pages), vec![5, 6, 7, 11]);
        assert!(!scattered(class, &pages), "12 items on 6 or 7 pages, under twice the 4 they fill");
        let far_apart = pages_of(class, (0..12).map(|i| Loc::new(class.id, i * 100, 0)));
        assert!(scattered(class, &far_apart), "12 items on 12 pages");
        let side_by_side = pages_of(class, (0..12).map(|slot| Loc::new(class.id, slot, 0)));
        assert!(!scattered(class, &side_by_side));
        assert!(scattered_members(class, &members[..12], &side_by_side).is_empty());
    }
}
