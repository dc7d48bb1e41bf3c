//! Power loss on the real backends: every acknowledged write survives any power loss after its
//! acknowledgement, judged from what the device did at the system-call boundary.
//!
//! kill -9 cannot test this: a killed process loses nothing that the kernel and the disk's write
//! cache still hold, so a write acknowledged with no fdatasync behind it survives every kill (issue
//! 20, finding 1, passed every crash test that way). Here a store runs on the real io_uring (or
//! pread/pwrite) backend with an `IoObserver` attached, which records, in one total order with
//! the test's acknowledgements: each write handed to the kernel (with its bytes), its completion,
//! and the start and end of every fdatasync, per file. From that record, for a cut at any point,
//! the test builds the disk images a power loss there could leave:
//! - a write that completed before an fdatasync of its file began, which finished before the cut,
//!   is on disk;
//! - every other write submitted before the cut is kept, dropped, or torn at 512-byte sectors,
//!   each on its own (one image keeps none of them: the harshest case);
//! - file sizes and new files are as the device made them durable (it fsyncs both at once).
//!
//! Each image is opened as a store and every key is checked against the writes acknowledged
//! before the cut: the value is that of the last acknowledged write or of a write issued after it,
//! never older, never absent if a put was acknowledged, never damaged; and a scrub finds nothing.
//!
//! The images are built from the record alone, so the check holds whatever the machine's own disk
//! did. Its limits: completions are observed when the device drains them, never earlier (so the
//! model is as hostile as the device's own view allows), and what the file system does with
//! metadata beyond file size and new files is not modelled (slab files are fully allocated and
//! their sizes fsynced before use, docs/durability.md).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use common::{describe_value, env_u64, make_value};
use copse::device::{Backend, DirStorage, IoObserver, WriteDurability};
use copse::{Db, Options, PlacementSetting};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SECTOR_BYTES: usize = 512;
const WRITERS: usize = 8;
const KEYS_PER_WRITER: usize = 12;
const OPS_PER_WRITER_DEFAULT: u64 = 150;
const CUTS_DEFAULT: u64 = 40;

#[derive(Clone, Debug)]
enum Event {
    Opened {
        name: String,
        len_bytes: u64,
    },
    Grown {
        name: String,
        len_bytes: u64,
    },
    Submitted {
        write: usize,
    },
    Completed {
        write: usize,
        ok: bool,
    },
    SyncStarted {
        name: String,
    },
    SyncFinished {
        name: String,
        ok: bool,
    },
    /// The test saw operation `op` of key `key` answered with success.
    Acked {
        key: usize,
        op: usize,
    },
    /// `Db::open` returned: the store exists from here on (before, a power loss may leave none).
    StoreOpened,
}

struct WriteData {
    name: String,
    offset: u64,
    data: Vec<u8>,
}

#[derive(Default)]
struct Log {
    events: Vec<Event>,
    writes: Vec<WriteData>,
}

#[derive(Default)]
struct Recorder {
    log: Mutex<Log>,
}

impl Recorder {
    fn push(&self, event: Event) {
        self.log.lock().unwrap().events.push(event);
    }
}

impl IoObserver for Recorder {
    fn file_opened(&self, name: &str, len_bytes: u64) {
        self.push(Event::Opened { name: name.into(), len_bytes });
    }
    fn file_grown(&self, name: &str, len_bytes: u64) {
        self.push(Event::Grown { name: name.into(), len_bytes });
    }
    fn write_submitted(&self, name: &str, offset: u64, data: &[u8]) -> u64 {
        let mut log = self.log.lock().unwrap();
        let write = log.writes.len();
        log.writes.push(WriteData { name: name.into(), offset, data: data.to_vec() });
        log.events.push(Event::Submitted { write });
        write as u64
    }
    fn write_completed(&self, tag: u64, ok: bool) {
        self.push(Event::Completed { write: tag as usize, ok });
    }
    fn sync_started(&self, name: &str) {
        self.push(Event::SyncStarted { name: name.into() });
    }
    fn sync_finished(&self, name: &str, ok: bool) {
        self.push(Event::SyncFinished { name: name.into(), ok });
    }
}

/// What one operation of a key did: a put of this value, or a delete.
type KeyOp = Option<Vec<u8>>;

fn key_name(key: usize) -> Vec<u8> {
    format!("key-{key:03}").into_bytes()
}

/// The files of a power loss at `cut` (an index into the events): name -> bytes. `keep_chance`:
/// the chance that a write not yet sure to be durable is kept whole (the rest are dropped or
/// torn in equal parts); 0 keeps none.
fn image_at(
    log: &Log,
    cut: usize,
    keep_chance: f64,
    rng: &mut ChaCha8Rng,
) -> BTreeMap<String, Vec<u8>> {
    let events = &log.events[..cut];
    let mut sizes: BTreeMap<&str, u64> = BTreeMap::new();
    let mut completed_at: BTreeMap<usize, (usize, bool)> = BTreeMap::new();
    let mut submitted: Vec<usize> = Vec::new();
    // Per file: positions of fdatasyncs that began and then finished successfully before the cut.
    let mut syncs: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    // Per file: positions of fdatasyncs begun and not yet finished, oldest first. Background
    // flushes can have two of one file in flight, and a finish does not say which one ended:
    // it is taken as the oldest's, which covers the fewest writes (the hostile reading).
    let mut sync_open: BTreeMap<&str, std::collections::VecDeque<usize>> = BTreeMap::new();
    for (at, event) in events.iter().enumerate() {
        match event {
            Event::Opened { name, len_bytes } | Event::Grown { name, len_bytes } => {
                let size = sizes.entry(name).or_default();
                *size = (*size).max(*len_bytes);
            }
            Event::Submitted { write } => submitted.push(*write),
            Event::Completed { write, ok } => {
                completed_at.insert(*write, (at, *ok));
            }
            Event::SyncStarted { name } => {
                sync_open.entry(name).or_default().push_back(at);
            }
            Event::SyncFinished { name, ok } => {
                if let Some(began) =
                    sync_open.get_mut(name.as_str()).and_then(|open| open.pop_front())
                {
                    if *ok {
                        syncs.entry(name).or_default().push(began);
                    }
                }
            }
            Event::Acked { .. } | Event::StoreOpened => {}
        }
    }
    let mut files: BTreeMap<String, Vec<u8>> =
        sizes.iter().map(|(name, len)| (name.to_string(), vec![0u8; *len as usize])).collect();
    // Completed writes in completion order, then the ones in flight at the cut.
    let mut order: Vec<usize> = submitted.clone();
    order.sort_by_key(|write| completed_at.get(write).map_or(usize::MAX, |(at, _)| *at));
    for write in order {
        let data = &log.writes[write];
        let durable = completed_at.get(&write).is_some_and(|&(done, ok)| {
            ok && syncs.get(data.name.as_str()).is_some_and(|began| began.iter().any(|&b| b > done))
        });
        let image = files.entry(data.name.clone()).or_default();
        let end = data.offset as usize + data.data.len();
        if image.len() < end {
            // A write past the durable size can only land if the size does; it cannot here.
            continue;
        }
        let range = data.offset as usize..end;
        if durable || (keep_chance > 0.0 && rng.gen_bool(keep_chance)) {
            image[range].copy_from_slice(&data.data);
        } else if keep_chance > 0.0 && rng.gen_bool(0.5) {
            for (sector, bytes) in data.data.chunks(SECTOR_BYTES).enumerate() {
                if rng.gen_bool(0.5) {
                    let at = range.start + sector * SECTOR_BYTES;
                    image[at..at + bytes.len()].copy_from_slice(bytes);
                }
            }
        }
    }
    files
}

fn write_image(dir: &Path, files: &BTreeMap<String, Vec<u8>>) {
    for (name, bytes) in files {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, bytes).unwrap();
    }
}

struct Run {
    log: Log,
    /// Per key, its operations in issue order.
    ops: Vec<Vec<KeyOp>>,
}

fn run_workload(
    placement: PlacementSetting,
    backend: Backend,
    seed: u64,
) -> Option<(tempfile::TempDir, Run)> {
    let dir = tempfile::tempdir().unwrap();
    let recorder = Arc::new(Recorder::default());
    let storage = match DirStorage::new(dir.path(), backend, WriteDurability::FlushPerRound, 64) {
        Ok(storage) => storage.with_observer(recorder.clone()),
        Err(err) => {
            eprintln!("skipping: {err}");
            return None;
        }
    };
    let options = Options {
        shards: 2,
        cache_bytes: 1 << 20,
        show_progress: false,
        pin_threads: false,
        placement,
        append_block_pages: 2,
        ..Options::default()
    };
    let db = match Db::open_with_storage(Arc::new(storage), options) {
        Ok(db) => {
            recorder.push(Event::StoreOpened);
            Arc::new(db)
        }
        Err(err) => {
            eprintln!("skipping ({backend:?}, O_DIRECT or io_uring unavailable?): {err}");
            return None;
        }
    };
    let ops_per_writer = env_u64("COPSE_POWER_LOSS_OPS", OPS_PER_WRITER_DEFAULT) as usize;
    let ops: Arc<Mutex<Vec<Vec<KeyOp>>>> =
        Arc::new(Mutex::new(vec![Vec::new(); WRITERS * KEYS_PER_WRITER]));
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let (db, ops, recorder) = (db.clone(), ops.clone(), recorder.clone());
            std::thread::spawn(move || {
                let mut rng = ChaCha8Rng::seed_from_u64(seed * 1000 + writer as u64);
                for n in 0..ops_per_writer {
                    let key = writer * KEYS_PER_WRITER + rng.gen_range(0..KEYS_PER_WRITER);
                    let op: KeyOp = if rng.gen_range(0..10) == 0 {
                        None
                    } else {
                        // Mostly small items (packed in pages), some spanning pages.
                        let len = if rng.gen_range(0..8) == 0 {
                            rng.gen_range(5_000..20_000)
                        } else {
                            rng.gen_range(10..400)
                        };
                        Some(make_value(&format!("w{writer}-{n}"), len))
                    };
                    let index = {
                        let mut ops = ops.lock().unwrap();
                        ops[key].push(op.clone());
                        ops[key].len() - 1
                    };
                    let name = key_name(key);
                    let done = match &op {
                        Some(value) => db.put(&name, value).map(|_| ()),
                        None => db.delete(&name).map(|_| ()),
                    };
                    done.unwrap_or_else(|err| panic!("write of key {key} failed: {err}"));
                    recorder.push(Event::Acked { key, op: index });
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    Arc::try_unwrap(db).ok().expect("writers are done").close().unwrap();
    let log = std::mem::take(&mut *recorder.log.lock().unwrap());
    let ops = std::mem::take(&mut *ops.lock().unwrap());
    Some((dir, Run { log, ops }))
}

/// Opens the image and checks every key against what was acknowledged before `cut`. Returns
/// the violations found.
fn check_image(
    run: &Run,
    cut: usize,
    files: &BTreeMap<String, Vec<u8>>,
    what: &str,
) -> Vec<String> {
    let mut last_acked: Vec<Option<usize>> = vec![None; run.ops.len()];
    for event in &run.log.events[..cut] {
        if let Event::Acked { key, op } = event {
            last_acked[*key] = Some(last_acked[*key].map_or(*op, |seen: usize| seen.max(*op)));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    write_image(dir.path(), files);
    let options = Options {
        create_if_missing: false,
        show_progress: false,
        pin_threads: false,
        backend: Backend::Sync,
        ..Options::default()
    };
    let created = run.log.events[..cut].iter().any(|event| matches!(event, Event::StoreOpened));
    let db = match Db::open(dir.path(), options) {
        Ok(db) => db,
        // Power lost while the store was being created: nothing was promised yet.
        Err(copse::OpenError::NotFound(_)) if !created => return Vec::new(),
        Err(err) => return vec![format!("{what}: the store does not open: {err}")],
    };
    let mut violations = Vec::new();
    for (key, ops) in run.ops.iter().enumerate() {
        let found = match db.get(&key_name(key)) {
            Ok(found) => found,
            Err(err) => {
                violations.push(format!("{what}: key {key} reads as an error: {err}"));
                continue;
            }
        };
        // Acceptable: the last acknowledged operation or any issued after it; with nothing
        // acknowledged, also the initial absence.
        let from = last_acked[key].unwrap_or(0);
        let mut acceptable = ops[from..].iter().map(|op| op.as_deref());
        let ok = acceptable.any(|op| op == found.as_deref())
            || (last_acked[key].is_none() && found.is_none());
        if !ok {
            violations.push(format!(
                "{what}: key {key} reads {} but operation {from} ({}) was acknowledged",
                describe_value(found.as_deref()),
                describe_value(ops[from].as_deref()),
            ));
        }
    }
    match db.scrub() {
        Ok(report) if report.problems_found > 0 => {
            violations.push(format!("{what}: the scrub found {:?}", report.problems));
        }
        Ok(_) => {}
        Err(err) => violations.push(format!("{what}: the scrub failed: {err}")),
    }
    let _ = db.close();
    violations
}

fn power_loss_run(placement: PlacementSetting, backend: Backend) {
    let seed = env_u64("COPSE_POWER_LOSS_SEED", 1);
    let Some((_dir, run)) = run_workload(placement, backend, seed) else { return };
    let acks: Vec<usize> = run
        .log
        .events
        .iter()
        .enumerate()
        .filter(|(_, event)| matches!(event, Event::Acked { .. }))
        .map(|(at, _)| at + 1)
        .collect();
    let syncs = run.log.events.iter().filter(|e| matches!(e, Event::SyncStarted { .. })).count();
    assert!(acks.len() > 100 && syncs > 10, "the workload made {} acks, {syncs} syncs", acks.len());
    // A shard keeps at most `FLUSHES_IN_FLIGHT_MAX` background flushes in flight, so no file
    // ever has more fdatasyncs under way at once (a file belongs to one shard).
    let mut open_syncs: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for event in &run.log.events {
        match event {
            Event::SyncStarted { name } => {
                let open = open_syncs.entry(name).or_default();
                *open += 1;
                assert!(
                    *open <= copse::limits::FLUSHES_IN_FLIGHT_MAX,
                    "{open} fdatasyncs of {name} under way at once"
                );
            }
            Event::SyncFinished { name, .. } => {
                if let Some(open) = open_syncs.get_mut(name.as_str()) {
                    *open = open.saturating_sub(1);
                }
            }
            _ => {}
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let cuts = env_u64("COPSE_POWER_LOSS_CUTS", CUTS_DEFAULT) as usize;
    let mut violations = Vec::new();
    for n in 0..cuts {
        // Right after an acknowledgement (where a missing flush shows), or anywhere.
        // The first event too: power lost while the store is being created.
        let cut = if n == 1 {
            1
        } else if n % 2 == 0 {
            acks[rng.gen_range(0..acks.len())]
        } else {
            rng.gen_range(1..=run.log.events.len())
        };
        for keep_chance in [0.0, 0.4] {
            let files = image_at(&run.log, cut, keep_chance, &mut rng);
            let what = format!("{placement:?}/{backend:?} cut {cut}, keep {keep_chance}");
            violations.extend(check_image(&run, cut, &files, &what));
        }
        if violations.len() > 10 {
            break;
        }
    }
    assert!(violations.is_empty(), "power-loss violations:\n{}", violations.join("\n"));
}

#[test]
fn power_loss_after_any_acknowledgement_keeps_it_io_uring_in_place() {
    power_loss_run(PlacementSetting::InPlace, Backend::Uring);
}

#[test]
fn power_loss_after_any_acknowledgement_keeps_it_io_uring_append() {
    power_loss_run(PlacementSetting::Append, Backend::Uring);
}

#[test]
fn power_loss_after_any_acknowledgement_keeps_it_pread_pwrite() {
    power_loss_run(PlacementSetting::Append, Backend::Sync);
}
