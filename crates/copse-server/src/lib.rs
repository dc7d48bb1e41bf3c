//! The copse network server (RStore's front end): the Redis protocol over copse's shards, so
//! every Redis client works with data on SSD and every acknowledged write durable.
//!
//! Reading order: `net/mod.rs` (threads and shutdown), `net/conn.rs` (a connection's waves),
//! `context.rs` (what commands see of the server), `cmd/mod.rs` (commands as exec programs),
//! `keyspace.rs` (how Redis types map onto items), `resp/` (the protocol), `config.rs`
//! (settings), `fds.rs` (the descriptor limit).
//!
//! Layers, bottom to top (`scripts/check_layers.py` keeps them): `config`, `resp`, `fds` →
//! `keyspace` → `context` → `cmd` → `net`.

pub mod cmd;
pub mod config;
pub mod context;
pub mod fds;
pub mod keyspace;
pub mod net;
pub mod resp;

pub use config::ServerConfig;
pub use net::{serve, start, Running, ServeError};
