//! The server started in-process: it serves over a real socket, stops cleanly with every
//! acknowledged write durable, serves the metrics page, and refuses a store it did not write.
//! (Every command is tested with redis-py against the `copse serve` binary in tests/server/.)

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use copse_server::ServerConfig;

fn config(path: &std::path::Path) -> ServerConfig {
    ServerConfig {
        path: path.to_path_buf(),
        port: 0,
        shards: 2,
        threads: 2,
        cache_mb: 8,
        ..ServerConfig::default()
    }
}

/// Sends one command as a multibulk request and reads one reply line (and a bulk's body).
fn command(stream: &mut BufReader<TcpStream>, args: &[&[u8]]) -> String {
    let mut request = Vec::new();
    copse_server::resp::encode_request(args, &mut request);
    stream.get_mut().write_all(&request).unwrap();
    let mut line = String::new();
    stream.read_line(&mut line).unwrap();
    if let Some(length) = line.strip_prefix('$') {
        let length: i64 = length.trim().parse().unwrap();
        if length >= 0 {
            let mut body = vec![0; length as usize + 2];
            stream.read_exact(&mut body).unwrap();
            return String::from_utf8_lossy(&body[..length as usize]).into_owned();
        }
    }
    line.trim_end().to_string()
}

#[test]
fn writes_acknowledged_before_a_stop_are_there_after_a_restart() {
    writes_survive_a_restart(config);
}

/// The same with each shard on a thread of its own, and with more shards than network threads
/// (thread-per-core places shard i on thread i mod threads).
#[test]
fn writes_survive_a_restart_whatever_the_shards_run_on() {
    writes_survive_a_restart(|path| ServerConfig { thread_per_core: false, ..config(path) });
    writes_survive_a_restart(|path| ServerConfig { shards: 3, ..config(path) });
}

fn writes_survive_a_restart(config: impl Fn(&std::path::Path) -> ServerConfig) {
    let dir = tempfile::tempdir().unwrap();
    let running = copse_server::start(config(dir.path())).unwrap();
    let mut client = BufReader::new(TcpStream::connect(running.local_addr).unwrap());
    for i in 0..200 {
        let key = format!("key{i}");
        assert_eq!(command(&mut client, &[b"SET", key.as_bytes(), b"value"]), "+OK");
    }
    assert_eq!(command(&mut client, &[b"INCRBY", b"counter", b"41"]), ":41");
    running.stop().unwrap();

    let running = copse_server::start(config(dir.path())).unwrap();
    let mut client = BufReader::new(TcpStream::connect(running.local_addr).unwrap());
    assert_eq!(command(&mut client, &[b"GET", b"key199"]), "value");
    assert_eq!(command(&mut client, &[b"INCR", b"counter"]), ":42");
    assert_eq!(command(&mut client, &[b"DBSIZE"]), ":201");
    running.stop().unwrap();
}

#[test]
fn the_metrics_page_reports_the_counters() {
    let dir = tempfile::tempdir().unwrap();
    let mut settings = config(dir.path());
    // Any free port: bind one, release it, hand it over.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    settings.metrics_port = free;
    let running = copse_server::start(settings).unwrap();
    let mut client = BufReader::new(TcpStream::connect(running.local_addr).unwrap());
    assert_eq!(command(&mut client, &[b"SET", b"a", b"1"]), "+OK");
    let mut http = TcpStream::connect(running.metrics_addr.unwrap()).unwrap();
    http.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut page = String::new();
    http.read_to_string(&mut page).unwrap();
    assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
    let commands = page
        .lines()
        .find_map(|line| line.strip_prefix("copse_commands_processed_total "))
        .expect("commands counter")
        .parse::<f64>()
        .unwrap();
    assert!(commands >= 1.0, "{page}");
    assert!(page.contains("\ncopse_store_items "), "{page}");
    running.stop().unwrap();
}

#[test]
fn a_store_written_through_the_api_is_refused_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    {
        let options = copse::Options { shards: 2, show_progress: false, ..Default::default() };
        let db = copse::Db::open(dir.path(), options).unwrap();
        db.put(b"plain", b"item").unwrap();
        db.close().unwrap();
    }
    let err = copse_server::start(config(dir.path())).err().expect("refused");
    assert!(err.to_string().contains("did not write"), "{err}");
    let options = copse::Options { shards: 2, show_progress: false, ..Default::default() };
    let db = copse::Db::open(dir.path(), options).unwrap();
    assert_eq!(db.get(b"plain").unwrap().as_deref(), Some(&b"item"[..]));
    assert_eq!(db.stats().unwrap().items, 1, "no marker was added");
}
