//! Redis's databases 0–15 and the database map: which namespace of the item keys holds each
//! database (`cmd/namespace.rs` translates; docs/format/redis-keyspace.md, "Databases").
//!
//! Invariants:
//! - The map is a permutation of 0..DATABASES, in memory and in its item.
//! - SWAPDB's new map is durable before it is installed, and `swap` returns only once no
//!   connection runs a wave it started under the map it replaced.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

/// Redis's default number of databases (`databases 16`): SELECT takes 0..DATABASES.
pub const DATABASES: usize = 16;
/// The item that holds the database map: 16 bytes, byte `d` the namespace of database `d`. Its
/// 0xff first byte puts it beside the marker, where no command's range goes.
pub const DATABASE_MAP_KEY: &[u8] = b"\xffcopse:redis-databases";

/// The database map: which namespace holds each database's keys, packed into one word (four
/// bits per database) so that a command reads it with one load and no lock, and the epoch, which
/// SWAPDB advances.
///
/// How SWAPDB knows no command still runs under the old map, with nothing shared written per
/// command: a connection's commands are answered wave by wave, and a connection publishes the
/// epoch it started its current wave under (`context::ClientInfo::busy_epoch`, its own cache line,
/// written twice per wave). SWAPDB installs the map, advances the epoch, and waits until every
/// other connection is idle or started its wave under the new epoch (`swap`'s `quiet`). The map
/// is stored before the epoch advances (both sequentially consistent), so a wave that started
/// under the new epoch reads the new map.
pub struct Databases {
    map: AtomicU64,
    epoch: AtomicU64,
    /// SWAPDBs one at a time.
    swapping: tokio::sync::Mutex<()>,
}

/// How often SWAPDB looks whether the connections are past the old map.
pub const SWAP_POLL_MS: u64 = 1;

impl Databases {
    /// The map as stored (`decode`), or the identity for a store without one.
    pub fn new(map: [u8; DATABASES]) -> Databases {
        Databases {
            map: AtomicU64::new(pack(&map)),
            epoch: AtomicU64::new(0),
            swapping: tokio::sync::Mutex::new(()),
        }
    }

    /// The map now, packed (`namespace_of` reads it).
    pub fn current(&self) -> u64 {
        self.map.load(Ordering::SeqCst)
    }

    /// The epoch now: a connection publishes it when it starts a wave.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// The map now.
    pub fn map(&self) -> [u8; DATABASES] {
        std::array::from_fn(|database| namespace_of(self.current(), database as u8))
    }

    /// Swaps databases `a` and `b`: `persist` makes the new map durable (its future answers
    /// whether it did), then the map is installed and the epoch advanced, `installed` runs
    /// (blocked clients look again), and this waits until `quiet(epoch)` says no connection
    /// still runs a wave started under an older epoch. Nothing changes if `persist` fails.
    pub async fn swap<P, Fut>(
        &self,
        a: u8,
        b: u8,
        persist: P,
        installed: impl FnOnce(),
        quiet: impl Fn(u64) -> bool,
    ) -> Result<(), String>
    where
        P: FnOnce(Vec<u8>) -> Fut,
        Fut: Future<Output = Result<(), String>>,
    {
        let _one_at_a_time = self.swapping.lock().await;
        let mut new = self.map();
        new.swap(a as usize, b as usize);
        persist(new.to_vec()).await?;
        self.map.store(pack(&new), Ordering::SeqCst);
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        installed();
        while !quiet(epoch) {
            tokio::time::sleep(std::time::Duration::from_millis(SWAP_POLL_MS)).await;
        }
        Ok(())
    }
}

/// `map` packed into a word, four bits per database.
fn pack(map: &[u8; DATABASES]) -> u64 {
    map.iter()
        .enumerate()
        .fold(0, |word, (database, &number)| word | (u64::from(number) & 0xf) << (4 * database))
}

/// The namespace of `database` in packed map `map`.
pub fn namespace_of(map: u64, database: u8) -> u8 {
    ((map >> (4 * database as u32)) & 0xf) as u8
}

/// The database map stored in `value`, None if it is not a permutation of 0..DATABASES.
pub fn decode_map(value: &[u8]) -> Option<[u8; DATABASES]> {
    let map: [u8; DATABASES] = value.try_into().ok()?;
    let mut seen = [false; DATABASES];
    for &number in &map {
        let slot = seen.get_mut(number as usize)?;
        if std::mem::replace(slot, true) {
            return None;
        }
    }
    Some(map)
}

/// The identity map: database `d` in namespace `d`.
pub fn identity_map() -> [u8; DATABASES] {
    std::array::from_fn(|at| at as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_must_be_a_permutation() {
        assert_eq!(decode_map(&identity_map()), Some(identity_map()));
        let mut swapped = identity_map();
        swapped.swap(0, 9);
        assert_eq!(decode_map(&swapped), Some(swapped));
        let mut twice = identity_map();
        twice[1] = 0;
        assert_eq!(decode_map(&twice), None);
        assert_eq!(decode_map(&[16; 16]), None);
        assert_eq!(decode_map(&[0; 15]), None);
        let databases = Databases::new(swapped);
        assert_eq!(databases.map(), swapped);
        assert_eq!(namespace_of(databases.current(), 0), 9);
        assert_eq!(namespace_of(databases.current(), 15), 15);
    }
}
