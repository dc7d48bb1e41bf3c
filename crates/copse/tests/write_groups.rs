//! Write groups (`shard::exec`, invariant 5): consecutive last writes on one lock key share one
//! durable write. These tests check that they do share it (so a hot key is not one flush per
//! write), that an exec started behind a group sees the group's writes through its view, and,
//! on the simulated device with a crash at every point of a run, that a group is all-or-nothing
//! and that no member is answered before its write, and every write before it, is durable.
//!
//! Replay one crash run: `COPSE_WRITE_GROUP_CRASH_SEED_START=<seed>
//! COPSE_WRITE_GROUP_CRASH_RUNS=1 cargo test --release -p copse --test
//! write_groups a_crash`.

mod common;

use std::ops::Bound;
use std::sync::{mpsc, Arc};

use copse::device::sim::{FaultError, FaultOp, SimDisk};
use copse::engine::BatchOp;
use copse::shard::exec::{Exec, ExecRequest, ExecStep, ExecView, StepInput};
use copse::{Db, Options, WriteDurability};

/// Writes `ops` as its last write; answers `(index, outcome)` once it is durable.
struct SetLast {
    index: usize,
    ops: Vec<BatchOp>,
    joins: bool,
    answer: mpsc::Sender<(usize, Result<(), String>)>,
}

impl Exec for SetLast {
    fn step(&mut self, _view: &ExecView<'_>, input: StepInput) -> ExecStep {
        match input {
            StepInput::Start => ExecStep::WriteLast(std::mem::take(&mut self.ops)),
            StepInput::Written(result) => {
                let _ = self.answer.send((self.index, result.map_err(|err| err.to_string())));
                ExecStep::Done
            }
            StepInput::Read(_) => panic!("SetLast reads nothing"),
        }
    }

    fn joins_write_groups(&self) -> bool {
        self.joins
    }
}

fn put(key: &[u8], value: &[u8]) -> BatchOp {
    BatchOp::Put { key: key.to_vec(), value: value.to_vec() }
}

/// Queues `count` writes of `key` (value: the write's number) in one message, so they reach the
/// shard together; returns the answers in the order they came and the device's flushes.
fn hot_key_writes(joins: bool, count: usize) -> (Vec<usize>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(1)).unwrap();
    let flushes_before = db.stats().unwrap().device.flushes;
    let (answer, answers) = mpsc::channel();
    let execs: Vec<ExecRequest> = (0..count)
        .map(|index| {
            let ops = vec![put(b"hot", index.to_string().as_bytes())];
            let exec = SetLast { index, ops, joins, answer: answer.clone() };
            ExecRequest::new(&[b"hot"], Box::new(exec))
        })
        .collect();
    futures::executor::block_on(db.exec_many_async(db.shard_of(b"hot"), execs));
    let mut order = Vec::new();
    for _ in 0..count {
        let (index, result) = answers.recv().unwrap();
        result.unwrap();
        order.push(index);
    }
    assert_eq!(db.get(b"hot").unwrap(), Some((count - 1).to_string().into_bytes()));
    let flushes = db.stats().unwrap().device.flushes - flushes_before;
    db.close().unwrap();
    (order, flushes)
}

#[test]
fn a_hot_key_s_writes_share_flushes_and_are_answered_in_order() {
    let count = 300;
    let (grouped_order, grouped_flushes) = hot_key_writes(true, count);
    let (alone_order, alone_flushes) = hot_key_writes(false, count);
    let in_order: Vec<usize> = (0..count).collect();
    assert_eq!(grouped_order, in_order);
    assert_eq!(alone_order, in_order);
    // Alone, each write waits for the one before it to be durable: a flush each.
    assert!(alone_flushes >= count as u64, "{alone_flushes} flushes for {count} writes alone");
    assert!(
        grouped_flushes * 20 <= count as u64,
        "{grouped_flushes} flushes for {count} grouped writes (alone: {alone_flushes})"
    );
}

/// A group takes at most `EXEC_WRITE_GROUP_MEMBERS_MAX` members: a longer run of one key's
/// writes is split into that many groups or more (each a flush of its own), answered in order.
/// (The group's operation bound, `EXEC_WRITE_GROUP_OPS_MAX`, would split this run in two only.)
#[test]
fn a_write_group_takes_at_most_its_member_bound() {
    use copse::limits::{EXEC_WRITE_GROUP_MEMBERS_MAX, EXEC_WRITE_GROUP_OPS_MAX};
    let count = 3 * EXEC_WRITE_GROUP_MEMBERS_MAX + 1;
    assert!(
        count.div_ceil(EXEC_WRITE_GROUP_OPS_MAX) < count.div_ceil(EXEC_WRITE_GROUP_MEMBERS_MAX)
    );
    let (order, flushes) = hot_key_writes(true, count);
    assert_eq!(order, (0..count).collect::<Vec<_>>());
    let groups_min = count.div_ceil(EXEC_WRITE_GROUP_MEMBERS_MAX) as u64;
    assert!(
        flushes >= groups_min,
        "{flushes} flushes for {count} writes: a group passed its bound"
    );
}

/// Starts behind a group and records what its view shows, then writes last.
struct Observer {
    seen: mpsc::Sender<(bool, bool, Vec<Vec<u8>>, usize)>,
    answer: mpsc::Sender<(usize, Result<(), String>)>,
}

impl Exec for Observer {
    fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep {
        match input {
            StepInput::Start => {
                let all = (Bound::Included(&b"a0"[..]), Bound::Excluded(&b"b"[..]));
                let seen = (
                    view.contains(b"a35"),
                    view.contains(b"a3"),
                    view.keys(all.0, all.1, 4),
                    view.count(all.0, all.1, 100),
                );
                // An inverted or empty range is empty, as the engine answers it (not a panic).
                let inverted = (Bound::Included(&b"a9"[..]), Bound::Excluded(&b"a1"[..]));
                assert!(view.keys(inverted.0, inverted.1, 10).is_empty());
                assert_eq!(view.count(inverted.0, inverted.1, 10), 0);
                let empty = (Bound::Excluded(&b"a35"[..]), Bound::Excluded(&b"a35"[..]));
                assert!(view.keys(empty.0, empty.1, 10).is_empty());
                let _ = self.seen.send(seen);
                ExecStep::WriteLast(vec![put(b"a5", b"observer")])
            }
            StepInput::Written(result) => {
                let _ = self.answer.send((1, result.map_err(|err| err.to_string())));
                ExecStep::Done
            }
            StepInput::Read(_) => panic!("Observer reads nothing"),
        }
    }

    fn joins_write_groups(&self) -> bool {
        true
    }
}

#[test]
fn an_exec_behind_a_group_sees_the_group_s_writes_before_they_are_durable() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(1)).unwrap();
    for n in 1..=9 {
        db.put(format!("a{n}").as_bytes(), b"indexed").unwrap();
    }
    let (answer, answers) = mpsc::channel();
    let (seen, sights) = mpsc::channel();
    // Both under one lock key, queued together: the observer starts behind the first's group.
    let lock = vec![b"lock".to_vec()];
    let first = SetLast {
        index: 0,
        ops: vec![
            BatchOp::Delete { key: b"a3".to_vec() },
            put(b"a35", b"new"),
            put(b"a99", b"new"),
        ],
        joins: false,
        answer: answer.clone(),
    };
    let observer = Observer { seen, answer };
    let execs: Vec<ExecRequest> =
        vec![ExecRequest::new(&lock, Box::new(first)), ExecRequest::new(&lock, Box::new(observer))];
    futures::executor::block_on(db.exec_many_async(0, execs));
    let (has_a35, has_a3, first_keys, count) = sights.recv().unwrap();
    assert!(has_a35, "the group's put is visible to the exec behind it");
    assert!(!has_a3, "the group's delete is visible to the exec behind it");
    let names: Vec<&[u8]> = first_keys.iter().map(Vec::as_slice).collect();
    assert_eq!(names, vec![&b"a1"[..], b"a2", b"a35", b"a4"]);
    // a1..a9, less a3, plus a35 and a99.
    assert_eq!(count, 10);
    assert_eq!(answers.recv().unwrap(), (0, Ok(())));
    assert_eq!(answers.recv().unwrap(), (1, Ok(())));
    assert_eq!(db.get(b"a3").unwrap(), None);
    assert_eq!(db.get(b"a35").unwrap(), Some(b"new".to_vec()));
    assert_eq!(db.get(b"a5").unwrap(), Some(b"observer".to_vec()));
    db.close().unwrap();
}

/// Lock keys and execs of a crash run.
const CRASH_LOCKS: usize = 3;
const CRASH_WRITES: usize = 240;

/// The lock key exec `index` of a crash run takes (interleaved, so groups of several keys form
/// in one pump).
fn crash_lock(index: usize) -> usize {
    (index * 7 + index / 5) % CRASH_LOCKS
}

/// The execs of a crash run's lock `lock`, in queue order.
fn crash_writes_of(lock: usize) -> Vec<usize> {
    (0..CRASH_WRITES).filter(|&index| crash_lock(index) == lock).collect()
}

fn crash_options(durability: WriteDurability) -> Options {
    Options {
        shards: 1,
        cache_bytes: 2 << 20,
        durability,
        show_progress: false,
        ..Options::default()
    }
}

/// Opens a store on a fresh simulated disk of `seed` set to crash after `crash_after` device
/// operations; None if the open itself did not survive.
fn open_crashing(
    seed: u64,
    crash_after: u64,
    durability: WriteDurability,
) -> Option<(SimDisk, Db)> {
    let disk = SimDisk::new(seed);
    let db = Db::open_with_storage(Arc::new(disk.storage(durability)), crash_options(durability))
        .ok()?;
    disk.crash_after_ops(crash_after);
    Some((disk, db))
}

/// Queues `execs` on shard 0 in messages of 40, so that groups form, are written and crash at
/// different points.
fn queue_in_messages(db: &Db, execs: impl IntoIterator<Item = ExecRequest>) {
    let mut message = Vec::new();
    for exec in execs {
        message.push(exec);
        if message.len() == 40 {
            futures::executor::block_on(db.exec_many_async(0, std::mem::take(&mut message)));
        }
    }
    futures::executor::block_on(db.exec_many_async(0, message));
}

/// Closes the crashed store and opens what the disk kept, as recovery after a power cut.
fn reopen_after_crash(db: Db, disk: SimDisk, durability: WriteDurability) -> Result<Db, String> {
    let _ = db.close();
    drop(db);
    let disk = disk.restart();
    Db::open_with_storage(Arc::new(disk.storage(durability)), crash_options(durability))
        .map_err(|err| format!("reopen failed: {err}"))
}

/// Runs `run(seed, crash_after, durability)` over the seeds of the environment
/// (`COPSE_WRITE_GROUP_CRASH_SEED_START`, `COPSE_WRITE_GROUP_CRASH_RUNS`; `make torture` runs
/// many more): seed `n` crashes after device operation `n % CRASH_OPS_SPAN` (a run does fewer,
/// so every operation is a crash point), under a durability mode drawn from the seed. Fails with
/// every violation found.
fn run_crash_seeds(run: fn(u64, u64, WriteDurability) -> Vec<String>) {
    let start = common::env_u64("COPSE_WRITE_GROUP_CRASH_SEED_START", 0);
    let runs = common::env_u64("COPSE_WRITE_GROUP_CRASH_RUNS", CRASH_RUNS_DEFAULT);
    let mut violations = Vec::new();
    for seed in start..start + runs {
        let crash_after = seed % CRASH_OPS_SPAN;
        let durability = if (seed / CRASH_OPS_SPAN).is_multiple_of(2) {
            WriteDurability::FlushPerRound
        } else {
            WriteDurability::Dsync
        };
        for violation in run(seed, crash_after, durability) {
            violations.push(format!(
                "seed {seed}: crash after {crash_after} ops, {durability:?}: {violation}"
            ));
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

/// Hot keys on the simulated device, crashed at device operation `crash_after`: writes of
/// `CRASH_LOCKS` lock keys, each writing two items with the same value, queued in messages of 40. Returns
/// the violations found after recovery.
fn crash_run(seed: u64, crash_after: u64, durability: WriteDurability) -> Vec<String> {
    let Some((disk, db)) = open_crashing(seed, crash_after, durability) else {
        return Vec::new();
    };
    let item = |lock: usize, side: &str| format!("hot{lock}:{side}").into_bytes();
    let (answer, answers) = mpsc::channel();
    queue_in_messages(
        &db,
        (0..CRASH_WRITES).map(|index| {
            let lock = crash_lock(index);
            let value = format!("w{index}").into_bytes();
            let ops = vec![put(&item(lock, "a"), &value), put(&item(lock, "b"), &value)];
            let exec = SetLast { index, ops, joins: true, answer: answer.clone() };
            ExecRequest {
                locks: copse::exec::lock_ids(&[format!("hot{lock}")]),
                exec: Box::new(exec),
            }
        }),
    );
    drop(answer);
    let mut acked = vec![false; CRASH_WRITES];
    let mut answered_per_lock: Vec<Vec<usize>> = vec![Vec::new(); CRASH_LOCKS];
    for (index, result) in answers.iter() {
        acked[index] = result.is_ok();
        answered_per_lock[crash_lock(index)].push(index);
    }
    let mut violations = Vec::new();
    let db = match reopen_after_crash(db, disk, durability) {
        Ok(db) => db,
        Err(err) => return vec![err],
    };
    for (lock, answered) in answered_per_lock.iter().enumerate() {
        let writes = crash_writes_of(lock);
        if *answered != writes {
            violations.push(format!("lock {lock}: answered in order {answered:?}"));
        }
        // Acknowledged writes of a lock are a prefix of its writes.
        let acked_count = writes.iter().take_while(|&&index| acked[index]).count();
        if writes[acked_count..].iter().any(|&index| acked[index]) {
            violations.push(format!("lock {lock}: a write acknowledged after one that failed"));
        }
        let a = db.get(&item(lock, "a")).unwrap();
        let b = db.get(&item(lock, "b")).unwrap();
        if a != b {
            violations.push(format!("lock {lock}: a group was half written: {a:?} against {b:?}"));
        }
        // The value is the last acknowledged write's or a later one's; absent only if none
        // was acknowledged.
        let allowed: Vec<Vec<u8>> = writes[acked_count.saturating_sub(1)..]
            .iter()
            .map(|index| format!("w{index}").into_bytes())
            .collect();
        match &a {
            None if acked_count == 0 => {}
            Some(value) if allowed.contains(value) => {}
            other => violations.push(format!(
                "lock {lock}: holds {:?} after {acked_count} acknowledged writes (last {:?})",
                other.as_ref().map(|v| String::from_utf8_lossy(v).into_owned()),
                writes.get(acked_count.wrapping_sub(1))
            )),
        }
    }
    db.close().unwrap();
    violations
}

/// Crash runs of both kinds (`run_crash_seeds`): 80 by default.
const CRASH_RUNS_DEFAULT: u64 = 80;
const CRASH_OPS_SPAN: u64 = 120;

#[test]
fn a_crash_leaves_each_write_group_whole_and_every_acknowledged_write() {
    run_crash_seeds(crash_run);
}

#[test]
fn a_poisoned_store_answers_every_member_of_a_write_group() {
    // A group formed after a write failed (in the pump that follows the reap) has its write
    // refused at once by the poisoned engine, with no I/O that would wake the shard again:
    // its members must still be answered (a hang found by 2,000 crash runs of the test above).
    let disk = SimDisk::new(7);
    let options = Options { shards: 1, show_progress: false, ..Options::default() };
    let db = Db::open_with_storage(Arc::new(disk.storage(options.durability)), options).unwrap();
    db.put(b"before", b"ok").unwrap();
    disk.fail_nth(1, FaultOp::Flush, FaultError::Io, true);
    let (answer, answers) = mpsc::channel();
    // The first does not let the others start behind it: they wait for its failed write, then
    // form a group of their own in the pump after the failure.
    let execs: Vec<ExecRequest> = (0..50)
        .map(|index| {
            let ops = vec![put(b"hot", b"v")];
            let exec = SetLast { index, ops, joins: index > 1, answer: answer.clone() };
            ExecRequest::new(&[b"hot"], Box::new(exec))
        })
        .collect();
    futures::executor::block_on(db.exec_many_async(0, execs));
    for _ in 0..50 {
        let (_, result) = answers
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("every member of the group is answered");
        assert!(result.is_err(), "a poisoned store acknowledges nothing");
    }
    let _ = db.close();
}

#[test]
fn a_write_too_large_for_the_group_s_batch_is_written_alone_after_it() {
    // Two writes of 9 MiB under one lock do not fit one batch (16 MiB): the second is written
    // alone once the first's group is durable, and the exec behind it still joins nothing
    // early. Merging them regardless would have the batch refused and both answered an error.
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(1)).unwrap();
    let (answer, answers) = mpsc::channel();
    let big = |byte: u8| vec![byte; 9 << 20];
    let writes = [(b"big:a", big(1)), (b"big:b", big(2)), (b"big:c", vec![3u8; 10])];
    let execs: Vec<ExecRequest> = writes
        .iter()
        .enumerate()
        .map(|(index, (key, value))| {
            let ops = vec![put(&key[..], value)];
            let exec = SetLast { index, ops, joins: true, answer: answer.clone() };
            ExecRequest::new(&[b"lock"], Box::new(exec))
        })
        .collect();
    futures::executor::block_on(db.exec_many_async(0, execs));
    for expected in 0..writes.len() {
        let (index, result) = answers.recv().unwrap();
        assert_eq!(index, expected, "answered in queue order");
        result.unwrap();
    }
    for (key, value) in &writes {
        assert_eq!(db.get(&key[..]).unwrap().as_deref(), Some(&value[..]));
    }
    db.close().unwrap();
}

/// Reads `counter` and `config` (point reads), then writes `counter` + 1 last: a
/// read-modify-write that joins write groups. Answers `(index, counter it wrote)`.
struct Increment {
    index: usize,
    answer: mpsc::Sender<(usize, Result<u64, String>)>,
    wrote: u64,
}

impl Exec for Increment {
    fn step(&mut self, _view: &ExecView<'_>, input: StepInput) -> ExecStep {
        use copse::shard::exec::{ReadOp, ReadResult};
        match input {
            StepInput::Start => ExecStep::Read(smallvec::smallvec![
                ReadOp::Get(b"counter".to_vec()),
                ReadOp::Get(b"config".to_vec())
            ]),
            StepInput::Read(Ok(results)) => {
                let value = |result: &ReadResult| match result {
                    ReadResult::Value(value) => value.clone(),
                    ReadResult::Items(_) => panic!("a point read answered with items"),
                };
                let counter = value(&results[0])
                    .map_or(0, |bytes| String::from_utf8(bytes).unwrap().parse::<u64>().unwrap());
                assert_eq!(value(&results[1]), Some(b"durable".to_vec()), "config reads whole");
                self.wrote = counter + 1;
                ExecStep::WriteLast(vec![put(b"counter", self.wrote.to_string().as_bytes())])
            }
            StepInput::Read(Err(err)) => panic!("read failed: {err}"),
            StepInput::Written(result) => {
                let _ = self
                    .answer
                    .send((self.index, result.map(|()| self.wrote).map_err(|e| e.to_string())));
                ExecStep::Done
            }
        }
    }

    fn joins_write_groups(&self) -> bool {
        true
    }
}

/// Read-modify-writes of one key behind one another (invariant 5, joiners that read): none is
/// lost (each reads the one before it, from the group's writes before they are durable), each is
/// answered in order with what it wrote, and they share flushes.
#[test]
fn read_modify_writes_of_one_key_join_groups_and_lose_no_update() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(1)).unwrap();
    db.put(b"config", b"durable").unwrap();
    let count = 400;
    let flushes_before = db.stats().unwrap().device.flushes;
    let (answer, answers) = mpsc::channel();
    let execs: Vec<ExecRequest> = (0..count)
        .map(|index| {
            let exec = Increment { index, answer: answer.clone(), wrote: 0 };
            ExecRequest::new(&[b"counter"], Box::new(exec))
        })
        .collect();
    futures::executor::block_on(db.exec_many_async(db.shard_of(b"counter"), execs));
    for expected in 0..count {
        let (index, wrote) = answers.recv().unwrap();
        assert_eq!(index, expected, "answered in queue order");
        assert_eq!(wrote.unwrap(), expected as u64 + 1, "each read the one before it");
    }
    assert_eq!(db.get(b"counter").unwrap(), Some(count.to_string().into_bytes()));
    let flushes = db.stats().unwrap().device.flushes - flushes_before;
    assert!(flushes * 10 <= count as u64, "{flushes} flushes for {count} read-modify-writes");
    db.close().unwrap();
}

/// Reads its counter (one point read), then writes it + 1 last: a read-modify-write joiner for
/// the crash runs. Answers `(index, counter it wrote)`.
struct Bump {
    index: usize,
    key: Vec<u8>,
    wrote: u64,
    answer: mpsc::Sender<(usize, Result<u64, String>)>,
}

impl Exec for Bump {
    fn step(&mut self, _view: &ExecView<'_>, input: StepInput) -> ExecStep {
        use copse::shard::exec::{ReadOp, ReadResult};
        match input {
            StepInput::Start => ExecStep::Read(smallvec::smallvec![ReadOp::Get(self.key.clone())]),
            StepInput::Read(Ok(results)) => {
                let counter = match &results[0] {
                    ReadResult::Value(value) => value.as_ref().map_or(0, |bytes| {
                        String::from_utf8_lossy(bytes).parse::<u64>().unwrap_or(u64::MAX)
                    }),
                    ReadResult::Items(_) => u64::MAX,
                };
                self.wrote = counter.saturating_add(1);
                ExecStep::WriteLast(vec![put(&self.key, self.wrote.to_string().as_bytes())])
            }
            StepInput::Read(Err(err)) => {
                let _ = self.answer.send((self.index, Err(err.to_string())));
                ExecStep::Done
            }
            StepInput::Written(result) => {
                let outcome = result.map(|()| self.wrote).map_err(|err| err.to_string());
                let _ = self.answer.send((self.index, outcome));
                ExecStep::Done
            }
        }
    }

    fn joins_write_groups(&self) -> bool {
        true
    }
}

/// Read-modify-writes of `CRASH_LOCKS` counters on the simulated device, crashed at device operation
/// `crash_after`: every acknowledged increment of a counter wrote the value after the one before
/// it (none lost, none read from a write a crash took back), the acknowledged ones are a prefix,
/// and after recovery each counter holds at least its acknowledged count and at most the
/// increments sent. Returns the violations.
fn crash_run_read_modify_write(
    seed: u64,
    crash_after: u64,
    durability: WriteDurability,
) -> Vec<String> {
    let Some((disk, db)) = open_crashing(seed, crash_after, durability) else {
        return Vec::new();
    };
    let key = |lock: usize| format!("counter{lock}").into_bytes();
    let (answer, answers) = mpsc::channel();
    queue_in_messages(
        &db,
        (0..CRASH_WRITES).map(|index| {
            let key = key(crash_lock(index));
            let exec = Bump { index, key: key.clone(), wrote: 0, answer: answer.clone() };
            ExecRequest::new(&[&key], Box::new(exec))
        }),
    );
    drop(answer);
    let mut outcome: Vec<Option<Result<u64, String>>> = vec![None; CRASH_WRITES];
    for (index, result) in answers.iter() {
        outcome[index] = Some(result);
    }
    let mut violations = Vec::new();
    let db = match reopen_after_crash(db, disk, durability) {
        Ok(db) => db,
        Err(err) => return vec![err],
    };
    for lock in 0..CRASH_LOCKS {
        let writes = crash_writes_of(lock);
        let acked: Vec<u64> = writes
            .iter()
            .map_while(|&index| outcome[index].as_ref().and_then(|result| result.as_ref().ok()))
            .copied()
            .collect();
        if writes[acked.len()..].iter().any(|&index| matches!(outcome[index], Some(Ok(_)))) {
            violations
                .push(format!("counter {lock}: an increment acknowledged after one that failed"));
        }
        let expected: Vec<u64> = (1..=acked.len() as u64).collect();
        if acked != expected {
            violations.push(format!("counter {lock}: acknowledged increments wrote {acked:?}"));
        }
        let stored = db
            .get(&key(lock))
            .unwrap()
            .map_or(0, |bytes| String::from_utf8_lossy(&bytes).parse::<u64>().unwrap_or(u64::MAX));
        if stored < acked.len() as u64 || stored > writes.len() as u64 {
            violations.push(format!(
                "counter {lock}: holds {stored} after {} acknowledged of {} increments",
                acked.len(),
                writes.len()
            ));
        }
    }
    db.close().unwrap();
    violations
}

/// `crash_run_read_modify_write` over crash points and both durability modes
/// (`run_crash_seeds`).
#[test]
fn a_crash_loses_no_acknowledged_read_modify_write_of_a_group() {
    run_crash_seeds(crash_run_read_modify_write);
}
