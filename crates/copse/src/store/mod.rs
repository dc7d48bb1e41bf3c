//! The store layer: what a store is on its storage as a whole, and how it is opened.
//!
//! - `manifest.rs`: the store's catalogue, one page that fixes the shard count, key hash,
//!   engine and placements every later open must agree with (docs/format/manifest.md), and the
//!   detection of a lost manifest beside engine files;
//! - `options.rs`: [`Options`], how to open a store;
//! - `open.rs`: `Store`, the open store (directory lock, manifest, shard threads started through
//!   the engine factory, interrupted cross-shard batches resolved), closed once.
//!
//! It sits between the API (`interfaces`) and the router: it starts the shards and hands the
//! router to `Db`, and names no engine (the engine factory builds each shard's engine).

pub mod manifest;
pub(crate) mod open;
pub mod options;

pub use open::StorePlacement;
pub use options::Options;
