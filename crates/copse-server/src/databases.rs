//! Redis's databases 0–15 and the database map: which namespace of the item keys holds each
//! database (`cmd/namespace.rs` translates; docs/format/redis-keyspace.md, "Databases").
//!
//! Invariants:
//! - The map is a permutation of 0..DATABASES, in memory and in its item.
//! - SWAPDB's new map is durable before it is installed, and `swap` returns only once nothing
//!   holds the map it replaced.

use std::future::Future;
use std::sync::{Arc, RwLock};

/// Redis's default number of databases (`databases 16`): SELECT takes 0..DATABASES.
pub const DATABASES: usize = 16;
/// The item that holds the database map: 16 bytes, byte `d` the namespace of database `d`. Its
/// 0xff first byte puts it beside the marker, where no command's range goes.
pub const DATABASE_MAP_KEY: &[u8] = b"\xffcopse:redis-databases";

/// The database map: which namespace holds each database's keys. The map is shared (`Arc`) by
/// every namespace resolved under it (`cmd::namespace::resolve`), and that count is its generation: SWAPDB installs a new
/// map, then waits until nothing holds the old one.
pub struct Databases {
    map: RwLock<Arc<[u8; DATABASES]>>,
    /// SWAPDBs one at a time.
    swapping: tokio::sync::Mutex<()>,
}

impl Databases {
    /// The map as stored (`decode`), or the identity for a store without one.
    pub fn new(map: [u8; DATABASES]) -> Databases {
        Databases { map: RwLock::new(Arc::new(map)), swapping: tokio::sync::Mutex::new(()) }
    }

    /// The map now, shared: whoever holds it holds its generation (SWAPDB waits for them).
    pub fn current(&self) -> Arc<[u8; DATABASES]> {
        self.map.read().unwrap_or_else(|poison| poison.into_inner()).clone()
    }

    /// The map now.
    pub fn map(&self) -> [u8; DATABASES] {
        **self.map.read().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Swaps databases `a` and `b`: `persist` makes the new map durable (its future answers
    /// whether it did), then the map is installed, `installed` runs (blocked clients look again),
    /// and this waits for every exec built under the old map to be done. Nothing changes if
    /// `persist` fails.
    pub async fn swap<P, Fut>(
        &self,
        a: u8,
        b: u8,
        persist: P,
        installed: impl FnOnce(),
    ) -> Result<(), String>
    where
        P: FnOnce(Vec<u8>) -> Fut,
        Fut: Future<Output = Result<(), String>>,
    {
        let _one_at_a_time = self.swapping.lock().await;
        let mut new = self.map();
        new.swap(a as usize, b as usize);
        persist(new.to_vec()).await?;
        let old = {
            let mut map = self.map.write().unwrap_or_else(|poison| poison.into_inner());
            std::mem::replace(&mut *map, Arc::new(new))
        };
        installed();
        // Commands concurrent with the swap may still run under the old map; once they are done,
        // anything that follows the reply sees only the new one. (Blocked clients hold no map
        // while they wait: `cmd::namespace::InDatabase`.)
        while Arc::strong_count(&old) > 1 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        Ok(())
    }
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
    }
}
