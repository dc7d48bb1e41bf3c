//! The upgrade of a key space of format 1 at open (`cmd/upgrade.rs`), on stores built item by
//! item through the embedded API in format 1's layout (one shard, so the API's routing and the
//! server's agree). The frozen fixture `tests/fixtures/redis-keyspace-v1` covers a real server's
//! store; these cover what it does not hold: keys whose format 2 items would meet another key's
//! format 1 items, and an element too long for format 2.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use copse_server::keyspace::{self, KeyType};
use copse_server::ServerConfig;

/// Format 1's marker value.
fn marker_v1() -> Vec<u8> {
    let mut value = keyspace::MARKER_MAGIC.to_vec();
    value.extend_from_slice(&1u32.to_le_bytes());
    value
}

/// A hash of format 1: its key, and (field, value) pairs.
type HashItems<'a> = (&'a [u8], Vec<(&'a [u8], &'a [u8])>);
/// A sorted set of format 1: its key, and (member, score) pairs.
type ZSetItems<'a> = (&'a [u8], Vec<(&'a [u8], f64)>);

fn options() -> copse::Options {
    copse::Options { shards: 1, ..copse::Options::default() }
}

/// Writes a format 1 store: hashes `(key, [(field, value)])` and sorted sets
/// `(key, [(member, score)])`. Format 1's element keys are format 2's with the Redis key in
/// place of the id.
fn write_v1_store(path: &Path, hashes: &[HashItems<'_>], zsets: &[ZSetItems<'_>]) {
    let db = copse::Db::open(path, options()).unwrap();
    db.put(keyspace::MARKER_KEY, &marker_v1()).unwrap();
    for (key, fields) in hashes {
        db.put(&keyspace::meta_key(key, KeyType::Hash), b"").unwrap();
        for (field, value) in fields {
            db.put(&keyspace::field_key(key, field), value).unwrap();
        }
    }
    for (key, members) in zsets {
        db.put(&keyspace::meta_key(key, KeyType::ZSet), b"").unwrap();
        for (member, score) in members {
            db.put(&keyspace::member_key(key, member), &keyspace::encode_score(*score)).unwrap();
            db.put(&keyspace::score_key(key, *score, member), b"").unwrap();
        }
    }
    db.close().unwrap();
}

fn config(path: &Path) -> ServerConfig {
    ServerConfig {
        path: path.to_path_buf(),
        port: 0,
        threads: 1,
        shards: 1,
        cache_mb: 8,
        ..ServerConfig::default()
    }
}

/// Sends one command and returns the raw reply lines up to `lines`.
fn ask(stream: &mut BufReader<TcpStream>, args: &[&[u8]], lines: usize) -> Vec<String> {
    let mut request = Vec::new();
    copse_server::resp::encode_request(args, &mut request);
    stream.get_mut().write_all(&request).unwrap();
    (0..lines)
        .map(|_| {
            let mut line = String::new();
            stream.read_line(&mut line).unwrap();
            line.trim_end().to_string()
        })
        .collect()
}

#[test]
fn keys_whose_new_items_would_meet_older_ones_upgrade_apart() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    // Format 2's items of "a" at version 0 have the bytes of format 1's items of "a" ++ 00×8.
    let long: &[u8] = b"a\0\0\0\0\0\0\0\0";
    write_v1_store(
        &store,
        &[
            (b"a", vec![(b"f", b"short"), (b"g", b"1")]),
            (long, vec![(b"f", b"long"), (b"h", b"2")]),
        ],
        &[(b"z", vec![(b"m", 1.0), (b"n", 2.0)]), (b"z\0\0\0\0\0\0\0\0", vec![(b"m", 5.0)])],
    );
    for open in 0..2 {
        let running = copse_server::start(config(&store)).unwrap();
        let stream = TcpStream::connect(running.local_addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut stream = BufReader::new(stream);
        assert_eq!(ask(&mut stream, &[b"HLEN", b"a"], 1), [":2"], "open {open}");
        assert_eq!(ask(&mut stream, &[b"HGET", b"a", b"f"], 2), ["$5", "short"]);
        assert_eq!(ask(&mut stream, &[b"HGET", b"a", b"h"], 1), ["$-1"]);
        assert_eq!(ask(&mut stream, &[b"HLEN", long], 1), [":2"]);
        assert_eq!(ask(&mut stream, &[b"HGET", long, b"f"], 2), ["$4", "long"]);
        assert_eq!(ask(&mut stream, &[b"HGET", long, b"g"], 1), ["$-1"]);
        assert_eq!(ask(&mut stream, &[b"ZCARD", b"z"], 1), [":2"]);
        assert_eq!(
            ask(&mut stream, &[b"ZRANGE", b"z", b"0", b"-1", b"WITHSCORES"], 9),
            ["*4", "$1", "m", "$1", "1", "$1", "n", "$1", "2"]
        );
        assert_eq!(
            ask(&mut stream, &[b"ZRANGE", b"z\0\0\0\0\0\0\0\0", b"0", b"-1", b"WITHSCORES"], 5),
            ["*2", "$1", "m", "$1", "5"]
        );
        drop(stream);
        running.stop().unwrap();
    }
}

#[test]
fn an_element_too_long_for_format_2_refuses_the_store_before_any_write() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let field = vec![b'f'; copse::limits::KEY_BYTES_MAX - 13 - 1];
    write_v1_store(&store, &[(b"ok", vec![(b"x", b"1")]), (b"k", vec![(&field[..], b"v")])], &[]);
    let error = copse_server::start(config(&store)).err().expect("the store is refused");
    assert!(error.to_string().contains("too long for key space format 2"), "{error}");
    // Nothing was written: the store still reads as format 1, item for item.
    let db = copse::Db::open(&store, options()).unwrap();
    assert_eq!(db.get(keyspace::MARKER_KEY).unwrap(), Some(marker_v1()));
    assert_eq!(db.get(&keyspace::meta_key(b"ok", KeyType::Hash)).unwrap(), Some(Vec::new()));
    assert_eq!(db.get(&keyspace::field_key(b"ok", b"x")).unwrap(), Some(b"1".to_vec()));
    db.close().unwrap();
}

/// A marker of format `version`.
fn marker(version: u32) -> Vec<u8> {
    let mut value = keyspace::MARKER_MAGIC.to_vec();
    value.extend_from_slice(&version.to_le_bytes());
    value
}

/// Writes a format 6 store of strings `(namespace, key, value)`.
fn write_v6_store(path: &Path, strings: &[(u8, &[u8], &[u8])]) {
    let db = copse::Db::open(path, options()).unwrap();
    db.put(keyspace::MARKER_KEY, &marker(6)).unwrap();
    for (namespace, key, value) in strings {
        let mut item = if *namespace > 0 { vec![*namespace] } else { Vec::new() };
        item.extend_from_slice(&keyspace::meta_key(key, KeyType::String));
        db.put(&item, value).unwrap();
    }
    db.close().unwrap();
}

/// Format 7 keeps every key of a format 6 store under the same name (the longest, 1013 bytes
/// outside database 0, included): the upgrade rewrites the marker only, and long keys work.
#[test]
fn a_format_6_store_is_upgraded_by_its_marker_when_no_key_changes_name() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let longest = vec![b'k'; keyspace::NAME_INLINE_BYTES_MAX];
    write_v6_store(&store, &[(0, b"plain", b"1"), (4, &longest, b"2"), (4, b"\xff\xc0#", b"3")]);
    for open in 0..2 {
        let running = copse_server::start(config(&store)).unwrap();
        let stream = TcpStream::connect(running.local_addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut stream = BufReader::new(stream);
        assert_eq!(ask(&mut stream, &[b"GET", b"plain"], 2), ["$1", "1"], "open {open}");
        assert_eq!(ask(&mut stream, &[b"SELECT", b"4"], 1), ["+OK"]);
        assert_eq!(ask(&mut stream, &[b"GET", &longest], 2), ["$1", "2"]);
        assert_eq!(ask(&mut stream, &[b"GET", b"\xff\xc0#"], 2), ["$1", "3"]);
        let long = vec![b'L'; 70_000];
        assert_eq!(ask(&mut stream, &[b"SET", &long, b"v"], 1), ["+OK"]);
        assert_eq!(ask(&mut stream, &[b"DBSIZE"], 1), [":3"]);
        drop(stream);
        running.stop().unwrap();
    }
    let db = copse::Db::open(&store, options()).unwrap();
    assert_eq!(db.get(keyspace::MARKER_KEY).unwrap(), Some(keyspace::marker_value()));
    db.close().unwrap();
}

/// A key that starts with the surrogate prefix would be looked up under another name by format
/// 7: the store is refused, naming the key and what to do, and nothing is written.
#[test]
fn a_format_6_store_with_a_key_starting_with_the_surrogate_prefix_is_refused_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let prefixed = b"\xff\xc0#Nuser:1";
    write_v6_store(&store, &[(0, b"plain", b"1"), (9, prefixed, b"2")]);
    let error = copse_server::start(config(&store)).err().expect("the store is refused");
    let text = error.to_string();
    assert!(text.contains(r"\xff\xc0#Nuser:1"), "{text}");
    assert!(text.contains("namespace 9") && text.contains("RENAME"), "{text}");
    let db = copse::Db::open(&store, options()).unwrap();
    assert_eq!(db.get(keyspace::MARKER_KEY).unwrap(), Some(marker(6)));
    let mut item = vec![9];
    item.extend_from_slice(&keyspace::meta_key(prefixed, KeyType::String));
    assert_eq!(db.get(&item).unwrap(), Some(b"2".to_vec()));
    db.close().unwrap();
}

/// Format 6 allowed 1014-byte keys in database 0, one byte past format 7's inline names: format
/// 7 would look such a key up under its surrogate, list it and never find it (a review's
/// upgraded store showed it in KEYS, answered GET with nil and DEL with 0). The store is
/// refused, naming the key, and nothing is written.
#[test]
fn a_format_6_store_with_a_1014_byte_key_in_database_0_is_refused_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let long = vec![b'q'; keyspace::NAME_INLINE_BYTES_MAX + 1];
    write_v6_store(&store, &[(0, b"plain", b"1"), (0, &long, b"2")]);
    let error = copse_server::start(config(&store)).err().expect("the store is refused");
    let text = error.to_string();
    assert!(text.contains("(1014 bytes, in namespace 0") && text.contains("RENAME"), "{text}");
    let db = copse::Db::open(&store, options()).unwrap();
    assert_eq!(db.get(keyspace::MARKER_KEY).unwrap(), Some(marker(6)));
    assert_eq!(db.get(&keyspace::meta_key(&long, KeyType::String)).unwrap(), Some(b"2".to_vec()));
    db.close().unwrap();
}
