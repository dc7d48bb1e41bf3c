//! DUMP and RESTORE in Redis's payload format, so that migration tools (redis-cli --pipe of
//! RESTOREs, riot, redis-shake, MIGRATE from a Redis) move keys between Redis and copse.
//!
//! A payload is one RDB object: its type byte, its body, the RDB version (2 bytes, little
//! endian) and a CRC-64 (Jones polynomial, little endian) of everything before it. copse writes
//! the plain encodings every Redis since 2.x loads (a string, a list as a plain list, a set, a
//! sorted set with binary scores, a hash) at RDB version 10 (Redis 7.0); it reads those and every
//! compact encoding Redis 7.x writes: integers and LZF in strings, intsets, ziplists, listpacks
//! and quicklists (versions 1 and 2). Streams and modules are refused ("Bad data format").
//!
//! Invariants:
//! - A payload is checked whole (version, checksum, every length against the bytes left) before
//!   anything is written: a bad payload changes nothing.
//! - A decoded collection is not empty and has no duplicate member or field (its count is
//!   its number of elements).

use std::collections::HashSet;

use super::objects::{replace_ops, snapshot_step, Snapshot, SnapshotReader, Value};
use super::{
    check_batch, now_ms, on_key, parse_i64, unexpected, Call, Expiry, Input, KeyTarget, Next,
    Outcome, Spec, NOT_INTEGER, SYNTAX,
};
use crate::resp::Reply;

/// The RDB version copse's payloads carry: Redis 7.0's, so every Redis from 7.0 on loads them.
pub const RDB_VERSION_WRITTEN: u16 = 10;
/// The newest RDB version whose payloads copse reads (Redis 7.2's).
pub const RDB_VERSION_READ_MAX: u16 = 11;

/// RDB object types. persisted: never renumber (Redis's numbers)
mod rdb_type {
    pub const STRING: u8 = 0;
    pub const LIST: u8 = 1;
    pub const SET: u8 = 2;
    pub const ZSET: u8 = 3;
    pub const HASH: u8 = 4;
    pub const ZSET_2: u8 = 5;
    pub const LIST_ZIPLIST: u8 = 10;
    pub const SET_INTSET: u8 = 11;
    pub const ZSET_ZIPLIST: u8 = 12;
    pub const HASH_ZIPLIST: u8 = 13;
    pub const LIST_QUICKLIST: u8 = 14;
    pub const HASH_LISTPACK: u8 = 16;
    pub const ZSET_LISTPACK: u8 = 17;
    pub const LIST_QUICKLIST_2: u8 = 18;
    pub const SET_LISTPACK: u8 = 20;
}

/// The most LZF expands its input: a 3-byte back reference stands for 264 bytes.
const LZF_EXPANSION_MAX: u64 = 88;

const CRC: crc::Crc<u64> = crc::Crc::<u64>::new(&crc::CRC_64_REDIS);

const BAD_PAYLOAD: &str = "ERR DUMP payload version or checksum are wrong";
/// A payload that decodes to more than `RESTORE_ELEMENTS_MAX` elements or `RESTORE_BYTES_MAX`
/// bytes: refused while it is decoded, before it takes more memory than that.
const TOO_LARGE: &str = "ERR this payload holds more than copse restores in one atomic batch (1,048,576 elements, 64 MiB decoded); nothing was changed";
/// Elements a payload may decode to. A RESTORE is one atomic batch of any size the batch limits
/// allow; these bounds are the memory a crafted payload may make the server spend (LZF expands
/// 88 times). A payload is at most `proto-max-bulk-len` (16 MiB by default), and real data
/// compresses far less than 4 times, so they do not refuse what Redis's DUMP writes.
pub const RESTORE_ELEMENTS_MAX: usize = 1024 * 1024;
/// Bytes of strings a payload may decode to.
pub const RESTORE_BYTES_MAX: usize = 64 * 1024 * 1024;
const BAD_DATA: &str = "ERR Bad data format";
const BUSY_KEY: &str = "BUSYKEY Target key name already exists.";

pub fn specs() -> Vec<Spec> {
    vec![
        Spec::new(
            "generic",
            "dump",
            2,
            &["readonly"],
            (1, 1, 1),
            "Serializes a key in Redis's payload format.",
            dump as _,
        ),
        Spec::new(
            "generic",
            "restore",
            -4,
            &["write"],
            (1, 1, 1),
            "Creates a key from a DUMP payload.",
            restore as _,
        ),
    ]
}

fn dump(call: &mut Call<'_>) -> Outcome {
    let key = std::mem::take(&mut call.args[1]);
    let reply_bytes_max =
        call.server.settings.client_output_bytes_max.load(std::sync::atomic::Ordering::Relaxed);
    let reader = SnapshotReader::for_reply(key.clone(), reply_bytes_max);
    let step = snapshot_step(reader, |snapshot| match snapshot.map(|snapshot| snapshot.value()) {
        None => Next::Reply(Reply::Null),
        Some(Some(value)) => Next::Reply(Reply::Bulk(encode(&value))),
        Some(None) => Next::Reply(Reply::error(super::CORRUPT_META)),
    });
    on_key(KeyTarget::of(call.db(), &key), step)
}

/// RESTORE key ttl payload [REPLACE] [ABSTTL] [IDLETIME seconds] [FREQ frequency].
fn restore(call: &mut Call<'_>) -> Outcome {
    let mut replace = false;
    let mut absolute = false;
    let (mut idle_s, mut freq) = (None, false);
    let mut at = 4;
    while at < call.args.len() {
        let more = at + 1 < call.args.len();
        match call.word(at).as_str() {
            "replace" => replace = true,
            "absttl" => absolute = true,
            "idletime" if more && !freq => {
                at += 1;
                match parse_i64(&call.args[at]) {
                    Some(seconds) if seconds >= 0 => idle_s = Some(seconds),
                    Some(_) => return Outcome::error("ERR Invalid IDLETIME value, must be >= 0"),
                    None => return Outcome::error(NOT_INTEGER),
                }
            }
            "freq" if more && idle_s.is_none() => {
                at += 1;
                match parse_i64(&call.args[at]) {
                    Some(count) if (0..=255).contains(&count) => freq = true,
                    Some(_) => {
                        return Outcome::error("ERR Invalid FREQ value, must be >= 0 and <= 255")
                    }
                    None => return Outcome::error(NOT_INTEGER),
                }
            }
            _ => return Outcome::error(SYNTAX),
        }
        at += 1;
    }
    // Redis's order: options, then BUSYKEY (in the exec), then the TTL, then the payload. The
    // TTL and the payload are checked here; their errors are answered after BUSYKEY's.
    let now = now_ms();
    let deadline = match parse_i64(&call.args[2]) {
        Some(0) => Ok(None),
        Some(ttl) if ttl > 0 && absolute => Ok(Some(ttl as u64)),
        // A relative TTL past what a deadline holds has, as in Redis, already expired.
        Some(ttl) if ttl > 0 => Ok(Some(
            i64::try_from(now).ok().and_then(|now| now.checked_add(ttl)).map_or(0, |at| at as u64),
        )),
        Some(_) => Err(Reply::error("ERR Invalid TTL value, must be >= 0")),
        None => Err(Reply::error(NOT_INTEGER)),
    };
    let snapshot = deadline.and_then(|deadline| match decode(&call.args[3]) {
        Ok(value) => Ok(Snapshot::of_value(&value, deadline)),
        Err(error) => Err(Reply::error(error)),
    });
    let key = std::mem::take(&mut call.args[1]);
    let server = call.server.clone();
    let database = super::namespace::current_number();
    let mut restored = None;
    on_key(KeyTarget::of(call.db(), &key), move |view, input| match input {
        Input::Start => {
            let expiry = Expiry::of(view, &key);
            let exists = expiry.live(super::stored_type(view, &key)).is_some();
            if exists && !replace {
                return Next::Reply(Reply::error(BUSY_KEY));
            }
            let snapshot = match &snapshot {
                Ok(snapshot) => snapshot,
                Err(error) => return Next::Reply(error.clone()),
            };
            let ops = if snapshot.deadline_ms.is_some_and(|deadline| deadline <= now) {
                // Already expired: as Redis, the key is only deleted (if REPLACE found one).
                match super::stored_type(view, &key) {
                    Some(ty) if exists => expiry.before(super::delete_ops(&key, ty, &expiry)),
                    _ => Vec::new(),
                }
            } else {
                restored = Some(snapshot.ty);
                replace_ops(view, &key, snapshot, true).unwrap_or_default()
            };
            if ops.is_empty() {
                return Next::Reply(Reply::ok());
            }
            if let Err(error) = check_batch(&ops) {
                return Next::Reply(error);
            }
            Next::Write(ops)
        }
        Input::Written => {
            if let Some(ty) = restored {
                if let Some(seconds) = idle_s {
                    server.access.set_idle(&key, server.access_clock_s(), seconds);
                }
                super::objects::wake_waiters(&server, ty, database, &key);
            }
            Next::Reply(Reply::ok())
        }
        Input::Read(_) => unexpected(),
    })
}

/// `value` as a DUMP payload.
pub fn encode(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    match value {
        Value::String(bytes) => {
            out.push(rdb_type::STRING);
            put_string(&mut out, bytes);
        }
        Value::List(items) => {
            out.push(rdb_type::LIST);
            put_len(&mut out, items.len() as u64);
            items.iter().for_each(|item| put_string(&mut out, item));
        }
        Value::Set(members) => {
            out.push(rdb_type::SET);
            put_len(&mut out, members.len() as u64);
            members.iter().for_each(|member| put_string(&mut out, member));
        }
        Value::ZSet(pairs) => {
            out.push(rdb_type::ZSET_2);
            put_len(&mut out, pairs.len() as u64);
            for (member, score) in pairs {
                put_string(&mut out, member);
                out.extend_from_slice(&score.to_le_bytes());
            }
        }
        Value::Hash(pairs) => {
            out.push(rdb_type::HASH);
            put_len(&mut out, pairs.len() as u64);
            for (field, item) in pairs {
                put_string(&mut out, field);
                put_string(&mut out, item);
            }
        }
    }
    out.extend_from_slice(&RDB_VERSION_WRITTEN.to_le_bytes());
    let crc = CRC.checksum(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// RDB's length encoding.
fn put_len(out: &mut Vec<u8>, len: u64) {
    if len < 1 << 6 {
        out.push(len as u8);
    } else if len < 1 << 14 {
        out.extend_from_slice(&[0x40 | (len >> 8) as u8, len as u8]);
    } else if len <= u32::MAX as u64 {
        out.push(0x80);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    } else {
        out.push(0x81);
        out.extend_from_slice(&len.to_be_bytes());
    }
}

fn put_string(out: &mut Vec<u8>, bytes: &[u8]) {
    put_len(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// The value a DUMP payload holds, or the error RESTORE answers.
pub fn decode(payload: &[u8]) -> Result<Value, &'static str> {
    let Some(body_len) = payload.len().checked_sub(10) else { return Err(BAD_PAYLOAD) };
    let version = u16::from_le_bytes([payload[body_len], payload[body_len + 1]]);
    let crc = u64::from_le_bytes(payload[body_len + 2..].try_into().map_err(|_| BAD_PAYLOAD)?);
    if version > RDB_VERSION_READ_MAX || CRC.checksum(&payload[..body_len + 2]) != crc {
        return Err(BAD_PAYLOAD);
    }
    let mut reader = Reader {
        bytes: &payload[..body_len],
        at: 0,
        budget: Budget {
            elements_left: RESTORE_ELEMENTS_MAX,
            bytes_left: RESTORE_BYTES_MAX,
            exceeded: false,
        },
    };
    let value = reader.object();
    if reader.budget.exceeded {
        return Err(TOO_LARGE);
    }
    let value = value.ok_or(BAD_DATA)?;
    if reader.at != body_len || !well_formed(&value) {
        return Err(BAD_DATA);
    }
    Ok(value)
}

/// Not empty, no duplicate member or field, no NaN score.
fn well_formed(value: &Value) -> bool {
    fn distinct<'a>(mut names: impl Iterator<Item = &'a [u8]>) -> bool {
        let mut seen = HashSet::new();
        names.all(|name| seen.insert(name))
    }
    match value {
        Value::String(_) => true,
        Value::List(items) => !items.is_empty(),
        Value::Set(members) => !members.is_empty() && distinct(members.iter().map(Vec::as_slice)),
        Value::Hash(pairs) => {
            !pairs.is_empty() && distinct(pairs.iter().map(|(field, _)| field.as_slice()))
        }
        Value::ZSet(pairs) => {
            !pairs.is_empty()
                && pairs.iter().all(|(_, score)| !score.is_nan())
                && distinct(pairs.iter().map(|(member, _)| member.as_slice()))
        }
    }
}

/// A cursor over an RDB object's bytes: every read checks the bytes left (None past them), and
/// what it decodes is charged to its budget.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    budget: Budget,
}

/// What a payload may still decode to: past either figure decoding stops (None) with `exceeded`
/// set, so a small payload (LZF, or many tiny entries) never takes more memory than a batch.
struct Budget {
    elements_left: usize,
    bytes_left: usize,
    exceeded: bool,
}

impl Budget {
    fn elements(&mut self, count: usize) -> Option<()> {
        self.charge(count, true)
    }

    fn bytes(&mut self, count: usize) -> Option<()> {
        self.charge(count, false)
    }

    fn charge(&mut self, count: usize, elements: bool) -> Option<()> {
        let left = if elements { &mut self.elements_left } else { &mut self.bytes_left };
        match left.checked_sub(count) {
            Some(rest) => {
                *left = rest;
                Some(())
            }
            None => {
                self.exceeded = true;
                None
            }
        }
    }
}

/// An RDB length: a plain one, or the special encoding of a string (integers, LZF).
enum Len {
    Plain(u64),
    Special(u8),
}

impl<'a> Reader<'a> {
    fn take(&mut self, count: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(count)?;
        let bytes = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(bytes)
    }

    fn byte(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn raw_len(&mut self) -> Option<Len> {
        let first = self.byte()?;
        Some(match first >> 6 {
            0 => Len::Plain((first & 0x3f) as u64),
            1 => Len::Plain(((first & 0x3f) as u64) << 8 | self.byte()? as u64),
            2 if first == 0x80 => {
                Len::Plain(u32::from_be_bytes(self.take(4)?.try_into().ok()?) as u64)
            }
            2 if first == 0x81 => Len::Plain(u64::from_be_bytes(self.take(8)?.try_into().ok()?)),
            2 => return None,
            _ => Len::Special(first & 0x3f),
        })
    }

    /// A length, bounded by the bytes left (each element takes at least one byte), so that a
    /// forged length never allocates more than the payload.
    fn len(&mut self) -> Option<usize> {
        match self.raw_len()? {
            Len::Plain(len) if len <= (self.bytes.len() - self.at) as u64 => Some(len as usize),
            _ => None,
        }
    }

    fn string(&mut self) -> Option<Vec<u8>> {
        match self.raw_len()? {
            Len::Plain(len) => {
                let len = usize::try_from(len).ok()?;
                let bytes = self.take(len)?;
                self.budget.bytes(len)?;
                Some(bytes.to_vec())
            }
            Len::Special(0) => Some((self.take(1)?[0] as i8).to_string().into_bytes()),
            Len::Special(1) => {
                Some(i16::from_le_bytes(self.take(2)?.try_into().ok()?).to_string().into_bytes())
            }
            Len::Special(2) => {
                Some(i32::from_le_bytes(self.take(4)?.try_into().ok()?).to_string().into_bytes())
            }
            Len::Special(3) => {
                let compressed = self.len()?;
                let Len::Plain(len) = self.raw_len()? else { return None };
                // No stored value is longer, and LZF expands at most `LZF_EXPANSION_MAX` times:
                // a forged length allocates nothing larger.
                let most = (compressed as u64).saturating_mul(LZF_EXPANSION_MAX);
                if len > most.min(copse::limits::VALUE_BYTES_MAX as u64) {
                    return None;
                }
                let input = self.take(compressed)?;
                self.budget.bytes(len as usize)?;
                lzf_decompress(input, len as usize)
            }
            Len::Special(_) => None,
        }
    }

    fn object(&mut self) -> Option<Value> {
        let kind = self.byte()?;
        Some(match kind {
            rdb_type::STRING => Value::String(self.string()?),
            rdb_type::LIST => {
                let count = self.len()?;
                self.budget.elements(count)?;
                Value::List((0..count).map(|_| self.string()).collect::<Option<_>>()?)
            }
            rdb_type::SET => {
                let count = self.len()?;
                self.budget.elements(count)?;
                Value::Set((0..count).map(|_| self.string()).collect::<Option<_>>()?)
            }
            rdb_type::ZSET | rdb_type::ZSET_2 => {
                let count = self.len()?;
                self.budget.elements(count.saturating_mul(2))?;
                let mut pairs = Vec::with_capacity(count);
                for _ in 0..count {
                    let member = self.string()?;
                    let score = match kind {
                        rdb_type::ZSET_2 => f64::from_le_bytes(self.take(8)?.try_into().ok()?),
                        _ => self.text_score()?,
                    };
                    pairs.push((member, score));
                }
                Value::ZSet(pairs)
            }
            rdb_type::HASH => {
                let count = self.len()?;
                self.budget.elements(count)?;
                let mut pairs = Vec::with_capacity(count);
                for _ in 0..count {
                    pairs.push((self.string()?, self.string()?));
                }
                Value::Hash(pairs)
            }
            rdb_type::SET_INTSET => Value::Set(intset(&self.string()?, &mut self.budget)?),
            rdb_type::SET_LISTPACK => Value::Set(listpack(&self.string()?, &mut self.budget)?),
            rdb_type::LIST_ZIPLIST => Value::List(ziplist(&self.string()?, &mut self.budget)?),
            rdb_type::ZSET_ZIPLIST => {
                Value::ZSet(scored(ziplist(&self.string()?, &mut self.budget)?)?)
            }
            rdb_type::ZSET_LISTPACK => {
                Value::ZSet(scored(listpack(&self.string()?, &mut self.budget)?)?)
            }
            rdb_type::HASH_ZIPLIST => {
                Value::Hash(paired(ziplist(&self.string()?, &mut self.budget)?)?)
            }
            rdb_type::HASH_LISTPACK => {
                Value::Hash(paired(listpack(&self.string()?, &mut self.budget)?)?)
            }
            rdb_type::LIST_QUICKLIST => {
                let nodes = self.len()?;
                let mut items = Vec::new();
                for _ in 0..nodes {
                    items.extend(ziplist(&self.string()?, &mut self.budget)?);
                }
                Value::List(items)
            }
            rdb_type::LIST_QUICKLIST_2 => {
                let nodes = self.len()?;
                let mut items = Vec::new();
                for _ in 0..nodes {
                    match self.len()? {
                        // PLAIN: one element, as is.
                        1 => items.push(self.string()?),
                        // PACKED: a listpack of elements.
                        2 => items.extend(listpack(&self.string()?, &mut self.budget)?),
                        _ => return None,
                    }
                }
                Value::List(items)
            }
            _ => return None,
        })
    }

    /// A score of the old sorted set type: its length byte, then its text (253 NaN, 254 +inf,
    /// 255 -inf).
    fn text_score(&mut self) -> Option<f64> {
        match self.byte()? {
            253 => Some(f64::NAN),
            254 => Some(f64::INFINITY),
            255 => Some(f64::NEG_INFINITY),
            len => std::str::from_utf8(self.take(len as usize)?).ok()?.parse().ok(),
        }
    }
}

fn scored(flat: Vec<Vec<u8>>) -> Option<Vec<(Vec<u8>, f64)>> {
    if !flat.len().is_multiple_of(2) {
        return None;
    }
    flat.chunks(2)
        .map(|pair| {
            let score = std::str::from_utf8(&pair[1]).ok()?.parse::<f64>().ok()?;
            Some((pair[0].clone(), score))
        })
        .collect()
}

fn paired(flat: Vec<Vec<u8>>) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    if !flat.len().is_multiple_of(2) {
        return None;
    }
    Some(flat.chunks(2).map(|pair| (pair[0].clone(), pair[1].clone())).collect())
}

/// An intset: encoding (2, 4 or 8 bytes per value), count, values; all little endian.
fn intset(bytes: &[u8], budget: &mut Budget) -> Option<Vec<Vec<u8>>> {
    let width = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?) as usize;
    let count = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?) as usize;
    let values = bytes.get(8..)?;
    if ![2, 4, 8].contains(&width) || values.len() != count.checked_mul(width)? {
        return None;
    }
    budget.elements(count)?;
    values
        .chunks(width)
        .map(|value| {
            let number = match width {
                2 => i16::from_le_bytes(value.try_into().ok()?) as i64,
                4 => i32::from_le_bytes(value.try_into().ok()?) as i64,
                _ => i64::from_le_bytes(value.try_into().ok()?),
            };
            Some(number.to_string().into_bytes())
        })
        .collect::<Option<_>>()
}

/// A listpack's entries (integers as their decimal text).
fn listpack(bytes: &[u8], budget: &mut Budget) -> Option<Vec<Vec<u8>>> {
    let total = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?) as usize;
    if total != bytes.len() {
        return None;
    }
    let mut at = 6;
    let mut out = Vec::new();
    loop {
        let first = *bytes.get(at)?;
        if first == 0xff {
            return (at + 1 == bytes.len()).then_some(out);
        }
        let int = |len: usize, bits: u32| -> Option<(Vec<u8>, usize)> {
            let raw = bytes.get(at + 1..at + 1 + len)?;
            let mut value = 0u64;
            for (shift, byte) in raw.iter().enumerate() {
                value |= (*byte as u64) << (8 * shift);
            }
            let signed = ((value << (64 - bits)) as i64) >> (64 - bits);
            Some((signed.to_string().into_bytes(), 1 + len))
        };
        let string = |header: usize, len: usize| -> Option<(Vec<u8>, usize)> {
            Some((bytes.get(at + header..at.checked_add(header + len)?)?.to_vec(), header + len))
        };
        let (entry, size) = if first & 0x80 == 0 {
            ((first & 0x7f).to_string().into_bytes(), 1)
        } else if first & 0xc0 == 0x80 {
            string(1, (first & 0x3f) as usize)?
        } else if first & 0xe0 == 0xc0 {
            let value = ((first & 0x1f) as u64) << 8 | *bytes.get(at + 1)? as u64;
            let signed = ((value << 51) as i64) >> 51;
            (signed.to_string().into_bytes(), 2)
        } else if first & 0xf0 == 0xe0 {
            string(2, ((first & 0x0f) as usize) << 8 | *bytes.get(at + 1)? as usize)?
        } else {
            match first {
                0xf0 => {
                    let len = u32::from_le_bytes(bytes.get(at + 1..at + 5)?.try_into().ok()?);
                    string(5, len as usize)?
                }
                0xf1 => int(2, 16)?,
                0xf2 => int(3, 24)?,
                0xf3 => int(4, 32)?,
                0xf4 => int(8, 64)?,
                _ => return None,
            }
        };
        budget.elements(1)?;
        out.push(entry);
        // The entry's back length: 7 bits per byte.
        let backlen = match size {
            0..=127 => 1,
            128..=16_383 => 2,
            16_384..=2_097_151 => 3,
            2_097_152..=268_435_455 => 4,
            _ => 5,
        };
        at = at.checked_add(size + backlen)?;
    }
}

/// A ziplist's entries (integers as their decimal text).
fn ziplist(bytes: &[u8], budget: &mut Budget) -> Option<Vec<Vec<u8>>> {
    let total = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?) as usize;
    if total != bytes.len() {
        return None;
    }
    let mut at = 10;
    let mut out = Vec::new();
    loop {
        let first = *bytes.get(at)?;
        if first == 0xff {
            return (at + 1 == bytes.len()).then_some(out);
        }
        // The previous entry's length: one byte, or 0xfe and four.
        at += if first == 0xfe { 5 } else { 1 };
        let encoding = *bytes.get(at)?;
        let int = |len: usize| -> Option<i64> {
            let raw = bytes.get(at + 1..at + 1 + len)?;
            Some(match len {
                1 => raw[0] as i8 as i64,
                2 => i16::from_le_bytes(raw.try_into().ok()?) as i64,
                3 => {
                    ((raw[0] as i32 | (raw[1] as i32) << 8 | (raw[2] as i32) << 16) << 8 >> 8)
                        as i64
                }
                4 => i32::from_le_bytes(raw.try_into().ok()?) as i64,
                _ => i64::from_le_bytes(raw.try_into().ok()?),
            })
        };
        let (entry, size) = match encoding >> 6 {
            0 => {
                let len = (encoding & 0x3f) as usize;
                (bytes.get(at + 1..at + 1 + len)?.to_vec(), 1 + len)
            }
            1 => {
                let len = ((encoding & 0x3f) as usize) << 8 | *bytes.get(at + 1)? as usize;
                (bytes.get(at + 2..at.checked_add(2 + len)?)?.to_vec(), 2 + len)
            }
            2 => {
                let len = u32::from_be_bytes(bytes.get(at + 1..at + 5)?.try_into().ok()?) as usize;
                (bytes.get(at + 5..at.checked_add(5 + len)?)?.to_vec(), 5 + len)
            }
            _ => {
                let (value, len) = match encoding {
                    0xc0 => (int(2)?, 2),
                    0xd0 => (int(4)?, 4),
                    0xe0 => (int(8)?, 8),
                    0xf0 => (int(3)?, 3),
                    0xfe => (int(1)?, 1),
                    0xf1..=0xfd => ((encoding & 0x0f) as i64 - 1, 0),
                    _ => return None,
                };
                (value.to_string().into_bytes(), 1 + len)
            }
        };
        budget.elements(1)?;
        out.push(entry);
        at = at.checked_add(size)?;
    }
}

/// LZF decompression (liblzf's format, which RDB uses): literal runs and back references.
/// None for input that does not decode to exactly `len` bytes.
fn lzf_decompress(input: &[u8], len: usize) -> Option<Vec<u8>> {
    let mut out: Vec<u8> = Vec::with_capacity(len);
    let mut at = 0;
    while at < input.len() {
        let control = input[at] as usize;
        at += 1;
        if control < 32 {
            let run = control + 1;
            out.extend_from_slice(input.get(at..at + run)?);
            at += run;
        } else {
            let mut run = control >> 5;
            if run == 7 {
                run += *input.get(at)? as usize;
                at += 1;
            }
            let back = ((control & 0x1f) << 8) + *input.get(at)? as usize + 1;
            at += 1;
            let from = out.len().checked_sub(back)?;
            // Overlapping copies repeat what they write: byte by byte.
            for offset in 0..run + 2 {
                out.push(out[from + offset]);
            }
        }
        if out.len() > len {
            return None;
        }
    }
    (out.len() == len).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_refuse_damage() {
        let values = [
            Value::String(b"hello".to_vec()),
            Value::String(vec![7; 20_000]),
            Value::List(vec![b"a".to_vec(), b"".to_vec(), vec![1; 300]]),
            Value::Set(vec![b"x".to_vec(), b"12".to_vec()]),
            Value::ZSet(vec![(b"m".to_vec(), -1.5), (b"n".to_vec(), f64::INFINITY)]),
            Value::Hash(vec![(b"f".to_vec(), b"v".to_vec())]),
        ];
        for value in &values {
            let payload = encode(value);
            assert_eq!(decode(&payload).as_ref(), Ok(value));
            for at in 0..payload.len() {
                let mut damaged = payload.clone();
                damaged[at] ^= 0x20;
                assert!(decode(&damaged).is_err(), "a flip at {at} of {value:?} is caught");
            }
            assert_eq!(decode(&payload[..payload.len() - 1]), Err(BAD_PAYLOAD));
        }
        assert_eq!(decode(b""), Err(BAD_PAYLOAD));
    }

    #[test]
    fn lzf_runs_and_back_references_decode() {
        // "abcabcabc": a literal run of 3, then a back reference of 6 bytes, 3 back.
        let input = [2, b'a', b'b', b'c', (4 << 5), 2];
        assert_eq!(lzf_decompress(&input, 9).as_deref(), Some(&b"abcabcabc"[..]));
        assert_eq!(lzf_decompress(&input, 8), None);
        assert_eq!(lzf_decompress(&[0x20, 5], 2), None, "a reference before the start");
    }
}
