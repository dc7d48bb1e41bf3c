//! Frozen Redis key space stores written by earlier builds of `copse serve`
//! (`tests/fixtures/NAME/`): every later build must serve each one and answer exactly what its
//! clients were given. The bytes are checked in and never regenerated, so a change to how
//! strings, hashes and sorted sets become items (docs/format/redis-keyspace.md, `keyspace.rs`)
//! that old stores cannot follow fails here. A new key space format version must upgrade these
//! stores or refuse them clearly (then this test is changed, deliberately, to expect that
//! refusal for those fixtures); it may never read them wrong. (The engine's own on-disk formats
//! have their fixtures in `crates/copse/tests/fixtures.rs`.)
//!
//! A fixture directory holds:
//! - `store/`: the store as a real server left it after a clean stop, having been driven over a
//!   socket with raw RESP commands (the recipe: `write_recipe`);
//! - `fixture.txt`: how it was written (`engine`, `shards`, `placement`, `keyspace_version`) and
//!   by whom (`written_by`);
//! - `contents.txt`: every Redis key the recipe touched and what a client must read back, one
//!   line per fact, sorted by key: `KEY absent`; `KEY string LEN XXH3`; `KEY hash FIELDS` and then
//!   `KEY field FIELD LEN XXH3` per field (sorted by field: HGETALL's order is not specified);
//!   `KEY zset MEMBERS` and then `KEY member RANK MEMBER SCORE` in ZRANGE order. `XXH3` is the
//!   value's xxh3-64 in hex; a score is printed as Rust prints the f64 (`-inf`, `0.1`, `2.5`).
//!   The file is what the store must answer, whatever the recipe of a later build does. A key
//!   of database D > 0 is written `dD:KEY` (version 6 on), a long key `%long:TAG:LEN` and one
//!   starting with the surrogate prefix `%prefix:TAIL` (version 7 on; `expand_key`).
//!
//! The check starts a server on a copy of each fixture (so the checked-in bytes stay as
//! written), reads every key with TYPE, EXISTS, GET/STRLEN, HGETALL/HLEN, ZRANGE ... WITHSCORES/
//! ZCARD/ZSCORE over a socket, and compares with `contents.txt`; DBSIZE and a full SCAN must
//! find exactly the live keys it lists.
//!
//! To freeze a new fixture (when the key space format version changes, keep the old ones and add
//! one): `COPSE_FREEZE_REDIS_FIXTURE=<name> cargo test --release -p copse-server --test fixtures
//! -- --ignored freeze`, then commit `tests/fixtures/<name>/`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use copse::{check_store, CheckOptions};
use copse_server::keyspace::KEYSPACE_FORMAT_VERSION;
use copse_server::ServerConfig;
use xxhash_rust::xxh3::xxh3_64;

/// Shards of the stores the recipe writes: two, so that a multi-key DEL crosses shards.
const FIXTURE_SHARDS: usize = 2;
/// String keys `str:NN` the recipe writes.
const STRING_KEYS: usize = 36;
/// Value lengths of strings and hash fields. Few, since each size class a store uses costs a
/// 1 MiB slab file per shard in the repository: a small one, one that shares its class with
/// a short item's, and one near a page (1,900 bytes: a string or a field item of it stays in
/// the 2 KiB class).
const VALUE_LENS: [usize; 3] = [8, 100, 1_900];
/// The one large string (a multi-page item).
const LARGE_LEN: usize = 70_000;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures")
}

// ---------------------------------------------------------------------------------------------
// A minimal RESP2 client.

#[derive(Clone, Debug, PartialEq)]
enum Reply {
    Status(String),
    Error(String),
    Integer(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

struct Client {
    stream: BufReader<TcpStream>,
}

impl Client {
    fn connect(addr: std::net::SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        Client { stream: BufReader::new(stream) }
    }

    /// Sends one command as a multibulk request and reads its reply.
    fn call(&mut self, args: &[&[u8]]) -> Reply {
        let mut request = Vec::new();
        copse_server::resp::encode_request(args, &mut request);
        self.stream.get_mut().write_all(&request).unwrap();
        self.read_reply()
    }

    fn read_line(&mut self) -> String {
        let mut line = Vec::new();
        self.stream.read_until(b'\n', &mut line).unwrap();
        assert!(line.ends_with(b"\r\n"), "truncated reply line {line:?}");
        line.truncate(line.len() - 2);
        String::from_utf8(line).expect("reply lines are text")
    }

    fn read_reply(&mut self) -> Reply {
        let line = self.read_line();
        let (kind, rest) = line.split_at(1);
        let length = || rest.parse::<i64>().unwrap_or_else(|_| panic!("bad length in {line:?}"));
        match kind {
            "+" => Reply::Status(rest.to_string()),
            "-" => Reply::Error(rest.to_string()),
            ":" => Reply::Integer(length()),
            "$" if length() < 0 => Reply::Bulk(None),
            "$" => {
                let mut body = vec![0; length() as usize + 2];
                self.stream.read_exact(&mut body).unwrap();
                assert!(body.ends_with(b"\r\n"), "bulk without its CRLF");
                body.truncate(body.len() - 2);
                Reply::Bulk(Some(body))
            }
            "*" if length() < 0 => Reply::Array(None),
            "*" => Reply::Array(Some((0..length()).map(|_| self.read_reply()).collect())),
            _ => panic!("unexpected reply line {line:?}"),
        }
    }

    fn integer(&mut self, args: &[&[u8]]) -> i64 {
        match self.call(args) {
            Reply::Integer(n) => n,
            other => panic!("{}: expected an integer, got {other:?}", show(args)),
        }
    }

    fn status(&mut self, args: &[&[u8]]) -> String {
        match self.call(args) {
            Reply::Status(text) => text,
            other => panic!("{}: expected a status, got {other:?}", show(args)),
        }
    }

    fn ok(&mut self, args: &[&[u8]]) {
        assert_eq!(self.status(args), "OK", "{}", show(args));
    }

    fn bulk(&mut self, args: &[&[u8]]) -> Option<Vec<u8>> {
        match self.call(args) {
            Reply::Bulk(bytes) => bytes,
            other => panic!("{}: expected a bulk string, got {other:?}", show(args)),
        }
    }

    /// An array of bulk strings.
    fn bulks(&mut self, args: &[&[u8]]) -> Vec<Vec<u8>> {
        match self.call(args) {
            Reply::Array(Some(items)) => items.into_iter().map(bulk_of).collect(),
            other => panic!("{}: expected an array, got {other:?}", show(args)),
        }
    }
}

fn bulk_of(reply: Reply) -> Vec<u8> {
    match reply {
        Reply::Bulk(Some(bytes)) => bytes,
        other => panic!("expected a bulk string, got {other:?}"),
    }
}

/// A command, for messages (arguments longer than 40 bytes shortened).
fn show(args: &[&[u8]]) -> String {
    let shown: Vec<String> = args
        .iter()
        .map(|arg| match arg.len() {
            0..=40 => String::from_utf8_lossy(arg).into_owned(),
            n => format!("<{n} bytes>"),
        })
        .collect();
    shown.join(" ")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("fixture keys, fields and members are text")
}

// ---------------------------------------------------------------------------------------------
// What the recipe wrote, and what contents.txt says.

#[derive(Clone, Debug)]
enum Value {
    String(Vec<u8>),
    Hash(BTreeMap<Vec<u8>, Vec<u8>>),
    ZSet(BTreeMap<Vec<u8>, f64>),
    List(Vec<Vec<u8>>),
    Set(BTreeSet<Vec<u8>>),
}

/// Every key the recipe touched: its value, or None once it is gone.
type Model = BTreeMap<Vec<u8>, Option<Value>>;
/// The deadlines (PEXPIRETIME, Unix ms) of the live keys that have one.
type Deadlines = BTreeMap<Vec<u8>, u64>;

/// Deterministic bytes of every value 0..=255 (CR, LF and NUL included: values are binary).
fn make_bytes(tag: &str, len: usize) -> Vec<u8> {
    let mut x = xxh3_64(tag.as_bytes()) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

fn hashed(bytes: &[u8]) -> String {
    format!("{} {:016x}", bytes.len(), xxh3_64(bytes))
}

/// The lines of `contents.txt` for one key: its value's, then `KEY deadline_ms N` if it has an
/// expiry (fixtures of key space version 3 on).
fn describe(key: &[u8], value: &Option<Value>, deadline_ms: Option<u64>) -> Vec<String> {
    let mut lines = describe_value(key, value);
    if let Some(deadline_ms) = deadline_ms {
        lines.push(format!("{} deadline_ms {deadline_ms}", text(key)));
    }
    lines
}

fn describe_value(key: &[u8], value: &Option<Value>) -> Vec<String> {
    let key = text(key);
    match value {
        None => vec![format!("{key} absent")],
        Some(Value::String(bytes)) => vec![format!("{key} string {}", hashed(bytes))],
        Some(Value::Hash(fields)) => {
            let mut lines = vec![format!("{key} hash {}", fields.len())];
            for (field, value) in fields {
                lines.push(format!("{key} field {} {}", text(field), hashed(value)));
            }
            lines
        }
        Some(Value::ZSet(members)) => {
            let mut ranked: Vec<(&Vec<u8>, f64)> =
                members.iter().map(|(member, score)| (member, *score)).collect();
            // Redis's order: by score, equal scores by member bytes.
            ranked.sort_by(|a, b| a.1.total_cmp(&b.1).then_with(|| a.0.cmp(b.0)));
            let mut lines = vec![format!("{key} zset {}", ranked.len())];
            for (rank, (member, score)) in ranked.into_iter().enumerate() {
                lines.push(format!("{key} member {rank} {} {score}", text(member)));
            }
            lines
        }
        Some(Value::Set(members)) => {
            let mut lines = vec![format!("{key} set {}", members.len())];
            for member in members {
                lines.push(format!("{key} smember {}", text(member)));
            }
            lines
        }
        Some(Value::List(elements)) => {
            let mut lines = vec![format!("{key} list {}", elements.len())];
            for (at, element) in elements.iter().enumerate() {
                lines.push(format!("{key} element {at} {}", hashed(element)));
            }
            lines
        }
    }
}

/// A score as the server sends it ("2.5", "-inf", ...).
fn parse_score(bytes: &[u8]) -> f64 {
    let text = std::str::from_utf8(bytes).unwrap();
    text.parse().unwrap_or_else(|_| panic!("not a score: {text:?}"))
}

/// Reads key `key` back over the socket, every way its type allows, as a Value, and its
/// deadline (PEXPIRETIME; TTL and EXPIRETIME must agree with it).
fn read_back(client: &mut Client, key: &[u8]) -> (Option<Value>, Option<u64>) {
    let value = read_value(client, key);
    let shown = shown_key(key);
    let deadline = client.integer(&[b"PEXPIRETIME", key]);
    let ttl = client.integer(&[b"TTL", key]);
    match (&value, deadline) {
        (None, _) => {
            assert_eq!((deadline, ttl), (-2, -2), "{shown}: a missing key's PEXPIRETIME and TTL");
            (None, None)
        }
        (Some(_), -1) => {
            assert_eq!(ttl, -1, "{shown}: TTL of a key without expiry");
            (value, None)
        }
        (Some(_), deadline) => {
            assert!(deadline > 0 && ttl >= 0, "{shown}: PEXPIRETIME {deadline}, TTL {ttl}");
            let seconds = client.integer(&[b"EXPIRETIME", key]);
            assert_eq!(seconds, (deadline + 500) / 1000, "{shown}: EXPIRETIME");
            (value, Some(deadline as u64))
        }
    }
}

fn read_value(client: &mut Client, key: &[u8]) -> Option<Value> {
    let exists = client.integer(&[b"EXISTS", key]);
    let ty = client.status(&[b"TYPE", key]);
    let shown = shown_key(key);
    let value = match ty.as_str() {
        "none" => {
            assert_eq!(client.bulk(&[b"GET", key]), None, "{shown}: GET of a missing key");
            None
        }
        "string" => {
            let bytes = client.bulk(&[b"GET", key]).expect("GET of a string");
            let length = client.integer(&[b"STRLEN", key]);
            assert_eq!(length as usize, bytes.len(), "{shown}: STRLEN disagrees with GET");
            Some(Value::String(bytes))
        }
        "hash" => {
            let flat = client.bulks(&[b"HGETALL", key]);
            assert_eq!(flat.len() % 2, 0, "{shown}: HGETALL returned an odd count");
            let mut fields = BTreeMap::new();
            for pair in flat.chunks(2) {
                let previous = fields.insert(pair[0].clone(), pair[1].clone());
                assert!(previous.is_none(), "{shown}: HGETALL repeats {:?}", text(&pair[0]));
            }
            let length = client.integer(&[b"HLEN", key]);
            assert_eq!(length as usize, fields.len(), "{shown}: HLEN disagrees with HGETALL");
            Some(Value::Hash(fields))
        }
        "zset" => {
            let flat = client.bulks(&[b"ZRANGE", key, b"0", b"-1", b"WITHSCORES"]);
            assert_eq!(flat.len() % 2, 0, "{shown}: ZRANGE WITHSCORES returned an odd count");
            let ranked: Vec<(Vec<u8>, f64)> =
                flat.chunks(2).map(|pair| (pair[0].clone(), parse_score(&pair[1]))).collect();
            let mut expected_order = ranked.clone();
            expected_order.sort_by(|a, b| a.1.total_cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
            assert_eq!(ranked, expected_order, "{shown}: ZRANGE is not in score order");
            // ZSCORE reads the member item, ZRANGE only the by-score items: they must agree.
            for (member, score) in &ranked {
                let got = client.bulk(&[b"ZSCORE", key, member]).expect("ZSCORE of a member");
                assert_eq!(parse_score(&got), *score, "{shown}: ZSCORE of {}", text(member));
            }
            let length = client.integer(&[b"ZCARD", key]);
            assert_eq!(length as usize, ranked.len(), "{shown}: ZCARD disagrees with ZRANGE");
            let members: BTreeMap<Vec<u8>, f64> = ranked.into_iter().collect();
            Some(Value::ZSet(members))
        }
        "list" => {
            let elements = client.bulks(&[b"LRANGE", key, b"0", b"-1"]);
            let length = client.integer(&[b"LLEN", key]);
            assert_eq!(length as usize, elements.len(), "{shown}: LLEN disagrees with LRANGE");
            for (at, element) in elements.iter().enumerate() {
                let index = at.to_string();
                let got = client.bulk(&[b"LINDEX", key, index.as_bytes()]);
                assert_eq!(
                    got.as_ref(),
                    Some(element),
                    "{shown}: LINDEX {at} disagrees with LRANGE"
                );
            }
            Some(Value::List(elements))
        }
        "set" => {
            let members: BTreeSet<Vec<u8>> =
                client.bulks(&[b"SMEMBERS", key]).into_iter().collect();
            let length = client.integer(&[b"SCARD", key]);
            assert_eq!(length as usize, members.len(), "{shown}: SCARD disagrees with SMEMBERS");
            for member in &members {
                let found = client.integer(&[b"SISMEMBER", key, member]);
                assert_eq!(found, 1, "{shown}: SISMEMBER {} disagrees with SMEMBERS", text(member));
            }
            Some(Value::Set(members))
        }
        other => panic!("{shown}: TYPE answered {other:?}"),
    };
    assert_eq!(exists, i64::from(value.is_some()), "{shown}: EXISTS disagrees with TYPE {ty}");
    value
}

/// A model key's database and Redis key: `dD:KEY` is KEY in database D (1..15; key space
/// version 6), any other name a key of database 0.
fn in_database(name: &[u8]) -> (u8, &[u8]) {
    let split = name.strip_prefix(b"d").and_then(|rest| {
        let colon = rest.iter().position(|&byte| byte == b':')?;
        let database: u8 = std::str::from_utf8(&rest[..colon]).ok()?.parse().ok()?;
        (1..16).contains(&database).then_some((database, &rest[colon + 1..]))
    });
    split.unwrap_or((0, name))
}

fn select(client: &mut Client, database: u8) {
    client.ok(&[b"SELECT", database.to_string().as_bytes()]);
}

/// Every key SCAN returns, walking the cursor from 0 until it is 0 again.
fn scan_all(client: &mut Client) -> BTreeSet<Vec<u8>> {
    let mut keys = BTreeSet::new();
    let mut cursor = b"0".to_vec();
    loop {
        let reply = client.call(&[b"SCAN", &cursor, b"COUNT", b"7"]);
        let Reply::Array(Some(mut parts)) = reply else { panic!("SCAN replied {reply:?}") };
        assert_eq!(parts.len(), 2, "SCAN replied {parts:?}");
        let Reply::Array(Some(page)) = parts.pop().unwrap() else { panic!("SCAN page") };
        keys.extend(page.into_iter().map(bulk_of));
        cursor = bulk_of(parts.pop().unwrap());
        if cursor == b"0" {
            return keys;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The recipe.

/// Sends commands and keeps the model of what they did.
struct Recipe {
    client: Client,
    model: Model,
    deadlines: Deadlines,
}

impl Recipe {
    fn set(&mut self, key: &str, value: Vec<u8>) {
        self.client.ok(&[b"SET", key.as_bytes(), &value]);
        self.model.insert(key.into(), Some(Value::String(value)));
        self.deadlines.remove(key.as_bytes());
    }

    /// Gives live key `key` the deadline `deadline_ms` (Unix ms); one already past deletes it.
    fn pexpireat(&mut self, key: &str, deadline_ms: u64) {
        let deadline = deadline_ms.to_string();
        let args: [&[u8]; 3] = [b"PEXPIREAT", key.as_bytes(), deadline.as_bytes()];
        assert_eq!(self.client.integer(&args), 1, "{}", show(&args));
        if deadline_ms <= 1_000_000 {
            self.model.insert(key.into(), None);
            self.deadlines.remove(key.as_bytes());
        } else {
            self.deadlines.insert(key.into(), deadline_ms);
        }
    }

    fn del(&mut self, keys: &[&str]) {
        let mut args: Vec<&[u8]> = vec![b"DEL"];
        args.extend(keys.iter().map(|key| key.as_bytes()));
        let live =
            keys.iter().filter(|key| matches!(self.model.get(key.as_bytes()), Some(Some(_))));
        let expected = live.count() as i64;
        assert_eq!(self.client.integer(&args), expected, "{}", show(&args));
        for key in keys {
            self.model.insert(key.as_bytes().to_vec(), None);
            self.deadlines.remove(key.as_bytes());
        }
    }

    fn hash(&mut self, key: &str) -> &mut BTreeMap<Vec<u8>, Vec<u8>> {
        let entry = self.model.entry(key.into()).or_insert(None);
        if !matches!(entry, Some(Value::Hash(_))) {
            *entry = Some(Value::Hash(BTreeMap::new()));
        }
        match entry {
            Some(Value::Hash(fields)) => fields,
            _ => unreachable!(),
        }
    }

    fn zset(&mut self, key: &str) -> &mut BTreeMap<Vec<u8>, f64> {
        let entry = self.model.entry(key.into()).or_insert(None);
        if !matches!(entry, Some(Value::ZSet(_))) {
            *entry = Some(Value::ZSet(BTreeMap::new()));
        }
        match entry {
            Some(Value::ZSet(members)) => members,
            _ => unreachable!(),
        }
    }

    /// Drops a hash or sorted set the recipe emptied (Redis deletes an empty one).
    fn forget_if_empty(&mut self, key: &str) {
        let entry = self.model.get_mut(key.as_bytes()).unwrap();
        let empty = match entry {
            Some(Value::Hash(fields)) => fields.is_empty(),
            Some(Value::ZSet(members)) => members.is_empty(),
            _ => false,
        };
        if empty {
            *entry = None;
            self.deadlines.remove(key.as_bytes());
        }
    }

    fn hset(&mut self, key: &str, pairs: &[(&str, Vec<u8>)]) {
        let mut args: Vec<&[u8]> = vec![b"HSET", key.as_bytes()];
        for (field, value) in pairs {
            args.push(field.as_bytes());
            args.push(value);
        }
        let reply = self.client.integer(&args);
        let fields = self.hash(key);
        let mut added = 0;
        for (field, value) in pairs {
            added += i64::from(fields.insert(field.as_bytes().to_vec(), value.clone()).is_none());
        }
        assert_eq!(reply, added, "HSET {key}: fields added");
    }

    fn hdel(&mut self, key: &str, names: &[&str]) {
        let mut args: Vec<&[u8]> = vec![b"HDEL", key.as_bytes()];
        args.extend(names.iter().map(|field| field.as_bytes()));
        let reply = self.client.integer(&args);
        let fields = self.hash(key);
        let removed = names.iter().filter(|field| fields.remove(field.as_bytes()).is_some());
        assert_eq!(reply, removed.count() as i64, "HDEL {key}: fields removed");
        self.forget_if_empty(key);
    }

    /// ZADD with scores as text (the model parses them as the server does).
    fn zadd(&mut self, key: &str, pairs: &[(&str, &str)]) {
        let mut args: Vec<&[u8]> = vec![b"ZADD", key.as_bytes()];
        for (score, member) in pairs {
            args.push(score.as_bytes());
            args.push(member.as_bytes());
        }
        let reply = self.client.integer(&args);
        let members = self.zset(key);
        let mut added = 0;
        for (score, member) in pairs {
            let score: f64 = score.parse().unwrap();
            added += i64::from(members.insert(member.as_bytes().to_vec(), score).is_none());
        }
        assert_eq!(reply, added, "ZADD {key}: members added");
    }

    fn zrem(&mut self, key: &str, names: &[&str]) {
        let mut args: Vec<&[u8]> = vec![b"ZREM", key.as_bytes()];
        args.extend(names.iter().map(|member| member.as_bytes()));
        let reply = self.client.integer(&args);
        let members = self.zset(key);
        let removed = names.iter().filter(|member| members.remove(member.as_bytes()).is_some());
        assert_eq!(reply, removed.count() as i64, "ZREM {key}: members removed");
        self.forget_if_empty(key);
    }
}

fn string_key(i: usize) -> String {
    format!("str:{i:02}")
}

/// The length of string `i`'s write number `round`.
fn string_len(i: usize, round: usize) -> usize {
    if i == 7 {
        return LARGE_LEN;
    }
    VALUE_LENS[(i + round) % VALUE_LENS.len()]
}

/// Drives a server through `client` and returns what every touched key must read as.
fn write_recipe(client: Client) -> (Model, Deadlines) {
    let mut r = Recipe { client, model: Model::new(), deadlines: Deadlines::new() };

    // Strings: writes, overwrites in other size classes, a multi-key DEL across both shards,
    // keys deleted and written again, APPEND, INCR on integer strings.
    for i in 0..STRING_KEYS {
        r.set(&string_key(i), make_bytes(&format!("str-{i}-r0"), string_len(i, 0)));
    }
    for i in (0..STRING_KEYS).step_by(3) {
        r.set(&string_key(i), make_bytes(&format!("str-{i}-r1"), string_len(i, 1)));
    }
    let doomed: Vec<String> = (1..STRING_KEYS).step_by(5).map(string_key).collect();
    let mut doomed: Vec<&str> = doomed.iter().map(String::as_str).collect();
    doomed.push("never-written");
    r.del(&doomed);
    for i in (1..STRING_KEYS).step_by(10) {
        r.set(&string_key(i), make_bytes(&format!("str-{i}-r2"), string_len(i, 2)));
    }
    let appended = r.client.integer(&[b"APPEND", b"str:02", b"+tail"]);
    let Some(Some(Value::String(value))) = r.model.get_mut(&b"str:02"[..]) else {
        panic!("str:02 is a string")
    };
    value.extend_from_slice(b"+tail");
    assert_eq!(appended as usize, value.len(), "APPEND str:02");
    r.set("greeting", b"hello".to_vec());
    r.set("stra\u{df}e", "gr\u{fc}\u{df}e".as_bytes().to_vec());
    assert_eq!(r.client.integer(&[b"INCRBY", b"counter", b"40"]), 40);
    assert_eq!(r.client.integer(&[b"INCR", b"counter"]), 41);
    assert_eq!(r.client.integer(&[b"INCR", b"counter"]), 42);
    r.model.insert(b"counter".to_vec(), Some(Value::String(b"42".to_vec())));
    r.set("negative", b"-7".to_vec());
    assert_eq!(r.client.integer(&[b"INCR", b"negative"]), -6);
    r.model.insert(b"negative".to_vec(), Some(Value::String(b"-6".to_vec())));

    // Hashes: several fields at once, overwrites, HDEL of some, of all, DEL, SET over a hash.
    let small = |tag: &str| make_bytes(tag, VALUE_LENS[0]);
    r.hset("user:1", &[("name", b"ann".to_vec()), ("age", b"42".to_vec()), ("city", small("c"))]);
    r.hdel("user:1", &["age", "nosuch"]);
    r.hset("user:1", &[("name", b"bob".to_vec()), ("email", b"bob@x.io".to_vec())]);
    for j in 0..16 {
        let field = format!("f{j:02}");
        let value = make_bytes(&format!("hash-{j}"), VALUE_LENS[j % VALUE_LENS.len()]);
        r.hset("hash:big", &[(&field, value)]);
    }
    r.hset("hash:big", &[("f01", small("f01-again")), ("f02", small("f02-again"))]);
    r.hdel("hash:big", &["f03", "f07", "f11", "f15"]);
    r.hset("hash:emptied", &[("a", b"1".to_vec()), ("b", b"2".to_vec())]);
    r.hdel("hash:emptied", &["a", "b"]);
    r.hset("hash:deleted", &[("x", b"1".to_vec())]);
    r.del(&["hash:deleted"]);
    r.hset("hash:now-string", &[("f", b"v".to_vec()), ("g", b"w".to_vec())]);
    r.set("hash:now-string", b"now str".to_vec());

    // Sorted sets: negative, fractional, equal and infinite scores, updates, ZINCRBY, ZREM.
    // At most four members per ZADD here: a multi-item write first writes a batch record into
    // a slot of its own size, and a larger one would open another size class (a 1 MiB file).
    r.zadd("board", &[("2.5", "ann"), ("2.5", "bob"), ("2.5", "cat"), ("-1", "dan")]);
    r.zadd("board", &[("0.1", "eve"), ("-3.75", "fay"), ("1e15", "gus"), ("inf", "hal")]);
    r.zadd("board", &[("-inf", "ivy"), ("0", "jo"), ("-0.5", "kim")]);
    r.zrem("board", &["cat", "gus", "nosuch"]);
    r.zadd("board", &[("7", "bob"), ("-1", "lee")]);
    let eve = r.client.bulk(&[b"ZINCRBY", b"board", b"0.2", b"eve"]).unwrap();
    let score = 0.1 + 0.2;
    assert_eq!(parse_score(&eve), score, "ZINCRBY board 0.2 eve");
    r.zset("board").insert(b"eve".to_vec(), score);
    let ranks: Vec<(String, String)> =
        (0..24i64).map(|i| (format!("{}", i % 4 - 1), format!("m{i:02}"))).collect();
    let ranks: Vec<(&str, &str)> = ranks.iter().map(|(s, m)| (s.as_str(), m.as_str())).collect();
    r.zadd("zset:ranks", &ranks);
    r.zrem("zset:ranks", &["m05", "m10", "m15", "m20"]);
    r.zadd("zset:emptied", &[("1", "a"), ("2", "b")]);
    r.zrem("zset:emptied", &["a", "b"]);
    r.zadd("zset:deleted", &[("1", "a")]);
    r.del(&["zset:deleted"]);

    // Expiry (key space version 3): deadlines far ahead on every type, one already past (the
    // key is gone), one removed by PERSIST, one kept by KEEPTTL, one dropped by a plain SET.
    // 2100-01-01 00:00 UTC, give or take a few milliseconds.
    const FAR: u64 = 4_102_444_800_000;
    r.set("exp:str", b"expires".to_vec());
    r.pexpireat("exp:str", FAR + 123);
    r.hset("exp:hash", &[("f", b"v".to_vec()), ("g", b"w".to_vec())]);
    r.pexpireat("exp:hash", FAR + 456);
    r.zadd("exp:zset", &[("1", "a"), ("2", "b")]);
    r.pexpireat("exp:zset", FAR);
    r.zadd("exp:zset", &[("3", "c")]);
    r.set("exp:gone", b"gone".to_vec());
    r.pexpireat("exp:gone", 1_000);
    r.hset("exp:gone-hash", &[("f", b"v".to_vec())]);
    r.pexpireat("exp:gone-hash", 1_000);
    r.set("exp:persisted", b"stays".to_vec());
    r.pexpireat("exp:persisted", FAR);
    assert_eq!(r.client.integer(&[b"PERSIST", b"exp:persisted"]), 1);
    r.deadlines.remove(&b"exp:persisted"[..]);
    r.set("exp:keepttl", b"first".to_vec());
    r.pexpireat("exp:keepttl", FAR + 789);
    r.client.ok(&[b"SET", b"exp:keepttl", b"second", b"KEEPTTL"]);
    r.model.insert(b"exp:keepttl".to_vec(), Some(Value::String(b"second".to_vec())));
    r.set("exp:cleared", b"first".to_vec());
    r.pexpireat("exp:cleared", FAR);
    r.set("exp:cleared", b"second".to_vec());

    // Lists (key space version 4): pushes at both ends, pops, LSET, LINSERT, LREM, LTRIM, a
    // list emptied, one deleted, one moved element by element, one with a deadline.
    let mut queue: Vec<Vec<u8>> = Vec::new();
    for i in 0..6 {
        let element = make_bytes(&format!("list-{i}"), VALUE_LENS[i % VALUE_LENS.len()]);
        let (command, at_front): (&[u8], bool) =
            if i % 2 == 0 { (b"RPUSH", false) } else { (b"LPUSH", true) };
        r.client.integer(&[command, b"list:q", &element]);
        if at_front {
            queue.insert(0, element);
        } else {
            queue.push(element);
        }
    }
    assert_eq!(r.client.bulk(&[b"LPOP", b"list:q"]).as_ref(), Some(&queue.remove(0)));
    assert_eq!(r.client.bulk(&[b"RPOP", b"list:q"]).as_ref(), queue.last());
    queue.pop();
    r.client.ok(&[b"LSET", b"list:q", b"1", b"set"]);
    queue[1] = b"set".to_vec();
    assert_eq!(r.client.integer(&[b"LINSERT", b"list:q", b"BEFORE", b"set", b"ins"]), 5);
    queue.insert(1, b"ins".to_vec());
    r.model.insert(b"list:q".to_vec(), Some(Value::List(queue)));
    r.client.integer(&[b"RPUSH", b"list:rem", b"a", b"b", b"a", b"c", b"a"]);
    assert_eq!(r.client.integer(&[b"LREM", b"list:rem", b"2", b"a"]), 2);
    r.client.ok(&[b"LTRIM", b"list:rem", b"0", b"1"]);
    r.model.insert(b"list:rem".to_vec(), Some(Value::List(vec![b"b".to_vec(), b"c".to_vec()])));
    r.client.integer(&[b"RPUSH", b"list:emptied", b"x"]);
    r.client.bulk(&[b"LPOP", b"list:emptied"]);
    r.model.insert(b"list:emptied".to_vec(), None);
    r.client.integer(&[b"RPUSH", b"list:deleted", b"x", b"y"]);
    r.model.insert(b"list:deleted".to_vec(), Some(Value::List(vec![b"x".to_vec(), b"y".to_vec()])));
    r.del(&["list:deleted"]);
    r.client.integer(&[b"RPUSH", b"list:from", b"1", b"2", b"3"]);
    for _ in 0..2 {
        r.client.bulk(&[b"LMOVE", b"list:from", b"list:to", b"LEFT", b"RIGHT"]);
    }
    r.model.insert(b"list:from".to_vec(), Some(Value::List(vec![b"3".to_vec()])));
    r.model.insert(b"list:to".to_vec(), Some(Value::List(vec![b"1".to_vec(), b"2".to_vec()])));
    r.client.integer(&[b"RPUSH", b"list:expiring", b"e"]);
    r.model.insert(b"list:expiring".to_vec(), Some(Value::List(vec![b"e".to_vec()])));
    r.pexpireat("list:expiring", FAR + 999);

    // Sets (key space version 5): adds, removes, a move across keys, a STORE, a set emptied by
    // SPOP, one with a deadline.
    let set = |members: &[&str]| -> Option<Value> {
        Some(Value::Set(members.iter().map(|m| m.as_bytes().to_vec()).collect()))
    };
    assert_eq!(r.client.integer(&[b"SADD", b"set:a", b"x", b"y", b"z", b"w"]), 4);
    assert_eq!(r.client.integer(&[b"SREM", b"set:a", b"w", b"nosuch"]), 1);
    assert_eq!(r.client.integer(&[b"SADD", b"set:b", b"y", b"q"]), 2);
    assert_eq!(r.client.integer(&[b"SMOVE", b"set:a", b"set:b", b"x"]), 1);
    r.model.insert(b"set:a".to_vec(), set(&["y", "z"]));
    r.model.insert(b"set:b".to_vec(), set(&["q", "x", "y"]));
    assert_eq!(r.client.integer(&[b"SINTERSTORE", b"set:inter", b"set:a", b"set:b"]), 1);
    r.model.insert(b"set:inter".to_vec(), set(&["y"]));
    r.client.integer(&[b"SADD", b"set:popped", b"only"]);
    assert_eq!(r.client.bulk(&[b"SPOP", b"set:popped"]), Some(b"only".to_vec()));
    r.model.insert(b"set:popped".to_vec(), None);
    r.client.integer(&[b"SADD", b"set:expiring", b"e"]);
    r.model.insert(b"set:expiring".to_vec(), set(&["e"]));
    r.pexpireat("set:expiring", FAR + 321);

    // Databases (key space version 6): keys of every type in database 2, one with a deadline, a
    // MOVE out of it and one out of database 0, a RENAME and a COPY ... DB; then two SWAPDBs
    // carry database 2 to database 4. Model keys of database D are named `dD:KEY`.
    select(&mut r.client, 2);
    r.client.ok(&[b"SET", b"k", b"two"]);
    assert_eq!(r.client.integer(&[b"HSET", b"h", b"f", b"v", b"g", b"w"]), 2);
    assert_eq!(r.client.integer(&[b"RPUSH", b"l", b"a", b"b"]), 2);
    assert_eq!(r.client.integer(&[b"SADD", b"s", b"m", b"n"]), 2);
    assert_eq!(r.client.integer(&[b"ZADD", b"z", b"1", b"a", b"-2.5", b"b"]), 2);
    let far = (FAR + 2).to_string();
    assert_eq!(r.client.integer(&[b"PEXPIREAT", b"h", far.as_bytes()]), 1);
    assert_eq!(r.client.integer(&[b"MOVE", b"k", b"5"]), 1);
    r.client.ok(&[b"RENAME", b"l", b"l2"]);
    assert_eq!(r.client.integer(&[b"COPY", b"s", b"s-copy", b"DB", b"7"]), 1);
    select(&mut r.client, 0);
    r.client.ok(&[b"SET", b"moved0", b"zero"]);
    assert_eq!(r.client.integer(&[b"MOVE", b"moved0", b"15"]), 1);
    r.client.ok(&[b"SWAPDB", b"2", b"9"]);
    r.client.ok(&[b"SWAPDB", b"9", b"4"]);
    let pairs = |items: &[(&str, &str)]| -> BTreeMap<Vec<u8>, Vec<u8>> {
        items.iter().map(|(a, b)| (a.as_bytes().to_vec(), b.as_bytes().to_vec())).collect()
    };
    let members = |items: &[&str]| -> BTreeSet<Vec<u8>> {
        items.iter().map(|m| m.as_bytes().to_vec()).collect()
    };
    let model = &mut r.model;
    model.insert(b"moved0".to_vec(), None);
    model.insert(b"d15:moved0".to_vec(), Some(Value::String(b"zero".to_vec())));
    model.insert(b"d5:k".to_vec(), Some(Value::String(b"two".to_vec())));
    model.insert(b"d2:k".to_vec(), None);
    model.insert(b"d4:k".to_vec(), None);
    model.insert(b"d4:h".to_vec(), Some(Value::Hash(pairs(&[("f", "v"), ("g", "w")]))));
    r.deadlines.insert(b"d4:h".to_vec(), FAR + 2);
    model.insert(b"d4:l".to_vec(), None);
    model.insert(b"d4:l2".to_vec(), Some(Value::List(vec![b"a".to_vec(), b"b".to_vec()])));
    model.insert(b"d4:s".to_vec(), Some(Value::Set(members(&["m", "n"]))));
    model.insert(b"d7:s-copy".to_vec(), Some(Value::Set(members(&["m", "n"]))));
    let scores = [(b"a".to_vec(), 1.0), (b"b".to_vec(), -2.5)].into_iter().collect();
    model.insert(b"d4:z".to_vec(), Some(Value::ZSet(scores)));
    model.insert(b"d9:h".to_vec(), None);

    // Long keys (key space version 7): a key of each type past the 1013 bytes kept inline, one
    // with a deadline, one deleted, renamed to and from a short key, moved and copied to
    // database 3, and a short key starting with the surrogate prefix. Model keys are named as
    // `expand_key` reads them.
    let long = |name: &str| expand_key(name.as_bytes());
    let (string, hash) = (long("%long:str:65536"), long("%long:hash:65537"));
    let (zset, list, set) =
        (long("%long:zset:65600"), long("%long:list:65601"), long("%long:set:66000"));
    r.client.ok(&[b"SET", &string, b"long value"]);
    assert_eq!(r.client.integer(&[b"HSET", &hash, b"f", b"v", b"g", &make_bytes("lh", 1_900)]), 2);
    assert_eq!(r.client.integer(&[b"ZADD", &zset, b"1", b"a", b"2.5", b"b"]), 2);
    assert_eq!(r.client.integer(&[b"RPUSH", &list, b"a", b"b", b"c"]), 3);
    assert_eq!(r.client.bulk(&[b"LPOP", &list]), Some(b"a".to_vec()));
    assert_eq!(r.client.integer(&[b"SADD", &set, b"x", b"y"]), 2);
    let far = (FAR + 7).to_string();
    assert_eq!(r.client.integer(&[b"PEXPIREAT", &hash, far.as_bytes()]), 1);
    let gone = long("%long:gone:65538");
    r.client.ok(&[b"SET", &gone, b"v"]);
    assert_eq!(r.client.integer(&[b"DEL", &gone]), 1);
    let (renamed_from, renamed_to) = (long("%long:from:65539"), long("%long:to:65540"));
    r.client.ok(&[b"SET", &renamed_from, b"first"]);
    r.client.ok(&[b"RENAME", &renamed_from, b"short-from-long"]);
    r.client.ok(&[b"SET", b"short-to-long", b"second"]);
    r.client.ok(&[b"RENAME", b"short-to-long", &renamed_to]);
    let prefixed = long("%prefix:abc");
    r.client.ok(&[b"SET", &prefixed, b"p"]);
    let (moved, in_three) = (long("%long:moved:65541"), long("%long:three:65542"));
    r.client.ok(&[b"SET", &moved, b"moved"]);
    assert_eq!(r.client.integer(&[b"MOVE", &moved, b"3"]), 1);
    assert_eq!(r.client.integer(&[b"COPY", &zset, &zset, b"DB", b"3"]), 1);
    select(&mut r.client, 3);
    assert_eq!(r.client.integer(&[b"HSET", &in_three, b"f", b"3"]), 1);
    let far3 = (FAR + 9).to_string();
    assert_eq!(r.client.integer(&[b"PEXPIREAT", &in_three, far3.as_bytes()]), 1);
    select(&mut r.client, 0);
    let text_pairs = |items: &[(&str, &[u8])]| -> BTreeMap<Vec<u8>, Vec<u8>> {
        items.iter().map(|(a, b)| (a.as_bytes().to_vec(), b.to_vec())).collect()
    };
    let zset_value: BTreeMap<Vec<u8>, f64> =
        [(b"a".to_vec(), 1.0), (b"b".to_vec(), 2.5)].into_iter().collect();
    let model = &mut r.model;
    model.insert(b"%long:str:65536".to_vec(), Some(Value::String(b"long value".to_vec())));
    let fields = text_pairs(&[("f", b"v"), ("g", &make_bytes("lh", 1_900))]);
    model.insert(b"%long:hash:65537".to_vec(), Some(Value::Hash(fields)));
    r.deadlines.insert(b"%long:hash:65537".to_vec(), FAR + 7);
    model.insert(b"%long:zset:65600".to_vec(), Some(Value::ZSet(zset_value.clone())));
    model.insert(b"d3:%long:zset:65600".to_vec(), Some(Value::ZSet(zset_value)));
    model.insert(
        b"%long:list:65601".to_vec(),
        Some(Value::List(vec![b"b".to_vec(), b"c".to_vec()])),
    );
    let members = [b"x".to_vec(), b"y".to_vec()].into_iter().collect();
    model.insert(b"%long:set:66000".to_vec(), Some(Value::Set(members)));
    model.insert(b"%long:gone:65538".to_vec(), None);
    model.insert(b"%long:from:65539".to_vec(), None);
    model.insert(b"short-from-long".to_vec(), Some(Value::String(b"first".to_vec())));
    model.insert(b"short-to-long".to_vec(), None);
    model.insert(b"%long:to:65540".to_vec(), Some(Value::String(b"second".to_vec())));
    model.insert(b"%prefix:abc".to_vec(), Some(Value::String(b"p".to_vec())));
    model.insert(b"%long:moved:65541".to_vec(), None);
    model.insert(b"d3:%long:moved:65541".to_vec(), Some(Value::String(b"moved".to_vec())));
    let three = text_pairs(&[("f", b"3")]);
    model.insert(b"d3:%long:three:65542".to_vec(), Some(Value::Hash(three)));
    r.deadlines.insert(b"d3:%long:three:65542".to_vec(), FAR + 9);

    (r.model, r.deadlines)
}

/// The Redis key a model key (a line of `contents.txt`) names, in its database: `%long:TAG:LEN`
/// is `long:TAG:` then the bytes 0, 1, ..., 255, 0, ... up to LEN bytes; `%prefix:TAIL` is the
/// surrogate prefix `ff c0 23 4e` then TAIL (key space version 7); any other name is itself.
/// Frozen: the contents of fixtures depend on it.
fn expand_key(name: &[u8]) -> Vec<u8> {
    if let Some(rest) = name.strip_prefix(b"%long:") {
        let rest = std::str::from_utf8(rest).expect("a long key's notation is text");
        let (tag, len) = rest.rsplit_once(':').expect("%long:TAG:LEN");
        let len: usize = len.parse().expect("%long:TAG:LEN");
        let mut key = format!("long:{tag}:").into_bytes();
        let mut byte = 0u8;
        while key.len() < len {
            key.push(byte);
            byte = byte.wrapping_add(1);
        }
        key.truncate(len);
        return key;
    }
    if let Some(tail) = name.strip_prefix(b"%prefix:") {
        let mut key = b"\xff\xc0#N".to_vec();
        key.extend_from_slice(tail);
        return key;
    }
    name.to_vec()
}

/// A key for messages: lossy text, long ones shortened.
fn shown_key(key: &[u8]) -> String {
    let text = String::from_utf8_lossy(&key[..key.len().min(40)]).into_owned();
    if key.len() > 40 {
        format!("{text}... ({} bytes)", key.len())
    } else {
        text
    }
}

// ---------------------------------------------------------------------------------------------
// Fixtures.

fn server_config(store: &Path, settings: &BTreeMap<String, String>) -> ServerConfig {
    ServerConfig {
        path: store.to_path_buf(),
        port: 0,
        threads: 1,
        shards: settings["shards"].parse().unwrap(),
        engine: settings["engine"].clone(),
        // Applies to a new store only: an existing one keeps its own (from its manifest).
        placement: settings["placement"].clone(),
        cache_mb: 8,
        ..ServerConfig::default()
    }
}

/// `name: value` lines of `fixture.txt`.
fn fixture_settings(dir: &Path) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(dir.join("fixture.txt")).unwrap();
    text.lines()
        .filter_map(|line| line.split_once(": "))
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// `contents.txt` as (key, its lines), in file order.
fn contents_by_key(fixture: &Path) -> Vec<(String, Vec<String>)> {
    let contents = std::fs::read_to_string(fixture.join("contents.txt")).unwrap();
    let mut keys: Vec<(String, Vec<String>)> = Vec::new();
    for line in contents.lines().filter(|line| !line.is_empty()) {
        let key = line.split(' ').next().unwrap();
        match keys.last_mut() {
            Some((last, lines)) if last == key => lines.push(line.to_string()),
            _ => keys.push((key.to_string(), vec![line.to_string()])),
        }
    }
    keys
}

/// Serves a copy of one fixture and checks every key of `contents.txt`, DBSIZE and SCAN.
/// Returns the number of keys checked.
fn verify_fixture(fixture: &Path) -> usize {
    let name = fixture.file_name().unwrap().to_string_lossy().to_string();
    let settings = fixture_settings(fixture);
    let copy = tempfile::tempdir().unwrap();
    let store = copy.path().join("store");
    copy_dir(&fixture.join("store"), &store);

    let report = check_store(&store, &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "fixture {name} does not check clean: {:#?}", report.problems);

    // Twice: the first open may upgrade the store to this build's key space format (a fixture
    // of an older version), the second opens what the upgrade left.
    let expected = contents_by_key(fixture);
    assert!(!expected.is_empty(), "fixture {name} lists no keys");
    for open in ["first", "second"] {
        check_served(&name, open, &store, &settings, &expected);
    }
    let report = check_store(&store, &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "fixture {name} after serving: {:#?}", report.problems);
    expected.len()
}

/// Starts a server on `store` and checks every key of `expected`, DBSIZE and SCAN.
fn check_served(
    name: &str,
    open: &str,
    store: &Path,
    settings: &BTreeMap<String, String>,
    expected: &[(String, Vec<String>)],
) {
    let running = copse_server::start(server_config(store, settings)).unwrap_or_else(|err| {
        panic!("fixture {name} ({open} open): the server does not start: {err}")
    });
    let mut client = Client::connect(running.local_addr);
    // Per database, its live keys (database 0 always checked).
    let mut live: BTreeMap<u8, BTreeSet<Vec<u8>>> = BTreeMap::from([(0, BTreeSet::new())]);
    for (key, lines) in expected {
        let (database, redis_key) = in_database(key.as_bytes());
        let redis_key = expand_key(redis_key);
        select(&mut client, database);
        let (value, deadline) = read_back(&mut client, &redis_key);
        let keys = live.entry(database).or_default();
        if value.is_some() {
            keys.insert(redis_key);
        }
        let got = describe(key.as_bytes(), &value, deadline);
        assert_eq!(
            &got, lines,
            "fixture {name} ({open} open): key {key} reads wrong (left: the server's answers, \
             right: contents.txt)"
        );
    }
    for (database, keys) in &live {
        select(&mut client, *database);
        let dbsize = client.integer(&[b"DBSIZE"]);
        assert_eq!(dbsize as usize, keys.len(), "fixture {name}: DBSIZE of db {database}");
        let scanned = scan_all(&mut client);
        let shown =
            |set: &BTreeSet<Vec<u8>>| set.iter().map(|key| shown_key(key)).collect::<Vec<_>>();
        assert!(
            scanned == *keys,
            "fixture {name}: SCAN of db {database} is not its live keys: {:?} against {:?}",
            shown(&scanned),
            shown(keys)
        );
    }
    drop(client);
    running.stop().unwrap_or_else(|err| panic!("fixture {name}: the server does not stop: {err}"));
}

#[test]
fn every_frozen_redis_fixture_serves_what_it_was_given() {
    let mut fixtures: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.join("fixture.txt").exists())
        .collect();
    fixtures.sort();
    assert!(!fixtures.is_empty(), "the frozen Redis fixtures are missing");
    for fixture in &fixtures {
        let keys = verify_fixture(fixture);
        println!("fixture {}: {keys} Redis keys read as frozen", fixture.display());
    }
}

/// Writes a new fixture (see the module header); ignored, run by hand.
#[test]
#[ignore]
fn freeze() {
    let name =
        std::env::var("COPSE_FREEZE_REDIS_FIXTURE").expect("COPSE_FREEZE_REDIS_FIXTURE=<name>");
    assert!(!name.is_empty() && !name.contains('/'), "a fixture name: {name:?}");
    let fixture = fixtures_dir().join(&name);
    assert!(!fixture.exists(), "{} exists: fixtures are never rewritten", fixture.display());
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .unwrap_or_default();
    let settings = format!(
        "engine: native\nshards: {FIXTURE_SHARDS}\nplacement: in-place\n\
         keyspace_version: {KEYSPACE_FORMAT_VERSION}\n\
         written_by: copse-server {} (commit {commit})\n",
        env!("CARGO_PKG_VERSION"),
    );
    std::fs::create_dir_all(&fixture).unwrap();
    std::fs::write(fixture.join("fixture.txt"), settings).unwrap();

    let running =
        copse_server::start(server_config(&fixture.join("store"), &fixture_settings(&fixture)))
            .unwrap();
    let (model, deadlines) = write_recipe(Client::connect(running.local_addr));
    running.stop().unwrap();

    let contents: Vec<String> = model
        .iter()
        .flat_map(|(key, value)| describe(key, value, deadlines.get(key).copied()))
        .collect();
    std::fs::write(fixture.join("contents.txt"), contents.join("\n") + "\n").unwrap();
    verify_fixture(&fixture);
}
