//! Pub/Sub: which connections are subscribed to which channels, patterns and shard channels,
//! and the delivery of published messages to them (`cmd/pubsub.rs` has the commands; the
//! connection writes what reaches its mailbox, `net/conn.rs`).
//!
//! A subscribed connection has a `Mailbox`: an unbounded queue of encoded frames, written out by
//! the connection's own task on whatever network thread it lives, and a count of the bytes
//! queued. A publisher encodes the message once per protocol and queues it in each subscriber's
//! mailbox; it never waits for a subscriber.
//!
//! Invariants:
//! - Memory per subscriber is bounded: a delivery that takes a mailbox past
//!   `PUBSUB_CLIENT_OUTPUT_BYTES_MAX` closes the mailbox instead (Redis's `client-output-buffer-
//!   limit pubsub` hard limit), and its connection is closed; nothing more is queued to it. So a
//!   mailbox holds at most the limit plus one message.
//! - A connection's subscriptions are in the registry exactly while it holds them: subscribe and
//!   unsubscribe change both under the registry's lock, and a closing connection removes all of
//!   its own (`unsubscribe_all`).
//! - Messages of one publisher to one channel reach each subscriber in publication order (one
//!   queue per mailbox, filled under the registry's lock).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use crate::glob::glob_match;
use crate::resp::{encode_reply, Protocol, Reply};

/// The most bytes of messages waiting for one subscriber before it is disconnected (Redis's
/// default `client-output-buffer-limit pubsub 32mb`).
pub const PUBSUB_CLIENT_OUTPUT_BYTES_MAX: usize = 32 * 1024 * 1024;

/// The three kinds of subscription.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Channel,
    Pattern,
    Shard,
}

impl Kind {
    /// The frame a subscription answers with, and the one an unsubscription does.
    pub fn verbs(self) -> (&'static str, &'static str) {
        match self {
            Kind::Channel => ("subscribe", "unsubscribe"),
            Kind::Pattern => ("psubscribe", "punsubscribe"),
            Kind::Shard => ("ssubscribe", "sunsubscribe"),
        }
    }
}

/// Where a subscriber's messages wait for its connection.
pub struct Mailbox {
    client: u64,
    sender: mpsc::UnboundedSender<Vec<u8>>,
    queued_bytes: AtomicUsize,
    closed: AtomicBool,
    /// Told when the mailbox closes: a connection blocked writing to a client that does not
    /// read stops waiting and closes (`closed`).
    closing: tokio::sync::Notify,
    /// 2 or 3: the connection's protocol (HELLO may change it while subscribed).
    protocol: AtomicU8,
}

impl Mailbox {
    /// Queues `frame`, or closes the mailbox if it would pass the limit. Returns whether the
    /// frame was queued.
    fn deliver(&self, frame: &[u8]) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        let queued = self.queued_bytes.fetch_add(frame.len(), Ordering::AcqRel) + frame.len();
        if queued > PUBSUB_CLIENT_OUTPUT_BYTES_MAX {
            self.queued_bytes.fetch_sub(frame.len(), Ordering::AcqRel);
            self.closed.store(true, Ordering::Release);
            // An empty frame tells the connection to close; `closing` wakes it if it is stuck
            // writing to the client.
            let _ = self.sender.send(Vec::new());
            self.closing.notify_one();
            tracing::warn!(
                client = self.client,
                limit = PUBSUB_CLIENT_OUTPUT_BYTES_MAX,
                "closing a subscriber that does not read its messages"
            );
            return false;
        }
        self.sender.send(frame.to_vec()).is_ok()
    }

    /// Resolves once the mailbox is closed (at once if it already is).
    pub async fn closed(&self) {
        while !self.closed.load(Ordering::Acquire) {
            self.closing.notified().await;
        }
    }

    fn protocol(&self) -> Protocol {
        match self.protocol.load(Ordering::Relaxed) {
            3 => Protocol::Resp3,
            _ => Protocol::Resp2,
        }
    }
}

/// A connection's side of its subscriptions (kept in its `ConnState`).
pub struct Subscriber {
    pub mailbox: Arc<Mailbox>,
    pub receiver: mpsc::UnboundedReceiver<Vec<u8>>,
    pub channels: BTreeSet<Vec<u8>>,
    pub patterns: BTreeSet<Vec<u8>>,
    pub shard_channels: BTreeSet<Vec<u8>>,
}

impl Subscriber {
    pub fn new(client: u64, protocol: Protocol) -> Subscriber {
        let (sender, receiver) = mpsc::unbounded_channel();
        let mailbox = Arc::new(Mailbox {
            client,
            sender,
            queued_bytes: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            closing: tokio::sync::Notify::new(),
            protocol: AtomicU8::new(if protocol == Protocol::Resp3 { 3 } else { 2 }),
        });
        Subscriber {
            mailbox,
            receiver,
            channels: BTreeSet::new(),
            patterns: BTreeSet::new(),
            shard_channels: BTreeSet::new(),
        }
    }

    pub fn set(&mut self, kind: Kind) -> &mut BTreeSet<Vec<u8>> {
        match kind {
            Kind::Channel => &mut self.channels,
            Kind::Pattern => &mut self.patterns,
            Kind::Shard => &mut self.shard_channels,
        }
    }

    /// Subscriptions of every kind but shard channels (what SUBSCRIBE's counts report).
    pub fn count(&self) -> usize {
        self.channels.len() + self.patterns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.channels.is_empty() && self.patterns.is_empty() && self.shard_channels.is_empty()
    }

    /// A frame taken from the mailbox was written: its bytes no longer count.
    pub fn written(&self, frame_bytes: usize) {
        self.mailbox.queued_bytes.fetch_sub(frame_bytes, Ordering::AcqRel);
    }

    pub fn set_protocol(&self, protocol: Protocol) {
        let number = if protocol == Protocol::Resp3 { 3 } else { 2 };
        self.mailbox.protocol.store(number, Ordering::Relaxed);
    }
}

type Subscribers = HashMap<Vec<u8>, HashMap<u64, Arc<Mailbox>>>;

/// Every subscription of the server.
#[derive(Default)]
pub struct PubSub {
    registry: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    channels: Subscribers,
    patterns: Subscribers,
    shard_channels: Subscribers,
}

impl Registry {
    fn of(&mut self, kind: Kind) -> &mut Subscribers {
        match kind {
            Kind::Channel => &mut self.channels,
            Kind::Pattern => &mut self.patterns,
            Kind::Shard => &mut self.shard_channels,
        }
    }
}

impl PubSub {
    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Subscribes `subscriber` to `name`; returns whether it was not subscribed already.
    pub fn subscribe(&self, subscriber: &mut Subscriber, kind: Kind, name: &[u8]) -> bool {
        let mut registry = self.lock();
        if !subscriber.set(kind).insert(name.to_vec()) {
            return false;
        }
        let mailbox = subscriber.mailbox.clone();
        registry.of(kind).entry(name.to_vec()).or_default().insert(mailbox.client, mailbox);
        true
    }

    /// Unsubscribes `subscriber` from `name`; returns whether it was subscribed.
    pub fn unsubscribe(&self, subscriber: &mut Subscriber, kind: Kind, name: &[u8]) -> bool {
        let mut registry = self.lock();
        if !subscriber.set(kind).remove(name) {
            return false;
        }
        let subscribers = registry.of(kind);
        if let Some(clients) = subscribers.get_mut(name) {
            clients.remove(&subscriber.mailbox.client);
            if clients.is_empty() {
                subscribers.remove(name);
            }
        }
        true
    }

    /// Removes every subscription of a connection that closes.
    pub fn unsubscribe_all(&self, subscriber: &mut Subscriber) {
        for kind in [Kind::Channel, Kind::Pattern, Kind::Shard] {
            for name in std::mem::take(subscriber.set(kind)) {
                subscriber.set(kind).insert(name.clone());
                self.unsubscribe(subscriber, kind, &name);
            }
        }
    }

    /// Delivers `message` on `channel` (a shard channel when `shard`); returns how many
    /// subscriptions received it (one per pattern that matched, as Redis counts).
    pub fn publish(&self, channel: &[u8], message: &[u8], shard: bool) -> usize {
        let registry = self.lock();
        let mut frames = Frames::default();
        let mut received = 0;
        let (kind_word, exact) = match shard {
            true => ("smessage", &registry.shard_channels),
            false => ("message", &registry.channels),
        };
        if let Some(clients) = exact.get(channel) {
            for mailbox in clients.values() {
                let frame = frames.get(mailbox.protocol(), || {
                    vec![
                        Reply::Bulk(kind_word.into()),
                        Reply::Bulk(channel.to_vec()),
                        Reply::Bulk(message.to_vec()),
                    ]
                });
                received += usize::from(mailbox.deliver(frame));
            }
        }
        if !shard {
            for (pattern, clients) in &registry.patterns {
                if !glob_match(pattern, channel) {
                    continue;
                }
                let mut pattern_frames = Frames::default();
                for mailbox in clients.values() {
                    let frame = pattern_frames.get(mailbox.protocol(), || {
                        vec![
                            Reply::Bulk(b"pmessage".to_vec()),
                            Reply::Bulk(pattern.clone()),
                            Reply::Bulk(channel.to_vec()),
                            Reply::Bulk(message.to_vec()),
                        ]
                    });
                    received += usize::from(mailbox.deliver(frame));
                }
            }
        }
        received
    }

    /// How many subscriptions a message on `channel` would reach now (what PUBLISH would answer).
    pub fn receivers(&self, channel: &[u8], shard: bool) -> usize {
        let registry = self.lock();
        if shard {
            return registry.shard_channels.get(channel).map_or(0, HashMap::len);
        }
        let exact = registry.channels.get(channel).map_or(0, HashMap::len);
        let patterns: usize = (registry.patterns.iter())
            .filter(|(pattern, _)| glob_match(pattern, channel))
            .map(|(_, clients)| clients.len())
            .sum();
        exact + patterns
    }

    /// Channels (or shard channels) with at least one subscriber, matching `pattern` if given.
    pub fn channels(&self, pattern: Option<&[u8]>, shard: bool) -> Vec<Vec<u8>> {
        let registry = self.lock();
        let channels = if shard { &registry.shard_channels } else { &registry.channels };
        let mut names: Vec<Vec<u8>> = channels
            .keys()
            .filter(|name| pattern.is_none_or(|pattern| glob_match(pattern, name)))
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// Subscribers of `channel` (a shard channel when `shard`).
    pub fn subscribers(&self, channel: &[u8], shard: bool) -> usize {
        let registry = self.lock();
        let channels = if shard { &registry.shard_channels } else { &registry.channels };
        channels.get(channel).map_or(0, HashMap::len)
    }

    /// Patterns with at least one subscriber.
    pub fn pattern_count(&self) -> usize {
        self.lock().patterns.len()
    }
}

/// A message's frame, encoded at most once per protocol.
#[derive(Default)]
struct Frames {
    resp2: Option<Vec<u8>>,
    resp3: Option<Vec<u8>>,
}

impl Frames {
    fn get(&mut self, protocol: Protocol, items: impl FnOnce() -> Vec<Reply>) -> &[u8] {
        let slot = match protocol {
            Protocol::Resp2 => &mut self.resp2,
            Protocol::Resp3 => &mut self.resp3,
        };
        slot.get_or_insert_with(|| {
            let mut out = Vec::new();
            encode_reply(&Reply::Push(items()), protocol, &mut out);
            out
        })
    }
}
