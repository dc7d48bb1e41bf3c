//! `copse`: the command-line tool over the embedded API (`copse::Db`) and the offline check.
//!
//! Contract with scripts (and `tests/cli.rs`):
//! - stdout carries only results (a value, `key\tvalue` lines, JSON); every message goes to stderr
//!   as one line starting with `copse: `.
//! - Exit codes: 0 success; 1 `get` found no such key; 2 `check` found problems; 3 anything that
//!   stopped the command (bad input, a store that cannot open, an I/O error, a usage error).
//! - Bad input never panics: keys and values are checked by the store against `copse::limits`
//!   and come back as errors; a closed stdout (`copse scan | head`) ends the command quietly.
//!
//! Layout: this file parses arguments and maps outcomes to exit codes; `commands.rs` runs them.

mod commands;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

/// mimalloc rather than glibc's malloc: the server allocates on its network threads and frees
/// on the shard threads (and back), which glibc serves through arena locks and consolidation
/// (~19% of the server's CPU per GET in the profile of docs/benchmarks.md, step 1); mimalloc
/// frees a block to its owning thread's page with no lock. It serves everything this binary runs,
/// `bench` included (RocksDB's C++ allocations keep the C library's malloc). `Counted` adds the
/// count of bytes allocated that the server's INFO reports as `used_memory`, as Redis's does.
#[global_allocator]
static GLOBAL: Counted = Counted(mimalloc::MiMalloc);

/// An allocator that counts the bytes outstanding. Each thread adds to a counter of its own (a
/// plain thread-local: two instructions on the allocation path) and publishes it to the shared
/// slots once it has moved by `PUBLISH_BYTES`, so the sum readers see is within `PUBLISH_BYTES`
/// per thread of the truth. A block freed by another thread than its allocator's counts there:
/// only the sum means anything.
struct Counted(mimalloc::MiMalloc);

/// Counters of `Counted`, each on its own cache line; threads take them in turn, wrapping (a
/// shared slot is added to atomically all the same).
const COUNTED_SLOTS: usize = 64;
/// How far a thread's own count moves before it is published.
const PUBLISH_BYTES: usize = 64 * 1024;

#[repr(align(64))]
struct Slot(std::sync::atomic::AtomicIsize);

static SLOTS: [Slot; COUNTED_SLOTS] =
    [const { Slot(std::sync::atomic::AtomicIsize::new(0)) }; COUNTED_SLOTS];
static NEXT_SLOT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

thread_local! {
    // Const-initialised, no destructor: usable inside the allocator.
    static UNPUBLISHED: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
    static SLOT: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

#[inline(always)]
fn count(bytes: isize) {
    // A thread past its locals' teardown is not counted (its last bytes are lost to the sum).
    let _ = UNPUBLISHED.try_with(|unpublished| {
        let moved = unpublished.get() + bytes;
        if moved.unsigned_abs() < PUBLISH_BYTES {
            unpublished.set(moved);
        } else {
            unpublished.set(0);
            publish(moved);
        }
    });
}

#[cold]
fn publish(bytes: isize) {
    use std::sync::atomic::Ordering::Relaxed;
    let slot = SLOT
        .try_with(|slot| {
            if slot.get() == usize::MAX {
                slot.set(NEXT_SLOT.fetch_add(1, Relaxed) % COUNTED_SLOTS);
            }
            slot.get()
        })
        .unwrap_or(0);
    SLOTS[slot].0.fetch_add(bytes, Relaxed);
}

// SAFETY: forwards every call to mimalloc unchanged; only counts sizes.
unsafe impl std::alloc::GlobalAlloc for Counted {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: the caller's layout, passed on.
        unsafe { self.0.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: the caller's layout, passed on.
        unsafe { self.0.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        count(-(layout.size() as isize));
        // SAFETY: `ptr` came from this allocator with this layout.
        unsafe { self.0.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        count(new_size as isize - layout.size() as isize);
        // SAFETY: `ptr` came from this allocator with `layout`; the caller's new size.
        unsafe { self.0.realloc(ptr, layout, new_size) }
    }
}

/// Bytes allocated and not freed, over every thread, to within `PUBLISH_BYTES` per thread
/// (INFO's `used_memory`).
fn allocated_bytes() -> u64 {
    let total: isize =
        SLOTS.iter().map(|slot| slot.0.load(std::sync::atomic::Ordering::Relaxed)).sum();
    total.max(0) as u64
}

/// Exit code of `get` when the key does not exist.
const EXIT_KEY_NOT_FOUND: u8 = 1;
/// Exit code of `check` when the store has problems.
const EXIT_PROBLEMS_FOUND: u8 = 2;
/// Exit code of any failure, usage errors included. Not clap's 2, which `check` already means.
const EXIT_FAILED: u8 = 3;

#[derive(Parser, Debug)]
#[command(
    name = "copse",
    version,
    about = "copse: a persistent key-value store for fast SSDs",
    after_help = "Exit codes: 0 ok, 1 key not found (get), 2 problems found (check), 3 error.\n\
                  Logging: COPSE_LOG=info (or debug, or a tracing filter), written to stderr."
)]
struct Cli {
    /// The store directory.
    #[arg(long, global = true, default_value = "./data")]
    path: PathBuf,
    /// Shards (threads). Fixed when the store is created; by default an existing store's count
    /// (from its manifest), else the number of cores.
    #[arg(long, global = true)]
    shards: Option<usize>,
    /// Page cache budget for the whole store, in MiB (default 256).
    #[arg(long, global = true)]
    cache_mb: Option<usize>,
    /// When a write counts as durable: one fdatasync per round of writes (default), or each
    /// write issued with RWF_DSYNC.
    #[arg(long, global = true, value_enum, default_value_t = Durability::FlushPerRound)]
    durability: Durability,
    /// How to do I/O: io_uring if the kernel allows it (auto), io_uring, or pread/pwrite.
    #[arg(long, global = true, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// The engine of a new store: native (KVell slabs) or rocksdb (one RocksDB per shard; a build
    /// with `--features rocksdb`). By default an existing store's engine, else native. Given
    /// before the command (`copse --engine rocksdb put k v`); `serve --engine` also takes it.
    #[arg(long)]
    engine: Option<copse::EngineKind>,
    /// How a new native store places records in its in-page size classes: in-place (KVell),
    /// append (RStore, with a garbage collector) or auto (default: from a short write probe of
    /// the device). An existing store keeps its own (docs/placement.md). Not for `bench`, whose
    /// engines name their placement (copse-in-place, copse-append).
    #[arg(long, global = true)]
    placement: Option<copse::PlacementSetting>,
    /// Append classes: the collector keeps each file under this many times its live bytes
    /// (default 1.5, from 1.1 to 16). Applies at every open, and to `bench`'s copse engines.
    #[arg(long, global = true)]
    space_amplification_max: Option<f64>,
    #[command(subcommand)]
    command: Command,
    /// Whether these flags were given (not defaulted): `serve` lets a config file set them.
    #[arg(skip)]
    path_given: bool,
    #[arg(skip)]
    durability_given: bool,
    #[arg(skip)]
    backend_given: bool,
}

/// Whether flag `id` was given on the command line, before or after the subcommand.
fn given(matches: &clap::ArgMatches, id: &str) -> bool {
    use clap::parser::ValueSource;
    let here = matches.value_source(id) == Some(ValueSource::CommandLine);
    here || matches.subcommand().is_some_and(|(_, sub)| given(sub, id))
}

impl Cli {
    fn parse_args() -> Result<Cli, clap::Error> {
        use clap::{CommandFactory, FromArgMatches};
        let matches = Cli::command().try_get_matches()?;
        let mut cli = Cli::from_arg_matches(&matches)?;
        cli.path_given = given(&matches, "path");
        cli.durability_given = given(&matches, "durability");
        cli.backend_given = given(&matches, "backend");
        Ok(cli)
    }
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Stores VALUE under KEY; returns once the write is durable.
    Put { key: OsString, value: OsString },
    /// Prints the value of KEY (raw bytes and a newline); exits 1 if there is none.
    Get {
        key: OsString,
        /// Print the value as hex.
        #[arg(long)]
        hex: bool,
    },
    /// Deletes KEY; prints `deleted` or `not found`.
    Del { key: OsString },
    /// Prints `key<TAB>value` lines for keys from START (inclusive) to END (exclusive), in order.
    Scan {
        start: Option<OsString>,
        end: Option<OsString>,
        /// Items to print at most.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// Print keys and values as hex (otherwise as UTF-8, invalid bytes replaced).
        #[arg(long)]
        hex: bool,
    },
    /// Prints the store's figures as JSON.
    Stats,
    /// Checks every slab of the store offline and prints a JSON report; exits 2 on problems.
    /// With --online, asks a serving store (SCRUB over the Redis protocol) to check itself.
    Check(CheckArgs),
    /// Writes a few keys, reads them back, and shows what to try next.
    Demo,
    /// Serves the store over the Redis protocol until SIGTERM or SIGINT (then closes it cleanly).
    /// Settings: defaults, then the --config file, then these flags. See docs/server.md.
    Serve(ServeArgs),
    /// Benchmarks: YCSB workloads per engine, the device's limits, engine comparisons
    /// (docs/benchmarks.md). Uses the global --cache-mb and --shards; not --path (see --dir).
    #[command(subcommand)]
    Bench(Box<copse_bench::cli::BenchCommand>),
}

#[derive(clap::Args, Debug, Default)]
pub(crate) struct CheckArgs {
    /// Check a serving store (`copse serve`) instead of a closed one: its online scrub reads
    /// every page and item from the device while it keeps serving. --path is not used.
    #[arg(long)]
    pub online: bool,
    /// The server to check online, host:port.
    #[arg(long, default_value = "127.0.0.1:6380", requires = "online")]
    pub addr: String,
    /// The server's password (requirepass); also read from COPSE_PASSWORD.
    #[arg(long, env = "COPSE_PASSWORD", hide_env_values = true, requires = "online")]
    pub password: Option<String>,
}

#[derive(clap::Args, Debug, Default)]
pub(crate) struct ServeArgs {
    /// A TOML file with any of the server's settings (copse.example.toml lists them).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address to listen on (loopback unless told otherwise).
    #[arg(long)]
    pub bind: Option<String>,
    #[arg(long)]
    pub port: Option<u16>,
    /// Network threads (event loops); default one per core.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Require AUTH with this password. Every local user can read it in /proc/PID/cmdline
    /// and ps: prefer --requirepass-file or the COPSE_REQUIREPASS environment variable.
    #[arg(long, conflicts_with = "requirepass_file")]
    pub requirepass: Option<String>,
    /// Require AUTH with the password held in this file (one trailing newline ignored).
    #[arg(long)]
    pub requirepass_file: Option<PathBuf>,
    #[arg(long)]
    pub maxclients: Option<usize>,
    /// Close clients idle this many seconds (0: never).
    #[arg(long)]
    pub timeout: Option<u64>,
    /// With a password set, close clients that have not authenticated this many seconds after
    /// connecting (default 10; 0: never).
    #[arg(long)]
    pub auth_timeout: Option<u64>,
    /// Serve Prometheus metrics over HTTP on this port (0: off).
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// Redis's protected mode: without a password, serve loopback clients only (yes, the
    /// default) or every client (no). The metrics endpoint serves loopback only unless no.
    #[arg(long, value_parser = ["yes", "no"])]
    pub protected_mode: Option<String>,
    /// The engine of a new store: native or rocksdb (see the global --engine).
    #[arg(long)]
    pub engine: Option<copse::EngineKind>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Durability {
    Dsync,
    FlushPerRound,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum BackendArg {
    Auto,
    Uring,
    Sync,
}

/// Why a command did not succeed.
#[derive(Debug)]
enum Failure {
    /// `get` of a key that does not exist (the message names the key).
    KeyNotFound(String),
    /// `check` found this many problems (the report is already on stdout).
    ProblemsFound(u64),
    /// Anything else; the message is the whole explanation.
    Failed(String),
}

impl Failure {
    fn exit_code(&self) -> u8 {
        match self {
            Failure::KeyNotFound(_) => EXIT_KEY_NOT_FOUND,
            Failure::ProblemsFound(_) => EXIT_PROBLEMS_FOUND,
            Failure::Failed(_) => EXIT_FAILED,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::KeyNotFound(key) => write!(f, "key not found: {key}"),
            Failure::ProblemsFound(count) => write!(f, "check found {count} problem(s)"),
            Failure::Failed(message) => f.write_str(message),
        }
    }
}

impl From<copse::OpenError> for Failure {
    fn from(err: copse::OpenError) -> Failure {
        Failure::Failed(err.to_string())
    }
}

impl From<copse::ReadError> for Failure {
    fn from(err: copse::ReadError) -> Failure {
        Failure::Failed(err.to_string())
    }
}

impl From<copse::WriteError> for Failure {
    fn from(err: copse::WriteError) -> Failure {
        Failure::Failed(err.to_string())
    }
}

fn init_logging(serving: bool) {
    use tracing_subscriber::filter::{EnvFilter, LevelFilter};
    // `from_env_lossy` skips directives it cannot parse, so a typo in COPSE_LOG costs logging
    // detail, never the command.
    let filter = EnvFilter::builder()
        .with_env_var("COPSE_LOG")
        .with_default_directive(if serving { LevelFilter::INFO } else { LevelFilter::WARN }.into())
        .from_env_lossy();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

fn main() -> ExitCode {
    let cli = match Cli::parse_args() {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            return if err.use_stderr() {
                ExitCode::from(EXIT_FAILED)
            } else {
                ExitCode::SUCCESS // --help, --version
            };
        }
    };
    init_logging(matches!(cli.command, Command::Serve(_)));
    copse_server::set_allocator_report(copse_server::AllocatorReport {
        name: "mimalloc",
        bytes: allocated_bytes,
    });
    match commands::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("copse: {failure}");
            ExitCode::from(failure.exit_code())
        }
    }
}
