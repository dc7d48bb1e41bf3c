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

/// What the process's allocator reports: its name (INFO's `mem_allocator`) and the bytes it holds
/// for the process now (INFO's `used_memory`). The binary that chooses the global allocator
/// registers it (`set_allocator_report`); without one, INFO says `libc` and uses the RSS.
#[derive(Clone, Copy)]
pub struct AllocatorReport {
    pub name: &'static str,
    pub bytes: fn() -> u64,
}

static ALLOCATOR_REPORT: std::sync::OnceLock<AllocatorReport> = std::sync::OnceLock::new();

/// Registers the process's allocator report, once (later calls are ignored).
pub fn set_allocator_report(report: AllocatorReport) {
    let _ = ALLOCATOR_REPORT.set(report);
}

pub fn allocator_report() -> Option<AllocatorReport> {
    ALLOCATOR_REPORT.get().copied()
}

/// Key lookups of read commands, as Redis counts them (`keyspace_hits`, `keyspace_misses`): one
/// per key a read command looks up, a hit when the key exists (of any type), counted by the
/// exec that decides it (`cmd::View::note_lookup`) on whichever shard thread runs it. One count
/// per process, as a server is (tests that run several servers in one process see their sum).
/// Each thread counts in a slot of its own (`LOOKUP_SLOTS`, taken in turn, wrapping; a shared
/// one is added to atomically all the same), so shard threads never contend for a cache line.
pub struct Lookups;

/// Slots of `Lookups`, each on its own cache line.
const LOOKUP_SLOTS: usize = 64;

#[repr(align(64))]
struct LookupSlot {
    hits: AtomicU64,
    misses: AtomicU64,
}

static LOOKUP_COUNTS: [LookupSlot; LOOKUP_SLOTS] =
    [const { LookupSlot { hits: AtomicU64::new(0), misses: AtomicU64::new(0) } }; LOOKUP_SLOTS];
static NEXT_LOOKUP_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static LOOKUP_SLOT: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

impl Lookups {
    /// Counts one lookup that found its key (`found`) or not.
    pub fn note(found: bool) {
        let slot = LOOKUP_SLOT.with(|slot| {
            if slot.get() == usize::MAX {
                slot.set(NEXT_LOOKUP_SLOT.fetch_add(1, Ordering::Relaxed) % LOOKUP_SLOTS);
            }
            slot.get()
        });
        let slot = &LOOKUP_COUNTS[slot];
        let counter = if found { &slot.hits } else { &slot.misses };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// (hits, misses) so far.
    pub fn totals() -> (u64, u64) {
        LOOKUP_COUNTS.iter().fold((0, 0), |(hits, misses), slot| {
            (hits + slot.hits.load(Ordering::Relaxed), misses + slot.misses.load(Ordering::Relaxed))
        })
    }
}

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

/// Redis's encoding knobs, as CONFIG GET and SET name them (with their older `ziplist` names):
/// (name, alias, default, least, most), Redis 7.0's compiled-in defaults and ranges. copse
/// accepts and reports them; they change what OBJECT ENCODING answers (the encoding Redis would
/// use), never copse's disk layout.
pub const ENCODING_KNOBS: [(&str, Option<&str>, i64, i64, i64); 7] = [
    ("hash-max-listpack-entries", Some("hash-max-ziplist-entries"), 512, 0, i64::MAX),
    ("hash-max-listpack-value", Some("hash-max-ziplist-value"), 64, 0, i64::MAX),
    ("zset-max-listpack-entries", Some("zset-max-ziplist-entries"), 128, 0, i64::MAX),
    ("zset-max-listpack-value", Some("zset-max-ziplist-value"), 64, 0, i64::MAX),
    ("set-max-intset-entries", None, 512, 0, i64::MAX),
    ("list-max-listpack-size", Some("list-max-ziplist-size"), -2, i32::MIN as i64, i32::MAX as i64),
    ("list-compress-depth", None, 0, 0, i32::MAX as i64),
];

/// The values of `ENCODING_KNOBS`, in its order.
pub struct EncodingKnobs {
    values: [std::sync::atomic::AtomicI64; ENCODING_KNOBS.len()],
}

impl Default for EncodingKnobs {
    fn default() -> Self {
        EncodingKnobs {
            values: std::array::from_fn(|at| {
                std::sync::atomic::AtomicI64::new(ENCODING_KNOBS[at].2)
            }),
        }
    }
}

impl EncodingKnobs {
    /// The position in `ENCODING_KNOBS` of the knob named `name` (or its alias).
    pub fn position(name: &str) -> Option<usize> {
        ENCODING_KNOBS.iter().position(|(knob, alias, ..)| *knob == name || *alias == Some(name))
    }

    pub fn get(&self, name: &str) -> i64 {
        let at = EncodingKnobs::position(name).expect("a known knob");
        self.values[at].load(Ordering::Relaxed)
    }

    pub fn set(&self, at: usize, value: i64) {
        self.values[at].store(value, Ordering::Relaxed)
    }
}

/// When each key was last used, approximately: a table of `ACCESS_SLOTS` clocks indexed by the
/// key's hash, each the second (since the server started) a key hashing there was last named by
/// a command. OBJECT IDLETIME reads it. Keys sharing a slot share a clock, so an idle time is
/// never longer than the truth, and may be shorter (Redis's own LRU clock is approximate too,
/// to its resolution). Costs one relaxed store per key a command names.
pub struct AccessClock {
    slots: Box<[std::sync::atomic::AtomicU32]>,
}

/// Slots of `AccessClock` (256 KiB of clocks).
pub const ACCESS_SLOTS: usize = 1 << 16;
/// The access clock's reading when the server starts: 2^30 s (34 years), so that a key restored
/// with an idle time longer than the uptime (RESTORE ... IDLETIME) still reads it back.
pub const CLOCK_START_S: u32 = 1 << 30;

impl Default for AccessClock {
    fn default() -> Self {
        AccessClock {
            slots: (0..ACCESS_SLOTS).map(|_| std::sync::atomic::AtomicU32::new(0)).collect(),
        }
    }
}

impl AccessClock {
    fn slot(&self, key: &[u8]) -> &std::sync::atomic::AtomicU32 {
        &self.slots[xxhash_rust::xxh3::xxh3_64(key) as usize % ACCESS_SLOTS]
    }

    /// Notes that `key` was used at `now_s` (seconds since the server started).
    pub fn touch(&self, key: &[u8], now_s: u32) {
        let slot = self.slot(key);
        if slot.load(Ordering::Relaxed) != now_s {
            slot.store(now_s, Ordering::Relaxed);
        }
    }

    /// Notes `key` as last used `idle_s` seconds before `now_s` (RESTORE ... IDLETIME), or at the
    /// server's start if that is earlier.
    pub fn set_idle(&self, key: &[u8], now_s: u32, idle_s: i64) {
        let at = (now_s as i64).saturating_sub(idle_s).max(0) as u32;
        self.slot(key).store(at, Ordering::Relaxed);
    }

    /// Seconds since `key` was last used, at most `now_s` (never used since the server started).
    pub fn idle_s(&self, key: &[u8], now_s: u32) -> u32 {
        now_s.saturating_sub(self.slot(key).load(Ordering::Relaxed))
    }
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
    /// `ENCODING_KNOBS` as CONFIG SET left them.
    pub encoding: EncodingKnobs,
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
    /// The database map epoch the connection's current wave started under, `IDLE_EPOCH` between
    /// waves and while a blocked command waits (`databases.rs`: SWAPDB waits on it). Written by
    /// the connection's own task only.
    pub busy_epoch: AtomicU64,
    /// CLIENT KILL: set, then `kill` told; the connection ends at its next look.
    pub killed: AtomicBool,
    pub kill: tokio::sync::Notify,
}

/// `ClientInfo::busy_epoch` of a connection running no wave.
pub const IDLE_EPOCH: u64 = u64::MAX;

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
    pub databases: crate::databases::Databases,
    /// When keys were last used (OBJECT IDLETIME).
    pub access: AccessClock,
    /// `access_clock_s`, kept by the clock task.
    clock_s: std::sync::atomic::AtomicU32,
    /// Moved by every FLUSHALL and FLUSHDB, at their start and end: they delete keys without
    /// taking their locks, so a WATCH of a key that existed fails the EXEC after one
    /// (`cmd/multi.rs`).
    pub flush_epoch: AtomicU64,
    /// Moved by every SWAPDB, at its start and end: a WATCH before one fails the EXEC after it.
    pub swap_epoch: AtomicU64,
    /// Scripts by the SHA-1 of their source (EVAL, SCRIPT LOAD; `cmd/scripts.rs`).
    pub scripts: Mutex<std::collections::HashMap<String, Arc<[u8]>>>,
    /// Moved by SCRIPT FLUSH: each thread's Lua state, compiled scripts and all, is made anew.
    pub scripts_generation: AtomicU64,
    /// Every subscription, and the delivery of published messages.
    pub pubsub: crate::pubsub::PubSub,
    /// CLIENT PAUSE: until when, and whether all commands wait (else writes only); `unpaused`
    /// wakes the waiting ones at CLIENT UNPAUSE.
    pub pause: Mutex<Option<(Instant, bool)>>,
    pub unpaused: tokio::sync::Notify,
    /// Whether `pause` may hold a pause: read by every command (one load), so the mutex is
    /// taken only while a pause is on. Changed only under `pause`'s lock.
    pub paused: AtomicBool,
}

/// How often the clock task moves `Server::access_clock_s` (Redis's LRU clock ticks every 100 ms too).
pub const CLOCK_TICK_MS: u64 = 100;

impl Server {
    /// The access clock's time: `CLOCK_START_S` plus the whole seconds since the server started,
    /// as of the last tick of the clock task (one load per command, no clock read; `tick_clock`).
    pub fn access_clock_s(&self) -> u32 {
        self.clock_s.load(Ordering::Relaxed)
    }

    /// Whether every connection but `except` is idle or runs a wave started under `epoch` or
    /// later (SWAPDB's wait).
    pub fn waves_past(&self, epoch: u64, except: u64) -> bool {
        let clients = self.clients.lock().unwrap_or_else(|poison| poison.into_inner());
        clients.values().filter(|client| client.id != except).all(|client| {
            let busy = client.busy_epoch.load(Ordering::SeqCst);
            busy == IDLE_EPOCH || busy >= epoch
        })
    }

    /// Moves `access_clock_s` to now (the clock task, every `CLOCK_TICK_MS`).
    pub fn tick_clock(&self) {
        let elapsed = self.started.elapsed().as_secs().min((u32::MAX - CLOCK_START_S) as u64);
        self.clock_s.store(CLOCK_START_S + elapsed as u32, Ordering::Relaxed);
    }

    /// The state of a server about to serve `db` on `local_addr`, with no client yet.
    pub fn new(
        db: Db,
        config: ServerConfig,
        settings: Settings,
        run_id: String,
        local_addr: SocketAddr,
        value_bytes_bound: usize,
        databases: crate::databases::Databases,
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
            flush_epoch: AtomicU64::new(0),
            swap_epoch: AtomicU64::new(0),
            scripts: Mutex::default(),
            scripts_generation: AtomicU64::new(0),
            pubsub: crate::pubsub::PubSub::default(),
            pause: Mutex::new(None),
            unpaused: tokio::sync::Notify::new(),
            paused: AtomicBool::new(false),
            access: AccessClock::default(),
            clock_s: std::sync::atomic::AtomicU32::new(CLOCK_START_S),
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
            busy_epoch: AtomicU64::new(IDLE_EPOCH),
            killed: AtomicBool::new(false),
            kill: tokio::sync::Notify::new(),
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
    /// Commands queued since MULTI, until EXEC or DISCARD (`cmd/multi.rs`).
    pub transaction: Option<Transaction>,
    /// The keys WATCH named, with the versions read (filled in when WATCH's reads answer, so
    /// shared with that command's answer).
    pub watched: Arc<Mutex<Watched>>,
    /// Set while EXEC builds its commands' execs: they run inside one sequence per shard, so
    /// a command that would make a cross-shard batch of its own (MSET) needs none.
    pub in_exec: bool,
    /// Its subscriptions and mailbox, from its first SUBSCRIBE (`pubsub.rs`).
    pub subscriber: Option<crate::pubsub::Subscriber>,
    /// CLIENT REPLY OFF: no reply is sent; `skip_replies`: so many next replies are not sent
    /// (CLIENT REPLY SKIP: its own and the next command's).
    pub replies_off: bool,
    pub skip_replies: u8,
    /// CLIENT NO-TOUCH ON: commands do not mark keys as used (OBJECT IDLETIME).
    pub no_touch: bool,
    /// The database an EXEC that ran left selected (a queued SELECT), plus one (0: none):
    /// applied before the next command, and never by an EXEC that did not run. An atomic, so
    /// the check per command is one load.
    pub after_exec: Arc<std::sync::atomic::AtomicU16>,
}

/// A transaction being queued (MULTI).
#[derive(Default)]
pub struct Transaction {
    pub queued: Vec<crate::resp::Args>,
    /// The queued arguments' bytes: at most the query buffer limit.
    pub queued_bytes: usize,
    /// A command was refused while queueing: EXEC answers EXECABORT and runs nothing.
    pub refused: bool,
}

/// What WATCH recorded.
#[derive(Default)]
pub struct Watched {
    pub keys: Vec<WatchedKey>,
    /// `Server::flush_epoch` and `swap_epoch` when the first key was watched.
    pub flush_epoch: u64,
    pub swap_epoch: u64,
}

/// One watched key: its shard, its lock id and the lock's version when WATCH read it, whether
/// it existed then, and its deadline if it had one.
#[derive(Clone, Copy)]
pub struct WatchedKey {
    pub shard: u32,
    pub lock: u64,
    pub version: u64,
    pub existed: bool,
    pub deadline_ms: Option<u64>,
}

impl ConnState {
    /// A new connection's state: RESP2, database 0, nothing queued or watched.
    pub fn new(info: Arc<ClientInfo>, authenticated: bool) -> ConnState {
        ConnState {
            protocol: Protocol::Resp2,
            authenticated,
            info,
            db: 0,
            transaction: None,
            watched: Arc::default(),
            in_exec: false,
            subscriber: None,
            replies_off: false,
            skip_replies: 0,
            no_touch: false,
            after_exec: Arc::default(),
        }
    }

    /// Whether the reply of the command just dispatched is sent (CLIENT REPLY).
    pub fn take_reply_sent(&mut self) -> bool {
        if self.skip_replies > 0 {
            self.skip_replies -= 1;
            return false;
        }
        !self.replies_off
    }

    /// Forgets every watched key (EXEC, DISCARD, UNWATCH, RESET).
    pub fn unwatch(&mut self) {
        *self.watched.lock().unwrap_or_else(|poison| poison.into_inner()) = Watched::default();
    }
    pub fn select(&mut self, db: u8) {
        self.db = db;
        self.info.db.store(db, Ordering::Relaxed);
    }

    pub fn set_protocol(&mut self, protocol: Protocol) {
        self.protocol = protocol;
        if let Some(subscriber) = &self.subscriber {
            subscriber.set_protocol(protocol);
        }
        let number = if protocol == Protocol::Resp3 { 3 } else { 2 };
        self.info.protocol.store(number, Ordering::Relaxed);
    }
}
