//! Helpers shared by the integration tests: which engine they run over, what a write did, and
//! values that name the write that made them. (Each test binary uses a part of this module.)
#![allow(dead_code)]

/// The engine the engine-generic tests run over: `COPSE_TEST_ENGINE` (`native`, the default, or
/// `rocksdb`; `make test-rocksdb` sets it). Tests on the simulated device are native-only and are
/// left out of that run by name (`simulated`).
pub fn engine() -> copse::EngineKind {
    match std::env::var("COPSE_TEST_ENGINE") {
        Ok(name) => name.parse().unwrap_or_else(|err| panic!("COPSE_TEST_ENGINE: {err}")),
        Err(_) => copse::EngineKind::Native,
    }
}

/// A small store of `shards` shards (4 MiB of cache) over the engine under test.
pub fn options(shards: usize) -> copse::Options {
    copse::Options {
        shards,
        cache_bytes: 4 << 20,
        show_progress: false,
        engine: engine(),
        ..copse::Options::default()
    }
}

/// What one write did to its key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Put(Vec<u8>),
    Delete,
}

/// A value that names its write (`tag`, before the `|`) and is `len` bytes long (at least the tag).
pub fn make_value(tag: &str, len: usize) -> Vec<u8> {
    let mut value = Vec::with_capacity(len.max(tag.len() + 1));
    value.extend_from_slice(tag.as_bytes());
    value.push(b'|');
    let mut x = tag
        .bytes()
        .fold(0x9e37_79b9_7f4a_7c15u64, |acc, b| (acc ^ b as u64).wrapping_mul(0x100_0000_01b3));
    while value.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        value.push(b'a' + (x % 26) as u8);
    }
    value
}

/// The tag and length of a value, for messages.
pub fn describe_value(value: Option<&[u8]>) -> String {
    match value {
        None => "absent".to_string(),
        Some(value) => {
            let tag_end = value.iter().position(|&b| b == b'|').unwrap_or(value.len().min(32));
            format!(
                "{:?} ({} bytes)",
                String::from_utf8_lossy(&value[..tag_end.min(40)]),
                value.len()
            )
        }
    }
}

/// A count from the environment (seeds, cycles), or `default` when unset. A value that is not a
/// number stops the test rather than running a different count than asked for.
pub fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(text) => {
            text.trim().parse().unwrap_or_else(|_| panic!("{name}={text:?} is not a number"))
        }
        Err(_) => default,
    }
}
