//! A shard with nothing to do sleeps (shard/wake.rs): an idle store's shard threads use next to
//! no CPU, after writes, a flush and a settle alike, and a request wakes them at once. A shard
//! loop that polled, spun or slept in short steps fails here.
//!
//! One test in this binary, so that no other store's shard threads are counted.

mod common;

use std::time::{Duration, Instant};

use copse::Db;

/// How long the store is left alone while its shards' CPU time is measured.
const IDLE_MEASURED: Duration = Duration::from_secs(1);
/// CPU the shard threads may use meanwhile: a few scheduler ticks (the kernel counts in ticks of
/// 10 ms). A loop that sleeps 50 µs per turn uses several times this.
const IDLE_CPU_SECONDS_MAX: f64 = 0.05;
/// How long a request to a sleeping shard may take on a loaded 2-core test machine.
const WAKE_SECONDS_MAX: f64 = 1.0;

/// CPU seconds (user and system) used so far by this process's shard threads.
fn shard_cpu_seconds() -> f64 {
    // SAFETY: sysconf takes no pointers.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut ticks = 0u64;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        // `pid (comm) state ...`: the name may hold spaces, so split after its closing paren.
        let Some((name_part, rest)) = stat.rsplit_once(") ") else { continue };
        if !name_part.contains("(copse-shard-") {
            continue;
        }
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // Fields 14 and 15 of stat (utime, stime) are the 12th and 13th after the name.
        ticks += fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    }
    ticks as f64 / ticks_per_second
}

#[test]
fn idle_shards_sleep_and_wake_for_a_request() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), common::options(2)).unwrap();
    for i in 0..300u32 {
        db.put(format!("key{i}").as_bytes(), &vec![i as u8; 1 + (i as usize * 37) % 5000]).unwrap();
    }
    db.flush().unwrap();
    db.settle().unwrap();
    for phase in ["after writes", "after a read"] {
        let before = shard_cpu_seconds();
        std::thread::sleep(IDLE_MEASURED);
        let used = shard_cpu_seconds() - before;
        assert!(
            used <= IDLE_CPU_SECONDS_MAX,
            "{phase}: idle shard threads used {used:.3} s of CPU in {IDLE_MEASURED:?}"
        );
        let started = Instant::now();
        assert_eq!(db.get(b"key7").unwrap(), Some(vec![7u8; 1 + 7 * 37]));
        let took = started.elapsed().as_secs_f64();
        assert!(took <= WAKE_SECONDS_MAX, "{phase}: a get to sleeping shards took {took:.3} s");
    }
    db.close().unwrap();
}
