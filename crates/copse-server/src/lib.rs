//! The copse network server (RStore's front end): the Redis protocol over copse's shards, so
//! every Redis client works with data on SSD and every acknowledged write durable.
//!
//! Reading order: `net/mod.rs` (threads and shutdown), `net/conn.rs` (a connection's waves),
//! `cmd/mod.rs` (commands as exec programs), `keyspace.rs` (how Redis types map onto items),
//! `resp/` (the protocol), `config.rs` (settings).

pub mod cmd;
pub mod config;
pub mod keyspace;
pub mod net;
pub mod resp;

pub use config::ServerConfig;
pub use net::{serve, start, Running, ServeError};
