//! Exec programs: atomic read-modify-write inside a shard, ordered per lock key, durable before
//! the next exec on the key sees it, and refused (changing nothing) when they break a limit.

mod common;

use std::ops::Bound;
use std::sync::mpsc;

use copse::engine::BatchOp;
use copse::shard::exec::{Exec, ExecStep, ExecView, ReadOp, ReadResult, StepInput};
use copse::Db;

/// Adds `by` to a decimal counter stored under `key`; answers the new value.
struct Increment {
    key: Vec<u8>,
    by: i64,
    value: i64,
    answer: Option<mpsc::Sender<Result<i64, String>>>,
}

impl Exec for Increment {
    fn step(&mut self, _view: &ExecView<'_>, input: StepInput) -> ExecStep {
        match input {
            StepInput::Start => ExecStep::Read(smallvec::smallvec![ReadOp::Get(self.key.clone())]),
            StepInput::Read(Ok(mut results)) => {
                let old = match results.pop() {
                    Some(ReadResult::Value(Some(bytes))) => {
                        String::from_utf8(bytes).unwrap().parse::<i64>().unwrap()
                    }
                    Some(ReadResult::Value(None)) => 0,
                    other => panic!("unexpected read result {other:?}"),
                };
                self.value = old + self.by;
                ExecStep::Write(vec![BatchOp::Put {
                    key: self.key.clone(),
                    value: self.value.to_string().into_bytes(),
                }])
            }
            StepInput::Written(Ok(())) => {
                let _ = self.answer.take().unwrap().send(Ok(self.value));
                ExecStep::Done
            }
            StepInput::Read(Err(err)) => {
                let _ = self.answer.take().unwrap().send(Err(err.to_string()));
                ExecStep::Done
            }
            StepInput::Written(Err(err)) => {
                let _ = self.answer.take().unwrap().send(Err(err.to_string()));
                ExecStep::Done
            }
        }
    }
}

fn increment(db: &Db, key: &[u8], by: i64) -> mpsc::Receiver<Result<i64, String>> {
    let (answer, receiver) = mpsc::channel();
    let exec = Increment { key: key.to_vec(), by, value: 0, answer: Some(answer) };
    db.exec(db.shard_of(key), vec![key.to_vec()], Box::new(exec));
    receiver
}

#[test]
fn concurrent_increments_of_one_key_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(2)).unwrap();
    let threads = 4;
    let per_thread = 300;
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let db = db.clone();
            scope.spawn(move || {
                // Many in flight at once from each thread, so execs queue behind each other.
                let receivers: Vec<_> =
                    (0..per_thread).map(|_| increment(&db, b"counter", 1)).collect();
                let mut seen = Vec::new();
                for receiver in receivers {
                    seen.push(receiver.recv().unwrap().unwrap());
                }
                // One thread's increments are answered in its own order.
                assert!(seen.windows(2).all(|pair| pair[0] < pair[1]), "{seen:?}");
            });
        }
    });
    let expected = (threads * per_thread).to_string();
    assert_eq!(db.get(b"counter").unwrap().unwrap(), expected.as_bytes());
    db.close().unwrap();
    // The counter's last value was durable before it was answered.
    let db = Db::open(dir.path(), common::options(2)).unwrap();
    assert_eq!(db.get(b"counter").unwrap().unwrap(), expected.as_bytes());
}

/// Moves one unit between two keys of the same shard under both locks, and counts keys with
/// the index view; the sum over both keys never changes.
struct Transfer {
    from: Vec<u8>,
    to: Vec<u8>,
    answer: Option<mpsc::Sender<(i64, i64, bool)>>,
    values: (i64, i64),
}

impl Exec for Transfer {
    fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep {
        match input {
            StepInput::Start => ExecStep::Read(smallvec::smallvec![
                ReadOp::Get(self.from.clone()),
                ReadOp::Get(self.to.clone())
            ]),
            StepInput::Read(Ok(results)) => {
                let parse = |result: &ReadResult| match result {
                    ReadResult::Value(Some(bytes)) => {
                        String::from_utf8(bytes.clone()).unwrap().parse::<i64>().unwrap()
                    }
                    _ => 0,
                };
                self.values = (parse(&results[0]) - 1, parse(&results[1]) + 1);
                ExecStep::Write(vec![
                    BatchOp::Put {
                        key: self.from.clone(),
                        value: self.values.0.to_string().into(),
                    },
                    BatchOp::Put { key: self.to.clone(), value: self.values.1.to_string().into() },
                ])
            }
            StepInput::Written(result) => {
                result.unwrap();
                let both = view.contains(&self.from) && view.contains(&self.to);
                let _ = self.answer.take().unwrap().send((self.values.0, self.values.1, both));
                ExecStep::Done
            }
            StepInput::Read(Err(err)) => panic!("{err}"),
        }
    }
}

#[test]
fn multi_key_execs_are_atomic_and_see_each_other_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(1)).unwrap();
    let receivers: Vec<_> = (0..200)
        .map(|_| {
            let (answer, receiver) = mpsc::channel();
            let exec = Transfer {
                from: b"a".to_vec(),
                to: b"b".to_vec(),
                answer: Some(answer),
                values: (0, 0),
            };
            db.exec(0, vec![b"b".to_vec(), b"a".to_vec()], Box::new(exec));
            receiver
        })
        .collect();
    for (i, receiver) in receivers.into_iter().enumerate() {
        let (a, b, both) = receiver.recv().unwrap();
        assert_eq!((a, b), (-(i as i64) - 1, i as i64 + 1));
        assert!(both);
    }
    let keys: Vec<_> = db.scan(.., 10).unwrap().into_iter().map(|(key, _)| key).collect();
    assert_eq!(keys, vec![b"a".to_vec(), b"b".to_vec()]);
}

/// Writes whatever it is given, answering the write's result.
struct WriteOnce {
    ops: Vec<BatchOp>,
    answer: Option<mpsc::Sender<Result<(), copse::WriteError>>>,
}

impl Exec for WriteOnce {
    fn step(&mut self, _view: &ExecView<'_>, input: StepInput) -> ExecStep {
        match input {
            StepInput::Start => ExecStep::Write(std::mem::take(&mut self.ops)),
            StepInput::Written(result) => {
                let _ = self.answer.take().unwrap().send(result);
                ExecStep::Done
            }
            StepInput::Read(_) => unreachable!(),
        }
    }
}

#[test]
fn an_exec_write_over_the_limits_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(1)).unwrap();
    let (answer, receiver) = mpsc::channel();
    let ops = vec![
        BatchOp::Put { key: b"ok".to_vec(), value: b"1".to_vec() },
        BatchOp::Put { key: vec![b'k'; copse::limits::KEY_BYTES_MAX + 1], value: vec![] },
    ];
    db.exec(0, vec![], Box::new(WriteOnce { ops, answer: Some(answer) }));
    let err = receiver.recv().unwrap().unwrap_err();
    assert!(matches!(err, copse::WriteError::Input(copse::InputError::KeyTooLarge { .. })));
    assert_eq!(db.get(b"ok").unwrap(), None);
}

/// The keys a scan returned, and the keys the index view listed.
type ScannedAndListed = (Vec<Vec<u8>>, Vec<Vec<u8>>);

/// Reads a range with values and with the key-only view; answers both.
struct ScanBoth {
    answer: Option<mpsc::Sender<ScannedAndListed>>,
}

impl Exec for ScanBoth {
    fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep {
        match input {
            StepInput::Start => ExecStep::Read(smallvec::smallvec![ReadOp::Scan {
                start: Bound::Included(b"k2".to_vec()),
                end: Bound::Excluded(b"k5".to_vec()),
                limit: 10,
            }]),
            StepInput::Read(Ok(mut results)) => {
                let Some(ReadResult::Items(items)) = results.pop() else { panic!() };
                let keys = view.keys(Bound::Included(b"k2"), Bound::Excluded(b"k5"), 10);
                let scanned = items.into_iter().map(|(key, _)| key).collect();
                let _ = self.answer.take().unwrap().send((scanned, keys));
                ExecStep::Done
            }
            _ => unreachable!(),
        }
    }
}

#[test]
fn exec_scans_and_index_views_agree() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(1)).unwrap();
    for i in 0..8 {
        db.put(format!("k{i}").as_bytes(), b"v").unwrap();
    }
    let (answer, receiver) = mpsc::channel();
    db.exec(0, vec![], Box::new(ScanBoth { answer: Some(answer) }));
    let (scanned, keys) = receiver.recv().unwrap();
    let expected: Vec<Vec<u8>> = (2..5).map(|i| format!("k{i}").into_bytes()).collect();
    assert_eq!(scanned, expected);
    assert_eq!(keys, expected);
}

#[test]
fn execs_queued_at_close_are_dropped_and_their_waiters_learn_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(1)).unwrap();
    db.close().unwrap();
    let receiver = increment(&db, b"late", 1);
    assert!(receiver.recv().is_err(), "a dropped exec closes its answer channel");
}
