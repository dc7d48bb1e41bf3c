//! Crash consistency on the simulated device: every acknowledged write survives a crash at any
//! device operation, nothing that was never written appears, and batches stay all-or-nothing per
//! shard.
//!
//! For each seed a store is opened on `SimDisk::new(seed)` with a crash armed at a device
//! operation drawn from the seed (so it lands anywhere: creating the manifest and the slab files,
//! growing a slab, writing pages, flushing). Client threads then run a mixed workload over a
//! small shared key space (puts with unique values, some of them multi-page; deletes; batches of
//! 2–5 operations; gets) until the disk dies, recording when each operation was issued and when
//! it ended on one logical clock. The disk is restarted (unflushed and in-flight writes kept,
//! dropped or torn at 512-byte sectors), the store reopened, and every key checked against the
//! history:
//! - a key holds the value of a write `w` that no acknowledged write of the key *began after `w`
//!   ended* (so the latest acknowledged value, or a write issued later that was in flight or
//!   failed at the crash); it is absent only if such a `w` is a delete (or nothing was ever
//!   written); any other value (or bytes no one wrote) is a violation;
//! - a batch is all-or-nothing per shard: if one of its puts is visible, each other operation of
//!   the batch in that shard is visible too, or its key holds a write that may be newer;
//! - no read fails, in particular none reports a corrupt item;
//! - every get issued during the workload saw every write acknowledged before it began, and no
//!   write that was never acknowledged (batches spanning shards excepted).
//!
//! In a quarter of the rounds, recovery itself is crashed too (during its scan, its batch
//! replays or its erasure of torn slots) and the store recovered again, with the same checks.
//! Then a few writes on the recovered store, a clean close (after which nothing may be left
//! pending on the disk), and a reopen that must find exactly the expected state and no torn slot.
//! Every tenth seed crashes the recovered store a second time and checks again.
//!
//! Over a full run the test also checks that the interesting cases happened: crashes that tore
//! writes, recoveries that found torn slots, crashes while the store was created and during
//! recovery, batches replayed, slab files grown.
//!
//! At the end of the file, reduced reproductions of the engine bugs this test found (those still
//! open are `#[ignore]`d).
//!
//! `COPSE_CRASH_KEEP_GOING=1` reports every failing seed instead of stopping at the first;
//! `COPSE_CRASH_DIAGNOSE=1` adds the on-disk records of the keys in violation to a report.
//! Replay one seed (its durability mode, shard count and crash point are a function of the seed;
//! thread interleavings are not, so a replay may need a few runs):
//! `COPSE_CRASH_SEED_START=<seed> COPSE_CRASH_SEEDS=1 cargo test --release -p copse --test crash`

mod common;
use common::{describe_value, env_u64, make_value, Op};
use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use copse::device::sim::{RestartStats, SimDisk};
use copse::device::DeviceError;
use copse::router::shard_of;
use copse::{
    Db, OpenError, Options, PlacementSetting, ReadError, WriteBatch, WriteDurability, WriteError,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Seeds of a default run (`COPSE_CRASH_SEEDS` overrides; `COPSE_CRASH_SEED_START` is the first).
const SEEDS_DEFAULT: u64 = 1_000;
/// Below this many seeds, the aggregate checks (tearing happened, was detected, …) are skipped:
/// a replay of one seed need not tear anything. Crashes just after a recovery are rare (a second
/// crash in one seed of ten, and timing decides where it lands): at 200 seeds, a run of seeds
/// 5,000 to 5,199 saw none in one try of four.
const SEEDS_FOR_AGGREGATE_CHECKS_MIN: u64 = 1_000;
/// Keys of the shared key space: few, so clients often write the same key concurrently. The
/// first `SMALL_KEYS` take values of every size up to 60 KiB; the rest ("blobs") take values of
/// one multi-page class of 7 slots per MiB, enough of them that its slab files must grow.
const SMALL_KEYS: usize = 24;
const BLOB_KEYS: usize = 20;
const KEYS: usize = SMALL_KEYS + BLOB_KEYS;
const BLOB_KEY_PERCENT: f64 = 0.2;
const CLIENT_THREADS: usize = 3;
/// Operations a client issues at most in one round (the crash normally stops it long before).
const CLIENT_OPS_MAX: usize = 400;
/// The crash lands at a device operation drawn below this: the clients' operations are enough
/// to reach it (a round whose crash is never reached is crashed at its end, counted in
/// `never_crashed`, and must stay rare).
const CRASH_OPS_MAX: u64 = 700;
/// Some seeds crash within the first few operations: while the store is being created.
const EARLY_CRASH_OPS_MAX: u64 = 24;
const EARLY_CRASH_PERCENT: f64 = 0.15;
/// In this share of the rounds, recovery itself is crashed, half the time at one of its first
/// device operations, half the time in the close right after it, and the store recovered again.
const RECOVERY_CRASH_PERCENT: f64 = 0.25;
const RECOVERY_CRASH_OPS_MAX: u64 = 80;
/// Every this many seeds, the recovered store is crashed (and recovered) once more.
const SECOND_CRASH_EVERY_SEEDS: u64 = 10;
/// Writes on the recovered store before it is closed and reopened cleanly.
const CLEAN_OPS: usize = 12;
/// Writes of a key listed in a violation's message at most.
const KEY_HISTORY_SHOWN_MAX: usize = 12;
/// A phase of one seed (open, workload, close, …) that takes longer than this is a hang.
const PHASE_SECONDS_MAX: u64 = 60;

const SMALL_VALUE_BYTES_MAX: usize = 400;
const MEDIUM_VALUE_BYTES: std::ops::Range<usize> = 500..3_600;
const LARGE_VALUE_BYTES: std::ops::Range<usize> = 5 * 1024..60 * 1024;
/// Records of 96 to 128 KiB: the 32-page class.
const BLOB_VALUE_BYTES: std::ops::Range<usize> = 97 * 1024..127 * 1024;

fn key_name(key: usize) -> Vec<u8> {
    if key < SMALL_KEYS {
        format!("key-{key:02}").into_bytes()
    } else {
        format!("blob-{:02}", key - SMALL_KEYS).into_bytes()
    }
}

fn pick_key(rng: &mut ChaCha8Rng) -> usize {
    if rng.gen_bool(BLOB_KEY_PERCENT) {
        rng.gen_range(SMALL_KEYS..KEYS)
    } else {
        rng.gen_range(0..SMALL_KEYS)
    }
}

/// Picks the length of a value for `key`: for small keys mostly in-page classes, some large
/// in-page, some multi-page.
fn value_len(key: usize, rng: &mut ChaCha8Rng) -> usize {
    if key >= SMALL_KEYS {
        return rng.gen_range(BLOB_VALUE_BYTES);
    }
    match rng.gen_range(0..100) {
        0..=69 => rng.gen_range(0..=SMALL_VALUE_BYTES_MAX),
        70..=84 => rng.gen_range(MEDIUM_VALUE_BYTES),
        _ => rng.gen_range(LARGE_VALUE_BYTES),
    }
}

// ---------------------------------------------------------------------------------------------
// Infrastructure: a watchdog for hangs, and a record of panics in shard and client threads (a
// shard's would otherwise only show as `Closed` errors).

struct Watchdog {
    phase: Mutex<(Instant, String)>,
}

fn watchdog() -> &'static Watchdog {
    static WATCHDOG: std::sync::OnceLock<&'static Watchdog> = std::sync::OnceLock::new();
    WATCHDOG.get_or_init(|| {
        let dog: &'static Watchdog = Box::leak(Box::new(Watchdog {
            phase: Mutex::new((Instant::now(), "starting".into())),
        }));
        std::thread::Builder::new()
            .name("crash-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_secs(1));
                let (since, phase) = dog.phase.lock().unwrap_or_else(|p| p.into_inner()).clone();
                if since.elapsed() > Duration::from_secs(PHASE_SECONDS_MAX) {
                    // Straight to stderr: the test harness would swallow a captured `eprintln!`.
                    use std::io::Write;
                    let _ = writeln!(
                        std::io::stderr(),
                        "crash test HUNG: {phase} for more than {PHASE_SECONDS_MAX} s; aborting"
                    );
                    std::process::abort();
                }
            })
            .expect("spawn the watchdog");
        dog
    })
}

impl Watchdog {
    fn phase(&self, phase: String) {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner()) = (Instant::now(), phase);
    }
}

static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current().name().unwrap_or("unnamed").to_string();
            if thread.starts_with("copse-shard") || thread.starts_with("crash-client") {
                PANICS
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(format!("thread {thread}: {info}"));
            }
            previous(info);
        }));
    });
}

fn take_panics() -> Vec<String> {
    std::mem::take(&mut *PANICS.lock().unwrap_or_else(|p| p.into_inner()))
}

// ---------------------------------------------------------------------------------------------
// The history of one round and the checks against it.

/// One write of one key (a batch contributes one per operation). Times are on the round's
/// logical clock: `issued` before the call, `ended` after it returned.
struct Write {
    key: usize,
    op: Op,
    batch: Option<usize>,
    issued: u64,
    ended: u64,
    acked: bool,
    label: String,
}

struct Batch {
    issued: u64,
    writes: Vec<usize>,
    label: String,
}

struct Read {
    key: usize,
    started: u64,
    ended: u64,
    value: Option<Vec<u8>>,
    label: String,
}

/// What a client did, in its order.
enum Event {
    Write {
        key: usize,
        op: Op,
        issued: u64,
        ended: u64,
        acked: bool,
        label: String,
    },
    Batch {
        ops: Vec<(usize, Op)>,
        issued: u64,
        ended: u64,
        acked: bool,
        label: String,
    },
    Read {
        key: usize,
        started: u64,
        ended: u64,
        value: Option<Vec<u8>>,
        label: String,
    },
    /// Something no crash explains (a write error before the disk crashed, a corrupt read, …).
    Unexpected(String),
}

struct History {
    writes: Vec<Write>,
    batches: Vec<Batch>,
    reads: Vec<Read>,
    by_key: Vec<Vec<usize>>,
    unexpected: Vec<String>,
}

impl History {
    /// A history whose first write of each key is its state before the round (time 0, acked).
    fn new(baseline: &[Option<Vec<u8>>]) -> History {
        let mut history = History {
            writes: Vec::new(),
            batches: Vec::new(),
            reads: Vec::new(),
            by_key: vec![Vec::new(); KEYS],
            unexpected: Vec::new(),
        };
        for (key, value) in baseline.iter().enumerate() {
            let op = value.clone().map_or(Op::Delete, Op::Put);
            history.push_write(Write {
                key,
                op,
                batch: None,
                issued: 0,
                ended: 0,
                acked: true,
                label: "state before the round".into(),
            });
        }
        history
    }

    fn push_write(&mut self, write: Write) -> usize {
        let index = self.writes.len();
        self.by_key[write.key].push(index);
        self.writes.push(write);
        index
    }

    fn add(&mut self, events: Vec<Event>) {
        for event in events {
            match event {
                Event::Write { key, op, issued, ended, acked, label } => {
                    self.push_write(Write { key, op, batch: None, issued, ended, acked, label });
                }
                Event::Batch { ops, issued, ended, acked, label } => {
                    let batch = self.batches.len();
                    let writes = ops
                        .into_iter()
                        .map(|(key, op)| {
                            self.push_write(Write {
                                key,
                                op,
                                batch: Some(batch),
                                issued,
                                ended,
                                acked,
                                label: label.clone(),
                            })
                        })
                        .collect();
                    self.batches.push(Batch { issued, writes, label });
                }
                Event::Read { key, started, ended, value, label } => {
                    self.reads.push(Read { key, started, ended, value, label })
                }
                Event::Unexpected(what) => self.unexpected.push(what),
            }
        }
    }

    fn describe(&self, write: usize) -> String {
        let w = &self.writes[write];
        let op = match &w.op {
            Op::Put(value) => format!("put {}", describe_value(Some(value))),
            Op::Delete => "delete".to_string(),
        };
        format!(
            "{op} by {}{} [issued {}, ended {}, {}]",
            if w.batch.is_some() { "the batch " } else { "" },
            w.label,
            w.issued,
            w.ended,
            if w.acked { "acknowledged" } else { "NOT acknowledged" }
        )
    }

    /// Every write of `key` in issue order (at most the last `KEY_HISTORY_SHOWN_MAX`), for messages.
    fn key_history(&self, key: usize) -> String {
        let mut writes = self.by_key[key].clone();
        writes.sort_by_key(|&w| (self.writes[w].issued, w));
        let skipped = writes.len().saturating_sub(KEY_HISTORY_SHOWN_MAX);
        let shown: Vec<String> = writes[skipped..].iter().map(|&w| self.describe(w)).collect();
        let reads: Vec<String> =
            self.reads.iter().filter(|read| read.key == key).map(Self::describe_read).collect();
        format!(
            "history of key {key} ({skipped} earlier writes not shown):\n      {}\n    its gets: {}",
            shown.join("\n      "),
            reads.join("; ")
        )
    }

    /// An acknowledged write of `write`'s key that began after `write` ended and ended before
    /// `before`: it is ordered after `write`, so `write` cannot be the key's state at `before`.
    fn superseded_by(&self, write: usize, before: u64) -> Option<usize> {
        let w = &self.writes[write];
        self.by_key[w.key].iter().copied().find(|&other| {
            let o = &self.writes[other];
            other != write && o.acked && o.issued > w.ended && o.ended < before
        })
    }

    /// A get of `write`'s key that began after `write` was acknowledged and saw another state:
    /// the write it saw is ordered after `write`, so `write` cannot be the key's final state
    /// either. (A write never acknowledged was never applied in memory, so gets say nothing
    /// about it: it may still have reached the disk, after what they saw.)
    fn contradicting_read(&self, write: usize) -> Option<&Read> {
        let w = &self.writes[write];
        self.reads.iter().find(|read| {
            w.acked
                && read.key == w.key
                && read.started > w.ended
                && match (&w.op, &read.value) {
                    (Op::Put(value), Some(seen)) => seen != value,
                    (Op::Put(_), None) => true,
                    (Op::Delete, seen) => seen.is_some(),
                }
        })
    }

    fn describe_read(read: &Read) -> String {
        format!(
            "the get by {} [started {}, ended {}] that saw {}",
            read.label,
            read.started,
            read.ended,
            describe_value(read.value.as_deref())
        )
    }

    fn writer_of(&self, key: usize, value: &[u8]) -> Option<usize> {
        self.by_key[key]
            .iter()
            .copied()
            .find(|&w| matches!(&self.writes[w].op, Op::Put(v) if v == value))
    }

    /// The acknowledged write of `key` that ended last (for messages).
    fn last_acked(&self, key: usize) -> usize {
        *self.by_key[key]
            .iter()
            .filter(|&&w| self.writes[w].acked)
            .max_by_key(|&&w| self.writes[w].ended)
            .unwrap()
    }

    /// Checks that `key` may hold `value` for a read over [`started`, `ended`]. After recovery,
    /// both are `u64::MAX` and writes that were never acknowledged may explain the state; during
    /// the workload only acknowledged writes may (a write is applied only once durable), except
    /// members of batches (a batch spanning shards fails if one part fails).
    fn check_state(
        &self,
        key: usize,
        value: Option<&[u8]>,
        started: u64,
        ended: u64,
        during_run: bool,
        what: &str,
    ) -> Option<String> {
        let usable = |w: usize| {
            let write = &self.writes[w];
            write.issued < ended && (!during_run || write.acked || write.batch.is_some())
        };
        match value {
            Some(value) => {
                let Some(writer) = self.writer_of(key, value) else {
                    let elsewhere = (0..KEYS)
                        .find_map(|other| self.writer_of(other, value).map(|w| (other, w)));
                    return Some(match elsewhere {
                        Some((other, w)) => format!(
                            "{what}: key {key} holds the value of key {other}: {}",
                            self.describe(w)
                        ),
                        None => format!(
                            "{what}: key {key} holds {} which no write of this round wrote (corrupt or invented)",
                            describe_value(Some(value))
                        ),
                    });
                };
                if !usable(writer) {
                    return Some(format!(
                        "{what}: key {key} holds a value it may not hold yet: {}",
                        self.describe(writer)
                    ));
                }
                if let Some(newer) = self.superseded_by(writer, started) {
                    return Some(format!(
                        "{what}: key {key} holds a lost-update value: {}; but {} began after it ended; {}",
                        self.describe(writer),
                        self.describe(newer),
                        self.key_history(key)
                    ));
                }
                let read = self.contradicting_read(writer).filter(|_| !during_run)?;
                Some(format!(
                    "{what}: key {key} holds {}, but {} began after it ended; {}",
                    self.describe(writer),
                    Self::describe_read(read),
                    self.key_history(key)
                ))
            }
            None => {
                let deletes: Vec<usize> = self.by_key[key]
                    .iter()
                    .copied()
                    .filter(|&w| self.writes[w].op == Op::Delete && usable(w))
                    .collect();
                let explains = |d: usize| {
                    self.superseded_by(d, started).is_none()
                        && (during_run || self.contradicting_read(d).is_none())
                };
                if deletes.iter().any(|&d| explains(d)) {
                    return None;
                }
                Some(format!(
                    "{what}: key {key} is absent, but no delete explains it; the last acknowledged write is {}; {}",
                    self.describe(self.last_acked(key)),
                    self.key_history(key)
                ))
            }
        }
    }

    fn check_reads_during_run(&self, violations: &mut Vec<String>) {
        for read in &self.reads {
            let what =
                format!("get by {} [started {}, ended {}]", read.label, read.started, read.ended);
            if let Some(violation) = self.check_state(
                read.key,
                read.value.as_deref(),
                read.started,
                read.ended,
                true,
                &what,
            ) {
                violations.push(violation);
            }
        }
    }

    /// Returns the keys in violation.
    fn check_recovered(
        &self,
        state: &[Option<Vec<u8>>],
        violations: &mut Vec<String>,
    ) -> Vec<usize> {
        let mut bad_keys = Vec::new();
        for (key, value) in state.iter().enumerate() {
            if let Some(violation) =
                self.check_state(key, value.as_deref(), u64::MAX, u64::MAX, false, "after recovery")
            {
                violations.push(violation);
                bad_keys.push(key);
            }
        }
        bad_keys
    }

    /// All-or-nothing per shard: if a put of a batch is visible, every other operation of the
    /// batch in that shard is visible too, or its key holds a write that may be newer.
    fn check_batches(&self, state: &[Option<Vec<u8>>], shards: u32, violations: &mut Vec<String>) {
        for batch in &self.batches {
            let mut by_shard: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
            for &w in &batch.writes {
                by_shard
                    .entry(shard_of(&key_name(self.writes[w].key), shards))
                    .or_default()
                    .push(w);
            }
            for (shard, members) in by_shard {
                let applied = |w: usize| {
                    let write = &self.writes[w];
                    match (&write.op, &state[write.key]) {
                        (Op::Put(value), Some(held)) => value == held,
                        (Op::Delete, None) => true,
                        _ => false,
                    }
                };
                let visible: Vec<usize> = members
                    .iter()
                    .copied()
                    .filter(|&w| matches!(self.writes[w].op, Op::Put(_)) && applied(w))
                    .collect();
                let Some(&witness) = visible.first() else {
                    continue;
                };
                for &member in &members {
                    if applied(member) {
                        continue;
                    }
                    let key = self.writes[member].key;
                    // The key's state must come from a write that may be ordered after the batch.
                    let newer = match &state[key] {
                        Some(value) => match self.writer_of(key, value) {
                            Some(writer) => self.writes[writer].ended > batch.issued,
                            None => true, // reported by check_recovered
                        },
                        None => self.by_key[key].iter().any(|&d| {
                            let write = &self.writes[d];
                            write.op == Op::Delete
                                && write.batch != self.writes[member].batch
                                && write.ended > batch.issued
                        }),
                    };
                    if !newer {
                        violations.push(format!(
                            "batch by {} is partly applied in shard {shard}: key {} shows its {} but key {key} holds {} instead of its {}",
                            batch.label,
                            self.writes[witness].key,
                            self.describe(witness),
                            describe_value(state[key].as_deref()),
                            self.describe(member),
                        ));
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The workload.

struct Clock(AtomicU64);

impl Clock {
    fn tick(&self) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

fn write_error_expected(err: &WriteError) -> bool {
    matches!(err, WriteError::Poisoned | WriteError::Device(DeviceError::Crashed))
}

/// One client: a mixed workload until the disk crashes (or `CLIENT_OPS_MAX` operations).
fn client(
    db: &Db,
    disk: &SimDisk,
    seed: u64,
    round: usize,
    thread: usize,
    clock: &Clock,
) -> Vec<Event> {
    let mut rng = ChaCha8Rng::seed_from_u64(
        seed.wrapping_mul(0x9e37_79b9).wrapping_add((round * 16 + thread) as u64),
    );
    let mut events = Vec::new();
    let mut stop = false;
    for counter in 0..CLIENT_OPS_MAX {
        if stop || disk.has_crashed() {
            break;
        }
        let label = format!("r{round} thread {thread} op {counter}");
        let tag = format!("s{seed}:r{round}:t{thread}:{counter}");
        let mut failed: Option<(&str, WriteError)> = None;
        match rng.gen_range(0..100) {
            0..=44 => {
                let key = pick_key(&mut rng);
                let value = make_value(&tag, value_len(key, &mut rng));
                let issued = clock.tick();
                let result = db.put(&key_name(key), &value);
                let ended = clock.tick();
                failed = result.as_ref().err().map(|err| ("put", err.clone()));
                events.push(Event::Write {
                    key,
                    op: Op::Put(value),
                    issued,
                    ended,
                    acked: result.is_ok(),
                    label,
                });
            }
            45..=59 => {
                let key = pick_key(&mut rng);
                let issued = clock.tick();
                let result = db.delete(&key_name(key));
                let ended = clock.tick();
                failed = result.as_ref().err().map(|err| ("delete", err.clone()));
                events.push(Event::Write {
                    key,
                    op: Op::Delete,
                    issued,
                    ended,
                    acked: result.is_ok(),
                    label,
                });
            }
            60..=74 => {
                let count = rng.gen_range(2..=5);
                let mut keys: Vec<usize> = Vec::new();
                while keys.len() < count {
                    let key = pick_key(&mut rng);
                    if !keys.contains(&key) {
                        keys.push(key);
                    }
                }
                let mut batch = WriteBatch::new();
                let mut ops = Vec::new();
                for (index, key) in keys.into_iter().enumerate() {
                    if rng.gen_bool(0.75) {
                        let len = if key >= SMALL_KEYS {
                            rng.gen_range(BLOB_VALUE_BYTES)
                        } else if rng.gen_bool(0.1) {
                            rng.gen_range(LARGE_VALUE_BYTES)
                        } else {
                            rng.gen_range(0..=SMALL_VALUE_BYTES_MAX)
                        };
                        let value = make_value(&format!("{tag}.{index}"), len);
                        batch.put(key_name(key), value.clone());
                        ops.push((key, Op::Put(value)));
                    } else {
                        batch.delete(key_name(key));
                        ops.push((key, Op::Delete));
                    }
                }
                let issued = clock.tick();
                let result = db.write_batch(batch);
                let ended = clock.tick();
                failed = result.as_ref().err().map(|err| ("write_batch", err.clone()));
                events.push(Event::Batch { ops, issued, ended, acked: result.is_ok(), label });
            }
            _ => {
                let key = pick_key(&mut rng);
                let started = clock.tick();
                let result = db.get(&key_name(key));
                let ended = clock.tick();
                match result {
                    Ok(value) => events.push(Event::Read { key, started, ended, value, label }),
                    Err(ReadError::Device(DeviceError::Crashed)) if disk.has_crashed() => {}
                    Err(err) => events.push(Event::Unexpected(format!(
                        "get of key {key} by {label} failed with {err:?} (disk crashed: {})",
                        disk.has_crashed()
                    ))),
                }
            }
        }
        // A failed write is expected only once the disk has crashed; the client stops there.
        if let Some((what, err)) = failed {
            stop = true;
            if !disk.has_crashed() || !write_error_expected(&err) {
                events.push(Event::Unexpected(format!(
                    "{what} by r{round} thread {thread} op {counter} failed with {err:?} (disk crashed: {})",
                    disk.has_crashed()
                )));
            }
        }
    }
    events
}

fn run_clients(db: &Db, disk: &SimDisk, seed: u64, round: usize) -> Vec<Event> {
    let clock = Clock(AtomicU64::new(0));
    std::thread::scope(|scope| {
        let clients: Vec<_> = (0..CLIENT_THREADS)
            .map(|thread| {
                let clock = &clock;
                std::thread::Builder::new()
                    .name(format!("crash-client-{thread}"))
                    .spawn_scoped(scope, move || client(db, disk, seed, round, thread, clock))
                    .expect("spawn a client")
            })
            .collect();
        let mut events = Vec::new();
        for client in clients {
            match client.join() {
                Ok(client_events) => events.extend(client_events),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        events
    })
}

// ---------------------------------------------------------------------------------------------
// One seed.

#[derive(Default, Debug)]
struct Totals {
    seeds: u64,
    rounds: u64,
    crashed_while_opening: u64,
    crashed_during_recovery: u64,
    crashed_after_recovery: u64,
    crashed_before_first_ack: u64,
    never_crashed: u64,
    restart: RestartStats,
    torn_or_corrupt: u64,
    batches_replayed: u64,
    /// Records of chains recovery found incomplete (and erased).
    broken_chain_records: u64,
    acked_writes: u64,
    unacked_writes: u64,
    reads_checked: u64,
    grown_slab_files: u64,
    max_round_ops: u64,
}

struct Config {
    seed: u64,
    durability: WriteDurability,
    shards: usize,
    /// Every in-page class appended, in one-page blocks under a tight space ceiling, so that
    /// crashes also strike collections (docs/placement.md).
    append: bool,
    /// `Options::batch_record_bytes_max`: small in some seeds, so batches are chains.
    batch_record_bytes_max: usize,
}

impl Config {
    /// One in-place shard, RWF_DSYNC writes, batches of one record: the reduced reproductions'.
    fn plain(seed: u64) -> Config {
        Config {
            seed,
            durability: WriteDurability::Dsync,
            shards: 1,
            append: false,
            batch_record_bytes_max: copse::limits::BATCH_RECORD_BYTES_MAX,
        }
    }

    fn open(&self, disk: &SimDisk) -> Result<Db, OpenError> {
        let options = Options {
            shards: self.shards,
            cache_bytes: 2 << 20,
            durability: self.durability,
            show_progress: false,
            placement: if self.append {
                PlacementSetting::Append
            } else {
                PlacementSetting::InPlace
            },
            append_block_pages: 1,
            space_amplification_max: 1.2,
            batch_record_bytes_max: self.batch_record_bytes_max,
            ..Options::default()
        };
        Db::open_with_storage(Arc::new(disk.storage(self.durability)), options)
    }

    fn phase(&self, round: usize, what: &str) {
        watchdog().phase(format!(
            "seed {} ({:?}, {} shards) round {round}: {what}",
            self.seed, self.durability, self.shards
        ));
    }
}

/// Reads every key; a failed read is a violation (the disk is healthy now).
fn read_all(db: &Db, what: &str, violations: &mut Vec<String>) -> Vec<Option<Vec<u8>>> {
    (0..KEYS)
        .map(|key| match db.get(&key_name(key)) {
            Ok(value) => value,
            Err(err) => {
                let kind =
                    if matches!(err, ReadError::Corrupt { .. }) { "CORRUPT" } else { "error" };
                violations.push(format!("{what}: get of key {key} returned {kind}: {err}"));
                None
            }
        })
        .collect()
}

/// Checks that a scan agrees with the gets and that stats count the live keys.
fn check_scan_and_stats(
    db: &Db,
    state: &[Option<Vec<u8>>],
    what: &str,
    violations: &mut Vec<String>,
) -> Option<copse::StoreStats> {
    match db.scan(.., 10_000) {
        Ok(items) => {
            let mut expected: Vec<(Vec<u8>, Vec<u8>)> = state
                .iter()
                .enumerate()
                .filter_map(|(key, value)| value.clone().map(|value| (key_name(key), value)))
                .collect();
            expected.sort();
            if items != expected {
                let keys = |items: &[(Vec<u8>, Vec<u8>)]| {
                    items
                        .iter()
                        .map(|(k, v)| {
                            format!("{}={}", String::from_utf8_lossy(k), describe_value(Some(v)))
                        })
                        .collect::<Vec<_>>()
                };
                violations.push(format!(
                    "{what}: scan disagrees with get: scan {:?}, get {:?}",
                    keys(&items),
                    keys(&expected)
                ));
            }
        }
        Err(err) => violations.push(format!("{what}: scan failed: {err}")),
    }
    match db.stats() {
        Ok(stats) => {
            let live = state.iter().filter(|value| value.is_some()).count() as u64;
            if stats.items != live {
                violations
                    .push(format!("{what}: stats count {} items, get finds {live}", stats.items));
            }
            Some(stats)
        }
        Err(err) => {
            violations.push(format!("{what}: stats failed: {err}"));
            None
        }
    }
}

/// Writes on a healthy store, each of which must succeed; updates `state`.
fn clean_writes(
    db: &Db,
    rng: &mut ChaCha8Rng,
    seed: u64,
    round: usize,
    state: &mut [Option<Vec<u8>>],
    violations: &mut Vec<String>,
) {
    for counter in 0..CLEAN_OPS {
        let tag = format!("s{seed}:r{round}:clean:{counter}");
        let key = pick_key(rng);
        let result = match rng.gen_range(0..10) {
            0..=5 => {
                let value = make_value(&tag, value_len(key, rng));
                db.put(&key_name(key), &value).map(|()| state[key] = Some(value))
            }
            6..=7 => db.delete(&key_name(key)).map(|existed| {
                if existed != state[key].is_some() {
                    violations.push(format!(
                        "clean delete of key {key} answered existed={existed}, state {}",
                        describe_value(state[key].as_deref())
                    ));
                }
                state[key] = None;
            }),
            _ => {
                let mut batch = WriteBatch::new();
                let mut updates = Vec::new();
                for index in 0..rng.gen_range(2..=5) {
                    let key = pick_key(rng);
                    if rng.gen_bool(0.7) {
                        let value = make_value(&format!("{tag}.{index}"), value_len(key, rng));
                        batch.put(key_name(key), value.clone());
                        updates.push((key, Some(value)));
                    } else {
                        batch.delete(key_name(key));
                        updates.push((key, None));
                    }
                }
                db.write_batch(batch).map(|()| {
                    // Within a batch the last operation of a key wins.
                    for (key, value) in updates {
                        state[key] = value;
                    }
                })
            }
        };
        if let Err(err) = result {
            violations.push(format!("write {counter} on the recovered store failed: {err}"));
        }
    }
}

fn compare_exact(
    got: &[Option<Vec<u8>>],
    expected: &[Option<Vec<u8>>],
    what: &str,
    violations: &mut Vec<String>,
) {
    for key in 0..KEYS {
        if got[key] != expected[key] {
            violations.push(format!(
                "{what}: key {key} holds {}, expected {}",
                describe_value(got[key].as_deref()),
                describe_value(expected[key].as_deref())
            ));
        }
    }
}

fn torn_or_corrupt(stats: &copse::StoreStats) -> u64 {
    stats.shards.iter().map(|shard| shard.recovery.torn_or_corrupt).sum()
}

/// `COPSE_CRASH_DIAGNOSE=1`: on a violation after recovery, list the records of the keys in
/// violation found in the disk image at the crash and in the image recovery read (costs a copy of
/// every image per round, so it is off by default).
fn diagnose() -> bool {
    std::env::var("COPSE_CRASH_DIAGNOSE").is_ok_and(|value| value == "1")
}

fn disk_images(disk: &SimDisk) -> BTreeMap<String, Vec<u8>> {
    disk.file_names()
        .into_iter()
        .filter_map(|name| disk.read_file(&name).map(|image| (name, image)))
        .collect()
}

/// The records (items, tombstones, batch operations) of `keys` in slab images, one line each.
fn records_on_disk(images: &BTreeMap<String, Vec<u8>>, keys: &[usize]) -> Vec<String> {
    use copse::engine::batch_codec::decode_batch;
    use copse::engine::native::format::class_of_file_name;
    use copse::engine::native::format::{
        decode_slab_header, decode_slot, peek_header, Loc, RecordKind, RecordLayout, SizeClass,
        Slot, RECORD_HEADER_BYTES,
    };
    use copse::limits::PAGE_BYTES;
    let names: Vec<Vec<u8>> = keys.iter().map(|&key| key_name(key)).collect();
    let mut lines = Vec::new();
    // Per shard: the highest durable watermark (`aux`) a valid record carries, and where.
    let mut watermarks: BTreeMap<u32, (u64, String)> = BTreeMap::new();
    for (name, image) in images {
        let Some((dir, file)) = name.split_once('/') else { continue };
        let (Some(shard), Some(class_id)) = (
            dir.strip_prefix("shard-").and_then(|n| n.parse::<u32>().ok()),
            class_of_file_name(file),
        ) else {
            continue;
        };
        let class = SizeClass::get(class_id);
        let slot_bytes = class.slot_bytes as usize;
        let layout = decode_slab_header(image).map_or(RecordLayout::current(), |header| {
            RecordLayout::of_version(header.format_version)
        });
        for slot in 0..class.slots_in_file(image.len() as u64) {
            let start = class.page_of_slot(slot) as usize * PAGE_BYTES + class.offset_in_page(slot);
            let Some(bytes) = image.get(start..start + slot_bytes) else { break };
            let (header, key, value) =
                match decode_slot(bytes, layout, shard, Loc::new(class_id, slot, 0), slot_bytes) {
                    Ok(Slot::Record { header, key, value }) => (header, key, value),
                    Ok(Slot::Empty) => continue,
                    Err(defect) => {
                        // A damaged slot whose header still names one of the keys.
                        let Some(header) = peek_header(bytes, layout) else { continue };
                        let key_end = RECORD_HEADER_BYTES + header.key_bytes as usize;
                        if bytes
                            .get(RECORD_HEADER_BYTES..key_end)
                            .is_some_and(|key| names.iter().any(|n| n == key))
                        {
                            lines.push(format!(
                            "{name} slot {slot}: DAMAGED ({defect}) {:?} seq {} watermark {} {}",
                            header.kind,
                            header.seq,
                            header.aux,
                            String::from_utf8_lossy(&bytes[RECORD_HEADER_BYTES..key_end])
                        ));
                        }
                        continue;
                    }
                };
            if header.kind != RecordKind::Free {
                let highest = watermarks.entry(shard).or_insert((0, String::new()));
                if header.aux > highest.0 {
                    *highest = (
                        header.aux,
                        format!("{name} slot {slot} ({:?} seq {})", header.kind, header.seq),
                    );
                }
            }
            let place = format!("{name} slot {slot}: seq {} watermark {}", header.seq, header.aux);
            match header.kind {
                RecordKind::Put | RecordKind::Tombstone if names.iter().any(|n| n == key) => {
                    lines.push(format!(
                        "{place} {:?} {} {}",
                        header.kind,
                        String::from_utf8_lossy(key),
                        describe_value(Some(value))
                    ));
                }
                RecordKind::Batch => {
                    for op in decode_batch(value).unwrap_or_default() {
                        let what = match &op {
                            copse::BatchOp::Put { key, value } => format!(
                                "put {} {}",
                                String::from_utf8_lossy(key),
                                describe_value(Some(value))
                            ),
                            copse::BatchOp::Delete { key } => {
                                format!("delete {}", String::from_utf8_lossy(key))
                            }
                        };
                        if names.iter().any(|n| n == op.key()) {
                            lines.push(format!("{place} batch record with {what}"));
                        }
                    }
                }
                _ => {}
            }
        }
    }
    for (shard, (watermark, place)) in watermarks {
        lines.push(format!(
            "shard {shard}: highest watermark on a valid record {watermark}, at {place}"
        ));
    }
    lines
}

/// Runs one seed; returns the violations found (empty: the seed passed).
fn run_seed(seed: u64, totals: &mut Totals) -> Vec<String> {
    let config = Config {
        seed,
        durability: if seed.is_multiple_of(2) {
            WriteDurability::Dsync
        } else {
            WriteDurability::FlushPerRound
        },
        shards: 1 + (seed / 2 % 3) as usize,
        // Every third seed, from its own bits so the other seeds run as they did before.
        append: (seed / 6).is_multiple_of(3),
        // Every third seed records its batches in chains of small records (256 B to 4 KiB),
        // so that crashes strike chains half written and half erased.
        batch_record_bytes_max: match (seed / 18) % 3 == 1 {
            true => 256 << (seed / 54 % 5),
            false => copse::limits::BATCH_RECORD_BYTES_MAX,
        },
    };
    let rounds =
        if seed % SECOND_CRASH_EVERY_SEEDS == SECOND_CRASH_EVERY_SEEDS - 1 { 2 } else { 1 };
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x00c0_55e0_c4a5_4000);
    let mut violations = Vec::new();
    let mut disk = SimDisk::new(seed);
    let mut state: Vec<Option<Vec<u8>>> = vec![None; KEYS];
    let mut db: Option<Db> = None;
    totals.seeds += 1;

    for round in 0..rounds {
        totals.rounds += 1;
        let crash_after = if rng.gen_bool(EARLY_CRASH_PERCENT) {
            rng.gen_range(0..EARLY_CRASH_OPS_MAX)
        } else {
            rng.gen_range(0..CRASH_OPS_MAX)
        };
        let ops_before = disk.ops();
        disk.crash_after_ops(crash_after);
        let mut history = History::new(&state);
        config.phase(round, &format!("opening with a crash after {crash_after} device operations"));
        let opened = match db.take() {
            Some(db) => Some(db),
            None => match config.open(&disk) {
                Ok(db) => Some(db),
                Err(err) => {
                    if !disk.has_crashed() {
                        violations.push(format!("open failed without a crash: {err}"));
                        return violations;
                    }
                    totals.crashed_while_opening += 1;
                    None
                }
            },
        };
        if let Some(db) = opened {
            config.phase(round, "running the workload");
            let events = run_clients(&db, &disk, seed, round);
            if !disk.has_crashed() {
                totals.never_crashed += 1;
                disk.crash_now();
            }
            config.phase(round, "closing after the crash");
            let _ = db.close();
            drop(db);
            history.add(events);
        }
        totals.max_round_ops = totals.max_round_ops.max(disk.ops() - ops_before);
        let acked = history.writes.iter().filter(|w| w.acked && w.issued > 0).count() as u64;
        totals.acked_writes += acked;
        totals.crashed_before_first_ack += u64::from(acked == 0);
        totals.unacked_writes += history.writes.iter().filter(|w| !w.acked).count() as u64;
        totals.reads_checked += history.reads.len() as u64;
        violations.extend(history.unexpected.iter().cloned());
        history.check_reads_during_run(&mut violations);

        // Reboot and recover; some seeds crash during that recovery too and recover again.
        config.phase(round, "restarting the disk and recovering");
        let mut rebooted = disk.restart();
        let mut restart = rebooted.restart_stats();
        if rng.gen_bool(RECOVERY_CRASH_PERCENT) {
            // How many device operations a clean open, and the close after it, take on this
            // image: measured on a copy (a restart of a disk with nothing pending is the same
            // image), so that half of these crashes land in the close right after a recovery,
            // which a fixed range of operations almost never reached once opens grew longer.
            let probe = rebooted.restart();
            rebooted = rebooted.restart();
            let (open_ops, close_ops) = match config.open(&probe) {
                Ok(db) => {
                    let opened = probe.ops();
                    let _ = db.close();
                    (opened, probe.ops())
                }
                Err(err) => {
                    violations.push(format!("recovery failed without a crash: {err}"));
                    return violations;
                }
            };
            let crash_at = if rng.gen_bool(0.5) {
                rng.gen_range(0..open_ops.clamp(1, RECOVERY_CRASH_OPS_MAX))
            } else {
                rng.gen_range(open_ops..close_ops.max(open_ops + 1))
            };
            rebooted.crash_after_ops(crash_at);
            match config.open(&rebooted) {
                Ok(db) => {
                    let _ = db.close();
                    drop(db);
                    totals.crashed_after_recovery += u64::from(rebooted.has_crashed());
                }
                Err(err) => {
                    if !rebooted.has_crashed() {
                        violations.push(format!("recovery failed without a crash: {err}"));
                        return violations;
                    }
                    totals.crashed_during_recovery += 1;
                }
            }
            rebooted = rebooted.restart();
            let again = rebooted.restart_stats();
            restart.kept_writes += again.kept_writes;
            restart.dropped_writes += again.dropped_writes;
            restart.torn_writes += again.torn_writes;
        }
        totals.restart.kept_writes += restart.kept_writes;
        totals.restart.dropped_writes += restart.dropped_writes;
        totals.restart.torn_writes += restart.torn_writes;
        let diagnosis = diagnose().then(|| (disk_images(&disk), disk_images(&rebooted)));
        let recovered = match config.open(&rebooted) {
            Ok(db) => db,
            Err(err) => {
                violations.push(format!(
                    "recovery failed to open the store: {err} (restart {restart:?})"
                ));
                return violations;
            }
        };
        config.phase(round, "checking the recovered store");
        let observed = read_all(&recovered, "after recovery", &mut violations);
        let bad_keys = history.check_recovered(&observed, &mut violations);
        if let (Some((at_crash, restarted)), false) = (&diagnosis, bad_keys.is_empty()) {
            violations.push(format!(
                "records of keys {bad_keys:?} on the disk at the crash (every completed write):\n      {}",
                records_on_disk(at_crash, &bad_keys).join("\n      ")
            ));
            violations.push(format!(
                "records of keys {bad_keys:?} in the image recovery read:\n      {}",
                records_on_disk(restarted, &bad_keys).join("\n      ")
            ));
        }
        history.check_batches(&observed, config.shards as u32, &mut violations);
        if let Some(stats) =
            check_scan_and_stats(&recovered, &observed, "after recovery", &mut violations)
        {
            totals.torn_or_corrupt += torn_or_corrupt(&stats);
            totals.batches_replayed +=
                stats.shards.iter().map(|s| s.recovery.batches_replayed).sum::<u64>();
            totals.broken_chain_records +=
                stats.shards.iter().map(|s| s.recovery.broken_chain_records).sum::<u64>();
            totals.grown_slab_files += stats
                .shards
                .iter()
                .flat_map(|s| s.classes.iter())
                .filter(|class| class.file_bytes > copse::limits::SLAB_GROWTH_BYTES_MIN)
                .count() as u64;
        }
        if !violations.is_empty() {
            violations.push(format!("restart: {restart:?}"));
            return violations;
        }
        state = observed;

        // The recovered store takes writes, closes cleanly and reopens with exactly that state.
        config.phase(round, "writing on the recovered store");
        clean_writes(&recovered, &mut rng, seed, round, &mut state, &mut violations);
        let got = read_all(&recovered, "after writes on the recovered store", &mut violations);
        compare_exact(&got, &state, "after writes on the recovered store", &mut violations);
        config.phase(round, "closing the recovered store");
        if let Err(err) = recovered.close() {
            violations.push(format!("clean close of the recovered store failed: {err}"));
        }
        drop(recovered);
        let after_close = rebooted.restart();
        if after_close.restart_stats() != RestartStats::default() {
            violations.push(format!(
                "writes were still pending on the disk after a clean close: {:?}",
                after_close.restart_stats()
            ));
        }
        config.phase(round, "reopening after a clean close");
        let reopened = match config.open(&after_close) {
            Ok(db) => db,
            Err(err) => {
                violations.push(format!("reopening after a clean close failed: {err}"));
                return violations;
            }
        };
        let got = read_all(&reopened, "after a clean reopen", &mut violations);
        compare_exact(&got, &state, "after a clean reopen", &mut violations);
        if let Some(stats) =
            check_scan_and_stats(&reopened, &state, "after a clean reopen", &mut violations)
        {
            if torn_or_corrupt(&stats) != 0 {
                let where_: Vec<String> = stats
                    .shards
                    .iter()
                    .flat_map(|shard| {
                        shard
                            .recovery
                            .defects_sample
                            .iter()
                            .map(move |d| format!("shard {}: {d}", shard.shard))
                    })
                    .collect();
                violations.push(format!(
                    "after a clean reopen recovery still finds {} torn or corrupt slots (they should have been erased): {where_:?}",
                    torn_or_corrupt(&stats)
                ));
            }
        }
        if !violations.is_empty() {
            return violations;
        }
        disk = after_close;
        db = Some(reopened);
    }
    config.phase(rounds, "final close");
    if let Some(db) = db {
        if let Err(err) = db.close() {
            violations.push(format!("final close failed: {err}"));
        }
    }
    violations
}

#[test]
fn every_acknowledged_write_survives_a_crash_at_any_device_operation() {
    count_panics();
    let first = env_u64("COPSE_CRASH_SEED_START", 0);
    let seeds = env_u64("COPSE_CRASH_SEEDS", SEEDS_DEFAULT);
    let started = Instant::now();
    let mut totals = Totals::default();
    let keep_going = std::env::var("COPSE_CRASH_KEEP_GOING").is_ok_and(|value| value == "1");
    let mut failed_seeds = Vec::new();
    for seed in first..first + seeds {
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| run_seed(seed, &mut totals)));
        let mut violations = match result {
            Ok(violations) => violations,
            Err(_) => vec!["the seed panicked (see above)".to_string()],
        };
        violations.extend(take_panics().into_iter().map(|panic| format!("panic: {panic}")));
        if !violations.is_empty() {
            let shown = violations.len().min(30);
            let report = format!(
                "crash test FAILED at seed {seed} ({} violations; replay with \
                 COPSE_CRASH_SEED_START={seed} COPSE_CRASH_SEEDS=1):\n  {}",
                violations.len(),
                violations[..shown].join("\n  ")
            );
            if !keep_going {
                panic!("{report}");
            }
            eprintln!("{report}");
            failed_seeds.push(seed);
        }
    }
    assert!(failed_seeds.is_empty(), "crash test FAILED at seeds {failed_seeds:?} (see above)");
    watchdog().phase("done".into());
    eprintln!(
        "crash test: {seeds} seeds from {first} in {:.1} s: {totals:?}",
        started.elapsed().as_secs_f64()
    );
    if seeds >= SEEDS_FOR_AGGREGATE_CHECKS_MIN {
        assert!(totals.restart.torn_writes > 0, "no crash tore a write: {totals:?}");
        assert!(totals.restart.kept_writes > 0 && totals.restart.dropped_writes > 0, "{totals:?}");
        assert!(totals.torn_or_corrupt > 0, "recovery never detected a torn slot: {totals:?}");
        assert!(
            totals.crashed_during_recovery > 0 && totals.crashed_after_recovery > 0,
            "no crash landed during or just after a recovery: {totals:?}"
        );
        assert!(
            totals.crashed_while_opening > 0,
            "no crash landed while the store was created: {totals:?}"
        );
        assert!(totals.batches_replayed > 0, "no crash left a batch to replay: {totals:?}");
        assert!(
            totals.broken_chain_records > 0,
            "no crash left a chain of batch records incomplete: {totals:?}"
        );
        assert!(totals.grown_slab_files > 0, "no slab file ever grew: {totals:?}");
        assert!(
            totals.never_crashed * 10 < totals.rounds,
            "the crash point is rarely reached: {totals:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Regressions: engine bugs the test above found, each reduced to a few steps. Those still open
// are `#[ignore]`d with the bug in one line; fixed ones run as ordinary tests.

/// Runs `body` on a thread; `None` if it does not finish within `seconds` (the thread is leaked).
fn finishes_within<T: Send + 'static>(
    seconds: u64,
    body: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(body());
    });
    receiver.recv_timeout(Duration::from_secs(seconds)).ok()
}

/// The bug (names as they were then; today `Io::sync_io`, `Io::purposes`, `Pages`' pages with a
/// write in flight): `NativeEngine::sync_io` (the synchronous header write of a new slab file)
/// reaps with `reap(1)` and returns as soon as it meets its own completion: completions reaped in
/// the same call after it are neither stashed nor completed. Their `io_purpose` stays, a page
/// write's page stays in `pages_in_flight` forever, so the writes it carried are never answered
/// and the shard
/// never becomes idle (`close` spins). Trigger: the first item of a size class arrives in a shard
/// while other I/O of that shard is in flight; the simulated device completes a random subset in
/// random order, so some seeds hang (about 4 in 100 here; seed 0 of the crash test above).
/// Fixed in 59e1bf6.
#[test]
fn slab_creation_while_writes_are_in_flight_loses_no_completion() {
    let mut hung = Vec::new();
    for seed in 0..200u64 {
        let finished = finishes_within(10, move || {
            let disk = SimDisk::new(seed);
            let config = Config::plain(seed);
            let db = config.open(&disk).unwrap();
            // Small puts (one page write in flight), then the first item of another size class.
            let keys: Vec<[u8; 2]> = (0..8u8).map(|i| [b'k', i]).collect();
            let small: Vec<_> = keys.iter().map(|key| db.put_async(key, b"small")).collect();
            let big = db.put_async(b"big", &[7u8; 3000]);
            let (small, big) = futures::executor::block_on(futures::future::join(
                futures::future::join_all(small),
                big,
            ));
            assert!(small.iter().all(Result::is_ok) && big.is_ok());
            db.close().unwrap();
        });
        if finished.is_none() {
            hung.push(seed);
            break; // one is enough: each hang costs the timeout
        }
    }
    assert!(hung.is_empty(), "seed {hung:?} hung (puts never answered or close never returned)");
}

/// `NativeEngine::open` loops until every replayed batch is finished, and gives up only when the
/// store is poisoned. A replayed batch finishes when the free record over its batch record is
/// durable; if the page read needed to place that free record fails (the device crashed, or EIO),
/// `write_failed` drops the erase write (`Effect::BatchErased`) but leaves the batch in `batches`,
/// and a failed read does not poison the store: the shard thread spins in that loop forever
/// (100% CPU) and `Db::open` never returns.
/// Steps: a batch whose record is durable but whose members never reached the disk (crash right
/// after the record's write); reboot; a clean open of that image replays the batch with two
/// writes (the members' page, then the free record over the batch record, whose page is read
/// first); open the image again with the crash armed at that read.
/// Fixed in 59e1bf6.
#[test]
fn recovery_that_cannot_erase_a_replayed_batch_record_returns() {
    let seed = 1;
    let config = Config::plain(seed);
    let disk = SimDisk::new(seed);
    let db = config.open(&disk).unwrap();
    // Create both size classes first: the members' (133-byte records) and the batch record's.
    for key in [&b"a"[..], b"b", b"c"] {
        db.put(key, &[1u8; 100]).unwrap();
    }
    db.put(b"x", &[2u8; 320]).unwrap();
    // The batch record is the next device operation; the members' page write crashes the disk.
    disk.crash_after_ops(1);
    let mut batch = WriteBatch::new();
    batch
        .put(b"a".to_vec(), vec![3u8; 100])
        .put(b"b".to_vec(), vec![3u8; 100])
        .put(b"c".to_vec(), vec![3u8; 100]);
    assert!(db.write_batch(batch).is_err(), "the disk crashed during the batch");
    let _ = db.close();
    drop(db);
    let image = disk.restart();
    let clean = image.restart();
    let ops = {
        let db = config.open(&clean).unwrap();
        let replayed: u64 =
            db.stats().unwrap().shards.iter().map(|s| s.recovery.batches_replayed).sum();
        assert_eq!(replayed, 1, "the batch record is durable, its members are not");
        assert_eq!(db.get(b"a").unwrap(), Some(vec![3u8; 100]));
        let ops = clean.ops();
        db.close().unwrap();
        ops
    };
    assert_eq!(
        clean.stats().writes,
        2,
        "the replay writes the members' page, then the free record"
    );
    // Crash at the last read: that of the batch record's page, before its free record is placed.
    let attempt = image.restart();
    attempt.crash_after_ops(ops - 2);
    let returned = finishes_within(10, move || config.open(&attempt).is_ok());
    assert!(
        returned.is_some(),
        "Db::open never returned (crash after {} device operations)",
        ops - 2
    );
}

/// When a shard fails to open, `Db::open` calls `close_shards`, which sends `Message::Close` to
/// every shard and blocks on the reply. The failed shard's thread has sent its error on `opened`
/// and is exiting; if the Close message is queued before the thread drops its flume receiver,
/// the message (and its oneshot sender) stays in the channel, kept alive by the `ShardHandle`'s
/// sender, so the reply never comes and never fails: `Db::open` deadlocks. It is a race (about
/// half of the attempts here): any open error raised by a shard (device error, corrupt slab
/// header, failed batch replay) can hang `Db::open` instead of returning it.
/// Steps: a store with one item; reopen it with a crash armed after 1 device operation (the
/// manifest read), so that the shard's first recovery read fails; repeat.
/// Fixed in 59e1bf6 (`close_shards` joins before waiting).
#[test]
fn open_returns_the_error_of_a_shard_that_fails_to_open() {
    let seed = 2;
    let config = Config::plain(seed);
    let disk = SimDisk::new(seed);
    let db = config.open(&disk).unwrap();
    db.put(b"a", b"1").unwrap();
    db.close().unwrap();
    drop(db);
    let image = disk.restart();
    for attempt_number in 0..20 {
        let attempt = image.restart();
        attempt.crash_after_ops(1);
        let config = Config::plain(seed);
        let result = finishes_within(10, move || {
            config.open(&attempt).map(drop).map_err(|err| err.to_string())
        });
        match result {
            None => panic!(
                "attempt {attempt_number}: Db::open never returned after a shard failed to open"
            ),
            Some(result) => assert!(result.is_err(), "the shard's first read crashed the disk"),
        }
    }
}

/// A batch takes its sequence number when the shard receives it, but its operations are written
/// (and applied to the index) only once the batch record is durable. If a newer write of one of
/// its keys (a higher sequence number) is received meanwhile and applied first, that key's
/// `Flight` is removed when that write finishes, so when the batch member completes `flight_end`
/// compares the member's older number with a fresh `applied_seq` of 0 and applies it: the index
/// now holds the batch's (older) operation, while on disk the newer record wins (recovery takes
/// the highest sequence number). Gets return the batch's value, and the next open (even after a
/// clean close) the newer one. In the crash test: seed 28 (a get after both writes were
/// acknowledged saw the batch's value, recovery brought back the put's), and at 59e1bf6 seed 407
/// (a batch deleting key 16 raced a put of key 16; the delete won in memory, so a later delete
/// answered "not found" without writing a tombstone, and recovery brought the put back).
/// Steps: one shard; send a batch writing `k` and a put of `k` (another size class, so the two
/// page writes complete in either order) together; both succeed; get `k` says "batch"; close;
/// reopen; get `k` says "nnn…" (the put). Fails within the first few of the 20 seeds.
/// Fixed in 665821c.
#[test]
fn a_batch_racing_a_newer_put_leaves_the_same_value_in_memory_and_on_disk() {
    for seed in 0..20u64 {
        let disk = SimDisk::new(seed);
        let config = Config::plain(seed);
        let db = config.open(&disk).unwrap();
        // The put's record is in another size class than the batch record, so their page
        // writes complete in either order.
        let new = vec![b'n'; 300];
        db.put(b"k", b"old").unwrap();
        db.put(b"other", &new).unwrap();
        let mut batch = WriteBatch::new();
        batch.put(b"k".to_vec(), b"batch".to_vec()).put(b"other".to_vec(), b"x".to_vec());
        let (batched, put) = futures::executor::block_on(futures::future::join(
            db.write_batch_async(batch),
            db.put_async(b"k", &new),
        ));
        batched.unwrap();
        put.unwrap();
        let before = db.get(b"k").unwrap();
        db.close().unwrap();
        drop(db);
        let db = config.open(&disk).unwrap();
        let after = db.get(b"k").unwrap();
        db.close().unwrap();
        assert_eq!(
            after.as_deref().map(|value| String::from_utf8_lossy(&value[..3]).into_owned()),
            before.as_deref().map(|value| String::from_utf8_lossy(&value[..3]).into_owned()),
            "seed {seed}: a clean close and reopen changed the value of k"
        );
    }
}

/// A tombstone applied while an older write of its key is still in flight is kept (guarded) for
/// that write (`older_in_flight` in `apply_tombstone`), but the guard is released as soon as the
/// key's stale-copy count drops to zero (`release_tag` → `release_guards`), which does not look at
/// writes still in flight. Here the tombstone's own `erase_stale_copies` erases the older copy,
/// the count drops to zero, the tombstone's slot is freed and reused, and only then does the
/// older in-flight put complete: it lands as a stale copy with no tombstone above it, so the next
/// open (clean or after a crash) brings the deleted key back. Crash test seeds 1880, 4428 and
/// 6763 at 665821c (4428 traced: put seq 51 in flight, delete seq 52 durable first, guard
/// released by the erasure of seq 24's copy, then seq 51 applied as stale; recovery found seq 51
/// and no tombstone).
/// Steps: one shard; `put k v1`; send `put k v2` (another size class) and `delete k` together;
/// both succeed and `get k` says absent; a few small puts reuse the freed tombstone slot; close;
/// reopen: `get k` says v2.
#[test]
fn a_delete_racing_an_older_put_stays_deleted_after_reopen() {
    for seed in 0..40u64 {
        let disk = SimDisk::new(seed);
        let config = Config::plain(seed);
        let db = config.open(&disk).unwrap();
        db.put(b"k", b"v1").unwrap();
        let v2 = vec![b'2'; 300];
        let (put, deleted) = futures::executor::block_on(futures::future::join(
            db.put_async(b"k", &v2),
            db.delete_async(b"k"),
        ));
        put.unwrap();
        deleted.unwrap();
        let before = db.get(b"k").unwrap();
        for i in 0..4u8 {
            db.put(&[b'z', i], b"").unwrap();
        }
        db.close().unwrap();
        drop(db);
        let db = config.open(&disk).unwrap();
        let after = db.get(b"k").unwrap();
        db.close().unwrap();
        assert_eq!(
            after.map(|value| value.len()),
            before.map(|value| value.len()),
            "seed {seed}: the value of k (its length) changed at a clean reopen"
        );
    }
}
