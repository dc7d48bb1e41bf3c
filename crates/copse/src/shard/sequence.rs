//! A sequence: several exec programs run one after another as one exec, whose writes reach the
//! engine together as one all-or-nothing batch at the end (Redis's MULTI ... EXEC, per shard).
//!
//! The sequence holds the locks of all its steps (and of the watched keys) from its start to its
//! end. Each step sees the shard as the steps before it left it: their writes are kept in the
//! sequence's overlay, which the step's view (`ExecView::with_overlay`) and its reads answer
//! from, and a step's write is answered at once (`Written(Ok)`), with nothing written yet. When
//! the last step is done the overlay is written as one batch (`Write`), or, inside a cross-shard
//! batch, prepared as this shard's part with the vote the sequence was given (`Prepare`).
//!
//! Invariants:
//! 1. Nothing a step writes reaches the engine before the sequence's one write: a crash leaves
//!    all of the sequence or none of it, and no other exec sees part of it (the sequence holds
//!    every lock its steps named until its write is durable, exec.rs invariant 2).
//! 2. A step reads what the steps before it wrote: a point read of a key in the overlay is
//!    answered from it, a scan is merged with it (`scan_over`), as the view's index questions
//!    are (`ExecView::with_overlay`).
//! 3. Watched locks: the sequence starts only if every watched lock's version is still the one
//!    the caller read (exec.rs invariant 6), checked under the locks; otherwise it writes
//!    nothing and ends `Changed`. The caller's `check` (what changes keys without their locks)
//!    is asked at the start and again right before the one write, in the same step that issues
//!    it: false ends the sequence `Changed`, with nothing written.
//! 4. The steps answer their own callers as they finish; the caller of the sequence must not
//!    pass those answers on before the sequence's own outcome says `Applied`.
//! 5. Bounded: the overlay's encoded bytes never pass `WRITE_BATCH_BYTES_MAX` (the write it
//!    becomes could not be made), and the bytes the steps read never pass the caller's
//!    `read_bytes_max`; either ends the sequence `Failed` at once, with nothing written.
//! 6. Lock versions: the sequence's write moves the versions of the locks of the steps that
//!    wrote (`Exec::written_locks`), not of every lock it holds, so a key it only read or watched
//!    does not look changed to a watcher.

use std::collections::VecDeque;
use std::ops::Bound;

use futures::channel::oneshot;

use super::exec::{
    apply, overlay_ops, Exec, ExecStep, ExecView, LockIds, Overlay, ReadOp, ReadOps, ReadResult,
    ReadResults, StepInput, Vote,
};
use crate::engine::batch_codec::{encoded_op_bytes, BATCH_HEADER_BYTES};
use crate::engine::{is_empty_range, BatchOp, KeyValue};
use crate::error::{InputError, WriteError};
use crate::limits::{SCAN_ITEMS_MAX, SEQUENCE_STEPS_MAX, WRITE_BATCH_BYTES_MAX};

/// How a sequence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SequenceOutcome {
    /// Every step ran and the sequence's writes are durable (and applied, in a cross-shard
    /// batch): the steps' answers stand.
    Applied,
    /// A watched lock's version moved, or a step called the sequence off: nothing was written.
    Changed,
    /// The write failed, or the cross-shard batch was called off: nothing was written.
    Failed(WriteError),
}

/// Runs `steps` in order as one exec (module comment). Build it with [`Sequence::new`] and send
/// it with the union of its steps' locks and the watched ones.
pub struct Sequence {
    steps: VecDeque<(Box<dyn Exec>, LockIds)>,
    /// The step running, with its locks.
    current: Option<(Box<dyn Exec>, LockIds)>,
    writes: Overlay,
    /// `writes` encoded as one batch (invariant 5).
    write_bytes: usize,
    /// Bytes the steps read so far, and the most they may (invariant 5).
    read_bytes: usize,
    read_bytes_max: usize,
    /// The locks of the steps that wrote (invariant 6).
    written_locks: LockIds,
    /// (lock, version the caller read): checked at the start (invariant 3).
    watched: Vec<(u64, u64)>,
    check: Option<Box<dyn Fn() -> bool + Send>>,
    vote: Option<Vote>,
    /// The current step's reads: answered from the overlay, or by the engine's read at `at`.
    reads: Option<Vec<PlannedRead>>,
    writing: bool,
    done: Option<oneshot::Sender<SequenceOutcome>>,
}

enum PlannedRead {
    Local(ReadResult),
    /// The engine's answer to read `at` of the sequence's own read step; a scan's is merged
    /// with the overlay over its range, cut at its limit.
    Engine { at: usize, scan: Option<ScanOver> },
}

/// A scan the overlay changes: its range, the limit the step asked for and the larger one the
/// engine was asked for.
pub struct ScanOver {
    start: Bound<Vec<u8>>,
    end: Bound<Vec<u8>>,
    limit: usize,
    engine_limit: usize,
}

impl Sequence {
    /// A sequence of `steps` (at most `SEQUENCE_STEPS_MAX`), each with its locks. `watched` are
    /// (lock, version) pairs read earlier with `ExecView::lock_version` (or with
    /// `lock_version_all`, the version marked `COUNTS_BACKGROUND`); `check` is asked at the
    /// start and before the write (invariant 3); the steps may read at most `read_bytes_max`
    /// bytes; `vote`, inside a cross-shard batch (`Db::exec_atomic`), makes the end a
    /// `Prepare`. `done` hears the outcome.
    pub fn new(
        steps: Vec<(Box<dyn Exec>, LockIds)>,
        watched: Vec<(u64, u64)>,
        check: Option<Box<dyn Fn() -> bool + Send>>,
        read_bytes_max: usize,
        vote: Option<Vote>,
        done: oneshot::Sender<SequenceOutcome>,
    ) -> Result<Sequence, InputError> {
        if steps.len() > SEQUENCE_STEPS_MAX {
            return Err(InputError::SequenceTooLong { steps: steps.len(), max: SEQUENCE_STEPS_MAX });
        }
        Ok(Sequence {
            steps: steps.into(),
            current: None,
            writes: Overlay::new(),
            write_bytes: BATCH_HEADER_BYTES,
            read_bytes: 0,
            read_bytes_max,
            written_locks: LockIds::new(),
            watched,
            check,
            vote,
            reads: None,
            writing: false,
            done: Some(done),
        })
    }

    fn finish(&mut self, outcome: SequenceOutcome) -> ExecStep {
        if let Some(vote) = self.vote.take() {
            // Called off before it was prepared: the other shards' parts are erased.
            let reason = match &outcome {
                SequenceOutcome::Failed(err) => err.clone(),
                _ => WriteError::Aborted("a watched key changed".into()),
            };
            vote.refuse(reason);
        }
        if let Some(done) = self.done.take() {
            let _ = done.send(outcome);
        }
        ExecStep::Done
    }

    /// Runs steps from `input` (for the current step) until one needs the engine, or all are
    /// done and the sequence writes.
    fn run(&mut self, view: &ExecView<'_>, mut input: StepInput) -> ExecStep {
        loop {
            if self.current.is_none() {
                match self.steps.pop_front() {
                    // `input` is `Start` here: a step that finished leaves it so.
                    Some(next) => self.current = Some(next),
                    None => return self.write(),
                }
            }
            let (step, locks) = self.current.as_mut().expect("a step runs");
            let asked = step.step(&view.with_overlay(&self.writes), input);
            input = match asked {
                ExecStep::Done => {
                    self.current = None;
                    StepInput::Start
                }
                ExecStep::Write(ops) | ExecStep::WriteLast(ops) => {
                    if !ops.is_empty() {
                        self.written_locks.extend_from_slice(locks);
                    }
                    if let Err(err) = self.keep_writes(ops) {
                        return self.finish(SequenceOutcome::Failed(err.into()));
                    }
                    StepInput::Written(Ok(()))
                }
                ExecStep::Prepare { vote, .. } => {
                    let refusal = WriteError::Aborted(
                        "a cross-shard batch cannot run as a step of a sequence".into(),
                    );
                    vote.refuse(refusal.clone());
                    StepInput::Written(Err(refusal))
                }
                ExecStep::Read(reads) => match self.plan_reads(reads) {
                    Ok(engine_reads) if engine_reads.is_empty() => {
                        let results = self.answer_reads(Vec::new());
                        if let Err(err) = self.count_reads(&results) {
                            return self.finish(SequenceOutcome::Failed(err.into()));
                        }
                        StepInput::Read(Ok(results))
                    }
                    Ok(engine_reads) => return ExecStep::Read(engine_reads),
                    Err(err) => StepInput::Read(Err(err.into())),
                },
            };
        }
    }

    /// Lays a step's writes over the overlay, keeping its encoded size (invariant 5).
    fn keep_writes(&mut self, ops: Vec<BatchOp>) -> Result<(), InputError> {
        for op in &ops {
            let (key, value) = match op {
                BatchOp::Put { key, value } => (key, Some(value.as_slice())),
                BatchOp::Delete { key } => (key, None),
            };
            if let Some(old) = self.writes.get(key) {
                self.write_bytes -= encoded_op_bytes(key, old.as_deref());
            }
            self.write_bytes += encoded_op_bytes(key, value);
        }
        apply(&mut self.writes, ops);
        if self.write_bytes > WRITE_BATCH_BYTES_MAX {
            return Err(InputError::BatchTooLarge {
                bytes: self.write_bytes,
                max: WRITE_BATCH_BYTES_MAX,
            });
        }
        Ok(())
    }

    /// Counts what a step read against `read_bytes_max` (invariant 5).
    fn count_reads(&mut self, results: &ReadResults) -> Result<(), InputError> {
        for result in results {
            self.read_bytes += match result {
                ReadResult::Value(value) => value.as_ref().map_or(0, Vec::len),
                ReadResult::Items(items) => {
                    items.iter().map(|(key, value)| key.len() + value.len()).sum()
                }
            };
        }
        if self.read_bytes > self.read_bytes_max {
            return Err(InputError::SequenceReadsTooLarge {
                bytes: self.read_bytes,
                max: self.read_bytes_max,
            });
        }
        Ok(())
    }

    /// Splits a step's reads into those the overlay answers and those the engine must.
    fn plan_reads(&mut self, reads: ReadOps) -> Result<ReadOps, InputError> {
        let mut planned = Vec::with_capacity(reads.len());
        let mut engine_reads = ReadOps::new();
        for read in reads {
            match plan_read(&self.writes, read)? {
                OverlayRead::Local(result) => planned.push(PlannedRead::Local(result)),
                OverlayRead::Engine(read, scan) => {
                    planned.push(PlannedRead::Engine { at: engine_reads.len(), scan });
                    engine_reads.push(read);
                }
            }
        }
        self.reads = Some(planned);
        Ok(engine_reads)
    }

    /// The current step's read results: the overlay's and the engine's, in the order it asked.
    fn answer_reads(&mut self, engine: Vec<ReadResult>) -> ReadResults {
        let mut engine: Vec<Option<ReadResult>> = engine.into_iter().map(Some).collect();
        let planned = self.reads.take().expect("a read step planned");
        planned
            .into_iter()
            .map(|read| match read {
                PlannedRead::Local(result) => result,
                PlannedRead::Engine { at, scan } => {
                    let result = engine[at].take().expect("each engine read answers one step read");
                    merge_read(&self.writes, scan.as_ref(), result)
                }
            })
            .collect()
    }

    fn write(&mut self) -> ExecStep {
        if self.check.as_ref().is_some_and(|check| !check()) {
            return self.finish(SequenceOutcome::Changed);
        }
        self.writing = true;
        self.written_locks.sort_unstable();
        self.written_locks.dedup();
        let ops = overlay_ops(std::mem::take(&mut self.writes));
        match self.vote.take() {
            Some(vote) => ExecStep::Prepare { vote, ops },
            None if ops.is_empty() => self.finish(SequenceOutcome::Applied),
            None => ExecStep::Write(ops),
        }
    }
}

impl Exec for Sequence {
    fn written_locks(&self) -> Option<&[u64]> {
        Some(&self.written_locks)
    }

    fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep {
        match input {
            StepInput::Start => {
                let moved = self.watched.iter().any(|&(lock, version)| current_version(view, lock, version) != version);
                if moved || self.check.as_ref().is_some_and(|check| !check()) {
                    return self.finish(SequenceOutcome::Changed);
                }
                self.run(view, StepInput::Start)
            }
            StepInput::Written(result) if self.writing => self.finish(match result {
                Ok(()) => SequenceOutcome::Applied,
                Err(err) => SequenceOutcome::Failed(err),
            }),
            StepInput::Read(Ok(results)) if self.reads.is_some() => {
                let results = self.answer_reads(results.into_iter().collect());
                if let Err(err) = self.count_reads(&results) {
                    return self.finish(SequenceOutcome::Failed(err.into()));
                }
                self.run(view, StepInput::Read(Ok(results)))
            }
            StepInput::Read(Err(err)) if self.reads.is_some() => {
                self.reads = None;
                self.run(view, StepInput::Read(Err(err)))
            }
            other => unreachable!("a sequence was resumed with {other:?} it did not ask for"),
        }
    }
}

/// Marks a watched version read with `ExecView::lock_version_all` (background work counted).
pub const COUNTS_BACKGROUND: u64 = 1 << 63;

/// The version of `lock` now, read as `version` was (`COUNTS_BACKGROUND` or not).
fn current_version(view: &ExecView<'_>, lock: u64, version: u64) -> u64 {
    match version & COUNTS_BACKGROUND {
        0 => view.lock_version(lock),
        _ => view.lock_version_all(lock) | COUNTS_BACKGROUND,
    }
}

/// A read of a step that runs over an overlay of writes (`plan_read`).
pub enum OverlayRead {
    /// The overlay answers it.
    Local(ReadResult),
    /// The engine must: this read (a scan's limit raised by the overlay's keys in its range),
    /// whose answer `merge_read` lays the overlay over.
    Engine(ReadOp, Option<ScanOver>),
}

/// How a step's `read` is answered over `overlay` (a sequence's writes, or a script's): a point
/// read of a key the overlay wrote from it, anything else by the engine.
pub fn plan_read(overlay: &Overlay, read: ReadOp) -> Result<OverlayRead, InputError> {
    match read {
        ReadOp::Get(key) => Ok(match overlay.get(&key) {
            Some(value) => OverlayRead::Local(ReadResult::Value(value.clone())),
            None => OverlayRead::Engine(ReadOp::Get(key), None),
        }),
        ReadOp::Scan { start, end, limit } => {
            if limit > SCAN_ITEMS_MAX {
                return Err(InputError::ScanLimitTooLarge { limit, max: SCAN_ITEMS_MAX });
            }
            let changed = if is_empty_range(as_ref(&start), as_ref(&end)) {
                0
            } else {
                overlay.range::<[u8], _>((as_ref(&start), as_ref(&end))).count()
            };
            // As many more as the overlay changed in the range leave at least `limit` after its
            // deletes whenever the engine had that many. Past the engine's own limit that
            // promise could not be kept: the read is refused rather than answered short.
            let engine_limit = limit.saturating_add(changed);
            if engine_limit > SCAN_ITEMS_MAX {
                return Err(InputError::ScanLimitTooLarge { limit: engine_limit, max: SCAN_ITEMS_MAX });
            }
            let scan = (changed > 0).then(|| ScanOver {
                start: start.clone(),
                end: end.clone(),
                limit,
                engine_limit,
            });
            Ok(OverlayRead::Engine(ReadOp::Scan { start, end, limit: engine_limit }, scan))
        }
    }
}

/// The engine's `result` of a read `plan_read` sent it, with `overlay` laid over (`scan`: what
/// `plan_read` returned beside the read).
pub fn merge_read(overlay: &Overlay, scan: Option<&ScanOver>, result: ReadResult) -> ReadResult {
    match (scan, result) {
        (Some(scan), ReadResult::Items(items)) => ReadResult::Items(scan_over(overlay, scan, items)),
        (_, result) => result,
    }
}

fn as_ref(bound: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    match bound {
        Bound::Included(key) => Bound::Included(key.as_slice()),
        Bound::Excluded(key) => Bound::Excluded(key.as_slice()),
        Bound::Unbounded => Bound::Unbounded,
    }
}

/// The engine's `items` of a range with `overlay`'s writes over the range applied: an item the
/// overlay wrote takes its value (or is gone, deleted), the overlay's new keys join in order;
/// cut at the step's limit. `items` are the engine's first items of the range, up to the
/// engine's limit (the step's plus the overlay's keys in the range): fewer means the engine
/// listed the whole range, else overlay keys past its last item are left out (the engine's
/// next items, unlisted, could come before them).
fn scan_over(overlay: &Overlay, scan: &ScanOver, items: Vec<KeyValue>) -> Vec<KeyValue> {
    let ScanOver { start, end, limit, engine_limit } = scan;
    let limit = *limit;
    let engine_complete = items.len() < *engine_limit;
    let last_engine_key = items.last().map(|(key, _)| key.clone());
    let mut changed = overlay.range::<[u8], _>((as_ref(start), as_ref(end))).peekable();
    let mut items = items.into_iter().peekable();
    let mut merged = Vec::with_capacity(limit.min(items.len() + 8));
    while merged.len() < limit {
        let take_changed = match (items.peek(), changed.peek()) {
            (None, None) => break,
            (Some((key, _)), Some((next, _))) => next.as_slice() <= key.as_slice(),
            (None, Some((next, _))) => {
                engine_complete || last_engine_key.as_ref().is_some_and(|last| *next <= last)
            }
            (Some(_), None) => false,
        };
        if !take_changed {
            if let Some(item) = items.next() {
                merged.push(item);
                continue;
            }
            break;
        }
        let (key, value) = changed.next().expect("peeked");
        items.next_if(|(item_key, _)| item_key == key);
        if let Some(value) = value {
            merged.push((key.clone(), value.clone()));
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(limit: usize, engine_limit: usize) -> ScanOver {
        ScanOver { start: Bound::Unbounded, end: Bound::Unbounded, limit, engine_limit }
    }

    fn kv(key: &str, value: &str) -> KeyValue {
        (key.as_bytes().to_vec(), value.as_bytes().to_vec())
    }

    #[test]
    fn a_scan_over_an_overlay_shows_its_puts_and_hides_its_deletes() {
        let mut overlay = Overlay::new();
        overlay.insert(b"b".to_vec(), Some(b"B2".to_vec()));
        overlay.insert(b"c".to_vec(), None);
        overlay.insert(b"d".to_vec(), Some(b"D".to_vec()));
        let items = vec![kv("a", "A"), kv("b", "B"), kv("c", "C"), kv("e", "E")];
        let merged = scan_over(&overlay, &all(10, 13), items.clone());
        assert_eq!(merged, vec![kv("a", "A"), kv("b", "B2"), kv("d", "D"), kv("e", "E")]);
        let merged = scan_over(&overlay, &all(2, 5), items);
        assert_eq!(merged, vec![kv("a", "A"), kv("b", "B2")]);
    }

    #[test]
    fn a_scan_cut_short_by_the_engine_does_not_list_overlay_keys_past_its_last_item() {
        let mut overlay = Overlay::new();
        overlay.insert(b"z".to_vec(), Some(b"Z".to_vec()));
        // The engine was asked for 3 + 1 and had more: "z" may lie past items it did not list.
        let items = vec![kv("a", "A"), kv("b", "B"), kv("c", "C"), kv("d", "D")];
        let merged = scan_over(&overlay, &all(5, 4), items.clone());
        assert_eq!(merged, vec![kv("a", "A"), kv("b", "B"), kv("c", "C"), kv("d", "D")]);
        // An engine that listed fewer than asked listed the whole range.
        let merged = scan_over(&overlay, &all(5, 6), items);
        assert_eq!(merged.last(), Some(&kv("z", "Z")));
        assert_eq!(merged.len(), 5);
    }
}
