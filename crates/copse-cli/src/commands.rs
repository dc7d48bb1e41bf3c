//! The subcommands. Each opens what it needs, does its work, closes the store explicitly (so a
//! failed close is reported, not lost in a drop) and writes results to stdout.
//!
//! Keys and values come from the command line as raw bytes (`OsString`, so any byte string a
//! shell can pass works); limits are the store's to enforce, so the CLI never second-guesses them.

use std::io::{BufWriter, Write};
use std::ops::Bound;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use copse::limits::{CACHE_BYTES_DEFAULT, SCAN_ITEMS_MAX, SHARDS_MAX};
use copse::read_manifest;
use copse::{check_store, CheckOptions};
use copse::{Backend, Db, Options, WriteDurability};

use crate::{BackendArg, CheckArgs, Cli, Command, Durability, Failure, ServeArgs};

const BYTES_PER_MIB: usize = 1024 * 1024;

pub(crate) fn run(cli: Cli) -> Result<(), Failure> {
    let mut out = Stdout::new();
    match &cli.command {
        Command::Put { key, value } => {
            let db = open(&cli, true)?;
            db.put(key.as_bytes(), value.as_bytes())?;
            db.close()?;
            out.line(b"OK")?;
        }
        Command::Get { key, hex } => {
            let db = open(&cli, false)?;
            let value = db.get(key.as_bytes())?;
            db.close()?;
            match value {
                Some(value) => out.line(&shown(&value, *hex))?,
                None => return Err(Failure::KeyNotFound(key.to_string_lossy().into_owned())),
            }
        }
        Command::Del { key } => {
            let db = open(&cli, false)?;
            let existed = db.delete(key.as_bytes())?;
            db.close()?;
            out.line(if existed { b"deleted" } else { b"not found" })?;
        }
        Command::Scan { start, end, limit, hex } => {
            let db = open(&cli, false)?;
            let start = start.as_ref().map(|key| key.as_bytes().to_vec());
            let end = end.as_ref().map(|key| key.as_bytes().to_vec());
            scan(&db, start, end, *limit, *hex, &mut out)?;
            db.close()?;
        }
        Command::Stats => {
            let db = open(&cli, false)?;
            let stats = db.stats()?;
            db.close()?;
            out.json(serde_json::to_string_pretty(&stats))?;
        }
        Command::Check(args) if args.online => {
            let report = check_online(args)?;
            out.json(serde_json::to_string_pretty(&report))?;
            out.finish()?;
            let problems = report["problems_found"].as_u64().unwrap_or(0);
            if problems > 0 {
                return Err(Failure::ProblemsFound(problems));
            }
        }
        Command::Check(_) => {
            let options = CheckOptions { backend: backend(cli.backend) };
            let report =
                check_store(&cli.path, &options).map_err(|err| missing_store(err, &cli.path))?;
            out.json(serde_json::to_string_pretty(&report))?;
            out.finish()?;
            if !report.is_clean() {
                return Err(Failure::ProblemsFound(report.problems_found));
            }
        }
        Command::Demo => demo(&cli, &mut out)?,
        Command::Serve(args) => serve(&cli, args)?,
        Command::Bench(command) => {
            let mut command = (**command).clone();
            if cli.placement.is_some() {
                return Err(Failure::Failed(
                    "bench takes no --placement: name the placement in the engine (copse-in-place, copse-append; copse is auto)".into(),
                ));
            }
            command.apply_globals(
                cli.cache_mb.map(|mib| mib as u64),
                cli.shards,
                cli.space_amplification_max,
            );
            copse_bench::cli::run(command).map_err(Failure::Failed)?;
        }
    }
    out.finish()
}

/// The shard count to open with: the one asked for, else the existing store's, else one per core
/// (at most `SHARDS_MAX`).
fn shard_count(cli: &Cli) -> Result<usize, Failure> {
    if let Some(shards) = cli.shards {
        return Ok(shards);
    }
    if let Some(manifest) = read_manifest(&cli.path)? {
        return Ok(manifest.shard_count as usize);
    }
    let cores = std::thread::available_parallelism().map_or(1, |cores| cores.get());
    Ok(cores.min(SHARDS_MAX))
}

/// The engine to open with: the one asked for, else the existing store's, else native.
fn engine(cli: &Cli) -> Result<copse::EngineKind, Failure> {
    if let Some(engine) = cli.engine {
        return Ok(engine);
    }
    Ok(read_manifest(&cli.path)?.map_or(copse::EngineKind::Native, |manifest| manifest.engine))
}

fn backend(arg: BackendArg) -> Backend {
    match arg {
        BackendArg::Auto => Backend::Auto,
        BackendArg::Uring => Backend::Uring,
        BackendArg::Sync => Backend::Sync,
    }
}

/// Opens the store. Only commands that write create a missing store: `get` on a mistyped path
/// should say there is no store, not make an empty one.
fn open(cli: &Cli, create_if_missing: bool) -> Result<Db, Failure> {
    let cache_bytes = match cli.cache_mb {
        None => CACHE_BYTES_DEFAULT,
        Some(mib) => mib
            .checked_mul(BYTES_PER_MIB)
            .ok_or_else(|| Failure::Failed(format!("--cache-mb {mib} is too large")))?,
    };
    let options = Options {
        shards: shard_count(cli)?,
        cache_bytes,
        durability: match cli.durability {
            Durability::Dsync => WriteDurability::Dsync,
            Durability::FlushPerRound => WriteDurability::FlushPerRound,
        },
        backend: backend(cli.backend),
        create_if_missing,
        engine: engine(cli)?,
        placement: cli.placement.unwrap_or_default(),
        space_amplification_max: cli
            .space_amplification_max
            .unwrap_or(copse::limits::SPACE_AMPLIFICATION_DEFAULT),
        ..Options::default()
    };
    Db::open(&cli.path, options).map_err(|err| missing_store(err, &cli.path))
}

/// Says how to make a store where there is none, in the CLI's terms (the library's message
/// speaks of `create_if_missing`).
fn missing_store(err: copse::OpenError, path: &Path) -> Failure {
    match err {
        copse::OpenError::NotFound(_) => Failure::Failed(format!(
            "no store at {} (`copse --path {} demo` or `put` creates one)",
            path.display(),
            shell_word(path)
        )),
        other => other.into(),
    }
}

/// Prints up to `limit` items from `start` (inclusive) to `end` (exclusive), in pages of at most
/// `SCAN_ITEMS_MAX` (the store's per-call limit), each page starting after the last key printed.
fn scan(
    db: &Db,
    start: Option<Vec<u8>>,
    end: Option<Vec<u8>>,
    limit: usize,
    hex: bool,
    out: &mut Stdout,
) -> Result<(), Failure> {
    let mut lower = start.map_or(Bound::Unbounded, Bound::Included);
    let upper = end.map_or(Bound::Unbounded, Bound::Excluded);
    let mut printed = 0usize;
    let mut exhausted = false;
    while printed < limit && !exhausted && !out.closed {
        let want = (limit - printed).min(SCAN_ITEMS_MAX);
        let items = db.scan((lower.clone(), upper.clone()), want)?;
        exhausted = items.len() < want;
        for (key, value) in &items {
            let mut line = shown(key, hex);
            line.push(b'\t');
            line.extend_from_slice(&shown(value, hex));
            out.line(&line)?;
        }
        printed += items.len();
        if let Some((last, _)) = items.last() {
            lower = Bound::Excluded(last.clone());
        }
    }
    if !exhausted && !out.closed && limit > 0 && !db.scan((lower, upper), 1)?.is_empty() {
        eprintln!("copse: stopped after --limit {limit} items; more follow");
    }
    Ok(())
}

/// `make run` until the server exists: a first write and read on a real store.
fn demo(cli: &Cli, out: &mut Stdout) -> Result<(), Failure> {
    const ITEMS: [(&str, &str); 4] = [
        ("greeting", "hello from copse"),
        ("fruit:apple", "red"),
        ("fruit:banana", "yellow"),
        ("fruit:cherry", "dark red"),
    ];
    let db = open(cli, true)?;
    out.line(format!("store: {} ({} shards)", cli.path.display(), db.shard_count()).as_bytes())?;
    for (key, value) in ITEMS {
        db.put(key.as_bytes(), value.as_bytes())?;
        out.line(format!("put  {key} = {value}").as_bytes())?;
    }
    for (key, _) in ITEMS {
        let value = db.get(key.as_bytes())?.ok_or_else(|| {
            Failure::Failed(format!("demo: {key} was written but reads back as missing"))
        })?;
        out.line(format!("get  {key} -> {}", String::from_utf8_lossy(&value)).as_bytes())?;
    }
    let fruit = db.scan(b"fruit:".to_vec()..b"fruit;".to_vec(), 10)?;
    out.line(format!("scan fruit: .. fruit; -> {} items", fruit.len()).as_bytes())?;
    for (key, value) in &fruit {
        out.line(
            format!("     {}\t{}", String::from_utf8_lossy(key), String::from_utf8_lossy(value))
                .as_bytes(),
        )?;
    }
    let stats = db.stats()?;
    db.close()?;
    out.line(format!("items in the store: {}", stats.items).as_bytes())?;
    let program = invoked_as();
    let path = shell_word(&cli.path);
    out.line(b"")?;
    out.line(b"Every write above was durable before it returned. Try next:")?;
    for example in [
        format!("{program} --path {path} get greeting"),
        format!("{program} --path {path} put color blue"),
        format!("{program} --path {path} scan fruit: 'fruit;'"),
        format!("{program} --path {path} scan"),
        format!("{program} --path {path} stats"),
        format!("{program} --path {path} check"),
        format!("{program} --help"),
    ] {
        out.line(format!("  {example}").as_bytes())?;
    }
    Ok(())
}

/// How this program was invoked (`./target/release/copse` under `make run`), for hints that can be
/// pasted back into the shell.
fn invoked_as() -> String {
    std::env::args_os()
        .next()
        .map(|arg| shell_word(Path::new(&arg)))
        .filter(|arg| !arg.is_empty())
        .unwrap_or_else(|| "copse".to_string())
}

/// `path` as one shell word: quoted if it holds anything but plain characters.
fn shell_word(path: &Path) -> String {
    let text = path.to_string_lossy();
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+:=,@".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text.into_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// Bytes as printed: hex, or UTF-8 with invalid sequences replaced.
fn shown(bytes: &[u8], hex: bool) -> Vec<u8> {
    if hex {
        bytes.iter().map(|byte| format!("{byte:02x}")).collect::<String>().into_bytes()
    } else {
        String::from_utf8_lossy(bytes).into_owned().into_bytes()
    }
}

/// Buffered stdout that stops quietly when the reader goes away (`copse scan | head`): Rust
/// ignores SIGPIPE, so a write to a closed pipe is an EPIPE error, which is no failure of ours.
struct Stdout {
    out: BufWriter<std::io::Stdout>,
    closed: bool,
}

impl Stdout {
    fn new() -> Stdout {
        Stdout { out: BufWriter::new(std::io::stdout()), closed: false }
    }

    fn checked(&mut self, result: std::io::Result<()>) -> Result<(), Failure> {
        match result {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => {
                self.closed = true;
                Ok(())
            }
            Err(err) => Err(Failure::Failed(format!("writing to stdout failed: {err}"))),
        }
    }

    fn line(&mut self, bytes: &[u8]) -> Result<(), Failure> {
        if self.closed {
            return Ok(());
        }
        let result = self.out.write_all(bytes).and_then(|()| self.out.write_all(b"\n"));
        self.checked(result)
    }

    /// Prints JSON made by `serde_json::to_string_pretty` (called by the caller: this crate does
    /// not depend on serde itself).
    fn json(&mut self, encoded: serde_json::Result<String>) -> Result<(), Failure> {
        let text =
            encoded.map_err(|err| Failure::Failed(format!("encoding JSON failed: {err}")))?;
        self.line(text.as_bytes())
    }

    fn finish(&mut self) -> Result<(), Failure> {
        if self.closed {
            return Ok(());
        }
        let result = self.out.flush();
        self.checked(result)
    }
}

/// The environment variable `copse serve` takes its password from when no flag gives one
/// (unlike argv, a process's environment is readable only by its user and root).
const REQUIREPASS_ENV: &str = "COPSE_REQUIREPASS";

/// `copse serve`: settings are the defaults, then the config file, then the flags given.
fn serve(cli: &Cli, args: &ServeArgs) -> Result<(), Failure> {
    let mut config = match &args.config {
        Some(file) => copse_server::ServerConfig::from_file(file)
            .map_err(|err| Failure::Failed(err.to_string()))?,
        None => copse_server::ServerConfig::default(),
    };
    // Global store flags override the file only when given (they have defaults of their own).
    if cli.path_given || args.config.is_none() {
        config.path = cli.path.clone();
    }
    if let Some(shards) = cli.shards {
        config.shards = shards;
    }
    if let Some(cache_mb) = cli.cache_mb {
        config.cache_mb = cache_mb;
    }
    if cli.durability_given {
        config.durability = match cli.durability {
            Durability::Dsync => "dsync",
            Durability::FlushPerRound => "flush-per-round",
        }
        .into();
    }
    if cli.backend_given {
        config.backend = match cli.backend {
            BackendArg::Auto => "auto",
            BackendArg::Uring => "uring",
            BackendArg::Sync => "sync",
        }
        .into();
    }
    if let Some(engine) = args.engine.or(cli.engine) {
        config.engine = engine.name().into();
    }
    if let Some(placement) = cli.placement {
        config.placement = placement.to_string();
    }
    if let Some(ratio) = cli.space_amplification_max {
        config.space_amplification_max = ratio;
    }
    if let Some(bind) = &args.bind {
        config.bind = bind.clone();
    }
    if let Some(port) = args.port {
        config.port = port;
    }
    if let Some(threads) = args.threads {
        config.threads = threads;
    }
    // The password: a flag, else COPSE_REQUIREPASS, else the config file's.
    if let Some(password) = &args.requirepass {
        tracing::warn!(
            "the password given with --requirepass is visible to every local user (/proc/PID/cmdline, ps); use --requirepass-file or COPSE_REQUIREPASS"
        );
        config.requirepass = password.clone();
        config.requirepass_file.clear();
    } else if let Some(file) = &args.requirepass_file {
        config.requirepass_file = file.display().to_string();
        config.requirepass.clear();
    } else if let Some(password) = std::env::var(REQUIREPASS_ENV).ok().filter(|p| !p.is_empty()) {
        config.requirepass = password;
        config.requirepass_file.clear();
    }
    if let Some(maxclients) = args.maxclients {
        config.maxclients = maxclients;
    }
    if let Some(timeout) = args.timeout {
        config.timeout_secs = timeout;
    }
    if let Some(timeout) = args.auth_timeout {
        config.auth_timeout_secs = timeout;
    }
    if let Some(port) = args.metrics_port {
        config.metrics_port = port;
    }
    if let Some(protected_mode) = &args.protected_mode {
        config.protected_mode = protected_mode == "yes";
    }
    let (bind, port) = (config.bind.clone(), config.port);
    let running = copse_server::start(config).map_err(|err| Failure::Failed(err.to_string()))?;
    eprintln!(
        "copse: serving the Redis protocol on {} (data in {}); connect with: redis-cli -h {bind} -p {port}",
        running.local_addr,
        cli.path.display()
    );
    copse_server::wait_for_signal().map_err(|err| Failure::Failed(err.to_string()))?;
    running.stop().map_err(|err| Failure::Failed(err.to_string()))
}

/// How long `check --online` waits to connect. The scrub itself has no time limit: it reads the
/// whole store.
const ONLINE_CONNECT_TIMEOUT_MS: u64 = 5_000;

/// `check --online`: asks a serving store to scrub itself (its SCRUB command) and returns the
/// report as JSON, `addr` first.
fn check_online(args: &CheckArgs) -> Result<serde_json::Value, Failure> {
    use redis::IntoConnectionInfo;
    let failed = |what: &str, err: redis::RedisError| {
        Failure::Failed(format!("{what} {}: {err}", args.addr))
    };
    let (host, port) = args
        .addr
        .rsplit_once(':')
        .and_then(|(host, port)| Some((host.trim_matches(['[', ']']), port.parse::<u16>().ok()?)))
        .ok_or_else(|| Failure::Failed(format!("--addr {}: expected host:port", args.addr)))?;
    let mut settings = redis::RedisConnectionInfo::default().set_skip_set_lib_name();
    if let Some(password) = &args.password {
        settings = settings.set_password(password);
    }
    let info = redis::ConnectionAddr::Tcp(host.to_string(), port)
        .into_connection_info()
        .map_err(|err| failed("connecting to", err))?
        .set_redis_settings(settings);
    let client = redis::Client::open(info).map_err(|err| failed("connecting to", err))?;
    let timeout = std::time::Duration::from_millis(ONLINE_CONNECT_TIMEOUT_MS);
    let mut connection =
        client.get_connection_with_timeout(timeout).map_err(|err| failed("connecting to", err))?;
    let reply: redis::Value =
        redis::cmd("SCRUB").query(&mut connection).map_err(|err| failed("SCRUB on", err))?;
    let mut report = serde_json::Map::new();
    report.insert("addr".into(), args.addr.clone().into());
    for (name, value) in scrub_fields(reply)? {
        report.insert(name, value);
    }
    Ok(serde_json::Value::Object(report))
}

/// The fields of a SCRUB reply: a map (RESP3) or a flat array of names and values (RESP2).
fn scrub_fields(reply: redis::Value) -> Result<Vec<(String, serde_json::Value)>, Failure> {
    use redis::Value;
    let unexpected = |what: &Value| Failure::Failed(format!("unexpected SCRUB reply: {what:?}"));
    let pairs: Vec<(Value, Value)> = match reply {
        Value::Map(pairs) => pairs,
        Value::Array(flat) if flat.len() % 2 == 0 => {
            let mut items = flat.into_iter();
            std::iter::from_fn(|| Some((items.next()?, items.next()?))).collect()
        }
        other => return Err(unexpected(&other)),
    };
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    };
    pairs
        .into_iter()
        .map(|(name, value)| {
            let name = text(&name).ok_or_else(|| unexpected(&name))?;
            let value = match &value {
                Value::Int(count) => serde_json::Value::from(*count),
                Value::Array(items) => items
                    .iter()
                    .map(|item| text(item).map(serde_json::Value::from))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| unexpected(&value))?
                    .into(),
                _ => return Err(unexpected(&value)),
            };
            Ok((name, value))
        })
        .collect()
}
