//! copse: a persistent key-value store for fast SSDs.
//!
//! Start with [`Db`] (`interfaces/db.rs`), then `ARCHITECTURE.md` for the reading order.
//! Layers, top to bottom: `interfaces` → `store` → `router` → `shard` → `engine` → `device`.

pub mod device;
pub mod engine;
pub mod error;
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
pub mod hash;
pub mod interfaces;
pub mod limits;
pub mod router;
pub mod shard;
pub mod store;

pub use device::{Backend, WriteDurability};
pub use engine::placement::{Placement, PlacementSetting};
pub use engine::{BatchOp, EngineKind, KeyValue, RecoveryStats, ScrubReport, ShardStats};
pub use error::{Error, InputError, OpenError, ReadError, WriteError};
pub use interfaces::db::{Db, ScrubRun, StoreStats, WriteBatch};
pub use store::{Options, StorePlacement};
