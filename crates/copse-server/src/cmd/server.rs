//! Connection and server commands: PING, ECHO, HELLO, AUTH, SELECT, QUIT, RESET, CLIENT,
//! COMMAND, CONFIG, INFO, TIME, and copse's own SCRUB.
//!
//! copse answers as a Redis 7.2 server would where clients look (`redis_version` in INFO and
//! HELLO), so client libraries enable the features copse has; INFO has a `copse` section with
//! the store's own figures.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use copse::BatchOp;

use super::namespace::{Namespace, DATABASES, DATABASE_MAP_KEY};
use super::{
    keys, lowercase, parse_i64, table, Call, Input, Next, Outcome, Spec, NOT_INTEGER, SYNTAX,
};
use crate::config::PROTO_MAX_BULK_LEN_DEFAULT;
use crate::context::{EncodingKnobs, Server};
use crate::resp::{Protocol, Reply};

/// The Redis version copse answers as: the one whose replies its differential tests compare
/// with, byte for byte (redis-server 7.0.15), and whose RDB payloads DUMP writes.
pub const REDIS_COMPAT_VERSION: &str = "7.0.15";

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, summary, handler| {
        Spec::new("connection", name, arity, flags, (0, 0, 0), summary, handler)
    };
    const F: &[&str] = &["fast"];
    const A: &[&str] = &["admin"];
    vec![
        spec("ping", -1, F, "Returns PONG, or the argument.", ping as _),
        spec("echo", 2, F, "Returns the argument.", echo as _),
        spec("hello", -1, F, "Handshakes: protocol version, authentication, name.", hello as _),
        spec("auth", -2, F, "Authenticates the connection.", auth as _),
        spec("select", 2, F, "Selects the database (0-15) of the connection.", select as _),
        spec("swapdb", 3, &["write"], "Swaps two databases.", swapdb as _),
        spec("quit", -1, F, "Closes the connection.", quit as _),
        spec("reset", 1, F, "Resets the connection's state.", reset as _),
        spec("client", -2, A, "Commands about client connections.", client as _),
        spec("command", -1, F, "Returns information about commands.", command as _),
        spec("config", -2, A, "Gets or sets settings.", config as _),
        spec("debug", -2, A, "Debugging: SET-ACTIVE-EXPIRE 0|1 only.", debug as _),
        spec("info", -1, F, "Returns information about the server.", info as _),
        spec("time", 1, F, "Returns the server time.", time as _),
        spec("function", -2, &["write"], "FUNCTION FLUSH (no function is stored).", function as _),
        spec(
            "scrub",
            1,
            A,
            "Verifies every item and page checksum against the device; returns what it found.",
            scrub as _,
        ),
    ]
}

fn ping(call: &mut Call<'_>) -> Outcome {
    if let Some(reply) = super::pubsub::subscribed_ping(call) {
        return Outcome::Reply(reply);
    }
    match call.args.len() {
        1 => Outcome::Reply(Reply::Simple("PONG".into())),
        2 => Outcome::Reply(Reply::Bulk(call.args[1].clone())),
        _ => Outcome::error("ERR wrong number of arguments for 'ping' command"),
    }
}

fn echo(call: &mut Call<'_>) -> Outcome {
    Outcome::Reply(Reply::Bulk(call.args[1].clone()))
}

/// Checks a password for the `default` user. Both sides are hashed to SHA-256 and the digests
/// compared in constant time, so how long a refusal takes tells nothing about how much of the
/// password a guess got right, nor (fixed-length digests) its length.
fn check_password(server: &Server, user: &[u8], password: &[u8]) -> Result<(), Reply> {
    let required = server.requirepass();
    let accepted = required.is_empty() || passwords_match(required.as_bytes(), password);
    if user != b"default" || !accepted {
        return Err(Reply::error("WRONGPASS invalid username-password pair or user is disabled."));
    }
    Ok(())
}

/// Whether `given` is `required`, in time independent of where they differ.
fn passwords_match(required: &[u8], given: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    use subtle::ConstantTimeEq;
    let required = Sha256::digest(required);
    let given = Sha256::digest(given);
    bool::from(required.as_slice().ct_eq(given.as_slice()))
}

fn auth(call: &mut Call<'_>) -> Outcome {
    let (user, password) = match call.args.len() {
        2 => (&b"default"[..], &call.args[1]),
        3 => (&call.args[1][..], &call.args[2]),
        _ => return Outcome::error(SYNTAX),
    };
    if call.server.requirepass().is_empty() {
        // Without a password the default user takes any (Redis's `nopass`); only the one-argument
        // form is refused, as Redis refuses it, because it suggests a misconfiguration.
        if call.args.len() == 3 && user == b"default" {
            call.conn.authenticated = true;
            return Outcome::Reply(Reply::ok());
        }
        if call.args.len() == 3 {
            return Outcome::error("WRONGPASS invalid username-password pair or user is disabled.");
        }
        return Outcome::error("ERR AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?");
    }
    match check_password(call.server, user, password) {
        Ok(()) => {
            call.conn.authenticated = true;
            Outcome::Reply(Reply::ok())
        }
        Err(reply) => Outcome::Reply(reply),
    }
}

fn hello(call: &mut Call<'_>) -> Outcome {
    let mut protocol = call.conn.protocol;
    let mut at = 1;
    if let Some(version) = call.args.get(1) {
        protocol = match parse_i64(version) {
            Some(2) => Protocol::Resp2,
            Some(3) => Protocol::Resp3,
            Some(_) => return Outcome::error("NOPROTO unsupported protocol version"),
            None => {
                return Outcome::error("ERR Protocol version is not an integer or out of range")
            }
        };
        at = 2;
    }
    let mut name = None;
    while at < call.args.len() {
        match call.word(at).as_str() {
            "auth" if at + 2 < call.args.len() => {
                if let Err(reply) =
                    check_password(call.server, &call.args[at + 1], &call.args[at + 2])
                {
                    return Outcome::Reply(reply);
                }
                call.conn.authenticated = true;
                at += 3;
            }
            "setname" if at + 1 < call.args.len() => {
                name = Some(call.args[at + 1].clone());
                at += 2;
            }
            option => {
                return Outcome::error(format!("ERR Syntax error in HELLO option '{option}'"))
            }
        }
    }
    if !call.conn.authenticated {
        return Outcome::error("NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the same time");
    }
    if let Some(name) = name {
        if let Err(reply) = set_name(call, &name) {
            return Outcome::Reply(reply);
        }
    }
    call.conn.set_protocol(protocol);
    let text = |s: &str| Reply::Bulk(s.as_bytes().to_vec());
    Outcome::Reply(Reply::Map(vec![
        (text("server"), text("redis")),
        (text("version"), text(REDIS_COMPAT_VERSION)),
        (text("proto"), Reply::Integer(if protocol == Protocol::Resp3 { 3 } else { 2 })),
        (text("id"), Reply::Integer(call.conn.info.id as i64)),
        (text("mode"), text("standalone")),
        (text("role"), text("master")),
        (text("modules"), Reply::Array(vec![])),
    ]))
}

fn select(call: &mut Call<'_>) -> Outcome {
    match parse_i64(&call.args[1]) {
        Some(database) if (0..DATABASES as i64).contains(&database) => {
            call.conn.select(database as u8);
            Outcome::Reply(Reply::ok())
        }
        Some(database) if i32::try_from(database).is_err() => Outcome::error(
            "ERR value is out of range, value must between -2147483648 and 2147483647",
        ),
        Some(_) => Outcome::error(DB_OUT_OF_RANGE),
        None => Outcome::error(NOT_INTEGER),
    }
}

const DB_OUT_OF_RANGE: &str = "ERR DB index is out of range";

/// SWAPDB: one durable write of the database map (`namespace.rs`), whatever the databases hold;
/// answered once no command still runs under the old map.
fn swapdb(call: &mut Call<'_>) -> Outcome {
    // As Redis: both indexes must be integers of C's int first, then in range.
    let index = |at: usize, which: &str| match parse_i64(&call.args[at]) {
        Some(database) if i32::try_from(database).is_ok() => Ok(database),
        _ => Err(Reply::Error(format!("ERR invalid {which} DB index"))),
    };
    let (a, b) = match (index(1, "first"), index(2, "second")) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(reply), _) | (_, Err(reply)) => return Outcome::Reply(reply),
    };
    let in_range = |database: i64| (0..DATABASES as i64).contains(&database);
    if !in_range(a) || !in_range(b) {
        return Outcome::error(DB_OUT_OF_RANGE);
    }
    let (a, b) = (a as u8, b as u8);
    let server = call.server.clone();
    // Its own connection's wave is this one: the commands before it are answered already.
    let own_id = call.conn.info.id;
    Outcome::AfterPending(Box::pin(async move {
        let persist = |map: Vec<u8>| async {
            let shard = server.db.shard_of(DATABASE_MAP_KEY);
            let mut plan = super::Plan::new();
            let mut map = Some(map);
            Namespace::raw().scope(|| {
                plan.add(shard, vec![DATABASE_MAP_KEY.to_vec()], move |_, input| match input {
                    Input::Start => {
                        let value = map.take().unwrap_or_default();
                        Next::Write(vec![BatchOp::Put { key: DATABASE_MAP_KEY.to_vec(), value }])
                    }
                    Input::Written => Next::Reply(Reply::ok()),
                    Input::Read(_) => super::unexpected(),
                })
            });
            let combine = Box::new(|mut replies: Vec<Reply>| replies.pop().unwrap_or(Reply::Null));
            match super::run_outcome(&server.db, plan.finish(combine)).await {
                Reply::Simple(_) => Ok(()),
                Reply::Error(error) => Err(error),
                other => Err(format!("ERR unexpected answer {other:?}")),
            }
        };
        let waiters = &server.waiters;
        let installed = || waiters.wake_everyone();
        let quiet = |epoch| server.waves_past(epoch, own_id);
        server.swap_epoch.fetch_add(1, Ordering::AcqRel);
        let swapped = server.databases.swap(a, b, persist, installed, quiet).await;
        server.swap_epoch.fetch_add(1, Ordering::AcqRel);
        match swapped {
            Ok(()) => Reply::ok(),
            Err(error) => Reply::Error(error),
        }
    }))
}

fn quit(_call: &mut Call<'_>) -> Outcome {
    Outcome::Close(Reply::ok())
}

fn reset(call: &mut Call<'_>) -> Outcome {
    call.conn.set_protocol(Protocol::Resp2);
    call.conn.select(0);
    call.conn.authenticated = call.server.requirepass().is_empty();
    call.conn.info.name.lock().unwrap_or_else(|poison| poison.into_inner()).clear();
    call.conn.transaction = None;
    call.conn.unwatch();
    if let Some(mut subscriber) = call.conn.subscriber.take() {
        call.server.pubsub.unsubscribe_all(&mut subscriber);
    }
    Outcome::Reply(Reply::Simple("RESET".into()))
}

fn set_name(call: &Call<'_>, name: &[u8]) -> Result<(), Reply> {
    if name.iter().any(|&byte| byte <= b' ' || byte > b'~') {
        return Err(Reply::error(
            "ERR Client names cannot contain spaces, newlines or special characters.",
        ));
    }
    *call.conn.info.name.lock().unwrap_or_else(|poison| poison.into_inner()) =
        String::from_utf8_lossy(name).into_owned();
    Ok(())
}

fn client(call: &mut Call<'_>) -> Outcome {
    let server = call.server;
    match (call.word(1).as_str(), call.args.len()) {
        ("id", 2) => Outcome::Reply(Reply::Integer(call.conn.info.id as i64)),
        ("setname", 3) => match set_name(call, &call.args[2].clone()) {
            Ok(()) => Outcome::Reply(Reply::ok()),
            Err(reply) => Outcome::Reply(reply),
        },
        ("getname", 2) => {
            let name =
                call.conn.info.name.lock().unwrap_or_else(|poison| poison.into_inner()).clone();
            Outcome::Reply(if name.is_empty() {
                Reply::Null
            } else {
                Reply::Bulk(name.into_bytes())
            })
        }
        ("list", _) => {
            let clients: Vec<_> = server
                .clients
                .lock()
                .unwrap_or_else(|poison| poison.into_inner())
                .values()
                .cloned()
                .collect();
            let mut text = String::new();
            for client in clients {
                text.push_str(&client.describe(server.started));
                text.push('\n');
            }
            Outcome::Reply(Reply::Verbatim { format: *b"txt", text: text.into_bytes() })
        }
        ("info", 2) => {
            let mut text = call.conn.info.describe(server.started);
            text.push('\n');
            Outcome::Reply(Reply::Verbatim { format: *b"txt", text: text.into_bytes() })
        }
        // Client libraries announce themselves (redis-py does on connect); noted, not kept.
        ("setinfo", 4) => Outcome::Reply(Reply::ok()),
        ("no-evict", 3) | ("no-touch", 3) => {
            let on = match call.word(2).as_str() {
                "on" => true,
                "off" => false,
                _ => return Outcome::error(SYNTAX),
            };
            // copse evicts nothing: NO-EVICT is accepted and has nothing to change.
            if call.word(1) == "no-touch" {
                call.conn.no_touch = on;
            }
            Outcome::Reply(Reply::ok())
        }
        ("reply", 3) => {
            match call.word(2).as_str() {
                "on" => {
                    call.conn.replies_off = false;
                    call.conn.skip_replies = 0;
                }
                "off" => call.conn.replies_off = true,
                // Its own reply and the next command's.
                "skip" => call.conn.skip_replies = 2,
                _ => return Outcome::error(SYNTAX),
            }
            Outcome::Reply(Reply::ok())
        }
        ("kill", n) if n >= 3 => client_kill(call),
        ("pause", 3 | 4) => client_pause(call),
        ("unpause", 2) => {
            let mut pause = server.pause.lock().unwrap_or_else(|poison| poison.into_inner());
            *pause = None;
            server.paused.store(false, Ordering::Release);
            drop(pause);
            server.unpaused.notify_waiters();
            Outcome::Reply(Reply::ok())
        }
        ("tracking" | "caching" | "getredir" | "trackinginfo", _) => Outcome::error(
            "ERR copse does not support client-side caching (CLIENT TRACKING): every read goes to the server",
        ),
        (sub, _) => Outcome::error(format!(
            "ERR unknown subcommand or wrong number of arguments for '{sub}'. Try CLIENT HELP."
        )),
    }
}

/// One condition of CLIENT KILL on a client.
type ClientFilter = Box<dyn Fn(&crate::context::ClientInfo) -> bool>;

/// CLIENT KILL addr:port (answers OK), or with filters ID, ADDR, LADDR, USER, SKIPME, TYPE,
/// MAXAGE (answers how many were closed). A closed client's connection ends at once if idle, or
/// after the commands it is running.
fn client_kill(call: &mut Call<'_>) -> Outcome {
    let server = call.server;
    let own = call.conn.info.id;
    let clients: Vec<Arc<crate::context::ClientInfo>> = server
        .clients
        .lock()
        .unwrap_or_else(|poison| poison.into_inner())
        .values()
        .cloned()
        .collect();
    let kill = |client: &crate::context::ClientInfo| {
        client.killed.store(true, Ordering::Release);
        client.kill.notify_one();
    };
    if call.args.len() == 3 {
        let addr = String::from_utf8_lossy(&call.args[2]).into_owned();
        return match clients.iter().find(|client| client.addr == addr) {
            Some(client) => {
                kill(client);
                Outcome::Reply(Reply::ok())
            }
            None => Outcome::error("ERR No such client"),
        };
    }
    if !call.args.len().is_multiple_of(2) {
        return Outcome::error(SYNTAX);
    }
    let mut skip_me = true;
    let mut filters: Vec<ClientFilter> = Vec::new();
    for pair in call.args[2..].chunks(2) {
        let value = String::from_utf8_lossy(&pair[1]).into_owned();
        match lowercase(&pair[0]).as_str() {
            "id" => match value.parse::<u64>() {
                Ok(id) => filters.push(Box::new(move |client| client.id == id)),
                Err(_) => return Outcome::error("ERR client-id should be greater than 0"),
            },
            "addr" => filters.push(Box::new(move |client| client.addr == value)),
            "laddr" => filters.push(Box::new(move |client| client.laddr == value)),
            "user" => filters.push(Box::new(move |_| value == "default")),
            "type" => match value.to_ascii_lowercase().as_str() {
                "normal" | "pubsub" => {}
                "master" | "replica" | "slave" => filters.push(Box::new(|_| false)),
                _ => return Outcome::error(format!("ERR Unknown client type '{value}'")),
            },
            "maxage" => match value.parse::<u64>() {
                Ok(age) => {
                    filters.push(Box::new(move |client| client.created.elapsed().as_secs() >= age))
                }
                Err(_) => return Outcome::error(NOT_INTEGER),
            },
            "skipme" => match value.to_ascii_lowercase().as_str() {
                "yes" => skip_me = true,
                "no" => skip_me = false,
                _ => return Outcome::error(SYNTAX),
            },
            _ => return Outcome::error(SYNTAX),
        }
    }
    let mut killed = 0;
    for client in clients.iter().filter(|client| !(skip_me && client.id == own)) {
        if filters.iter().all(|filter| filter(client)) {
            kill(client);
            killed += 1;
        }
    }
    Outcome::Reply(Reply::Integer(killed))
}

/// CLIENT PAUSE timeout [WRITE|ALL]: commands (or write commands) wait until the timeout passes
/// or CLIENT UNPAUSE (`held_by_pause`).
fn client_pause(call: &mut Call<'_>) -> Outcome {
    let Some(timeout_ms) = parse_i64(&call.args[2]).filter(|&ms| ms >= 0) else {
        return Outcome::error("ERR timeout is not an integer or out of range");
    };
    let all = match call.args.get(3).map(|mode| lowercase(mode)) {
        None => true,
        Some(mode) if mode == "all" => true,
        Some(mode) if mode == "write" => false,
        Some(_) => return Outcome::error(SYNTAX),
    };
    let until = std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms as u64);
    let mut pause = call.server.pause.lock().unwrap_or_else(|poison| poison.into_inner());
    *pause = Some((until, all));
    call.server.paused.store(true, Ordering::Release);
    Outcome::Reply(Reply::ok())
}

/// Commands that run even while clients are paused (as in Redis: the pause must be undoable).
const RUN_WHILE_PAUSED: &[&str] = &["client", "ping", "quit", "reset", "auth", "hello", "info"];

/// `outcome`, held while a CLIENT PAUSE covers command `spec`: it then runs once the pause ends.
pub fn held_by_pause(server: &Arc<Server>, spec: &Spec, outcome: Outcome) -> Outcome {
    if !server.paused.load(Ordering::Acquire) {
        return outcome;
    }
    let paused = {
        let mut pause = server.pause.lock().unwrap_or_else(|poison| poison.into_inner());
        if pause.is_some_and(|(until, _)| std::time::Instant::now() >= until) {
            // Expired: the next commands skip the lock again.
            *pause = None;
            server.paused.store(false, Ordering::Release);
        }
        *pause
    };
    let Some((_, all)) = paused else { return outcome };
    if RUN_WHILE_PAUSED.contains(&spec.name) {
        return outcome;
    }
    if !all && !spec.flags.contains(&"write") {
        return outcome;
    }
    let server = server.clone();
    Outcome::AfterPending(Box::pin(async move {
        loop {
            let paused = *server.pause.lock().unwrap_or_else(|poison| poison.into_inner());
            let Some((until, _)) = paused else { break };
            if std::time::Instant::now() >= until {
                break;
            }
            let _ = tokio::time::timeout_at(until.into(), server.unpaused.notified()).await;
        }
        super::run_outcome(&server.db, outcome).await
    }))
}

fn command_info(spec: &Spec) -> Reply {
    let flags = spec.flags.iter().map(|flag| Reply::Simple((*flag).into())).collect();
    Reply::Array(vec![
        Reply::Bulk(spec.name.as_bytes().to_vec()),
        Reply::Integer(spec.arity as i64),
        Reply::Set(flags),
        Reply::Integer(spec.first_key as i64),
        Reply::Integer(spec.last_key as i64),
        Reply::Integer(spec.key_step as i64),
        Reply::Set(vec![]),
        Reply::Array(vec![]),
        Reply::Array(vec![]),
        Reply::Array(vec![]),
    ])
}

fn command_docs(spec: &Spec) -> Reply {
    let text = |s: &str| Reply::Bulk(s.as_bytes().to_vec());
    Reply::Map(vec![
        (text("summary"), text(spec.summary)),
        (text("since"), text("1.0.0")),
        (text("group"), text(spec.group)),
    ])
}

fn command(call: &mut Call<'_>) -> Outcome {
    let specs = table();
    let named = |at: usize| -> Vec<Option<&'static Spec>> {
        call.args[at..].iter().map(|name| super::find(&lowercase(name))).collect()
    };
    match call.word(1).as_str() {
        "" => Outcome::Reply(Reply::Array(specs.iter().map(command_info).collect())),
        "count" => Outcome::Reply(Reply::Integer(specs.len() as i64)),
        "info" => {
            let chosen =
                if call.args.len() == 2 { specs.iter().map(Some).collect() } else { named(2) };
            Outcome::Reply(Reply::Array(
                chosen
                    .into_iter()
                    .map(|spec| spec.map_or(Reply::NullArray, command_info))
                    .collect(),
            ))
        }
        "docs" => {
            let chosen: Vec<&Spec> = if call.args.len() == 2 {
                specs.iter().collect()
            } else {
                named(2).into_iter().flatten().collect()
            };
            Outcome::Reply(Reply::Map(
                chosen
                    .into_iter()
                    .map(|spec| (Reply::Bulk(spec.name.as_bytes().to_vec()), command_docs(spec)))
                    .collect(),
            ))
        }
        "list" => Outcome::Reply(Reply::Array(
            specs.iter().map(|spec| Reply::Bulk(spec.name.as_bytes().to_vec())).collect(),
        )),
        sub => Outcome::error(format!(
            "ERR unknown subcommand or wrong number of arguments for '{sub}'. Try COMMAND HELP."
        )),
    }
}

/// The settings CONFIG GET shows, with their current values.
fn config_values(server: &Server) -> Vec<(&'static str, String)> {
    let settings = &server.settings;
    let mut values = vec![
        ("bind", server.config.bind.clone()),
        ("port", server.local_addr.port().to_string()),
        ("dir", server.config.path.display().to_string()),
        ("requirepass", server.requirepass()),
        (
            "protected-mode",
            if settings.protected_mode.load(Ordering::Relaxed) { "yes" } else { "no" }.into(),
        ),
        ("maxclients", settings.maxclients.load(Ordering::Relaxed).to_string()),
        ("timeout", settings.timeout_secs.load(Ordering::Relaxed).to_string()),
        ("proto-max-bulk-len", settings.proto_max_bulk_len.load(Ordering::Relaxed).to_string()),
        (
            "client-output-buffer-limit",
            format!("normal {} 0 0", settings.client_output_bytes_max.load(Ordering::Relaxed)),
        ),
        ("client-query-buffer-limit", server.config.client_query_buffer_bytes_max.to_string()),
        (
            "copse-client-pending-reply-bytes-max",
            server.config.client_pending_reply_bytes_max.to_string(),
        ),
        // Every acknowledged write is durable without a log: there is nothing to snapshot or
        // append, so these say what a Redis user would configure to get the same promise.
        ("save", String::new()),
        ("appendonly", "no".into()),
        ("appendfsync", "always".into()),
        ("databases", super::namespace::DATABASES.to_string()),
        ("io-threads", server.config.thread_count().to_string()),
    ];
    for (name, alias, ..) in crate::context::ENCODING_KNOBS {
        let value = settings.encoding.get(name).to_string();
        values.push((name, value.clone()));
        if let Some(alias) = alias {
            values.push((alias, value));
        }
    }
    values
}

/// A checked CONFIG SET change, applied once every pair of the call is checked.
type SettingChange = Box<dyn FnOnce(&Server)>;

fn config(call: &mut Call<'_>) -> Outcome {
    let server = call.server;
    match call.word(1).as_str() {
        "get" if call.args.len() >= 3 => {
            let values = config_values(server);
            let mut out = Vec::new();
            for pattern in &call.args[2..] {
                let pattern = lowercase(pattern);
                for (name, value) in &values {
                    if keys::glob_match(pattern.as_bytes(), name.as_bytes())
                        && !out.iter().any(|(n, _): &(Reply, Reply)| {
                            *n == Reply::Bulk(name.as_bytes().to_vec())
                        })
                    {
                        out.push((
                            Reply::Bulk(name.as_bytes().to_vec()),
                            Reply::Bulk(value.clone().into_bytes()),
                        ));
                    }
                }
            }
            Outcome::Reply(Reply::Map(out))
        }
        "set" if call.args.len() >= 4 && call.args.len().is_multiple_of(2) => {
            // All or nothing: check every pair before applying any.
            let mut changes: Vec<SettingChange> = Vec::new();
            for pair in call.args[2..].chunks(2) {
                let name = lowercase(&pair[0]);
                let value = String::from_utf8_lossy(&pair[1]).into_owned();
                let number = value.parse::<u64>().ok();
                let change: SettingChange = match (name.as_str(), number) {
                    ("requirepass", _) => Box::new(move |server: &Server| {
                        *server.settings.requirepass.lock().unwrap_or_else(|p| p.into_inner()) = value;
                    }),
                    ("maxclients", Some(n)) if n >= 1 => {
                        // As Redis: more clients than descriptors allow is refused, after
                        // trying to raise the open files limit.
                        let wanted = n.saturating_add(server.settings.reserved_fds);
                        let limit = crate::fds::raise_fd_limit(wanted).unwrap_or(0);
                        let allowed = crate::fds::clients_max_for(limit, server.settings.reserved_fds);
                        if (n as usize) > allowed {
                            return Outcome::error(format!(
                                "ERR CONFIG SET failed (possibly related to argument 'maxclients') - The operating system is not able to handle the specified number of clients, try with {allowed}"
                            ));
                        }
                        Box::new(move |server: &Server| {
                            server.settings.maxclients.store(n as usize, Ordering::Relaxed)
                        })
                    }
                    ("timeout", Some(n)) => Box::new(move |server: &Server| {
                        server.settings.timeout_secs.store(n, Ordering::Relaxed)
                    }),
                    ("proto-max-bulk-len", Some(n))
                        if n >= 1 && n as usize <= PROTO_MAX_BULK_LEN_DEFAULT =>
                    {
                        Box::new(move |server: &Server| {
                            server.settings.proto_max_bulk_len.store(n as usize, Ordering::Relaxed)
                        })
                    }
                    ("protected-mode", _) => {
                        let on = match value.to_ascii_lowercase().as_str() {
                            "yes" => true,
                            "no" => false,
                            _ => {
                                return Outcome::error(
                                    "ERR CONFIG SET failed (possibly related to argument 'protected-mode') - argument must be 'yes' or 'no'",
                                )
                            }
                        };
                        Box::new(move |server: &Server| {
                            server.settings.protected_mode.store(on, Ordering::Relaxed)
                        })
                    }
                    (knob, _) if EncodingKnobs::position(knob).is_some() => {
                        let at = EncodingKnobs::position(knob).expect("found");
                        let (.., least, most) = crate::context::ENCODING_KNOBS[at];
                        let failed = |why: String| {
                            Outcome::error(format!(
                                "ERR CONFIG SET failed (possibly related to argument '{name}') - {why}"
                            ))
                        };
                        match value.parse::<i64>() {
                            Ok(number) if (least..=most).contains(&number) => {
                                Box::new(move |server: &Server| server.settings.encoding.set(at, number))
                            }
                            Ok(_) => {
                                return failed(format!("argument must be between {least} and {most} inclusive"))
                            }
                            Err(_) => return failed("argument couldn't be parsed into an integer".into()),
                        }
                    }
                    ("maxclients" | "timeout" | "proto-max-bulk-len", _) => {
                        return Outcome::error(format!(
                            "ERR CONFIG SET failed (possibly related to argument '{name}') - argument couldn't be parsed into an integer or is out of range"
                        ))
                    }
                    _ => {
                        return Outcome::error(format!(
                            "ERR Unknown option or number of arguments for CONFIG SET - '{name}'"
                        ))
                    }
                };
                changes.push(change);
            }
            for change in changes {
                change(server);
            }
            Outcome::Reply(Reply::ok())
        }
        "resetstat" if call.args.len() == 2 => {
            server.stats.commands.store(0, Ordering::Relaxed);
            server.stats.connections_received.store(0, Ordering::Relaxed);
            server.stats.rejected_connections.store(0, Ordering::Relaxed);
            server.stats.protocol_errors.store(0, Ordering::Relaxed);
            Outcome::Reply(Reply::ok())
        }
        sub => Outcome::error(format!(
            "ERR unknown subcommand or wrong number of arguments for '{sub}'. Try CONFIG HELP."
        )),
    }
}

/// DEBUG: of Redis's subcommands, SET-ACTIVE-EXPIRE, which test suites (Redis's own among them)
/// send to see expired keys that active expiry has not deleted yet.
fn debug(call: &mut Call<'_>) -> Outcome {
    match (call.word(1).as_str(), call.args.len()) {
        ("set-active-expire", 3) => {
            let Some(on) = super::parse_i64(&call.args[2]) else {
                return Outcome::error(super::NOT_INTEGER);
            };
            call.server.settings.active_expire.store(on != 0, Ordering::Relaxed);
            Outcome::Reply(Reply::ok())
        }
        _ => Outcome::error(format!(
            "ERR DEBUG {} is not supported by copse (only SET-ACTIVE-EXPIRE)",
            String::from_utf8_lossy(&call.args[1])
        )),
    }
}

/// FUNCTION FLUSH: copse stores no functions yet (FUNCTION LOAD is issue 24's), so there is
/// nothing to delete; test suites and clients send it between runs. Other subcommands are
/// refused as not supported.
fn function(call: &mut Call<'_>) -> Outcome {
    flush_only(call, "FUNCTION", "FUNCTION FLUSH only supports SYNC|ASYNC option")
}

/// SCRIPT FLUSH: copse caches no scripts yet (EVAL is issue 24's); as FUNCTION FLUSH.
fn flush_only(call: &Call<'_>, command: &str, bad_mode: &str) -> Outcome {
    let sub = call.word(1);
    if sub != "flush" {
        return Outcome::error(format!(
            "ERR {command} {} is not supported by copse yet",
            sub.to_ascii_uppercase()
        ));
    }
    match (call.args.len(), call.word(2).as_str()) {
        (2, _) | (3, "sync" | "async") => Outcome::Reply(Reply::ok()),
        (3, _) => Outcome::error(format!("ERR {bad_mode}")),
        _ => Outcome::error(format!(
            "ERR wrong number of arguments for '{}|flush' command",
            command.to_ascii_lowercase()
        )),
    }
}

fn time(_call: &mut Call<'_>) -> Outcome {
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Outcome::Reply(Reply::Array(vec![
        Reply::Bulk(now.as_secs().to_string().into_bytes()),
        Reply::Bulk(now.subsec_micros().to_string().into_bytes()),
    ]))
}

/// Bytes of resident memory (VmRSS), 0 where /proc is absent.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Bytes as Redis's INFO shows them in `*_human` fields (`1.50M`).
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "K", "M", "G", "T"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{bytes}B"),
        _ => format!("{value:.2}{}", UNITS[unit]),
    }
}

fn capitalize(word: &str) -> String {
    let mut chars = word.chars();
    chars.next().map_or_else(String::new, |first| first.to_uppercase().chain(chars).collect())
}

/// SCRUB: runs an online scrub of the whole store (or joins the one running) and answers with
/// its report as a map: the counts, then `problems`, the first problems with their locations.
/// It answers when the scrub is done, which takes a full read of the store.
fn scrub(call: &mut Call<'_>) -> Outcome {
    let db = call.db().clone();
    Outcome::AfterPending(Box::pin(async move {
        let (report, duration_ms) = match db.scrub_async().await {
            Ok(run) => (run.report, run.duration_ms),
            Err(err) => return super::read_error(&err),
        };
        let text = |s: &str| Reply::Bulk(s.as_bytes().to_vec());
        let count = |n: u64| Reply::Integer(n as i64);
        Reply::Map(vec![
            (text("pages_checked"), count(report.pages_checked)),
            (text("items_checked"), count(report.items_checked)),
            (text("pages_reread"), count(report.pages_reread)),
            (text("problems_found"), count(report.problems_found)),
            (text("duration_ms"), count(duration_ms)),
            (text("problems"), Reply::Array(report.problems.iter().map(|p| text(p)).collect())),
        ])
    }))
}

const INFO_SECTIONS: &[&str] =
    &["server", "clients", "memory", "persistence", "stats", "keyspace", "copse"];

fn info(call: &mut Call<'_>) -> Outcome {
    let mut wanted: Vec<String> = call.args[1..].iter().map(|arg| lowercase(arg)).collect();
    if wanted.is_empty() || wanted.iter().any(|s| s == "all" || s == "everything" || s == "default")
    {
        wanted = INFO_SECTIONS.iter().map(|s| s.to_string()).collect();
    }
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        let text = info_text(&server, &wanted).await;
        Reply::Verbatim { format: *b"txt", text: text.into_bytes() }
    }))
}

pub async fn info_text(server: &Arc<Server>, wanted: &[String]) -> String {
    let stats = &server.stats;
    let store = server.db.stats_async().await.ok();
    // Per database with keys: its number, keys and keys with an expiry.
    let mut keyspace = Vec::new();
    let used = match wanted.iter().any(|section| section == "keyspace") {
        true => keys::namespaces_in_use(&server.db).await.unwrap_or_else(|_| vec![0]),
        false => Vec::new(),
    };
    for database in 0..DATABASES as u8 {
        let namespace = super::namespace::resolve(&server.databases, database);
        if !namespace.number().is_some_and(|number| used.contains(&number)) {
            continue;
        }
        let keys = namespace.bind(keys::key_count(&server.db)).await.unwrap_or(0);
        if keys > 0 {
            let expires = namespace.bind(keys::expiring_key_count(&server.db)).await.unwrap_or(0);
            keyspace.push((database, keys, expires));
        }
    }
    let mut out = String::new();
    for section in INFO_SECTIONS.iter().filter(|s| wanted.iter().any(|w| w == *s)) {
        if !out.is_empty() {
            out.push_str("\r\n");
        }
        let title = if *section == "copse" { "Copse".to_string() } else { capitalize(section) };
        let _ = write!(out, "# {title}\r\n");
        let mut line = |name: &str, value: &dyn std::fmt::Display| {
            let _ = write!(out, "{name}:{value}\r\n");
        };
        match *section {
            "server" => {
                line("redis_version", &REDIS_COMPAT_VERSION);
                line("copse_version", &env!("CARGO_PKG_VERSION"));
                line("redis_mode", &"standalone");
                line("os", &std::env::consts::OS);
                line("arch_bits", &64);
                line("multiplexing_api", &"epoll");
                line("process_id", &std::process::id());
                line("run_id", &server.run_id);
                line("tcp_port", &server.local_addr.port());
                line("uptime_in_seconds", &server.started.elapsed().as_secs());
                line("uptime_in_days", &(server.started.elapsed().as_secs() / 86_400));
                line("io_threads_active", &server.config.thread_count());
            }
            "clients" => {
                line("connected_clients", &stats.connected_clients.load(Ordering::Relaxed));
                line("maxclients", &server.settings.maxclients.load(Ordering::Relaxed));
                line("blocked_clients", &server.waiters.blocked_clients());
            }
            "memory" => {
                let rss = rss_bytes();
                let (allocator, used) = match crate::context::allocator_report() {
                    Some(report) => (report.name, (report.bytes)()),
                    None => ("libc", rss),
                };
                line("used_memory", &used);
                line("used_memory_human", &human_bytes(used));
                line("used_memory_rss", &rss);
                line("used_memory_rss_human", &human_bytes(rss));
                line("mem_allocator", &allocator);
                if let Some(store) = &store {
                    line("copse_index_bytes", &store.index_bytes);
                    let cache: u64 =
                        store.shards.iter().map(|s| s.cache_capacity_pages * 4096).sum();
                    line("copse_cache_bytes_max", &cache);
                }
            }
            "persistence" => {
                line("loading", &0);
                line("aof_enabled", &0);
                line("rdb_changes_since_last_save", &0);
                line("copse_durability", &server.config.durability);
                line("copse_store_dir", &server.config.path.display());
            }
            "stats" => {
                line(
                    "total_connections_received",
                    &stats.connections_received.load(Ordering::Relaxed),
                );
                line("total_commands_processed", &stats.commands.load(Ordering::Relaxed));
                line("total_net_input_bytes", &stats.net_input_bytes.load(Ordering::Relaxed));
                line("total_net_output_bytes", &stats.net_output_bytes.load(Ordering::Relaxed));
                line("rejected_connections", &stats.rejected_connections.load(Ordering::Relaxed));
                line("total_error_replies", &0);
                line("expired_keys", &stats.expired_keys.load(Ordering::Relaxed));
                line("copse_protocol_errors", &stats.protocol_errors.load(Ordering::Relaxed));
                line(
                    "copse_output_limit_closes",
                    &stats.output_limit_closes.load(Ordering::Relaxed),
                );
                line(
                    "copse_query_buffer_closes",
                    &stats.query_buffer_closes.load(Ordering::Relaxed),
                );
                line(
                    "copse_parser_examined_bytes",
                    &stats.parser_examined_bytes.load(Ordering::Relaxed),
                );
                line(
                    "copse_reply_backpressure_waits",
                    &stats.reply_backpressure_waits.load(Ordering::Relaxed),
                );
                let (hits, misses) = crate::context::Lookups::totals();
                line("keyspace_hits", &hits);
                line("keyspace_misses", &misses);
                if let Some(store) = &store {
                    let hits: u64 = store.shards.iter().map(|s| s.cache_hits).sum();
                    let misses: u64 = store.shards.iter().map(|s| s.cache_misses).sum();
                    line("copse_page_cache_hits", &hits);
                    line("copse_page_cache_misses", &misses);
                }
            }
            "keyspace" => {
                for (database, keys, expires) in &keyspace {
                    line(
                        &format!("db{database}"),
                        &format!("keys={keys},expires={expires},avg_ttl=0"),
                    )
                }
            }
            "copse" => {
                line("shards", &server.db.shard_count());
                let depths = server.db.queue_depths();
                line(
                    "shard_queue_depths",
                    &depths.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","),
                );
                if let Some(store) = &store {
                    line("items", &store.items);
                    line("file_bytes", &store.file_bytes);
                    line("index_bytes_per_item", &format!("{:.1}", store.index_bytes_per_item));
                    line("cache_hit_rate", &format!("{:.4}", store.cache_hit_rate));
                    line("device_reads", &store.device.reads);
                    line("device_writes", &store.device.writes);
                    line("device_flushes", &store.device.flushes);
                    line("device_bytes_written", &store.device.bytes_written);
                    line("user_bytes_written", &store.user_bytes_written);
                    line("write_amplification", &format!("{:.2}", store.write_amplification));
                    if let Some(asked) = store.placement.asked {
                        line("placement", &asked);
                    }
                    if let Some(ratio) = store.placement.probe_sequential_over_random {
                        line("placement_probe_sequential_over_random", &format!("{ratio:.2}"));
                    }
                    for class in &store.classes {
                        line(
                            &format!("class_{}", class.class),
                            &format!(
                                "placement={},slot_bytes={},file_bytes={},live_bytes={},dead_bytes={},gc_runs={},gc_blocks_freed={},gc_bytes_moved={},write_amplification={:.2}",
                                class.placement,
                                class.slot_bytes,
                                class.file_bytes,
                                class.live_bytes,
                                class.dead_bytes,
                                class.append.gc_runs,
                                class.append.gc_blocks_freed,
                                class.append.gc_bytes_moved,
                                class.write_amplification(),
                            ),
                        );
                    }
                }
                line("orphan_records_seen", &stats.orphan_records_seen.load(Ordering::Relaxed));
                line(
                    "orphan_elements_deleted",
                    &stats.orphan_elements_deleted.load(Ordering::Relaxed),
                );
                line("orphan_keys_collected", &stats.orphan_keys_collected.load(Ordering::Relaxed));
                line("scrub_in_progress", &u8::from(server.db.scrub_running()));
                match server.db.last_scrub() {
                    None => line("last_scrub_status", &"never"),
                    Some(run) => {
                        let clean = run.report.problems_found == 0;
                        line("last_scrub_status", &if clean { "ok" } else { "problems" });
                        line("last_scrub_finished_unix", &run.finished_unix_secs);
                        line("last_scrub_duration_ms", &run.duration_ms);
                        line("last_scrub_pages_checked", &run.report.pages_checked);
                        line("last_scrub_items_checked", &run.report.items_checked);
                        line("last_scrub_problems", &run.report.problems_found);
                    }
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_match_exactly() {
        assert!(passwords_match(b"secret", b"secret"));
        for wrong in [&b""[..], b"secre", b"secret ", b"Secret", b"secretsecret", b"\0secret"] {
            assert!(!passwords_match(b"secret", wrong), "{wrong:?}");
        }
        assert!(passwords_match(b"", b""));
    }
}
