//! The Prometheus text endpoint (`--metrics-port`): the INFO counters as metrics. It has no
//! password, so with protected mode on it answers loopback peers only (`access.rs`).
//!
//! Hand-written rather than built on an HTTP crate: it answers one fixed page to any GET, and
//! a 40-line responder is smaller than the dependency it would replace.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::access;
use crate::context::Server;

/// Bytes of request head read before answering (anything longer is answered all the same).
const REQUEST_HEAD_BYTES_MAX: usize = 8 * 1024;

pub async fn serve(server: Arc<Server>, listener: tokio::net::TcpListener) {
    loop {
        let Ok((mut stream, peer)) = listener.accept().await else { continue };
        let server = server.clone();
        tokio::spawn(async move {
            // No password guards this page: protected mode alone decides who may read it.
            let protected_mode = server.settings.protected_mode.load(Ordering::Relaxed);
            if access::refuses_metrics(protected_mode, peer.ip()) {
                let _ = stream.write_all(access::METRICS_DENIED.as_bytes()).await;
                return;
            }
            let mut head = Vec::with_capacity(1024);
            let mut buf = [0u8; 1024];
            while head.len() < REQUEST_HEAD_BYTES_MAX && !head.windows(4).any(|w| w == b"\r\n\r\n")
            {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let body = render(&server).await;
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        });
    }
}

/// The metrics page.
pub async fn render(server: &Server) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(
            out,
            "# HELP copse_{name} {help}\n# TYPE copse_{name} {kind}\ncopse_{name} {value}"
        );
    };
    let stats = &server.stats;
    metric(
        "uptime_seconds",
        "gauge",
        "Seconds since the server started.",
        server.started.elapsed().as_secs_f64(),
    );
    metric(
        "connected_clients",
        "gauge",
        "Open client connections.",
        stats.connected_clients.load(Ordering::Relaxed) as f64,
    );
    // Every one a counter: it only grows while the server runs.
    let counters = [
        ("connections_received_total", "Connections accepted.", &stats.connections_received),
        (
            "rejected_connections_total",
            "Connections refused by maxclients.",
            &stats.rejected_connections,
        ),
        ("commands_processed_total", "Commands handled.", &stats.commands),
        ("net_input_bytes_total", "Bytes read from clients.", &stats.net_input_bytes),
        ("net_output_bytes_total", "Bytes written to clients.", &stats.net_output_bytes),
        (
            "protocol_errors_total",
            "Connections closed for a protocol error.",
            &stats.protocol_errors,
        ),
    ];
    for (name, help, value) in counters {
        metric(name, "counter", help, value.load(Ordering::Relaxed) as f64);
    }
    if let Ok(store) = server.db.stats_async().await {
        let (reads, writes) = (store.device.reads, store.device.writes);
        metric(
            "store_items",
            "gauge",
            "Items in the store (meta items, fields and members).",
            store.items as f64,
        );
        metric(
            "store_file_bytes",
            "gauge",
            "Bytes of the store's slab files.",
            store.file_bytes as f64,
        );
        metric(
            "store_index_bytes",
            "gauge",
            "Estimated bytes of the in-memory indexes.",
            store.index_bytes as f64,
        );
        metric("cache_hit_ratio", "gauge", "Page cache hits over lookups.", store.cache_hit_rate);
        metric("device_reads_total", "counter", "Device reads issued by the shards.", reads as f64);
        metric(
            "device_writes_total",
            "counter",
            "Device writes issued by the shards.",
            writes as f64,
        );
    }
    let depth: usize = server.db.queue_depths().iter().sum();
    metric("shard_queue_depth", "gauge", "Messages waiting in shard queues.", depth as f64);
    out
}
