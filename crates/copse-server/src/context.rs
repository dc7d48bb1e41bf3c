//! What commands see of the server (`Server`: the store, the configuration and settings that
//! CONFIG changes at run time, counters, the client registry) and of their connection
//! (`ConnState`). The network layer (`net/`) builds and owns both; command code (`cmd/`)
//! depends on this module, never on `net`.
//!
//! The client registry is the one structure under a mutex: it is touched when a client
//! connects, disconnects, names itself or is listed, never per command.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use copse::Db;

use crate::config::ServerConfig;
use crate::resp::Protocol;

/// Counters for INFO and the metrics endpoint.
#[derive(Default)]
pub struct Stats {
    pub commands: AtomicU64,
    pub connections_received: AtomicU64,
    pub rejected_connections: AtomicU64,
    pub connected_clients: AtomicUsize,
    pub net_input_bytes: AtomicU64,
    pub net_output_bytes: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub output_limit_closes: AtomicU64,
    /// Clients closed because their request outgrew the query buffer limit.
    pub query_buffer_closes: AtomicU64,
    /// Times a connection stopped dispatching to wait for its client to take replies.
    pub reply_backpressure_waits: AtomicU64,
    /// Bytes the request parser examined (searched for line ends, or copied): about the bytes
    /// received, however finely requests were split (`resp::ParseState`).
    pub parser_examined_bytes: AtomicU64,
    /// Orphan records the collector's last pass found (`cmd/orphans.rs`).
    pub orphan_records_seen: AtomicU64,
    /// Element items of dead collection versions the collector deleted.
    pub orphan_elements_deleted: AtomicU64,
    /// Orphan records the collector finished (all their dead elements deleted).
    pub orphan_keys_collected: AtomicU64,
    /// Keys active expiry deleted (`cmd/expiry.rs`): Redis's `expired_keys`.
    pub expired_keys: AtomicU64,
}

/// Settings CONFIG SET may change while the server runs.
pub struct Settings {
    pub requirepass: Mutex<String>,
    pub maxclients: AtomicUsize,
    pub timeout_secs: AtomicU64,
    pub proto_max_bulk_len: AtomicUsize,
    pub client_output_bytes_max: AtomicUsize,
    /// Protected mode (net/access.rs): without a password, only loopback peers are served.
    pub protected_mode: AtomicBool,
    /// Descriptors the server keeps for itself; CONFIG SET maxclients must leave them free.
    pub reserved_fds: u64,
    /// Whether active expiry runs (`DEBUG SET-ACTIVE-EXPIRE`, as in Redis's own tests): off,
    /// expired keys stay until a write deletes them, and still read as missing.
    pub active_expire: AtomicBool,
}

/// What CLIENT LIST shows of one connection.
pub struct ClientInfo {
    pub id: u64,
    pub addr: String,
    pub laddr: String,
    pub name: Mutex<String>,
    pub created: Instant,
    pub last_active_ms: AtomicU64,
    /// The name of the last command (a table entry: noting it allocates nothing).
    pub last_command: Mutex<&'static str>,
    pub protocol: AtomicU8,
    pub db: AtomicU8,
}

impl ClientInfo {
    /// One line of CLIENT LIST, in Redis's field=value form.
    pub fn describe(&self, started: Instant) -> String {
        let now_ms = started.elapsed().as_millis() as u64;
        let idle = now_ms.saturating_sub(self.last_active_ms.load(Ordering::Relaxed)) / 1000;
        let name = self.name.lock().unwrap_or_else(|poison| poison.into_inner()).clone();
        let command = self.last_command.lock().unwrap_or_else(|poison| poison.into_inner()).clone();
        format!(
            "id={} addr={} laddr={} fd=0 name={} age={} idle={} flags=N db={} sub=0 psub=0 ssub=0 multi=-1 qbuf=0 qbuf-free=0 argv-mem=0 multi-mem=0 obl=0 oll=0 omem=0 tot-mem=0 events=r cmd={} user=default redir=-1 resp={}",
            self.id,
            self.addr,
            self.laddr,
            name,
            self.created.elapsed().as_secs(),
            idle,
            self.db.load(Ordering::Relaxed),
            if command.is_empty() { "NULL" } else { command },
            self.protocol.load(Ordering::Relaxed),
        )
    }
}

/// Everything the connections share.
pub struct Server {
    pub db: Db,
    pub config: ServerConfig,
    pub settings: Settings,
    pub stats: Stats,
    pub clients: Mutex<BTreeMap<u64, Arc<ClientInfo>>>,
    next_client_id: AtomicU64,
    pub started: Instant,
    pub run_id: String,
    pub local_addr: SocketAddr,
    pub shutting_down: AtomicBool,
    /// At least the largest value the store holds: from the largest size class with live
    /// items at start, raised by every write before it is queued (`cmd::dispatch`). Replies
    /// are reserved against it, so small values keep deep pipelines and large ones are bounded.
    pub value_bytes_bound: Arc<AtomicUsize>,
    /// Clients blocked on list keys (BLPOP and the like).
    pub waiters: crate::waiters::Waiters,
    /// Which namespace holds each database's keys (SELECT, SWAPDB).
    pub databases: crate::cmd::namespace::Databases,
}

impl Server {
    /// The state of a server about to serve `db` on `local_addr`, with no client yet.
    pub fn new(
        db: Db,
        config: ServerConfig,
        settings: Settings,
        run_id: String,
        local_addr: SocketAddr,
        value_bytes_bound: usize,
        databases: crate::cmd::namespace::Databases,
    ) -> Server {
        Server {
            db,
            config,
            settings,
            stats: Stats::default(),
            clients: Mutex::new(BTreeMap::new()),
            next_client_id: AtomicU64::new(0),
            started: Instant::now(),
            run_id,
            local_addr,
            shutting_down: AtomicBool::new(false),
            value_bytes_bound: Arc::new(AtomicUsize::new(value_bytes_bound)),
            waiters: crate::waiters::Waiters::default(),
            databases,
        }
    }

    pub fn register_client(&self, addr: String, laddr: String) -> Arc<ClientInfo> {
        let id = self.next_client_id.fetch_add(1, Ordering::Relaxed) + 1;
        let info = Arc::new(ClientInfo {
            id,
            addr,
            laddr,
            name: Mutex::new(String::new()),
            created: Instant::now(),
            last_active_ms: AtomicU64::new(self.started.elapsed().as_millis() as u64),
            last_command: Mutex::new(""),
            protocol: AtomicU8::new(2),
            db: AtomicU8::new(0),
        });
        self.clients.lock().unwrap_or_else(|poison| poison.into_inner()).insert(id, info.clone());
        info
    }

    pub fn unregister_client(&self, id: u64) {
        self.clients.lock().unwrap_or_else(|poison| poison.into_inner()).remove(&id);
    }

    pub fn requirepass(&self) -> String {
        self.settings.requirepass.lock().unwrap_or_else(|poison| poison.into_inner()).clone()
    }
}

/// One connection's protocol state.
pub struct ConnState {
    pub protocol: Protocol,
    pub authenticated: bool,
    pub info: Arc<ClientInfo>,
    /// The database SELECT chose (0..DATABASES).
    pub db: u8,
}

impl ConnState {
    pub fn select(&mut self, db: u8) {
        self.db = db;
        self.info.db.store(db, Ordering::Relaxed);
    }

    pub fn set_protocol(&mut self, protocol: Protocol) {
        self.protocol = protocol;
        let number = if protocol == Protocol::Resp3 { 3 } else { 2 };
        self.info.protocol.store(number, Ordering::Relaxed);
    }
}
