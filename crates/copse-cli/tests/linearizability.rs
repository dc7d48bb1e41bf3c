//! Linearizability of a real `copse serve` under SIGKILL restarts: concurrent clients (the
//! `redis` crate) run GET, SET, DEL and INCR on a few keys while the server is killed at a random
//! moment and restarted on the same store. Every operation's invocation and answer is recorded,
//! per key, and stateright's `LinearizabilityTester` must find an order of them that a single
//! register explains and that respects real time. An operation whose connection died with the
//! killed server may have happened or not, as the tester allows; any other failure (an error
//! reply, no reply within `REPLY_TIMEOUT`) fails the test.
//!
//! Linearizability is local, so checking each key's history on its own checks the whole. Each
//! key lives for two rounds (one kill in the middle of its history) to keep the search small.
//!
//! Replay: `COPSE_LIN_SEED=<seed>`; more rounds: `COPSE_LIN_ROUNDS=<n>` (`make torture`).

// The copse crate's test helpers (`env_u64`).
#[path = "../../copse/tests/common/mod.rs"]
mod common;
use common::env_u64;

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester, SequentialSpec};

/// Client threads per round.
const CLIENTS: u64 = 4;
/// Operations each client issues per round at most (the kill usually comes first).
const OPS_PER_CLIENT_MAX: usize = 400;
/// Keys that start in each round; each is used in its round and the next.
const KEYS_PER_ROUND: usize = 2;
/// The kill comes this long after the round starts, drawn uniformly.
const KILL_AFTER_MS: std::ops::Range<u64> = 10..150;
const ROUNDS_DEFAULT: u64 = 8;
/// Bytes of a violating key's recorded history shown in the failure.
const VIOLATION_SHOWN_BYTES_MAX: usize = 4_000;
const SERVER_START_TIMEOUT: Duration = Duration::from_secs(60);
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Op {
    Get,
    Set(i64),
    Del,
    Incr,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Ret {
    Value(Option<i64>),
    Stored,
    /// DEL's count of deleted keys.
    Deleted(i64),
    /// INCR's new value.
    Incremented(i64),
}

/// The sequential specification: one register holding an integer or nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct Register(Option<i64>);

impl SequentialSpec for Register {
    type Op = Op;
    type Ret = Ret;

    fn invoke(&mut self, op: &Op) -> Ret {
        match op {
            Op::Get => Ret::Value(self.0),
            Op::Set(value) => {
                self.0 = Some(*value);
                Ret::Stored
            }
            Op::Del => Ret::Deleted(i64::from(self.0.take().is_some())),
            Op::Incr => {
                let value = self.0.unwrap_or(0) + 1;
                self.0 = Some(value);
                Ret::Incremented(value)
            }
        }
    }
}

type Tester = LinearizabilityTester<u64, Register>;

struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(dir: &Path) -> Server {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.with_extension("log"))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_copse"))
            .arg("--path")
            .arg(dir)
            .args(["--shards", "2", "--cache-mb", "8", "serve", "--bind", "127.0.0.1"])
            .args(["--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("copse serve starts");
        let server = Server { child, port };
        let started = Instant::now();
        while connect(port).is_err() {
            assert!(started.elapsed() < SERVER_START_TIMEOUT, "the server did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reaped");
    }
}

fn connect(port: u16) -> redis::RedisResult<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let mut connection = client.get_connection_with_timeout(Duration::from_secs(5))?;
    connection.set_read_timeout(Some(REPLY_TIMEOUT))?;
    redis::cmd("PING").query::<String>(&mut connection)?;
    Ok(connection)
}

fn run(connection: &mut redis::Connection, key: &str, op: &Op) -> redis::RedisResult<Ret> {
    Ok(match op {
        Op::Get => Ret::Value(redis::cmd("GET").arg(key).query(connection)?),
        Op::Set(value) => {
            redis::cmd("SET").arg(key).arg(*value).query::<()>(connection)?;
            Ret::Stored
        }
        Op::Del => Ret::Deleted(redis::cmd("DEL").arg(key).query(connection)?),
        Op::Incr => Ret::Incremented(redis::cmd("INCR").arg(key).query(connection)?),
    })
}

#[derive(Default)]
struct Figures {
    completed: u64,
    in_flight_at_kills: u64,
}

/// One client's round: operations on `keys` until its budget ends or, in a round with a kill,
/// the connection drops. Any other failure (an error reply, a reply that never came, a dropped
/// connection in a round without a kill) fails the test.
fn client(
    port: u16,
    thread: u64,
    seed: u64,
    keys: Vec<(usize, String)>,
    testers: Arc<Vec<Mutex<Tester>>>,
    killed: bool,
) -> Figures {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut figures = Figures::default();
    let mut connection = match connect(port) {
        Ok(connection) => connection,
        // The kill may come before this client connects: then it has nothing to record.
        Err(err) if killed && err.is_io_error() => return figures,
        Err(err) => panic!("client {thread}: connecting failed: {err}"),
    };
    for n in 0..OPS_PER_CLIENT_MAX {
        let (index, key) = &keys[rng.gen_range(0..keys.len())];
        let op = match rng.gen_range(0..100) {
            0..40 => Op::Get,
            // Unique values: a read names the write it saw.
            40..65 => Op::Set(((thread * 1_000 + n as u64) * 1_000) as i64),
            65..85 => Op::Incr,
            _ => Op::Del,
        };
        testers[*index].lock().unwrap().on_invoke(thread, op.clone()).unwrap();
        match run(&mut connection, key, &op) {
            Ok(ret) => {
                testers[*index].lock().unwrap().on_return(thread, ret).unwrap();
                figures.completed += 1;
            }
            // The server died: the operation may or may not have happened; it stays in flight
            // and this client's round ends.
            Err(err) if killed && err.is_io_error() && !err.is_timeout() => {
                figures.in_flight_at_kills += 1;
                break;
            }
            Err(err) => panic!("client {thread}: {op:?} of {key} failed: {err}"),
        }
    }
    figures
}

#[test]
fn concurrent_get_set_del_incr_with_kill_9_restarts_are_linearizable() {
    let seed = env_u64("COPSE_LIN_SEED", rand::random::<u32>() as u64);
    let rounds = env_u64("COPSE_LIN_ROUNDS", ROUNDS_DEFAULT);
    println!("linearizability: seed {seed} (replay: COPSE_LIN_SEED={seed}), {rounds} rounds");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let key_count = (rounds as usize + 1) * KEYS_PER_ROUND;
    let testers: Arc<Vec<Mutex<Tester>>> =
        Arc::new((0..key_count).map(|_| Mutex::new(Tester::new(Register(None)))).collect());
    let key_name = |index: usize| format!("lin{seed}-{index}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut figures = Figures::default();
    // Round `rounds` is a last one without a kill: it reads the keys of the round before.
    for round in 0..=rounds {
        let server = Server::start(&store);
        let first = round.saturating_sub(1) as usize * KEYS_PER_ROUND;
        let keys: Vec<(usize, String)> = (first..(round as usize + 1) * KEYS_PER_ROUND)
            .filter(|&index| index < key_count)
            .map(|index| (index, key_name(index)))
            .collect();
        let killed = round < rounds;
        let clients: Vec<_> = (0..CLIENTS)
            .map(|client_index| {
                let (port, keys, testers) = (server.port, keys.clone(), testers.clone());
                let thread = round * CLIENTS + client_index;
                let client_seed = seed ^ (thread + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                std::thread::spawn(move || client(port, thread, client_seed, keys, testers, killed))
            })
            .collect();
        if killed {
            std::thread::sleep(Duration::from_millis(rng.gen_range(KILL_AFTER_MS)));
        }
        let last = if killed {
            server.kill();
            None
        } else {
            Some(server)
        };
        for handle in clients {
            let done = handle.join().expect("client thread");
            figures.completed += done.completed;
            figures.in_flight_at_kills += done.in_flight_at_kills;
        }
        if let Some(server) = last {
            server.kill();
        }
    }
    let started = Instant::now();
    let mut violations = Vec::new();
    for (index, tester) in testers.iter().enumerate() {
        let tester = tester.lock().unwrap();
        if tester.serialized_history().is_none() {
            let mut history = format!("{tester:?}");
            history.truncate(VIOLATION_SHOWN_BYTES_MAX);
            let operations = tester.len();
            violations.push(format!("key {}: {operations} operations: {history}", key_name(index)));
        }
    }
    println!(
        "linearizability: {} histories checked ({} operations answered, {} in flight at {} \
         kills) in {:.1} s; {} violations",
        testers.len(),
        figures.completed,
        figures.in_flight_at_kills,
        rounds,
        started.elapsed().as_secs_f64(),
        violations.len()
    );
    assert!(figures.completed > 0, "no operation was answered");
    assert!(violations.is_empty(), "seed {seed}: not linearizable:\n{}", violations.join("\n"));
}

/// Operations of the transaction histories: on two keys, one of each pair, or both at once.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum PairOp {
    Get(usize),
    Set(usize, i64),
    Incr(usize),
    /// MULTI, INCR of both keys, EXEC.
    IncrBoth,
    /// WATCH both, GET both, MULTI, SET first to a + 1 and second to b - 1, EXEC.
    Move,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum PairRet {
    Value(Option<i64>),
    Stored,
    Incremented(i64),
    Both(i64, i64),
    /// The values both GETs read, the EXEC having run.
    Moved(Option<i64>, Option<i64>),
    /// EXEC answered nil: a watched key changed; nothing was written.
    Aborted,
}

/// The sequential specification of the transaction histories: two registers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct Pair([Option<i64>; 2]);

impl SequentialSpec for Pair {
    type Op = PairOp;
    type Ret = PairRet;

    fn invoke(&mut self, op: &PairOp) -> PairRet {
        match op {
            PairOp::Get(at) => PairRet::Value(self.0[*at]),
            PairOp::Set(at, value) => {
                self.0[*at] = Some(*value);
                PairRet::Stored
            }
            PairOp::Incr(at) => {
                let value = self.0[*at].unwrap_or(0) + 1;
                self.0[*at] = Some(value);
                PairRet::Incremented(value)
            }
            PairOp::IncrBoth => {
                let first = self.0[0].unwrap_or(0) + 1;
                let second = self.0[1].unwrap_or(0) + 1;
                self.0 = [Some(first), Some(second)];
                PairRet::Both(first, second)
            }
            PairOp::Move => {
                let (first, second) = (self.0[0], self.0[1]);
                self.0 = [Some(first.unwrap_or(0) + 1), Some(second.unwrap_or(0) - 1)];
                PairRet::Moved(first, second)
            }
        }
    }

    /// A watched transaction that EXEC called off read values some write changed before its
    /// EXEC, and wrote nothing: it is a read that may see anything, so any state allows it.
    fn is_valid_step(&mut self, op: &PairOp, ret: &PairRet) -> bool {
        if matches!((op, ret), (PairOp::Move, PairRet::Aborted)) {
            return true;
        }
        &self.invoke(op) == ret
    }
}

fn run_pair(
    connection: &mut redis::Connection,
    keys: &[String; 2],
    op: &PairOp,
) -> redis::RedisResult<PairRet> {
    Ok(match op {
        PairOp::Get(at) => PairRet::Value(redis::cmd("GET").arg(&keys[*at]).query(connection)?),
        PairOp::Set(at, value) => {
            redis::cmd("SET").arg(&keys[*at]).arg(*value).query::<()>(connection)?;
            PairRet::Stored
        }
        PairOp::Incr(at) => {
            PairRet::Incremented(redis::cmd("INCR").arg(&keys[*at]).query(connection)?)
        }
        PairOp::IncrBoth => {
            let (first, second): (i64, i64) = redis::pipe()
                .atomic()
                .cmd("INCR")
                .arg(&keys[0])
                .cmd("INCR")
                .arg(&keys[1])
                .query(connection)?;
            PairRet::Both(first, second)
        }
        PairOp::Move => {
            redis::cmd("WATCH").arg(&keys[0]).arg(&keys[1]).query::<()>(connection)?;
            let first: Option<i64> = redis::cmd("GET").arg(&keys[0]).query(connection)?;
            let second: Option<i64> = redis::cmd("GET").arg(&keys[1]).query(connection)?;
            let done: Option<((), ())> = redis::pipe()
                .atomic()
                .cmd("SET")
                .arg(&keys[0])
                .arg(first.unwrap_or(0) + 1)
                .cmd("SET")
                .arg(&keys[1])
                .arg(second.unwrap_or(0) - 1)
                .query(connection)?;
            match done {
                Some(_) => PairRet::Moved(first, second),
                None => PairRet::Aborted,
            }
        }
    })
}

/// Linearizability of MULTI/EXEC and WATCH over two keys under SIGKILL restarts: clients mix
/// single-key GET, SET and INCR with transactions that increment both keys and watched
/// transactions that move one unit from the second to the first. Each round uses fresh pairs
/// (some on one shard, some on two: keys are named at random) for two rounds, as above.
#[test]
fn transactions_over_two_keys_with_kill_9_restarts_are_linearizable() {
    let seed = env_u64("COPSE_LIN_SEED", rand::random::<u32>() as u64);
    let rounds = env_u64("COPSE_LIN_ROUNDS", ROUNDS_DEFAULT);
    println!("transactions: seed {seed} (replay: COPSE_LIN_SEED={seed}), {rounds} rounds");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let pair_count = (rounds as usize + 1) * KEYS_PER_ROUND;
    let testers: Arc<Vec<Mutex<LinearizabilityTester<u64, Pair>>>> = Arc::new(
        (0..pair_count).map(|_| Mutex::new(LinearizabilityTester::new(Pair::default()))).collect(),
    );
    let pair_keys =
        move |index: usize| [format!("tx{seed}-{index}-a"), format!("tx{seed}-{index}-b")];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut completed, mut in_flight) = (0u64, 0u64);
    for round in 0..=rounds {
        let server = Server::start(&store);
        let first = round.saturating_sub(1) as usize * KEYS_PER_ROUND;
        let pairs: Vec<usize> = (first..(round as usize + 1) * KEYS_PER_ROUND)
            .filter(|&index| index < pair_count)
            .collect();
        let killed = round < rounds;
        let clients: Vec<_> = (0..CLIENTS)
            .map(|client_index| {
                let (port, pairs, testers) = (server.port, pairs.clone(), testers.clone());
                let thread = round * CLIENTS + client_index;
                let client_seed = seed ^ (thread + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                std::thread::spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(client_seed);
                    let (mut done, mut lost) = (0u64, 0u64);
                    let mut connection = match connect(port) {
                        Ok(connection) => connection,
                        Err(err) if killed && err.is_io_error() => return (done, lost),
                        Err(err) => panic!("client {thread}: connecting failed: {err}"),
                    };
                    for n in 0..OPS_PER_CLIENT_MAX / 2 {
                        let index = pairs[rng.gen_range(0..pairs.len())];
                        let keys = pair_keys(index);
                        let op = match rng.gen_range(0..100) {
                            0..25 => PairOp::Get(rng.gen_range(0..2)),
                            25..35 => PairOp::Set(
                                rng.gen_range(0..2),
                                ((thread * 1_000 + n as u64) * 1_000) as i64,
                            ),
                            35..50 => PairOp::Incr(rng.gen_range(0..2)),
                            50..75 => PairOp::IncrBoth,
                            _ => PairOp::Move,
                        };
                        testers[index].lock().unwrap().on_invoke(thread, op.clone()).unwrap();
                        match run_pair(&mut connection, &keys, &op) {
                            Ok(ret) => {
                                testers[index].lock().unwrap().on_return(thread, ret).unwrap();
                                done += 1;
                            }
                            Err(err) if killed && err.is_io_error() && !err.is_timeout() => {
                                lost += 1;
                                break;
                            }
                            Err(err) => panic!("client {thread}: {op:?} of {keys:?} failed: {err}"),
                        }
                    }
                    (done, lost)
                })
            })
            .collect();
        if killed {
            std::thread::sleep(Duration::from_millis(rng.gen_range(KILL_AFTER_MS)));
        }
        let last = if killed {
            server.kill();
            None
        } else {
            Some(server)
        };
        for handle in clients {
            let (done, lost) = handle.join().expect("client thread");
            completed += done;
            in_flight += lost;
        }
        if let Some(server) = last {
            server.kill();
        }
    }
    let mut violations = Vec::new();
    for (index, tester) in testers.iter().enumerate() {
        let tester = tester.lock().unwrap();
        if tester.serialized_history().is_none() {
            let mut history = format!("{tester:?}");
            history.truncate(VIOLATION_SHOWN_BYTES_MAX);
            violations.push(format!("pair {:?}: {history}", pair_keys(index)));
        }
    }
    println!(
        "transactions: {} pair histories checked ({completed} operations answered, {in_flight} in \
         flight at {rounds} kills); {} violations",
        testers.len(),
        violations.len()
    );
    assert!(completed > 0, "no operation was answered");
    assert!(violations.is_empty(), "seed {seed}: not linearizable:\n{}", violations.join("\n"));
}
