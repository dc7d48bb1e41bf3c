//! kill -9 on the real file system: a child process writes under load and is killed with SIGKILL
//! at a random moment; every write it acknowledged must be found when the store is reopened.
//!
//! The parent re-executes this test binary as a child running only the ignored `child_writer`
//! test, with `COPSE_KILL_CHILD_DIR` naming the store. The child opens the store (2 shards) and
//! works from 4 threads over 2,000 keys: puts of unique values, deletes, batches and gets. Before
//! it issues an operation it prints an `I` line; once the operation is acknowledged it prints the
//! acknowledgement; each line is flushed at once, so the order of lines on the pipe is the real-
//! time order of those events. The parent kills the child 50–400 ms after it opened the store
//! (every fifth cycle instead while it opens it: during recovery), reopens the store itself and
//! checks every key:
//! - it holds the value of a write that no acknowledged write of the key began after (the last
//!   acknowledged value, or a later write that was in flight at the kill), or it is absent and
//!   such a write is a delete; and no get the child saw after that write was acknowledged saw
//!   another state (what that get saw is newer); nothing else;
//! - a batch is all-or-nothing, across shards too (cross-shard batches, router/txn.rs);
//! - every get the child saw returned a value written to its key (or nothing), not replaced by a
//!   write acknowledged before the get began;
//! - a scan agrees with the gets, and `stats()` counts the live keys.
//!
//! Two stores take turns, four cycles each: one in place, one appending every in-page class in
//! one-page blocks under a 1.2 space ceiling, where the child also runs `CHURN_THREADS` threads
//! rewriting hot keys (not checked) in the same size classes, so the collector keeps moving the
//! checked keys' records and the kills strike collections under way. The child reports the
//! collector's figures (`C runs moved` lines); a run of 8 cycles or more fails unless records
//! were moved. Each directory is kept across cycles (20 by default, `COPSE_KILL_CYCLES`), so
//! recovery runs over an ever larger store; every open must finish within `OPEN_SECONDS_MAX`. Cycles alternate
//! the durability mode and the I/O backend (io_uring when available, pread/pwrite). The kill
//! times come from a seed printed at the start (`COPSE_KILL_SEED` sets it); what the child has
//! done by then depends on timing.
//!
//! Child protocol (one line each, prefixed with `@@ ` because the test harness may print on the
//! same line): `S` opening the store; `R` opened; `I P key tag len` / `P key tag len` put;
//! `I D key tag` / `D key tag` delete; `I B tag op…` / `B tag` batch, with ops `P:key:len:i` or
//! `D:key` (the value of batch op `i` is made from `tag.i`); `I G key tag` / `G tag seen len` or
//! `G tag -` get, with the tag and length of the value seen; `E message` a failure no kill
//! explains. Values are generated from (tag, len), so lines stay short.

mod common;
use common::{describe_value, make_value, Op};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use copse::{Backend, Db, Options, WriteBatch, WriteDurability};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const CYCLES_DEFAULT: u64 = 20;
const SHARDS: usize = 2;
const KEYS: usize = 2_000;
const CHILD_THREADS: usize = 4;
const KILL_AFTER_READY_MS: std::ops::Range<u64> = 50..400;
/// Every this many cycles the child is killed while it opens the store instead: at a random
/// moment up to twice the parent's last open time after the child starts opening (during
/// recovery and its batch replays, or its first writes).
const EARLY_KILL_EVERY_CYCLES: u64 = 5;
/// Opening the store (recovery included) must take less than this, however large it has grown.
const OPEN_SECONDS_MAX: u64 = 30;
/// Threads of the child that rewrite hot keys in an append store, so that collections run.
const CHURN_THREADS: usize = 6;
const CHURN_KEYS: usize = 300;
/// Cycles with the same store before the other one takes its turn.
const CYCLES_PER_STORE: u64 = 4;
/// The churn's first thread reports the collector's figures this often.
const COLLECTOR_REPORT_EVERY_WRITES: u64 = 20;
/// In an appending cycle the parent waits up to this long for the child to report a record
/// moved before it starts the kill timer, so the kill strikes while collections run.
const WAIT_FOR_COLLECTION_MAX: Duration = Duration::from_secs(15);
/// A run of this many cycles must see the collector move records.
const CYCLES_FOR_COLLECTIONS_MIN: u64 = 8;
/// The child stops by itself after this long, in case the parent is gone.
const CHILD_SECONDS_MAX: u64 = 60;
const MARK: &str = "@@ ";

const DIR_ENV: &str = "COPSE_KILL_CHILD_DIR";
const CYCLE_ENV: &str = "COPSE_KILL_CHILD_CYCLE";

fn key_name(key: usize) -> Vec<u8> {
    format!("k{key:04}").into_bytes()
}

/// Whether `cycle` runs on the appending store (the other one stays in place).
fn appends(cycle: u64) -> bool {
    (cycle / CYCLES_PER_STORE) % 2 == 1
}

/// What the store is opened with in `cycle` (child and parent alike).
fn options(cycle: u64) -> Options {
    Options {
        placement: if appends(cycle) {
            copse::PlacementSetting::Append
        } else {
            copse::PlacementSetting::InPlace
        },
        append_block_pages: 1,
        space_amplification_max: 1.2,
        shards: SHARDS,
        cache_bytes: 8 << 20,
        durability: if cycle.is_multiple_of(2) {
            WriteDurability::Dsync
        } else {
            WriteDurability::FlushPerRound
        },
        backend: if (cycle / 2).is_multiple_of(2) { Backend::Auto } else { Backend::Sync },
        show_progress: false,
        engine: common::engine(),
        ..Options::default()
    }
}

// ---------------------------------------------------------------------------------------------
// The child.

fn value_len(rng: &mut ChaCha8Rng) -> usize {
    match rng.gen_range(0..100) {
        0..=74 => rng.gen_range(0..300),
        75..=94 => rng.gen_range(300..4_000),
        _ => rng.gen_range(5 * 1024..60 * 1024),
    }
}

/// Prints one protocol line and flushes it before returning.
fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{MARK}{line}");
    let _ = out.flush();
}

fn child_thread(db: &Db, cycle: u64, thread: usize, deadline: Instant) {
    let mut rng =
        ChaCha8Rng::seed_from_u64(cycle * 1_000 + thread as u64 + std::process::id() as u64 * 7);
    let mut counter = 0u64;
    while Instant::now() < deadline {
        counter += 1;
        let tag = format!("c{cycle}:t{thread}:{counter}");
        let choice = rng.gen_range(0..100);
        let result = match choice {
            0..=59 => {
                let key = rng.gen_range(0..KEYS);
                let len = value_len(&mut rng);
                emit(&format!("I P {key} {tag} {len}"));
                db.put(&key_name(key), &make_value(&tag, len))
                    .map(|()| emit(&format!("P {key} {tag} {len}")))
            }
            60..=74 => {
                let key = rng.gen_range(0..KEYS);
                emit(&format!("I D {key} {tag}"));
                db.delete(&key_name(key)).map(|_| emit(&format!("D {key} {tag}")))
            }
            75..=89 => {
                let mut batch = WriteBatch::new();
                let mut ops = Vec::new();
                let mut keys = Vec::new();
                for index in 0..rng.gen_range(2..=5) {
                    let key = rng.gen_range(0..KEYS);
                    if keys.contains(&key) {
                        continue;
                    }
                    keys.push(key);
                    if rng.gen_bool(0.75) {
                        let len = rng.gen_range(0..1_000);
                        batch.put(key_name(key), make_value(&format!("{tag}.{index}"), len));
                        ops.push(format!("P:{key}:{len}:{index}"));
                    } else {
                        batch.delete(key_name(key));
                        ops.push(format!("D:{key}"));
                    }
                }
                emit(&format!("I B {tag} {}", ops.join(" ")));
                db.write_batch(batch).map(|()| emit(&format!("B {tag}")))
            }
            _ => {
                let key = rng.gen_range(0..KEYS);
                emit(&format!("I G {key} {tag}"));
                match db.get(&key_name(key)) {
                    Ok(None) => emit(&format!("G {tag} -")),
                    Ok(Some(value)) => {
                        let tag_end = value.iter().position(|&b| b == b'|').unwrap_or(0);
                        let seen =
                            String::from_utf8_lossy(&value[..tag_end.min(64)]).replace(' ', "_");
                        emit(&format!("G {tag} {seen} {}", value.len()));
                    }
                    Err(err) => {
                        emit(&format!("E get of key {key} failed: {err}"));
                        return;
                    }
                }
                Ok(())
            }
        };
        if let Err(err) = result {
            emit(&format!("E write {tag} failed: {err}"));
            return;
        }
    }
}

/// Rewrites hot keys (outside the checked ones) with values of the checked keys' small sizes;
/// the first thread reports the collector's figures every `COLLECTOR_REPORT_EVERY_WRITES`.
fn churn_thread(db: &Db, cycle: u64, thread: usize, deadline: Instant) {
    let mut rng = ChaCha8Rng::seed_from_u64(cycle * 7_919 + thread as u64);
    let mut written = 0u64;
    while Instant::now() < deadline {
        let key = format!("hot{:03}", rng.gen_range(0..CHURN_KEYS));
        let len = rng.gen_range(0..300);
        if let Err(err) = db.put(key.as_bytes(), &make_value(&format!("hot-c{cycle}"), len)) {
            emit(&format!("E churn write failed: {err}"));
            return;
        }
        written += 1;
        if thread == 0 && written.is_multiple_of(COLLECTOR_REPORT_EVERY_WRITES) {
            if let Ok(stats) = db.stats() {
                let classes = stats.shards.iter().flat_map(|shard| shard.classes.iter());
                let (runs, moved) = classes
                    .fold((0, 0), |(r, m), c| (r + c.append.gc_runs, m + c.append.gc_slots_moved));
                emit(&format!("C {runs} {moved}"));
            }
        }
    }
}

/// Run by the parent in a child process (see the module comment); does nothing when run alone.
#[test]
#[ignore = "the child process of kill_9_loses_no_acknowledged_write; runs only when that test starts it"]
fn child_writer() {
    let Ok(dir) = std::env::var(DIR_ENV) else { return };
    let cycle: u64 = std::env::var(CYCLE_ENV).ok().and_then(|text| text.parse().ok()).unwrap_or(0);
    emit("S");
    let db = match Db::open(&dir, options(cycle)) {
        Ok(db) => db,
        Err(err) => {
            emit(&format!("E open failed: {err}"));
            return;
        }
    };
    emit("R");
    let deadline = Instant::now() + Duration::from_secs(CHILD_SECONDS_MAX);
    std::thread::scope(|scope| {
        for thread in 0..CHILD_THREADS {
            let db = &db;
            scope.spawn(move || child_thread(db, cycle, thread, deadline));
        }
        if appends(cycle) {
            for thread in 0..CHURN_THREADS {
                let db = &db;
                scope.spawn(move || churn_thread(db, cycle, thread, deadline));
            }
        }
    });
    emit("E the child was not killed in time");
}

// ---------------------------------------------------------------------------------------------
// The parent's model of one cycle. Times are line numbers of the child's output.

struct Write {
    key: usize,
    op: Op,
    batch: Option<usize>,
    issued: u64,
    /// Line of the acknowledgement; `u64::MAX` if the write was in flight at the kill.
    ended: u64,
    tag: String,
}

impl Write {
    fn acked(&self) -> bool {
        self.ended != u64::MAX
    }
}

/// A get: issued at line `started`, answered at line `ended` with the tag and length of the value
/// it saw (`None`: absent); gets cut by the kill are dropped.
struct Read {
    key: usize,
    started: u64,
    ended: u64,
    seen: Option<(String, usize)>,
}

struct Cycle {
    writes: Vec<Write>,
    by_key: Vec<Vec<usize>>,
    batches: Vec<(u64, Vec<usize>, String)>,
    /// In-flight writes by tag (batches: the index of their first write).
    pending: HashMap<String, Vec<usize>>,
    reads: Vec<Read>,
    pending_reads: HashMap<String, (usize, u64)>,
    errors: Vec<String>,
    opening: bool,
    ready: bool,
    /// The collector's figures the child last reported: victim blocks, records moved.
    collections: (u64, u64),
}

impl Cycle {
    /// A cycle whose first write of each key is its state before the cycle (line 0, acked).
    fn new(baseline: &[Option<Vec<u8>>]) -> Cycle {
        let mut cycle = Cycle {
            writes: Vec::new(),
            by_key: vec![Vec::new(); KEYS],
            batches: Vec::new(),
            pending: HashMap::new(),
            reads: Vec::new(),
            pending_reads: HashMap::new(),
            errors: Vec::new(),
            opening: false,
            ready: false,
            collections: (0, 0),
        };
        for (key, value) in baseline.iter().enumerate() {
            let op = value.clone().map_or(Op::Delete, Op::Put);
            cycle.push(Write {
                key,
                op,
                batch: None,
                issued: 0,
                ended: 0,
                tag: "state before the cycle".into(),
            });
        }
        cycle
    }

    fn push(&mut self, write: Write) -> usize {
        let index = self.writes.len();
        self.by_key[write.key].push(index);
        self.writes.push(write);
        index
    }

    fn parse_key(text: &str) -> Result<usize, String> {
        text.parse::<usize>()
            .ok()
            .filter(|&key| key < KEYS)
            .ok_or_else(|| format!("bad key {text:?}"))
    }

    /// Takes one complete line of the child's output (`line` is its number, from 1).
    fn take_line(&mut self, line: u64, text: &str) -> Result<(), String> {
        let Some(at) = text.find(MARK) else { return Ok(()) };
        let words: Vec<&str> = text[at + MARK.len()..].split(' ').collect();
        let number = |text: &str| text.parse::<usize>().map_err(|_| format!("bad number {text:?}"));
        let issue = |cycle: &mut Cycle, tag: &str, writes: Vec<Write>, batch: bool| {
            let batch_index = batch.then_some(cycle.batches.len());
            let indices: Vec<usize> = writes
                .into_iter()
                .map(|write| cycle.push(Write { batch: batch_index, ..write }))
                .collect();
            if batch {
                cycle.batches.push((line, indices.clone(), tag.to_string()));
            }
            cycle.pending.insert(tag.to_string(), indices);
        };
        match words.as_slice() {
            ["S"] => self.opening = true,
            ["R"] => self.ready = true,
            ["C", runs, moved] => self.collections = (number(runs)? as u64, number(moved)? as u64),
            ["E", ..] => self.errors.push(text[at + MARK.len()..].to_string()),
            ["I", "P", key, tag, len] => {
                let write = Write {
                    key: Self::parse_key(key)?,
                    op: Op::Put(make_value(tag, number(len)?)),
                    batch: None,
                    issued: line,
                    ended: u64::MAX,
                    tag: tag.to_string(),
                };
                issue(self, tag, vec![write], false);
            }
            ["I", "D", key, tag] => {
                let write = Write {
                    key: Self::parse_key(key)?,
                    op: Op::Delete,
                    batch: None,
                    issued: line,
                    ended: u64::MAX,
                    tag: tag.to_string(),
                };
                issue(self, tag, vec![write], false);
            }
            ["I", "B", tag, ops @ ..] => {
                let mut writes = Vec::new();
                for op in ops {
                    let parts: Vec<&str> = op.split(':').collect();
                    let (key, op) = match parts.as_slice() {
                        ["P", key, len, index] => (
                            Self::parse_key(key)?,
                            Op::Put(make_value(&format!("{tag}.{index}"), number(len)?)),
                        ),
                        ["D", key] => (Self::parse_key(key)?, Op::Delete),
                        _ => return Err(format!("bad batch op {op:?}")),
                    };
                    writes.push(Write {
                        key,
                        op,
                        batch: None,
                        issued: line,
                        ended: u64::MAX,
                        tag: tag.to_string(),
                    });
                }
                issue(self, tag, writes, true);
            }
            ["I", "G", key, tag] => {
                self.pending_reads.insert(tag.to_string(), (Self::parse_key(key)?, line));
            }
            ["G", tag, seen @ ..] => {
                let (key, started) = self
                    .pending_reads
                    .remove(*tag)
                    .ok_or_else(|| format!("answer of get {tag} never issued"))?;
                let seen = match seen {
                    ["-"] => None,
                    [value_tag, len] => Some((value_tag.to_string(), number(len)?)),
                    _ => return Err(format!("bad get answer {text:?}")),
                };
                self.reads.push(Read { key, started, ended: line, seen });
            }
            ["P", _, tag, _] | ["D", _, tag] | ["B", tag] => {
                let indices = self
                    .pending
                    .remove(*tag)
                    .ok_or_else(|| format!("acknowledgement of {tag} never issued"))?;
                for index in indices {
                    self.writes[index].ended = line;
                }
            }
            _ => return Err(format!("unknown line {text:?}")),
        }
        Ok(())
    }

    fn describe(&self, write: usize) -> String {
        let w = &self.writes[write];
        let op = match &w.op {
            Op::Put(value) => format!("put {}", describe_value(Some(value))),
            Op::Delete => "delete".to_string(),
        };
        let ended = if w.acked() {
            format!("acknowledged at line {}", w.ended)
        } else {
            "in flight at the kill".into()
        };
        format!("{op} ({}) issued at line {}, {ended}", w.tag, w.issued)
    }

    /// An acknowledged write of the same key issued after `write` was acknowledged.
    fn superseded_by(&self, write: usize) -> Option<usize> {
        let w = &self.writes[write];
        self.by_key[w.key].iter().copied().find(|&other| {
            let o = &self.writes[other];
            other != write && o.acked() && o.issued > w.ended
        })
    }

    /// Whether `write` wrote what `read` saw.
    fn read_saw(&self, read: &Read, write: usize) -> bool {
        match (&self.writes[write].op, &read.seen) {
            (Op::Put(value), Some((tag, len))) => {
                value.len() == *len && value.starts_with(format!("{tag}|").as_bytes())
            }
            (Op::Delete, None) => true,
            _ => false,
        }
    }

    /// A get that began after `write` was acknowledged and saw another state: what it saw is
    /// ordered after `write`, so `write` cannot be the key's final state.
    fn contradicting_read(&self, write: usize) -> Option<&Read> {
        let w = &self.writes[write];
        self.reads.iter().find(|read| {
            w.acked() && read.key == w.key && read.started > w.ended && !self.read_saw(read, write)
        })
    }

    /// Gets during the run: each saw a write of its key (or nothing) that no write acknowledged
    /// before the get began had replaced.
    fn check_reads(&self, violations: &mut Vec<String>) {
        for read in &self.reads {
            let fresh = self.by_key[read.key].iter().copied().any(|w| {
                let write = &self.writes[w];
                self.read_saw(read, w)
                    && write.issued < read.ended
                    && !self.by_key[read.key].iter().any(|&o| {
                        let other = &self.writes[o];
                        o != w
                            && other.acked()
                            && other.issued > write.ended
                            && other.ended < read.started
                    })
            });
            if !fresh {
                violations.push(format!(
                    "the get of key {} at lines {}–{} saw {:?}, which no write explains (or a write acknowledged before it began had replaced it)",
                    read.key, read.started, read.ended, read.seen
                ));
            }
        }
    }

    fn writer_of(&self, key: usize, value: &[u8]) -> Option<usize> {
        self.by_key[key]
            .iter()
            .copied()
            .find(|&w| matches!(&self.writes[w].op, Op::Put(v) if v == value))
    }

    fn check(&self, state: &[Option<Vec<u8>>], violations: &mut Vec<String>) {
        for (key, value) in state.iter().enumerate() {
            let problem = match value {
                Some(value) => match self.writer_of(key, value) {
                    None => Some(format!(
                        "holds {} which no write of key {key} wrote",
                        describe_value(Some(value))
                    )),
                    Some(writer) => {
                        match (self.superseded_by(writer), self.contradicting_read(writer)) {
                            (Some(newer), _) => Some(format!(
                                "holds {}, lost the later {}",
                                self.describe(writer),
                                self.describe(newer)
                            )),
                            (None, Some(read)) => Some(format!(
                                "holds {}, but the get at lines {}–{} saw {:?} after it was acknowledged",
                                self.describe(writer),
                                read.started,
                                read.ended,
                                read.seen
                            )),
                            (None, None) => None,
                        }
                    }
                },
                None => {
                    let explained = self.by_key[key].iter().any(|&w| {
                        self.writes[w].op == Op::Delete
                            && self.superseded_by(w).is_none()
                            && self.contradicting_read(w).is_none()
                    });
                    (!explained).then(|| {
                        let last = self.by_key[key]
                            .iter()
                            .copied()
                            .filter(|&w| self.writes[w].acked())
                            .max_by_key(|&w| self.writes[w].ended)
                            .expect("the baseline is acknowledged");
                        format!(
                            "is absent, but the last acknowledged write is {}",
                            self.describe(last)
                        )
                    })
                }
            };
            if let Some(problem) = problem {
                violations.push(format!("key {key} {problem}"));
            }
        }
        // Batches: all-or-nothing, across every shard they touch (one group per batch).
        for (issued, members, tag) in &self.batches {
            let by_shard: BTreeMap<&str, Vec<usize>> =
                BTreeMap::from([("of the batch", members.clone())]);
            let applied = |w: usize| match (&self.writes[w].op, &state[self.writes[w].key]) {
                (Op::Put(value), Some(held)) => value == held,
                (Op::Delete, None) => true,
                _ => false,
            };
            for (shard, members) in by_shard {
                let visible = members
                    .iter()
                    .copied()
                    .find(|&w| matches!(self.writes[w].op, Op::Put(_)) && applied(w));
                let Some(witness) = visible else { continue };
                for &member in &members {
                    if applied(member) {
                        continue;
                    }
                    let key = self.writes[member].key;
                    let newer = match &state[key] {
                        Some(value) => self
                            .writer_of(key, value)
                            .is_none_or(|w| self.writes[w].ended > *issued),
                        None => self.by_key[key].iter().any(|&d| {
                            let write = &self.writes[d];
                            write.op == Op::Delete
                                && write.batch != self.writes[member].batch
                                && write.ended > *issued
                        }),
                    };
                    if !newer {
                        violations.push(format!(
                            "batch {tag} is partly applied ({shard}): {} is visible but key {key} holds {} instead of {}",
                            self.describe(witness),
                            describe_value(state[key].as_deref()),
                            self.describe(member)
                        ));
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The parent.

/// Opens the store, timing it; reads every key, checks scan and stats; closes it.
fn reopen_and_read(
    dir: &std::path::Path,
    cycle: u64,
    violations: &mut Vec<String>,
) -> (Vec<Option<Vec<u8>>>, Duration, copse::StoreStats) {
    let started = Instant::now();
    let db = Db::open(dir, options(cycle))
        .unwrap_or_else(|err| panic!("cycle {cycle}: reopening after the kill failed: {err}"));
    let opened = started.elapsed();
    let state: Vec<Option<Vec<u8>>> = (0..KEYS)
        .map(|key| {
            db.get(&key_name(key)).unwrap_or_else(|err| {
                violations.push(format!("get of key {key} failed: {err}"));
                None
            })
        })
        .collect();
    // The checked keys are `k....`; the churn threads' hot keys (`hot...`) sort before them.
    let items = db.scan(b"k".to_vec().., KEYS * 2).expect("scan after the kill");
    let hot_keys = db.scan(..b"k".to_vec(), CHURN_KEYS * 2).expect("scan after the kill").len();
    let expected: Vec<(Vec<u8>, Vec<u8>)> = state
        .iter()
        .enumerate()
        .filter_map(|(key, value)| value.clone().map(|value| (key_name(key), value)))
        .collect();
    if items != expected {
        violations.push(format!(
            "scan returns {} items, gets find {}; or they differ",
            items.len(),
            expected.len()
        ));
    }
    let stats = db.stats().expect("stats after the kill");
    if stats.items != (expected.len() + hot_keys) as u64 {
        violations.push(format!(
            "stats count {} items, gets find {} and {hot_keys} hot keys",
            stats.items,
            expected.len()
        ));
    }
    db.close()
        .unwrap_or_else(|err| panic!("cycle {cycle}: closing the reopened store failed: {err}"));
    (state, opened, stats)
}

#[test]
fn kill_9_loses_no_acknowledged_write() {
    let cycles: u64 = std::env::var("COPSE_KILL_CYCLES")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(CYCLES_DEFAULT);
    let seed: u64 = std::env::var("COPSE_KILL_SEED")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
                as u64
        });
    eprintln!("kill test: seed {seed} (COPSE_KILL_SEED), {cycles} cycles");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let exe = std::env::current_exe().unwrap();
    let mut states: [Vec<Option<Vec<u8>>>; 2] = [vec![None; KEYS], vec![None; KEYS]];
    let (mut collections_total, mut moved_total) = (0u64, 0u64);
    let started = Instant::now();
    let (mut acked_total, mut in_flight_total, mut open_max) = (0u64, 0u64, Duration::ZERO);
    let mut last_open = Duration::ZERO;
    let mut killed_while_opening = 0u64;

    for cycle in 0..cycles {
        let store = usize::from(appends(cycle));
        let (dir, state) = (&dirs[store], &mut states[store]);
        let mut child = Command::new(&exe)
            .args(["--exact", "child_writer", "--nocapture", "--ignored", "--test-threads=1"])
            .env(DIR_ENV, dir.path())
            .env(CYCLE_ENV, cycle.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the child");
        let spawned = Instant::now();
        // Complete lines only: a line cut by the kill has no newline and is dropped.
        let (lines_sender, lines) = mpsc::channel::<String>();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match reader.read_until(b'\n', &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) if buf.ends_with(b"\n") => {
                        let _ = lines_sender
                            .send(String::from_utf8_lossy(&buf[..buf.len() - 1]).into_owned());
                    }
                    Ok(_) => break,
                }
            }
        });
        let mut model = Cycle::new(state);
        let mut line_number = 0u64;
        let mut take = |model: &mut Cycle, text: String| {
            line_number += 1;
            if let Err(err) = model.take_line(line_number, &text) {
                panic!(
                    "cycle {cycle}: cannot parse the child's line {line_number} {text:?}: {err}"
                );
            }
        };
        let early = cycle % EARLY_KILL_EVERY_CYCLES == EARLY_KILL_EVERY_CYCLES - 1;
        // Wait for the child to start opening the store (early kill) or to have opened it.
        let ready_by = spawned + Duration::from_secs(OPEN_SECONDS_MAX);
        while !(if early { model.opening } else { model.ready }) && model.errors.is_empty() {
            let wait = ready_by.saturating_duration_since(Instant::now());
            match lines.recv_timeout(wait) {
                Ok(text) => take(&mut model, text),
                Err(_) => {
                    let _ = child.kill();
                    panic!("cycle {cycle}: the child did not open the store within {OPEN_SECONDS_MAX} s");
                }
            }
        }
        if appends(cycle) && !early {
            let until = Instant::now() + WAIT_FOR_COLLECTION_MAX;
            while model.collections.1 == 0 && model.errors.is_empty() {
                let Some(wait) = until.checked_duration_since(Instant::now()) else { break };
                match lines.recv_timeout(wait) {
                    Ok(text) => take(&mut model, text),
                    Err(_) => break,
                }
            }
        }
        let kill_at = if early {
            let window_us = (2 * last_open.as_micros() as u64).max(5_000);
            Instant::now() + Duration::from_micros(rng.gen_range(0..window_us))
        } else {
            Instant::now() + Duration::from_millis(rng.gen_range(KILL_AFTER_READY_MS))
        };
        std::thread::sleep(kill_at.saturating_duration_since(Instant::now()));
        child.kill().expect("SIGKILL the child");
        let status = child.wait().expect("wait for the child");
        reader.join().unwrap();
        for text in lines.try_iter() {
            take(&mut model, text);
        }
        assert!(
            model.errors.is_empty(),
            "cycle {cycle}: the child reported failures: {:?}",
            model.errors
        );
        assert!(
            !status.success(),
            "cycle {cycle}: the child exited by itself ({status}) instead of being killed"
        );

        let mut violations = Vec::new();
        let (observed, opened, stats) = reopen_and_read(dir.path(), cycle, &mut violations);
        model.check(&observed, &mut violations);
        model.check_reads(&mut violations);
        assert!(
            violations.is_empty(),
            "cycle {cycle} (seed {seed}, {:?}): {} violations after kill -9:\n  {}",
            options(cycle).durability,
            violations.len(),
            violations[..violations.len().min(30)].join("\n  ")
        );
        assert!(
            opened < Duration::from_secs(OPEN_SECONDS_MAX),
            "cycle {cycle}: opening the store took {opened:?} (file bytes {})",
            stats.file_bytes
        );
        let acked = model.writes.iter().filter(|w| w.issued > 0 && w.acked()).count() as u64;
        let in_flight = model.writes.iter().filter(|w| !w.acked()).count() as u64;
        acked_total += acked;
        in_flight_total += in_flight;
        open_max = open_max.max(opened);
        last_open = opened;
        killed_while_opening += u64::from(model.opening && !model.ready);
        eprintln!(
            "kill test cycle {cycle}: {acked} acknowledged writes, {in_flight} in flight at the kill{}; \
             reopened in {opened:.1?}: {} items, {} file bytes, {} torn or corrupt slots, {} batches replayed",
            if !model.ready { " (killed while opening)" } else { "" },
            stats.items,
            stats.file_bytes,
            stats.shards.iter().map(|s| s.recovery.torn_or_corrupt).sum::<u64>(),
            stats.shards.iter().map(|s| s.recovery.batches_replayed).sum::<u64>(),
        );
        collections_total += model.collections.0;
        moved_total += model.collections.1;
        *state = observed;
    }
    eprintln!(
        "kill test: {cycles} cycles in {:.1?}: {acked_total} acknowledged writes checked, \
         {in_flight_total} in flight at kills, {killed_while_opening} kills while opening, slowest open {open_max:.1?}",
        started.elapsed()
    );
    assert!(acked_total > 0, "no write was acknowledged before a kill");
    eprintln!(
        "kill test: the collector took {collections_total} victim blocks and moved \
         {moved_total} records in the appending store's cycles (as last reported before kills)"
    );
    if cycles >= CYCLES_FOR_COLLECTIONS_MIN && common::engine() == copse::EngineKind::Native {
        assert!(moved_total > 0, "no collection moved a record in {cycles} cycles");
    }
}
