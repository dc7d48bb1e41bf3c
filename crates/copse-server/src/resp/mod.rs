//! The Redis protocol (RESP2 and RESP3): parsing requests and encoding replies.
//!
//! `parse` turns the bytes a client sent into commands; `encode` turns replies into bytes. Both
//! are pure functions over byte slices, with no I/O and no per-connection state, so that the
//! connection code owns buffering and the protocol can be tested byte for byte.
//!
//! Invariants, because these bytes come from the network and anyone can send them:
//! - **Never panics**, whatever the input: a malformed request costs its connection a protocol
//!   error, never the server.
//! - **No allocation by an untrusted size**: a count or length read from the wire sizes nothing
//!   until the bytes it announces have arrived, so memory stays proportional to what a client
//!   actually sent, and every size is checked against `ParseLimits` first.
//! - **Incremental**: a request's outcome depends only on its own bytes. A strict prefix of a
//!   valid request is `Incomplete`, and a request parses the same however the network split it.
//!   A connection keeps a `ParseState` so that parsing after each read resumes where the last
//!   parse stopped instead of walking the request again (linear, not quadratic, in its size).
//!
//! Behaviour follows Redis's `networking.c` (`processInlineBuffer`, `processMultibulkBuffer`) and
//! its error texts, so that Redis clients and Redis's own protocol tests see what they expect;
//! `parse.rs` lists where it is deliberately stricter.

pub mod encode;
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
pub mod parse;

#[cfg(any(test, feature = "testing"))]
pub use encode::encode_request;
pub use encode::{encode_reply, format_double, Protocol, Reply};
#[cfg(any(test, feature = "testing"))]
pub use parse::parse_command;
pub use parse::{parse_command_resumed, Args, ParseLimits, ParseState, Parsed};
