//! The hash maps of the engine and the shard: fast (foldhash), seeded at random in a normal
//! process so that keys chosen by a client cannot be aimed at one bucket, and seeded with a fixed
//! value when the process asked for determinism ([`make_deterministic`]).
//!
//! Why this matters: the engine iterates some maps (dirty pages, waiting reads) to decide the
//! order of its I/O, and the simulator (`tests/sim.rs`) replays a failing seed only if that order
//! is the same in every run. std's `RandomState` cannot be seeded, so every engine map uses
//! [`State`] instead.
//!
//! Invariant: within one process every `State` is built the same way, chosen before the first
//! map is made: a test that wants determinism calls [`make_deterministic`] before it opens an
//! engine, and the flag is never cleared.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};

use foldhash::fast::{FoldHasher, SeedableRandomState};

static DETERMINISTIC: AtomicBool = AtomicBool::new(false);

/// Makes every map made from now on in this process hash with a fixed seed. For simulators and
/// tests that replay a seed; never called by the store itself.
#[cfg(any(test, feature = "testing"))]
pub fn make_deterministic() {
    DETERMINISTIC.store(true, Ordering::Release);
}

pub fn is_deterministic() -> bool {
    DETERMINISTIC.load(Ordering::Acquire)
}

/// The hasher builder of every engine and shard map.
#[derive(Clone, Debug)]
pub struct State(SeedableRandomState);

impl Default for State {
    fn default() -> State {
        if is_deterministic() {
            State(SeedableRandomState::fixed())
        } else {
            State(SeedableRandomState::random())
        }
    }
}

impl BuildHasher for State {
    type Hasher = FoldHasher<'static>;

    fn build_hasher(&self) -> Self::Hasher {
        self.0.build_hasher()
    }
}

pub type HashMap<K, V> = std::collections::HashMap<K, V, State>;
pub type HashSet<T> = std::collections::HashSet<T, State>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_maps_iterate_in_the_same_order() {
        make_deterministic();
        let fill = || {
            let mut map: HashMap<u64, u64> = HashMap::default();
            for key in 0..1000u64 {
                map.insert(key.wrapping_mul(0x9e37_79b9_7f4a_7c15), key);
            }
            map.into_values().collect::<Vec<_>>()
        };
        let first = fill();
        assert_eq!(first, fill());
        // The order is not simply the insertion order (the maps really hash).
        assert_ne!(first, (0..1000u64).collect::<Vec<_>>());
    }
}
