//! The server's settings: defaults, a TOML file (`--config FILE`), then command-line flags, each
//! overriding the one before. Every setting is documented in docs/server.md, and
//! `copse.example.toml` at the repository root lists them all.

use std::path::PathBuf;

use serde::Deserialize;

/// Redis's default for `maxclients`.
pub const MAXCLIENTS_DEFAULT: usize = 10_000;
/// Descriptors kept for the server besides clients and the store (Redis's
/// CONFIG_MIN_RESERVED_FDS): listeners, the metrics endpoint, logs, files opened briefly.
pub const FDS_RESERVED_MIN: usize = 32;
/// Descriptors a shard may still open: a slab file per size class (36) with room to spare.
pub const FDS_PER_SHARD_RESERVED: usize = 48;
/// Descriptors of one network thread's event loop (epoll, its wakeup eventfd, timers).
pub const FDS_PER_NETWORK_THREAD: usize = 4;
/// Seconds a connection may stay unauthenticated while a password is set before it is closed
/// (copse's; Redis has no such bound): a client that never authenticates holds a descriptor
/// and a maxclients slot, and can do nothing else. 0 never closes.
pub const AUTH_TIMEOUT_SECS_DEFAULT: u64 = 10;
/// Arguments in one multibulk request (Redis: 1024 × 1024).
pub const MULTIBULK_ARGS_MAX: usize = 1024 * 1024;
/// Bytes of one inline request line, or of a `*`/`$` header line (Redis: 64 KiB).
pub const INLINE_BYTES_MAX: usize = 64 * 1024;
/// Bytes of one bulk argument (Redis's `proto-max-bulk-len`): the largest value copse stores,
/// plus room for nothing else, so a too-large value is refused before it is read.
pub const PROTO_MAX_BULK_LEN_DEFAULT: usize = copse::limits::VALUE_BYTES_MAX;
/// Bytes of replies a client may have waiting before the server closes it (Redis's
/// `client-output-buffer-limit` for normal clients is unlimited; copse bounds it).
pub const CLIENT_OUTPUT_BYTES_MAX_DEFAULT: usize = 256 * 1024 * 1024;
/// Bytes of one client's query buffer (Redis's `client-query-buffer-limit`, 1 GiB there): a
/// request that does not fit closes the client. The largest request a client needs is one
/// `VALUE_BYTES_MAX` value, or an MSET whose shards' parts each fit `WRITE_BATCH_BYTES_MAX`
/// (16 MiB): 256 MiB covers sixteen shards' worth, and bounds what one connection's input and
/// its parsed copy can hold to twice that.
pub const CLIENT_QUERY_BUFFER_BYTES_MAX_DEFAULT: usize = 256 * 1024 * 1024;
/// The smallest query buffer limit accepted (Redis's minimum, 1 MiB).
pub const CLIENT_QUERY_BUFFER_BYTES_MIN: usize = 1024 * 1024;
/// Bytes of replies a connection may have pending (reserved for the commands it has handed to
/// the shards and not yet written) before it stops dispatching and reading until the client
/// takes its replies. A command reserves the most its reply can be before it runs
/// (`cmd::ReplySize::reserved_bytes`), so this bounds what a client that never reads can make the
/// server hold, whatever it pipelines: at most this, or one command's reply when that is more.
/// Four of copse's largest values fit at once.
pub const CLIENT_PENDING_REPLY_BYTES_MAX_DEFAULT: usize = 64 * 1024 * 1024;
/// What a command reserves for a reply that holds no stored value (an integer, a status, a
/// key, a score): more than any such reply needs.
pub const REPLY_SMALL_BYTES_MAX: usize = 4 * 1024;
/// Bytes of requests a connection reads before it stops reading and answers what it has
/// (bounds one connection's input buffer; a request larger than this is still read whole).
pub const CLIENT_INPUT_CHUNK_BYTES: usize = 64 * 1024;
/// Commands of one pipeline handed to the shards together before their replies are written.
pub const PIPELINE_COMMANDS_MAX: usize = 1024;
/// Arguments of one multibulk request before the client has authenticated (Redis since
/// CVE-2021-32675): enough for AUTH, HELLO 3 AUTH user pass SETNAME name, QUIT and RESET.
pub const UNAUTHENTICATED_ARGS_MAX: usize = 10;
/// Bytes of one bulk argument before the client has authenticated (Redis: 16 KiB), so an
/// unauthenticated client can make the server hold at most about 160 KiB of its request.
pub const UNAUTHENTICATED_BULK_BYTES_MAX: usize = 16 * 1024;

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Store directory.
    pub path: PathBuf,
    pub bind: String,
    pub port: u16,
    /// Network threads (event loops); 0 means one per core.
    pub threads: usize,
    /// Shards of a new store; 0 means one per core (an existing store keeps its count).
    pub shards: usize,
    /// Thread-per-core: run each shard on a network thread (shard i on thread i mod threads),
    /// between that thread's connections, when its engine can share a thread (the native
    /// engine on io_uring). False gives every shard a thread of its own.
    pub thread_per_core: bool,
    pub cache_mb: usize,
    /// "flush-per-round" (default) or "dsync": see docs/durability.md.
    pub durability: String,
    /// "auto", "uring" or "sync".
    pub backend: String,
    /// The engine: "native", "rocksdb" (a build with the rocksdb feature), or "auto": an existing
    /// store's engine (from its manifest), native for a new store.
    pub engine: String,
    /// How a new native store places records in its in-page size classes: "in-place", "append"
    /// or "auto" (from a write probe of the device). An existing store keeps the placement it
    /// was created with (docs/placement.md).
    pub placement: String,
    /// The collector keeps each append class's file under this many times its live slots
    /// (copse's `SPACE_AMPLIFICATION_MIN` to `SPACE_AMPLIFICATION_MAX`); applies at every open.
    pub space_amplification_max: f64,
    /// Password for AUTH; empty means none. Anything in a config file or on the command line
    /// can be read by others (argv is world-readable in /proc): prefer `requirepass_file`.
    pub requirepass: String,
    /// A file holding the password (one trailing newline is ignored); empty for none.
    pub requirepass_file: String,
    /// Clients served at once; lowered at start to what the open files limit leaves.
    pub maxclients: usize,
    /// With a password set, close a client not authenticated this many seconds after it
    /// connected; 0 never.
    pub auth_timeout_secs: u64,
    /// Close a client idle this many seconds; 0 never.
    pub timeout_secs: u64,
    pub proto_max_bulk_len: usize,
    /// The largest reply: a larger one is refused (MGET, as it reads) or closes the client.
    pub client_output_bytes_max: usize,
    /// The largest request a client may send, buffered (`client-query-buffer-limit`).
    pub client_query_buffer_bytes_max: usize,
    /// Replies a connection may have pending before it stops reading (backpressure).
    pub client_pending_reply_bytes_max: usize,
    /// Port of the Prometheus text endpoint on `bind`; 0 for none.
    pub metrics_port: u16,
    /// Redis's protected mode: with no password, serve loopback peers only (and the metrics
    /// endpoint, which has no password, loopback peers only whatever the password).
    pub protected_mode: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            path: PathBuf::from("./data"),
            bind: "127.0.0.1".into(),
            port: 6380,
            threads: 0,
            shards: 0,
            thread_per_core: true,
            cache_mb: copse::limits::CACHE_BYTES_DEFAULT / (1024 * 1024),
            durability: "flush-per-round".into(),
            backend: "auto".into(),
            engine: "auto".into(),
            placement: "auto".into(),
            space_amplification_max: copse::limits::SPACE_AMPLIFICATION_DEFAULT,
            requirepass: String::new(),
            requirepass_file: String::new(),
            maxclients: MAXCLIENTS_DEFAULT,
            auth_timeout_secs: AUTH_TIMEOUT_SECS_DEFAULT,
            timeout_secs: 0,
            proto_max_bulk_len: PROTO_MAX_BULK_LEN_DEFAULT,
            client_output_bytes_max: CLIENT_OUTPUT_BYTES_MAX_DEFAULT,
            client_query_buffer_bytes_max: CLIENT_QUERY_BUFFER_BYTES_MAX_DEFAULT,
            client_pending_reply_bytes_max: CLIENT_PENDING_REPLY_BYTES_MAX_DEFAULT,
            metrics_port: 0,
            protected_mode: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("config file {path}: {error}")]
    Parse { path: String, error: String },
    #[error("invalid setting: {0}")]
    Invalid(String),
}

impl ServerConfig {
    pub fn from_file(path: &std::path::Path) -> Result<ServerConfig, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|error| ConfigError::Read { path: path.display().to_string(), error })?;
        toml::from_str(&text).map_err(|error| ConfigError::Parse {
            path: path.display().to_string(),
            error: error.to_string(),
        })
    }

    /// Reads the password from `requirepass_file`, if one is named, into `requirepass`.
    pub fn load_password_file(&mut self) -> Result<(), ConfigError> {
        if self.requirepass_file.is_empty() {
            return Ok(());
        }
        if !self.requirepass.is_empty() {
            return Err(ConfigError::Invalid(
                "requirepass and requirepass_file are both set; give the password once".into(),
            ));
        }
        let path = self.requirepass_file.clone();
        let text = std::fs::read(&path)
            .map_err(|error| ConfigError::Read { path: path.clone(), error })?;
        let text = text.strip_suffix(b"\n").unwrap_or(&text);
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        if text.is_empty() {
            return Err(ConfigError::Invalid(format!(
                "requirepass_file {path} is empty: a password file must hold a password"
            )));
        }
        self.requirepass = String::from_utf8(text.to_vec()).map_err(|_| {
            ConfigError::Invalid(format!("requirepass_file {path} does not hold UTF-8 text"))
        })?;
        self.requirepass_file.clear();
        Ok(())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.proto_max_bulk_len == 0 || self.proto_max_bulk_len > PROTO_MAX_BULK_LEN_DEFAULT {
            return Err(ConfigError::Invalid(format!(
                "proto_max_bulk_len must be 1 to {PROTO_MAX_BULK_LEN_DEFAULT} (copse's largest value)"
            )));
        }
        if self.client_query_buffer_bytes_max < CLIENT_QUERY_BUFFER_BYTES_MIN {
            return Err(ConfigError::Invalid(format!(
                "client_query_buffer_bytes_max must be at least {CLIENT_QUERY_BUFFER_BYTES_MIN}"
            )));
        }
        if self.client_pending_reply_bytes_max == 0 || self.client_output_bytes_max == 0 {
            return Err(ConfigError::Invalid(
                "client_pending_reply_bytes_max and client_output_bytes_max must be at least 1"
                    .into(),
            ));
        }
        if self.maxclients == 0 {
            return Err(ConfigError::Invalid("maxclients must be at least 1".into()));
        }
        self.store_options()?.validate().map_err(|err| ConfigError::Invalid(err.to_string()))?;
        Ok(())
    }

    pub fn thread_count(&self) -> usize {
        if self.threads > 0 {
            self.threads
        } else {
            std::thread::available_parallelism().map_or(1, |cores| cores.get())
        }
    }

    /// The store's options from these settings.
    pub fn store_options(&self) -> Result<copse::Options, ConfigError> {
        let mut options = copse::Options::default();
        let existing = copse::read_manifest(&self.path).ok().flatten();
        if self.shards > 0 {
            options.shards = self.shards;
        } else if let Some(existing) = existing {
            options.shards = existing.shard_count as usize;
        }
        options.engine = match self.engine.as_str() {
            "auto" => existing.map_or(copse::EngineKind::Native, |existing| existing.engine),
            name => name
                .parse()
                .map_err(|err: String| ConfigError::Invalid(format!("engine: {err} (or auto)")))?,
        };
        options.placement = self
            .placement
            .parse()
            .map_err(|err: String| ConfigError::Invalid(format!("placement: {err}")))?;
        // The range is checked by `Options::validate`, with the same message for every caller.
        options.space_amplification_max = self.space_amplification_max;
        options.cache_bytes = self.cache_mb.saturating_mul(1024 * 1024);
        options.durability = match self.durability.as_str() {
            "flush-per-round" => copse::WriteDurability::FlushPerRound,
            "dsync" => copse::WriteDurability::Dsync,
            other => {
                return Err(ConfigError::Invalid(format!(
                    "durability {other:?} (expected flush-per-round or dsync)"
                )))
            }
        };
        options.backend = match self.backend.as_str() {
            "auto" => copse::Backend::Auto,
            "uring" => copse::Backend::Uring,
            "sync" => copse::Backend::Sync,
            other => {
                return Err(ConfigError::Invalid(format!(
                    "backend {other:?} (expected auto, uring or sync)"
                )))
            }
        };
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_toml_file_overrides_defaults_and_unknown_settings_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("copse.toml");
        std::fs::write(&file, "port = 7000\nrequirepass = \"secret\"\ntimeout_secs = 5\n").unwrap();
        let config = ServerConfig::from_file(&file).unwrap();
        assert_eq!(
            (config.port, config.requirepass.as_str(), config.timeout_secs),
            (7000, "secret", 5)
        );
        assert_eq!(config.bind, "127.0.0.1", "unset settings keep their defaults");
        std::fs::write(&file, "prot = 7000\n").unwrap();
        assert!(matches!(ServerConfig::from_file(&file), Err(ConfigError::Parse { .. })));
        // The example file in the repository lists every setting with its default.
        let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../copse.example.toml");
        let example = ServerConfig::from_file(std::path::Path::new(example)).unwrap();
        assert_eq!(format!("{example:?}"), format!("{:?}", ServerConfig::default()));
        let engine = ServerConfig { engine: "leveldb".into(), ..ServerConfig::default() };
        assert!(engine.store_options().unwrap_err().to_string().contains("leveldb"));
        let bad = ServerConfig { durability: "sometimes".into(), ..ServerConfig::default() };
        assert!(matches!(bad.validate(), Err(ConfigError::Invalid(_))));
        std::fs::write(&file, "placement = \"append\"\nspace_amplification_max = 2.5\n").unwrap();
        let options = ServerConfig::from_file(&file).unwrap().store_options().unwrap();
        assert_eq!(options.placement, copse::PlacementSetting::Append);
        assert_eq!(options.space_amplification_max, 2.5);
        let bad = ServerConfig { space_amplification_max: 0.5, ..ServerConfig::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("space_amplification_max"));
        let bad = ServerConfig { placement: "sideways".into(), ..ServerConfig::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("sideways"));
    }
}
