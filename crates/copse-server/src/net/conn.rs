//! One client connection: read requests, hand them to the shards, write replies in order.
//!
//! The connection works in waves. It parses every complete request it has read (up to
//! `PIPELINE_COMMANDS_MAX`), gathers each command's execs per shard in request order and sends
//! each shard its share as one message (so a pipeline reaches the shards together, crossing to
//! each once, and they batch it), then awaits the answers in request
//! order and writes them. Commands over the whole key space (SCAN, KEYS, FLUSHALL, ...) first
//! wait for the answers of every earlier command, so they see its effects.
//!
//! Invariants:
//! - Replies go out in request order, each encoded in the protocol in force when its command
//!   was handled (HELLO switches it for the commands after it).
//! - A command's execs are queued before any later command's, so commands on one key run in the
//!   order the client sent them (each shard's queue is FIFO and its lock queues keep arrival
//!   order).
//! - A protocol error answers `-ERR Protocol error: ...` after the replies of the requests before
//!   it, then closes: the stream cannot be trusted past it.
//! - Memory per connection is bounded: input by `client_query_buffer_bytes_max` (and before
//!   AUTH by the parser's unauthenticated limits); replies by `client_pending_reply_bytes_max`:
//!   each command reserves the most its reply can be before its execs are queued, and a
//!   command that does not fit waits for the replies before it to be written (backpressure: a
//!   client that does not read stops being read and served); one reply by
//!   `client_output_bytes_max` (MGET refuses a larger one as it reads; any other larger reply
//!   closes the connection).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::access;
use copse::exec::ExecRequest;

use crate::cmd::{
    answered, collect, dispatch, Combine, Dispatched, Execs, Outcome, Queued, ReplySize,
};
use crate::config::{
    CLIENT_INPUT_CHUNK_BYTES, INLINE_BYTES_MAX, MULTIBULK_ARGS_MAX, PIPELINE_COMMANDS_MAX,
    UNAUTHENTICATED_ARGS_MAX, UNAUTHENTICATED_BULK_BYTES_MAX,
};
use crate::context::{ConnState, Server, IDLE_EPOCH};
use crate::resp::parse::UnauthenticatedLimits;
use crate::resp::{
    encode_reply, parse_command_resumed, ParseLimits, ParseState, Parsed, Protocol, Reply,
};

/// Bytes of encoded replies gathered before they are written out.
const WRITE_CHUNK_BYTES: usize = 64 * 1024;
/// How long a shutdown waits for a client to take its replies before dropping it.
const SHUTDOWN_WRITE_GRACE_MS: u64 = 2_000;
/// The last words to a client being closed (an error, a refusal) get this long to be written:
/// a client that does not read must not hold its task, its descriptor or a shutdown.
const FINAL_REPLY_WRITE_MS: u64 = 1_000;

/// Commands a connection's wave lists keep room for between waves (`connection_loop`).
const WAVE_COMMANDS_KEPT: usize = 64;

/// A reply on its way, in request order.
enum Slot {
    Ready(Reply),
    WaitingOne(futures::channel::oneshot::Receiver<Reply>),
    Waiting(Vec<futures::channel::oneshot::Receiver<Reply>>, Combine),
}

/// Why a connection ends.
enum End {
    /// The client closed, QUIT, or the server is shutting down.
    Done,
    /// An error to write before closing (protocol error, output limit).
    Error(String),
}

pub async fn run(
    server: Arc<Server>,
    stream: std::net::TcpStream,
    shutdown: watch::Receiver<bool>,
) {
    let connected = server.stats.connected_clients.fetch_add(1, Ordering::AcqRel) + 1;
    let result = serve(&server, stream, shutdown, connected).await;
    server.stats.connected_clients.fetch_sub(1, Ordering::AcqRel);
    if let Err(err) = result {
        tracing::debug!(%err, "connection ended with an I/O error");
    }
}

async fn serve(
    server: &Arc<Server>,
    stream: std::net::TcpStream,
    mut shutdown: watch::Receiver<bool>,
    connected: usize,
) -> std::io::Result<()> {
    stream.set_nonblocking(true)?;
    let mut stream = TcpStream::from_std(stream)?;
    stream.set_nodelay(true)?;
    if connected > server.settings.maxclients.load(Ordering::Relaxed) {
        server.stats.rejected_connections.fetch_add(1, Ordering::Relaxed);
        write_final(&mut stream, b"-ERR max number of clients reached\r\n").await;
        return Ok(());
    }
    let peer = stream.peer_addr()?;
    let protected_mode = server.settings.protected_mode.load(Ordering::Relaxed);
    if access::refuses_client(protected_mode, !server.requirepass().is_empty(), peer.ip()) {
        server.stats.rejected_connections.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%peer, "protected mode: refusing a client from outside loopback");
        write_final(&mut stream, access::PROTECTED_MODE_DENIED.as_bytes()).await;
        return Ok(());
    }
    let addr = peer.to_string();
    let laddr = stream.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let info = server.register_client(addr, laddr);
    let id = info.id;
    let mut conn = ConnState::new(info, server.requirepass().is_empty());
    let result = connection_loop(server, &mut stream, &mut conn, &mut shutdown).await;
    if let Some(mut subscriber) = conn.subscriber.take() {
        server.pubsub.unsubscribe_all(&mut subscriber);
    }
    server.unregister_client(id);
    match result {
        Ok(End::Done) => Ok(()),
        Ok(End::Error(text)) => {
            let mut out = Vec::new();
            encode_reply(&Reply::Error(text), conn.protocol, &mut out);
            write_final(&mut stream, &out).await;
            Ok(())
        }
        Err(err) => Err(err),
    }
}

async fn connection_loop(
    server: &Arc<Server>,
    stream: &mut TcpStream,
    conn: &mut ConnState,
    shutdown: &mut watch::Receiver<bool>,
) -> std::io::Result<End> {
    let mut input: Vec<u8> = Vec::with_capacity(16 * 1024);
    let mut out: Vec<u8> = Vec::with_capacity(16 * 1024);
    // When the connection last became unauthenticated (at connect, or by RESET).
    let mut unauthenticated_since: Option<Instant> = None;
    // Where the parse of a request that is still arriving stopped.
    let mut parse_state = ParseState::default();
    let auth_timeout_secs = server.config.auth_timeout_secs;
    // Kept from wave to wave, so that a wave allocates none of its bookkeeping.
    let mut wave = Vec::new();
    let mut pending = Pending { slots: VecDeque::new(), reserved_bytes: 0 };
    let mut outbox = Outbox::new(server.db.shard_count());
    loop {
        if conn.info.killed.load(Ordering::Acquire) {
            return Ok(End::Done);
        }
        let authenticated_before = conn.authenticated;
        if conn.authenticated {
            unauthenticated_since = None;
        } else {
            let since = *unauthenticated_since.get_or_insert_with(Instant::now);
            if auth_timeout_secs > 0 && since.elapsed() >= Duration::from_secs(auth_timeout_secs) {
                return Ok(End::Error(auth_timeout_error(auth_timeout_secs)));
            }
        }
        // Read until at least one complete request is buffered.
        let limits = ParseLimits {
            multibulk_len_max: MULTIBULK_ARGS_MAX,
            bulk_bytes_max: server.settings.proto_max_bulk_len.load(Ordering::Relaxed),
            inline_bytes_max: INLINE_BYTES_MAX,
            unauthenticated: (!conn.authenticated).then_some(UnauthenticatedLimits {
                multibulk_len_max: UNAUTHENTICATED_ARGS_MAX,
                bulk_bytes_max: UNAUTHENTICATED_BULK_BYTES_MAX,
            }),
        };
        let mut consumed_total = 0;
        let mut protocol_error = None;
        loop {
            match parse_command_resumed(&input[consumed_total..], &limits, &mut parse_state) {
                Ok(Parsed::Command { args, consumed }) => {
                    consumed_total += consumed;
                    wave.push(args);
                    // Until AUTH has run, the next request is parsed only after it, under the
                    // limits its outcome decides (a pipelined AUTH then SET of a large value).
                    if wave.len() >= PIPELINE_COMMANDS_MAX || limits.unauthenticated.is_some() {
                        break;
                    }
                }
                Ok(Parsed::Skip { consumed }) => consumed_total += consumed,
                Ok(Parsed::Incomplete) => break,
                Err(err) => {
                    server.stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    protocol_error = Some(format!("ERR {err}"));
                    break;
                }
            }
        }
        input.drain(..consumed_total);
        let examined_bytes = parse_state.take_examined_bytes();
        server.stats.parser_examined_bytes.fetch_add(examined_bytes, Ordering::Relaxed);
        if wave.is_empty() && protocol_error.is_none() {
            if *shutdown.borrow() {
                return Ok(End::Done);
            }
            // Only an incomplete request is buffered here: it may not grow past the limit.
            let query_buffer_max = server.config.client_query_buffer_bytes_max;
            if input.len() >= query_buffer_max {
                server.stats.query_buffer_closes.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    client = conn.info.id,
                    bytes = input.len(),
                    limit = query_buffer_max,
                    "closing a client whose request exceeds the query buffer limit"
                );
                return Ok(End::Error(format!(
                    "ERR Protocol error: request exceeds the client query buffer limit ({query_buffer_max} bytes)"
                )));
            }
            let timeout_secs = server.settings.timeout_secs.load(Ordering::Relaxed);
            input.reserve(CLIENT_INPUT_CHUNK_BYTES);
            let subscribed = conn.subscriber.is_some();
            let read = tokio::select! {
                read = stream.read_buf(&mut input) => read?,
                frame = next_frame(&mut conn.subscriber), if subscribed => {
                    // A published message: written with any others already waiting.
                    let mut frames = Vec::new();
                    if !take_frames(conn, Some(frame), &mut frames) {
                        return Ok(End::Done);
                    }
                    let mailbox = conn.subscriber.as_ref().map(|sub| sub.mailbox.clone());
                    let mut writer = Writer { stream, deadline: None };
                    if !write_unless_closed(server, &mut writer, &mut frames, shutdown, mailbox).await? {
                        return Ok(End::Done);
                    }
                    continue;
                }
                _ = shutdown.changed() => return Ok(End::Done),
                _ = conn.info.kill.notified() => return Ok(End::Done),
                _ = idle(timeout_secs) => {
                    tracing::debug!(client = conn.info.id, "closing an idle client");
                    return Ok(End::Done);
                }
                _ = auth_deadline(unauthenticated_since, auth_timeout_secs) => {
                    tracing::debug!(client = conn.info.id, "closing a client that did not authenticate");
                    return Ok(End::Error(auth_timeout_error(auth_timeout_secs)));
                }
            };
            if read == 0 {
                return Ok(End::Done);
            }
            server.stats.net_input_bytes.fetch_add(read as u64, Ordering::Relaxed);
            conn.info
                .last_active_ms
                .store(server.started.elapsed().as_millis() as u64, Ordering::Relaxed);
            continue;
        }
        // Until AUTH, replies are written against the same deadline as reads: a client that sends
        // without ever reading must not outlive it by filling its socket.
        let write_deadline = auth_deadline_at(unauthenticated_since, auth_timeout_secs);
        let writer = &mut Writer { stream, deadline: write_deadline };
        assert!(pending.slots.is_empty() && pending.reserved_bytes == 0, "a wave left replies");
        // SWAPDB waits for waves started under the map it replaces (`databases.rs`).
        conn.info.busy_epoch.store(server.databases.epoch(), Ordering::SeqCst);
        let mut close = false;
        for args in wave.drain(..) {
            // A subscriber's messages go out between replies in the order they came, before
            // the reply of a command that may end the subscription (RESP2 clients read a frame
            // after UNSUBSCRIBE as the next reply otherwise).
            if conn.subscriber.is_some() && !mailbox_into_pending(conn, &mut pending) {
                close = true;
                break;
            }
            let Dispatched { outcome, reply_size, blocking, holds_no_map } =
                dispatch(server, conn, args);
            let protocol = conn.take_reply_sent().then_some(conn.protocol);
            match outcome {
                Outcome::Reply(reply) => pending.push(Slot::Ready(reply), protocol, 0),
                Outcome::Execs(execs) => {
                    let room = make_room(
                        server,
                        writer,
                        &mut pending,
                        &mut out,
                        shutdown,
                        &mut outbox,
                        reply_size,
                    );
                    let reply_bytes_reserved = match room.await? {
                        Ok(reserved) => reserved,
                        Err(end) => return Ok(end),
                    };
                    let slot = outbox.queue(execs);
                    pending.push(slot, protocol, reply_bytes_reserved);
                }
                Outcome::AfterPending(future) => {
                    // Everything before it is answered first, so it sees those effects.
                    outbox.send(server).await;
                    if let Some(end) =
                        drain(server, writer, &mut pending, &mut out, shutdown, Drain::All).await?
                    {
                        return Ok(end);
                    }
                    if !blocking {
                        // Everything before it is answered: a SWAPDB's wait holds no map.
                        if holds_no_map {
                            conn.info.busy_epoch.store(IDLE_EPOCH, Ordering::SeqCst);
                        }
                        let reply = future.await;
                        if holds_no_map {
                            conn.info.busy_epoch.store(server.databases.epoch(), Ordering::SeqCst);
                        }
                        pending.push(Slot::Ready(reply), protocol, 0);
                        continue;
                    }
                    // A blocking command (BLPOP) may wait long: the replies before it go out
                    // first, and meanwhile the connection is watched, so a client that goes
                    // away, or a shutdown, drops the command (and its place among the blocked
                    // clients). Bytes that arrive are kept for the next wave, up to the query
                    // buffer limit.
                    write_out(server, writer, &mut out, shutdown).await?;
                    if *shutdown.borrow() {
                        return Ok(End::Done);
                    }
                    // Waiting, it holds no map (`InDatabase` reads it at each poll): SWAPDB does
                    // not wait for it.
                    conn.info.busy_epoch.store(IDLE_EPOCH, Ordering::SeqCst);
                    let mut future = future;
                    let query_buffer_max = server.config.client_query_buffer_bytes_max;
                    let reply = loop {
                        let room = input.len() < query_buffer_max;
                        tokio::select! {
                            reply = &mut future => break reply,
                            read = writer.stream.read_buf(&mut input), if room => match read {
                                Ok(0) | Err(_) => return Ok(End::Done),
                                Ok(read) => {
                                    server.stats.net_input_bytes.fetch_add(read as u64, Ordering::Relaxed);
                                }
                            },
                            _ = shutdown.changed() => return Ok(End::Done),
                        }
                    };
                    pending.push(Slot::Ready(reply), protocol, 0);
                    conn.info.busy_epoch.store(server.databases.epoch(), Ordering::SeqCst);
                }
                Outcome::Close(reply) => {
                    pending.push(Slot::Ready(reply), protocol, 0);
                    close = true;
                    break;
                }
            }
        }
        outbox.send(server).await;
        if let Some(end) =
            drain(server, writer, &mut pending, &mut out, shutdown, Drain::All).await?
        {
            return Ok(end);
        }
        conn.info.busy_epoch.store(IDLE_EPOCH, Ordering::SeqCst);
        // Messages published meanwhile go out after the wave's replies.
        if conn.subscriber.is_some() {
            let open = take_frames(conn, None, &mut out);
            let mailbox = conn.subscriber.as_ref().map(|sub| sub.mailbox.clone());
            if !write_unless_closed(server, writer, &mut out, shutdown, mailbox).await? || !open {
                return Ok(End::Done);
            }
            if conn.subscriber.as_ref().is_some_and(|subscriber| subscriber.is_empty()) {
                conn.subscriber = None;
            }
        }
        write_out(server, writer, &mut out, shutdown).await?;
        // A deep pipeline's lists shrink back: an idle connection keeps a few KiB, not the most
        // a wave ever needed.
        wave.shrink_to(WAVE_COMMANDS_KEPT);
        pending.slots.shrink_to(WAVE_COMMANDS_KEPT);
        if close {
            return Ok(End::Done);
        }
        if let Some(text) = protocol_error {
            return Ok(End::Error(text));
        }
        if conn.authenticated != authenticated_before {
            // A request still arriving was parsed so far under the other state's limits (RESET
            // then a large request): parse it again from its start under the new ones.
            parse_state = ParseState::default();
        }
    }
}

/// Backpressure: a command runs only once the replies before it leave room for the most its own
/// can be, so a client that does not read makes the server hold at most the budget (or one
/// command's reply) for it. The bound on values is read again after each wait: a write queued
/// meanwhile may have raised it. Returns the bytes reserved, or how the connection ends.
async fn make_room(
    server: &Server,
    writer: &mut Writer<'_>,
    pending: &mut Pending,
    out: &mut Vec<u8>,
    shutdown: &mut watch::Receiver<bool>,
    outbox: &mut Outbox,
    reply_size: ReplySize,
) -> std::io::Result<Result<usize, End>> {
    let budget = server.config.client_pending_reply_bytes_max;
    loop {
        let reserved = reply_size.reserved_bytes(
            server.value_bytes_bound.load(Ordering::Acquire),
            server.settings.client_output_bytes_max.load(Ordering::Relaxed),
        );
        let keep = budget.saturating_sub(reserved);
        if pending.reserved_bytes <= keep {
            return Ok(Ok(reserved));
        }
        server.stats.reply_backpressure_waits.fetch_add(1, Ordering::Relaxed);
        outbox.send(server).await;
        let until = Drain::UntilReserved(keep);
        if let Some(end) = drain(server, writer, pending, out, shutdown, until).await? {
            return Ok(Err(end));
        }
    }
}

/// The execs of a wave not yet sent, per shard, in the order their commands were dispatched.
/// They go out together, one message per shard (`Db::exec_many_async`), before the connection
/// waits for any answer: a wave of pipelined commands crosses to each shard once, not once per
/// command, and each shard still sees the connection's execs in request order.
struct Outbox {
    by_shard: Vec<Vec<ExecRequest>>,
}

impl Outbox {
    fn new(shards: u32) -> Outbox {
        Outbox { by_shard: (0..shards).map(|_| Vec::new()).collect() }
    }

    fn push(&mut self, queued: Queued) {
        self.by_shard[queued.shard as usize].push(queued.request);
    }

    /// Queues the execs of a command; returns the slot its reply waits in.
    fn queue(&mut self, execs: Execs) -> Slot {
        match execs {
            Execs::One { queued, answer } => {
                self.push(queued);
                Slot::WaitingOne(answer)
            }
            Execs::Many { queued, answers, combine } => {
                for queued in queued {
                    self.push(queued);
                }
                Slot::Waiting(answers, combine)
            }
        }
    }

    async fn send(&mut self, server: &Server) {
        for (shard, execs) in self.by_shard.iter_mut().enumerate() {
            if !execs.is_empty() {
                // The list goes to the shard; the next wave's starts with this one's room
                // (up to what an idle connection keeps) instead of growing by doubling.
                let room = execs.len().min(WAVE_COMMANDS_KEPT);
                let execs = std::mem::replace(execs, Vec::with_capacity(room));
                server.db.exec_many_async(shard as u32, execs).await;
            }
        }
    }
}

/// The replies of a wave on their way, in request order, each with the protocol in force when
/// its command ran and the bytes reserved for it until it is encoded.
struct Pending {
    /// Each slot with the protocol of its reply, None for a reply not sent (CLIENT REPLY).
    slots: VecDeque<(Slot, Option<Protocol>, usize)>,
    /// The sum of the slots' reservations.
    reserved_bytes: usize,
}

impl Pending {
    fn push(&mut self, slot: Slot, protocol: Option<Protocol>, reserved_bytes: usize) {
        self.reserved_bytes += reserved_bytes;
        self.slots.push_back((slot, protocol, reserved_bytes));
    }
}

/// How far `drain` goes.
#[derive(Clone, Copy)]
enum Drain {
    /// Every slot.
    All,
    /// Until the slots still pending reserve at most this many bytes.
    UntilReserved(usize),
}

/// The connection's stream as replies are written to it, with the time by which an
/// unauthenticated connection must have authenticated (writes past it fail).
struct Writer<'a> {
    stream: &'a mut TcpStream,
    deadline: Option<Instant>,
}

/// Awaits the slots in order and encodes their replies, writing whenever a chunk is full.
async fn drain(
    server: &Server,
    writer: &mut Writer<'_>,
    pending: &mut Pending,
    out: &mut Vec<u8>,
    shutdown: &mut watch::Receiver<bool>,
    until: Drain,
) -> std::io::Result<Option<End>> {
    loop {
        let done = match until {
            Drain::All => pending.slots.is_empty(),
            Drain::UntilReserved(keep) => pending.reserved_bytes <= keep,
        };
        if done {
            break;
        }
        let Some((slot, protocol, reserved_bytes)) = pending.slots.pop_front() else { break };
        let reply = match slot {
            Slot::Ready(reply) => reply,
            Slot::WaitingOne(answer) => answered(answer).await,
            Slot::Waiting(answers, combine) => collect(answers, combine).await,
        };
        pending.reserved_bytes -= reserved_bytes;
        let Some(protocol) = protocol else { continue };
        let before = out.len();
        encode_reply(&reply, protocol, out);
        drop(reply);
        let limit = server.settings.client_output_bytes_max.load(Ordering::Relaxed);
        let bytes = out.len() - before;
        if bytes > limit {
            server.stats.output_limit_closes.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(bytes, limit, "a reply exceeds the client output limit; closing");
            // The replies before it still go out; this one is replaced by the error.
            out.truncate(before);
            write_out(server, writer, out, shutdown).await?;
            return Ok(Some(End::Error(format!(
                "ERR reply of {bytes} bytes exceeds the client output limit ({limit} bytes)"
            ))));
        }
        // Waiting to write is the backpressure: while the client does not read, nothing more
        // of its is dispatched or read.
        if out.len() >= WRITE_CHUNK_BYTES {
            write_out(server, writer, out, shutdown).await?;
        }
    }
    Ok(None)
}

/// Writes the gathered replies. A client that does not read would hold a shutdown forever, so
/// once the server is shutting down a write gets `SHUTDOWN_WRITE_GRACE_MS` more, then the client
/// is dropped (its commands are done and durable; only their replies are lost).
async fn write_out(
    server: &Server,
    writer: &mut Writer<'_>,
    out: &mut Vec<u8>,
    shutdown: &mut watch::Receiver<bool>,
) -> std::io::Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    tokio::select! {
        written = writer.stream.write_all(out) => written?,
        _ = shutdown_grace(shutdown) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "shutting down: the client is not reading its replies",
            ));
        }
        _ = sleep_until_or_never(writer.deadline) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "authentication timeout: the client neither authenticated nor read its replies",
            ));
        }
    }
    server.stats.net_output_bytes.fetch_add(out.len() as u64, Ordering::Relaxed);
    out.clear();
    Ok(())
}

/// `write_out`, given up when the subscriber's mailbox closes meanwhile (a client that does
/// not read past its output limit is dropped, not waited for). Returns whether the connection
/// stays open.
async fn write_unless_closed(
    server: &Server,
    writer: &mut Writer<'_>,
    out: &mut Vec<u8>,
    shutdown: &mut watch::Receiver<bool>,
    mailbox: Option<Arc<crate::pubsub::Mailbox>>,
) -> std::io::Result<bool> {
    let Some(mailbox) = mailbox else {
        write_out(server, writer, out, shutdown).await?;
        return Ok(true);
    };
    tokio::select! {
        written = write_out(server, writer, out, shutdown) => written.map(|()| true),
        _ = mailbox.closed() => Ok(false),
    }
}

/// Moves the frames a subscriber's mailbox holds into `pending` as one ready reply, and drops a
/// subscriber with no subscription left (its last frames moved). Returns false when the mailbox
/// was closed (the connection must close).
fn mailbox_into_pending(conn: &mut ConnState, pending: &mut Pending) -> bool {
    let mut frames = Vec::new();
    let open = take_frames(conn, None, &mut frames);
    if !frames.is_empty() {
        pending.push(Slot::Ready(Reply::Encoded(frames)), Some(conn.protocol), 0);
    }
    if conn.subscriber.as_ref().is_some_and(|subscriber| subscriber.is_empty()) {
        conn.subscriber = None;
    }
    open
}

/// The next frame a subscribed connection's mailbox holds (an empty one: close the client).
async fn next_frame(subscriber: &mut Option<crate::pubsub::Subscriber>) -> Vec<u8> {
    match subscriber {
        Some(subscriber) => subscriber.receiver.recv().await.unwrap_or_default(),
        None => std::future::pending().await,
    }
}

/// Appends `first` (if any) and every frame already waiting to `out`, releasing their bytes from
/// the mailbox's count. Returns false when the mailbox was closed (the subscriber fell past its
/// output limit): the connection must close.
fn take_frames(conn: &mut ConnState, first: Option<Vec<u8>>, out: &mut Vec<u8>) -> bool {
    let Some(subscriber) = conn.subscriber.as_mut() else { return true };
    let mut next = first;
    loop {
        let frame = match next.take() {
            Some(frame) => frame,
            None => match subscriber.receiver.try_recv() {
                Ok(frame) => frame,
                Err(_) => return true,
            },
        };
        if frame.is_empty() {
            return false;
        }
        subscriber.written(frame.len());
        out.extend_from_slice(&frame);
    }
}

/// Resolves `SHUTDOWN_WRITE_GRACE_MS` after the server starts shutting down.
async fn shutdown_grace(shutdown: &mut watch::Receiver<bool>) {
    while !*shutdown.borrow_and_update() {
        if shutdown.changed().await.is_err() {
            // The sender is gone: the server is going away.
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(SHUTDOWN_WRITE_GRACE_MS)).await;
}

/// When a connection unauthenticated since `since` must have authenticated: `None` for an
/// authenticated one, for 0 (no timeout), or past what a clock can hold.
fn auth_deadline_at(since: Option<Instant>, timeout_secs: u64) -> Option<Instant> {
    let since = since?;
    (timeout_secs > 0).then(|| since.checked_add(Duration::from_secs(timeout_secs))).flatten()
}

/// Resolves `timeout_secs` after `since` (never, for 0 or an authenticated connection).
async fn auth_deadline(since: Option<Instant>, timeout_secs: u64) {
    sleep_until_or_never(auth_deadline_at(since, timeout_secs)).await
}

async fn sleep_until_or_never(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending::<()>().await,
    }
}

/// Writes a closing connection's last words, giving up after `FINAL_REPLY_WRITE_MS` (the client
/// may be gone or not reading; nothing more is owed to it).
async fn write_final(stream: &mut TcpStream, bytes: &[u8]) {
    let write = stream.write_all(bytes);
    let _ = tokio::time::timeout(Duration::from_millis(FINAL_REPLY_WRITE_MS), write).await;
}

fn auth_timeout_error(timeout_secs: u64) -> String {
    format!("ERR authentication timeout: no AUTH within {timeout_secs} seconds (auth_timeout_secs)")
}

/// Resolves after `timeout_secs` (never, for 0).
async fn idle(timeout_secs: u64) {
    if timeout_secs == 0 {
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(Duration::from_secs(timeout_secs)).await;
}
