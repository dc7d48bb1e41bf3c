//! Pub/Sub commands: SUBSCRIBE, UNSUBSCRIBE, PSUBSCRIBE, PUNSUBSCRIBE, SSUBSCRIBE, SUNSUBSCRIBE,
//! PUBLISH, SPUBLISH and PUBSUB, with Redis's replies in RESP2 and RESP3 (`pubsub.rs` keeps the
//! subscriptions and delivers; the connection writes its mailbox, `net/conn.rs`).
//!
//! A (un)subscription answers one frame per name: `[verb, name, subscriptions now]` (a push in
//! RESP3). A RESP2 connection with subscriptions may only run the subscription commands, PING,
//! QUIT and RESET (`allowed_while_subscribed`); RESP3 connections run anything.
//!
//! A PUBLISH is delivered at once. Inside EXEC and inside a script it is delivered only after
//! the transaction's or the script's writes are durable (`multi.rs`, `scripts.rs`), so no
//! subscriber learns of a write that a crash could take back.

use super::{Call, Outcome, Spec};
use crate::pubsub::Kind;
use crate::resp::{Protocol, Reply};

/// What a RESP2 connection with subscriptions may run (Redis's list).
const ALLOWED_WHILE_SUBSCRIBED: &[&str] = &[
    "subscribe",
    "unsubscribe",
    "psubscribe",
    "punsubscribe",
    "ssubscribe",
    "sunsubscribe",
    "ping",
    "quit",
    "reset",
];

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, summary, handler| {
        Spec::new("pubsub", name, arity, &["pubsub"], (0, 0, 0), summary, handler)
    };
    vec![
        spec("subscribe", -2, "Listens for messages on channels.", subscribe as _),
        spec(
            "unsubscribe",
            -1,
            "Stops listening on channels (all without arguments).",
            unsubscribe as _,
        ),
        spec("psubscribe", -2, "Listens on channels matching glob patterns.", psubscribe as _),
        spec("punsubscribe", -1, "Stops listening on patterns.", punsubscribe as _),
        spec("ssubscribe", -2, "Listens on shard channels.", ssubscribe as _),
        spec("sunsubscribe", -1, "Stops listening on shard channels.", sunsubscribe as _),
        spec("publish", 3, "Posts a message to a channel.", publish as _),
        spec("spublish", 3, "Posts a message to a shard channel.", spublish as _),
        spec(
            "pubsub",
            -2,
            "PUBSUB CHANNELS, NUMSUB, NUMPAT, SHARDCHANNELS, SHARDNUMSUB.",
            pubsub as _,
        ),
    ]
}

/// The error for `name` on a RESP2 connection with subscriptions, if it may not run there.
pub fn refused_while_subscribed(
    call_name: &str,
    conn: &crate::context::ConnState,
) -> Option<String> {
    let subscribed = conn.subscriber.as_ref().is_some_and(|subscriber| !subscriber.is_empty());
    if !subscribed
        || conn.protocol == Protocol::Resp3
        || ALLOWED_WHILE_SUBSCRIBED.contains(&call_name)
    {
        return None;
    }
    Some(format!(
        "ERR Can't execute '{call_name}': only (P|S)SUBSCRIBE / (P|S)UNSUBSCRIBE / PING / QUIT / RESET are allowed in this context"
    ))
}

/// PING on a RESP2 connection with subscriptions answers `["pong", argument or ""]`.
pub fn subscribed_ping(call: &Call<'_>) -> Option<Reply> {
    let subscribed = call.conn.subscriber.as_ref().is_some_and(|subscriber| !subscriber.is_empty());
    if !subscribed || call.conn.protocol == Protocol::Resp3 {
        return None;
    }
    let argument = call.args.get(1).cloned().unwrap_or_default();
    Some(Reply::Array(vec![Reply::Bulk(b"pong".to_vec()), Reply::Bulk(argument)]))
}

fn subscribe(call: &mut Call<'_>) -> Outcome {
    subscribe_to(call, Kind::Channel)
}

fn psubscribe(call: &mut Call<'_>) -> Outcome {
    subscribe_to(call, Kind::Pattern)
}

fn ssubscribe(call: &mut Call<'_>) -> Outcome {
    subscribe_to(call, Kind::Shard)
}

fn unsubscribe(call: &mut Call<'_>) -> Outcome {
    unsubscribe_from(call, Kind::Channel)
}

fn punsubscribe(call: &mut Call<'_>) -> Outcome {
    unsubscribe_from(call, Kind::Pattern)
}

fn sunsubscribe(call: &mut Call<'_>) -> Outcome {
    unsubscribe_from(call, Kind::Shard)
}

/// The count a (un)subscription frame reports: shard channels count apart (Redis 7).
fn frame_count(subscriber: &crate::pubsub::Subscriber, kind: Kind) -> i64 {
    match kind {
        Kind::Shard => subscriber.shard_channels.len() as i64,
        _ => subscriber.count() as i64,
    }
}

fn frame(verb: &str, name: Option<Vec<u8>>, count: i64) -> Reply {
    Reply::Push(vec![
        Reply::Bulk(verb.as_bytes().to_vec()),
        name.map_or(Reply::Null, Reply::Bulk),
        Reply::Integer(count),
    ])
}

fn subscribe_to(call: &mut Call<'_>, kind: Kind) -> Outcome {
    let (verb, _) = kind.verbs();
    let (client, protocol) = (call.conn.info.id, call.conn.protocol);
    let subscriber = call
        .conn
        .subscriber
        .get_or_insert_with(|| crate::pubsub::Subscriber::new(client, protocol));
    let mut frames = Vec::with_capacity(call.args.len() - 1);
    for name in &call.args[1..] {
        call.server.pubsub.subscribe(subscriber, kind, name);
        frames.push(frame(verb, Some(name.clone()), frame_count(subscriber, kind)));
    }
    Outcome::Reply(Reply::Frames(frames))
}

fn unsubscribe_from(call: &mut Call<'_>, kind: Kind) -> Outcome {
    let (_, verb) = kind.verbs();
    let Some(subscriber) = call.conn.subscriber.as_mut() else {
        let names: Vec<Option<Vec<u8>>> = match call.args.len() {
            1 => vec![None],
            _ => call.args[1..].iter().cloned().map(Some).collect(),
        };
        return Outcome::Reply(Reply::Frames(
            names.into_iter().map(|name| frame(verb, name, 0)).collect(),
        ));
    };
    let names: Vec<Vec<u8>> = match call.args.len() {
        1 => subscriber.set(kind).iter().cloned().collect(),
        _ => call.args[1..].to_vec(),
    };
    if names.is_empty() {
        return Outcome::Reply(Reply::Frames(vec![frame(
            verb,
            None,
            frame_count(subscriber, kind),
        )]));
    }
    let mut frames = Vec::with_capacity(names.len());
    for name in names {
        call.server.pubsub.unsubscribe(subscriber, kind, &name);
        frames.push(frame(verb, Some(name), frame_count(subscriber, kind)));
    }
    Outcome::Reply(Reply::Frames(frames))
}

fn publish(call: &mut Call<'_>) -> Outcome {
    let received = call.server.pubsub.publish(&call.args[1], &call.args[2], false);
    Outcome::Reply(Reply::Integer(received as i64))
}

fn spublish(call: &mut Call<'_>) -> Outcome {
    let received = call.server.pubsub.publish(&call.args[1], &call.args[2], true);
    Outcome::Reply(Reply::Integer(received as i64))
}

fn pubsub(call: &mut Call<'_>) -> Outcome {
    let pubsub = &call.server.pubsub;
    let bulks = |names: Vec<Vec<u8>>| Reply::Array(names.into_iter().map(Reply::Bulk).collect());
    let counts = |shard: bool| {
        let mut reply = Vec::new();
        for channel in &call.args[2..] {
            reply.push(Reply::Bulk(channel.clone()));
            reply.push(Reply::Integer(pubsub.subscribers(channel, shard) as i64));
        }
        Reply::Array(reply)
    };
    match (call.word(1).as_str(), call.args.len()) {
        ("channels", 2 | 3) => {
            Outcome::Reply(bulks(pubsub.channels(call.args.get(2).map(Vec::as_slice), false)))
        }
        ("shardchannels", 2 | 3) => {
            Outcome::Reply(bulks(pubsub.channels(call.args.get(2).map(Vec::as_slice), true)))
        }
        ("numsub", _) => Outcome::Reply(counts(false)),
        ("shardnumsub", _) => Outcome::Reply(counts(true)),
        ("numpat", 2) => Outcome::Reply(Reply::Integer(pubsub.pattern_count() as i64)),
        (sub @ ("channels" | "shardchannels" | "numpat"), _) => {
            Outcome::error(format!("ERR wrong number of arguments for 'pubsub|{sub}' command"))
        }
        _ => Outcome::error(format!(
            "ERR unknown subcommand '{}'. Try PUBSUB HELP.",
            String::from_utf8_lossy(&call.args[1])
        )),
    }
}
