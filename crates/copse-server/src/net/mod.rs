//! The network layer (RStore's front end): thread-per-core event loops that own connections and
//! talk to the shards only by message.
//!
//! Threads:
//! - the main thread accepts connections (and serves the metrics endpoint and signals), and hands
//!   each new connection to a network thread, round robin, over a channel;
//! - each network thread runs one single-threaded tokio runtime: every connection it owns is a
//!   cooperative task on it, and never moves to another thread;
//! - each shard runs as a task of one network thread (`shard_task.rs`; shard i on thread
//!   i mod threads) when `thread_per_core` is on and its engine can share a thread, and on a
//!   thread of its own otherwise. A command for a key becomes an exec program queued on the
//!   owning shard's channel; the shard answers on a oneshot channel. A connection on the
//!   shard's own thread reaches it without leaving that thread. No lock is shared between
//!   connections and shards on the command path.
//!
//! The state commands see (`Server`, `ConnState`, the client registry) lives in `context.rs`,
//! so command code never depends on this layer.
//!
//! Shutdown (SIGTERM, SIGINT): stop accepting, tell every connection to finish the commands it
//! has read and close, wait until every network thread's connections are done, close the store
//! cleanly (the network threads run their shards until the shards stop), then join the threads.

pub mod access;
pub mod conn;
pub mod metrics;
pub mod shard_task;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use copse::Db;
use tokio::sync::{mpsc, watch};

use crate::config::{ConfigError, ServerConfig};
use crate::context::{Server, Settings};
use crate::fds;

/// Makes sure the store holds the Redis key space in a format this build reads: a new store
/// gets the marker; a store with items but no marker (written through the embedded API or the
/// CLI) or with another version is refused, so the server never misreads foreign items.
fn check_keyspace_marker(db: &Db, config: &ServerConfig) -> Result<(), ServeError> {
    use crate::keyspace::{
        marker_value, marker_version, KEYSPACE_FORMAT_VERSION, KEYSPACE_FORMAT_VERSIONS_SUBSET,
        KEYSPACE_FORMAT_VERSION_UNVERSIONED, MARKER_KEY,
    };
    let path = config.path.display().to_string();
    let mark =
        || db.put(MARKER_KEY, &marker_value()).map_err(|err| ServeError::Store(err.to_string()));
    // An older store is upgraded only if none of its keys would change its stored name.
    let no_prefixed_keys = |version: u32| -> Result<(), ServeError> {
        let found = crate::cmd::names::prefixed_key_in_store(db);
        match futures::executor::block_on(found) {
            Ok(None) => Ok(()),
            Ok(Some((namespace, key))) => {
                Err(prefixed_key_refused(&path, version, namespace, &key))
            }
            Err(reply) => Err(ServeError::Keyspace(format!(
                "store at {path}: listing its keys before the upgrade failed: {reply:?}"
            ))),
        }
    };
    match db.get(MARKER_KEY).map_err(|err| ServeError::Store(err.to_string()))? {
        Some(value) => match marker_version(&value) {
            Some(KEYSPACE_FORMAT_VERSION) => Ok(()),
            Some(version) if KEYSPACE_FORMAT_VERSIONS_SUBSET.contains(&version) => {
                no_prefixed_keys(version)?;
                // These versions wrote only items this one reads the same: the marker changes.
                mark()?;
                tracing::info!(%path, from = version, to = KEYSPACE_FORMAT_VERSION, "key space upgraded");
                Ok(())
            }
            Some(KEYSPACE_FORMAT_VERSION_UNVERSIONED) => {
                no_prefixed_keys(KEYSPACE_FORMAT_VERSION_UNVERSIONED)?;
                tracing::info!(
                    %path,
                    from = KEYSPACE_FORMAT_VERSION_UNVERSIONED,
                    to = KEYSPACE_FORMAT_VERSION,
                    "upgrading the Redis key space"
                );
                let upgrade = crate::cmd::upgrade::upgrade_collections(db);
                let moved = futures::executor::block_on(upgrade).map_err(|err| {
                    ServeError::Keyspace(format!("upgrading the key space of the store at {path}: {err}"))
                })?;
                mark()?;
                tracing::info!(%path, collections = moved, "key space upgraded");
                Ok(())
            }
            Some(version) => Err(ServeError::Keyspace(format!(
                "store at {path} holds Redis key space format version {version}; this build reads version {KEYSPACE_FORMAT_VERSION}"
            ))),
            None => Err(ServeError::Keyspace(format!("store at {path} has a damaged key space marker"))),
        },
        None => {
            let items = db.stats().map_err(|err| ServeError::Store(err.to_string()))?.items;
            if items > 0 {
                return Err(ServeError::Keyspace(format!(
                    "store at {path} holds {items} items that copse serve did not write (it was used through the API or the CLI); serve a store of its own"
                )));
            }
            mark()
        }
    }
}

/// The refusal of an older store holding `key` (in namespace `namespace`), which starts with the
/// bytes format 7 reserves for surrogate names (`keyspace::SURROGATE_PREFIX`).
fn prefixed_key_refused(path: &str, version: u32, namespace: u8, key: &[u8]) -> ServeError {
    const SHOWN_BYTES_MAX: usize = 64;
    let shown: String = key[..key.len().min(SHOWN_BYTES_MAX)].escape_ascii().to_string();
    let more = if key.len() > SHOWN_BYTES_MAX { "..." } else { "" };
    ServeError::Keyspace(format!(
        "store at {path} holds Redis key space format version {version} and a key that this build \
         would read under another name: \"{shown}{more}\" ({} bytes, in namespace {namespace}, which \
         is database {namespace} unless SWAPDB moved it) is longer than {} bytes or starts with the \
         bytes {}, which key space format {} stores under a SHA-256 name (docs/format/redis-keyspace.md, \
         \"Upgrading\"). Nothing was changed. Serve the store with the build that wrote it, RENAME \
         (or DEL) every such key, stop it, then open the store with this build",
        key.len(),
        crate::keyspace::NAME_INLINE_BYTES_MAX,
        crate::keyspace::SURROGATE_PREFIX.escape_ascii(),
        crate::keyspace::KEYSPACE_FORMAT_VERSION,
    ))
}

/// The database map (`cmd/namespace.rs`): as stored, or the identity in a store SWAPDB never
/// changed.
fn load_database_map(
    db: &Db,
    config: &ServerConfig,
) -> Result<[u8; crate::databases::DATABASES], ServeError> {
    use crate::databases::{decode_map, identity_map, DATABASE_MAP_KEY};
    match db.get(DATABASE_MAP_KEY).map_err(|err| ServeError::Store(err.to_string()))? {
        None => Ok(identity_map()),
        Some(value) => decode_map(&value).ok_or_else(|| {
            ServeError::Keyspace(format!(
                "store at {} has a damaged database map ({} bytes that are not a permutation of 0..16)",
                config.path.display(),
                value.len()
            ))
        }),
    }
}

/// Raises the open files limit for `maxclients` clients plus the server's own descriptors,
/// and lowers `maxclients` to what the limit allows, saying so (Redis's words).
fn clamp_maxclients(maxclients: usize, reserved_fds: u64) -> Result<usize, ServeError> {
    let wanted = (maxclients as u64).saturating_add(reserved_fds);
    let limit = fds::raise_fd_limit(wanted).map_err(ServeError::Runtime)?;
    let allowed = fds::clients_max_for(limit, reserved_fds);
    if allowed == 0 {
        return Err(ServeError::Runtime(std::io::Error::other(format!(
            "the open files limit ({limit}) is not enough for the server to start: it needs {reserved_fds} descriptors of its own; raise 'ulimit -n' to at least {}",
            reserved_fds + 1
        ))));
    }
    if allowed < maxclients {
        tracing::warn!(
            "You requested maxclients of {maxclients} requiring at least {wanted} max file descriptors. Current maximum open files is {limit}. maxclients has been reduced to {allowed} to compensate for low ulimit. If you need higher maxclients increase 'ulimit -n'."
        );
        return Ok(allowed);
    }
    Ok(maxclients)
}

/// Whether `bind` names only this host's loopback (an address that does not parse counts as
/// not: the warning it decides is better given once too often).
fn bind_is_loopback(bind: &str) -> bool {
    bind == "localhost" || bind.parse().is_ok_and(access::is_loopback)
}

/// The largest value the store can hold now, from its figures: the slot size of the largest
/// size class with anything live (a record holds its value and more). An engine without size
/// classes (RocksDB) gives no such figure, so a store with items counts copse's largest value.
fn stored_value_bytes_bound(db: &Db) -> Result<usize, ServeError> {
    let stats = db.stats().map_err(|err| ServeError::Store(err.to_string()))?;
    let live_slot_bytes =
        stats.classes.iter().filter(|class| class.live_bytes > 0).map(|class| class.slot_bytes);
    let bound = match live_slot_bytes.max() {
        Some(slot_bytes) => slot_bytes as usize,
        None if stats.classes.is_empty() && stats.items > 1 => copse::limits::VALUE_BYTES_MAX,
        None => 0,
    };
    Ok(bound.min(copse::limits::VALUE_BYTES_MAX))
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Keyspace(String),
    #[error("store error while starting: {0}")]
    Store(String),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot open the store: {0}")]
    Open(#[from] copse::OpenError),
    #[error("cannot listen on {addr}: {error}")]
    Bind { addr: String, error: std::io::Error },
    #[error("cannot start the server: {0}")]
    Runtime(std::io::Error),
    #[error("closing the store failed: {0}")]
    Close(#[from] copse::WriteError),
}

/// A running server: its address, and a way to stop it (tests; `serve` waits for a signal).
pub struct Running {
    pub local_addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    main: std::thread::JoinHandle<Result<(), ServeError>>,
}

impl Running {
    /// Shuts down as on SIGTERM and waits until the store is closed.
    pub fn stop(self) -> Result<(), ServeError> {
        let _ = self.stop.send(true);
        self.main.join().unwrap_or_else(|_| {
            Err(ServeError::Runtime(std::io::Error::other("the server thread panicked")))
        })
    }
}

/// Opens the store, binds, and starts serving on background threads.
pub fn start(mut config: ServerConfig) -> Result<Running, ServeError> {
    config.load_password_file()?;
    config.validate()?;
    let options = config.store_options()?;
    let db = Db::open(&config.path, options)?;
    if let Err(err) = check_keyspace_marker(&db, &config) {
        let _ = db.close();
        return Err(err);
    }
    let databases = match load_database_map(&db, &config) {
        Ok(map) => crate::databases::Databases::new(map),
        Err(err) => {
            let _ = db.close();
            return Err(err);
        }
    };
    let value_bytes_bound = match stored_value_bytes_bound(&db) {
        Ok(bound) => bound,
        Err(err) => {
            let _ = db.close();
            return Err(err);
        }
    };
    let addr = format!("{}:{}", config.bind, config.port);
    let listener = std::net::TcpListener::bind(&addr)
        .map_err(|error| ServeError::Bind { addr: addr.clone(), error })?;
    listener.set_nonblocking(true).map_err(ServeError::Runtime)?;
    let local_addr = listener.local_addr().map_err(ServeError::Runtime)?;
    let metrics_listener = if config.metrics_port > 0 {
        let addr = format!("{}:{}", config.bind, config.metrics_port);
        let listener = std::net::TcpListener::bind(&addr)
            .map_err(|error| ServeError::Bind { addr: addr.clone(), error })?;
        listener.set_nonblocking(true).map_err(ServeError::Runtime)?;
        Some(listener)
    } else {
        None
    };
    let metrics_addr = metrics_listener.as_ref().and_then(|l| l.local_addr().ok());
    let threads = config.thread_count();
    let reserved_fds = fds::reserved_fds(db.shard_count() as usize, threads);
    let maxclients = clamp_maxclients(config.maxclients, reserved_fds)?;
    let settings = Settings {
        requirepass: Mutex::new(config.requirepass.clone()),
        maxclients: AtomicUsize::new(maxclients),
        timeout_secs: AtomicU64::new(config.timeout_secs),
        proto_max_bulk_len: AtomicUsize::new(config.proto_max_bulk_len),
        client_output_bytes_max: AtomicUsize::new(config.client_output_bytes_max),
        protected_mode: AtomicBool::new(config.protected_mode),
        reserved_fds,
        active_expire: AtomicBool::new(true),
        encoding: Default::default(),
    };
    if config.protected_mode && config.requirepass.is_empty() && !bind_is_loopback(&config.bind) {
        tracing::warn!(
            bind = %config.bind,
            "protected mode: no password is set, so only loopback clients will be served; set requirepass or protected_mode = false to serve others"
        );
    }
    let run_id = format!("{:040x}", rand_id());
    let server = Arc::new(Server::new(
        db,
        config,
        settings,
        run_id,
        local_addr,
        value_bytes_bound,
        databases,
    ));
    let (stop, stop_receiver) = watch::channel(false);
    let main = std::thread::Builder::new()
        .name("copse-accept".into())
        .spawn(move || run_main(server, listener, metrics_listener, threads, stop_receiver))
        .map_err(ServeError::Runtime)?;
    tracing::info!(%local_addr, threads, "copse is serving the Redis protocol");
    Ok(Running { local_addr, metrics_addr, stop, main })
}

/// Starts the server and serves until SIGTERM or SIGINT, then shuts down cleanly.
pub fn serve(config: ServerConfig) -> Result<(), ServeError> {
    let running = start(config)?;
    wait_for_signal()?;
    running.stop()
}

/// Blocks until SIGTERM or SIGINT.
pub fn wait_for_signal() -> Result<(), ServeError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    runtime.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).map_err(ServeError::Runtime)?;
        let mut int = signal(SignalKind::interrupt()).map_err(ServeError::Runtime)?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        Ok::<(), ServeError>(())
    })
}

fn rand_id() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (u128::from(hasher.finish()) << 64) | u128::from(std::process::id())
}

/// The accept thread: hands connections to the network threads, serves metrics, and on stop
/// shuts everything down in order.
fn run_main(
    server: Arc<Server>,
    listener: std::net::TcpListener,
    metrics_listener: Option<std::net::TcpListener>,
    threads: usize,
    mut stop: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let (shutdown_sender, shutdown) = watch::channel(false);
    // Thread-per-core: each shard whose engine can share a thread runs on network thread
    // (shard id mod threads); the rest keep their own threads.
    let mut hosted: Vec<Vec<copse::ShardLoop>> = (0..threads).map(|_| Vec::new()).collect();
    if server.config.thread_per_core {
        for shard in server.db.hand_off_shards() {
            hosted[shard.shard_id() as usize % threads].push(shard);
        }
    }
    let shards_hosted: usize = hosted.iter().map(Vec::len).sum();
    tracing::info!(
        shards_hosted,
        shards = server.db.shard_count(),
        threads,
        "shards on network threads (thread-per-core)"
    );
    // Each network thread drops its end once its connections are done.
    let (connections_done, all_connections_done) = std::sync::mpsc::channel::<()>();
    let mut senders = Vec::with_capacity(threads);
    let mut handles = Vec::with_capacity(threads);
    for (index, shards) in hosted.into_iter().enumerate() {
        let (sender, receiver) = mpsc::unbounded_channel::<std::net::TcpStream>();
        senders.push(sender);
        let server = server.clone();
        let shutdown = shutdown.clone();
        let connections_done = connections_done.clone();
        let handle = std::thread::Builder::new()
            .name(format!("copse-net-{index}"))
            .spawn(move || network_thread(server, receiver, shutdown, shards, connections_done))
            .map_err(ServeError::Runtime)?;
        handles.push(handle);
    }
    drop(connections_done);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    // The orphan collector (cmd/orphans.rs) runs beside the accept loop and stops with it.
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async {
        tokio::task::spawn_local(crate::cmd::orphans::run(server.clone()));
        tokio::task::spawn_local(crate::cmd::expiry::run(server.clone()));
        let clock = server.clone();
        tokio::task::spawn_local(async move {
            let tick = std::time::Duration::from_millis(crate::context::CLOCK_TICK_MS);
            loop {
                clock.tick_clock();
                tokio::time::sleep(tick).await;
            }
        });
        let listener = tokio::net::TcpListener::from_std(listener).map_err(ServeError::Runtime)?;
        if let Some(metrics_listener) = metrics_listener {
            let metrics_listener =
                tokio::net::TcpListener::from_std(metrics_listener).map_err(ServeError::Runtime)?;
            tokio::spawn(metrics::serve(server.clone(), metrics_listener));
        }
        let mut next = 0;
        loop {
            tokio::select! {
                _ = stop.changed() => break,
                accepted = listener.accept() => {
                    let (stream, _) = match accepted {
                        Ok(accepted) => accepted,
                        Err(err) => {
                            // Out of descriptors, say: keep serving the clients we have.
                            tracing::warn!(%err, "accept failed");
                            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                            continue;
                        }
                    };
                    server.stats.connections_received.fetch_add(1, Ordering::Relaxed);
                    let Ok(stream) = stream.into_std() else { continue };
                    if senders[next].send(stream).is_err() {
                        tracing::error!(thread = next, "a network thread has stopped");
                    }
                    next = (next + 1) % senders.len();
                }
            }
        }
        Ok::<(), ServeError>(())
    })?;
    drop(local);
    drop(runtime);
    tracing::info!("stopped accepting; finishing in-flight commands");
    server.shutting_down.store(true, Ordering::Release);
    let _ = shutdown_sender.send(true);
    drop(senders);
    // Every end dropped: every network thread's connections are done (or the thread ended).
    while all_connections_done.recv().is_ok() {}
    // The network threads still run their shards, which this close stops.
    let closed = server.db.close();
    for handle in handles {
        if handle.join().is_err() {
            tracing::error!("a network thread panicked");
        }
    }
    closed?;
    tracing::info!("store closed cleanly");
    Ok(())
}

/// One network thread: a single-threaded runtime whose tasks are its connections and the
/// shards it hosts. It drops `connections_done` once its connections are done, and returns once
/// its shards have stopped too (the store's close stops them).
fn network_thread(
    server: Arc<Server>,
    mut connections: mpsc::UnboundedReceiver<std::net::TcpStream>,
    shutdown: watch::Receiver<bool>,
    shards: Vec<copse::ShardLoop>,
    connections_done: std::sync::mpsc::Sender<()>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            tracing::error!(%err, "cannot start a network thread's runtime");
            return;
        }
    };
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        let shard_tasks: Vec<_> = shards
            .into_iter()
            .map(|shard| tokio::task::spawn_local(shard_task::run(shard)))
            .collect();
        let mut tasks = Vec::new();
        while let Some(stream) = connections.recv().await {
            tasks.retain(|task: &tokio::task::JoinHandle<()>| !task.is_finished());
            tasks.push(tokio::task::spawn_local(conn::run(
                server.clone(),
                stream,
                shutdown.clone(),
            )));
        }
        // The accept thread is gone: wait for the connections to finish what they read.
        for task in tasks {
            let _ = task.await;
        }
        drop(connections_done);
        for task in shard_tasks {
            if task.await.is_err() {
                tracing::error!("a shard task panicked");
            }
        }
    });
}
