//! The copse network server (RStore's front end): the Redis protocol over copse's shards, so
//! every Redis client works with data on SSD and every acknowledged write durable.
//!
//! Reading order: `net/mod.rs` (threads and shutdown), `net/conn.rs` (a connection's waves),
//! `context.rs` (what commands see of the server), `cmd/mod.rs` (commands as exec programs),
//! `keyspace.rs` (how Redis types map onto items), `resp/` (the protocol), `config.rs`
//! (settings), `fds.rs` (the descriptor limit), `waiters.rs` (clients blocked on keys).
//!
//! Layers, bottom to top (`scripts/check_layers.py` keeps them): `config`, `resp`, `fds`,
//! `waiters`, `glob`, `pubsub` →
//! `keyspace`, `databases` → `context` → `cmd` → `net`.

//! The public API is what this file exports: start or serve a server from a [`ServerConfig`],
//! and wait for a stop signal. The modules are crate-private; the `testing` cargo feature (the
//! crate's tests, the corpus example and the fuzz crate turn it on) makes them public and adds
//! the protocol's fuzz target.

/// Declares a module: crate-private, public under the `testing` feature.
macro_rules! module {
    ($name:ident) => {
        #[cfg(feature = "testing")]
        pub mod $name;
        #[cfg(not(feature = "testing"))]
        pub(crate) mod $name;
    };
}

module!(cmd);
module!(config);
module!(context);
module!(databases);
module!(fds);
module!(glob);
module!(keyspace);
module!(net);
module!(pubsub);
module!(resp);
module!(waiters);

pub use config::ServerConfig;
pub use context::{set_allocator_report, AllocatorReport};
pub use keyspace::KEYSPACE_FORMAT_VERSION;
pub use net::{serve, start, wait_for_signal, Running, ServeError};
