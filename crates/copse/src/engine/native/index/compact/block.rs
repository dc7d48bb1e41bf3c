//! The encoding of one block of the compact index: entries in increasing key order, each key
//! front-coded against the previous one (the first stored whole).
//!
//! Block grammar (all integers LEB128 varints unless said):
//!
//! ```text
//! block  := base entry*
//! entry  := header suffix value
//! header := u8 (shared << 4 | suffix_len), shared <= 14, suffix_len <= 15
//!         | 0xFF shared suffix_len
//! value  := (slot << 1 | has_pages) class:u8 [pages] zigzag(seq - base, wrapping)
//! ```
//!
//! `shared` is the exact length of the common prefix with the previous key (0 for the first),
//! which `block_find` relies on to skip entries without rebuilding keys.

use crate::engine::native::format::{Loc, CLASS_COUNT};
use crate::engine::native::index::Entry;

// `skip_value` finds a value's end from its bytes' high bits: the class byte must have it clear.
const _: () = assert!(CLASS_COUNT <= 0x80);

/// A one-byte entry header holds a shared length up to this and a suffix length up to 15.
const HEADER_SHARED_MAX: usize = 14;
const HEADER_SUFFIX_MAX: usize = 15;
const HEADER_ESCAPE: u8 = 0xFF;

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

pub(super) fn get_varint(bytes: &[u8], pos: &mut usize) -> u64 {
    let mut value = 0u64;
    let mut shift = 0;
    loop {
        let byte = bytes[*pos];
        *pos += 1;
        value |= ((byte & 0x7F) as u64) << shift;
        if byte < 0x80 {
            return value;
        }
        shift += 7;
    }
}

fn skip_varint(bytes: &[u8], pos: &mut usize) {
    while bytes[*pos] >= 0x80 {
        *pos += 1;
    }
    *pos += 1;
}

pub(super) fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Entry header: (shared, suffix) in one byte when both are small, else an escape and varints.
/// Inlined: it runs once per entry a search steps over (docs/benchmarks.md, 2026-11-28: left to
/// itself the compiler stopped inlining it and `block_find` as the crate grew, +600
/// instructions per SET).
#[inline(always)]
pub(super) fn get_header(bytes: &[u8], pos: &mut usize) -> (usize, usize) {
    let byte = bytes[*pos];
    *pos += 1;
    if byte != HEADER_ESCAPE {
        return ((byte >> 4) as usize, (byte & 0x0F) as usize);
    }
    let shared = get_varint(bytes, pos) as usize;
    let suffix = get_varint(bytes, pos) as usize;
    (shared, suffix)
}

/// Writes `key` as the header (`shared`, rest) and the rest of the key after `shared` bytes.
pub(super) fn put_key(out: &mut Vec<u8>, shared: usize, key: &[u8]) {
    let suffix = &key[shared..];
    if shared <= HEADER_SHARED_MAX && suffix.len() <= HEADER_SUFFIX_MAX {
        out.push(((shared << 4) | suffix.len()) as u8);
    } else {
        out.push(HEADER_ESCAPE);
        put_varint(out, shared as u64);
        put_varint(out, suffix.len() as u64);
    }
    out.extend_from_slice(suffix);
}

pub(super) fn put_value(out: &mut Vec<u8>, entry: Entry, base: u64) {
    let loc = entry.loc;
    let pages = loc.pages_used();
    put_varint(out, (loc.slot() << 1) | (pages != 0) as u64);
    out.push(loc.class());
    if pages != 0 {
        put_varint(out, pages as u64);
    }
    let delta = entry.seq.wrapping_sub(base) as i64;
    put_varint(out, ((delta << 1) ^ (delta >> 63)) as u64);
}

/// Value: varint(slot << 1 | has pages), class byte, [varint pages], zigzag varint seq - base.
pub(super) fn get_value(bytes: &[u8], pos: &mut usize, base: u64) -> Entry {
    let slot_and_flag = get_varint(bytes, pos);
    let class = bytes[*pos];
    *pos += 1;
    let pages = if slot_and_flag & 1 == 1 { get_varint(bytes, pos) as u32 } else { 0 };
    let zigzag = get_varint(bytes, pos);
    let delta = (zigzag >> 1) ^ (zigzag & 1).wrapping_neg();
    Entry { loc: Loc::new(class, slot_and_flag >> 1, pages), seq: base.wrapping_add(delta) }
}

pub(super) fn skip_value(bytes: &[u8], pos: &mut usize) {
    // The usual value fits in 8 bytes (a slot under 2^20 and a seq delta under 2^20 take 3 bytes
    // each). Its fields all end in a byte with the high bit clear (the class byte is below 0x80,
    // a varint's last byte too), so its end is the 3rd such byte, or the 4th with pages: found
    // from one load's high bits instead of a loop per byte. This is most of what a lookup
    // spends walking a block (`block_find` skips every entry before its key).
    if let Some(word) = bytes.get(*pos..*pos + 8) {
        let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        let fields = 3 + (word & 1) as u32;
        let mut ends = !word & 0x8080_8080_8080_8080;
        for _ in 1..fields {
            ends &= ends.wrapping_sub(1);
        }
        if ends != 0 {
            *pos += (ends.trailing_zeros() / 8 + 1) as usize;
            return;
        }
    }
    skip_value_bytewise(bytes, pos);
}

/// `skip_value` a byte at a time: a value near the block's end, or wider than 8 bytes.
fn skip_value_bytewise(bytes: &[u8], pos: &mut usize) {
    let flag = bytes[*pos] & 1;
    skip_varint(bytes, pos);
    *pos += 1;
    if flag == 1 {
        skip_varint(bytes, pos);
    }
    skip_varint(bytes, pos);
}

/// Searches one block for `key` without rebuilding keys: tracks how much of `key` the previous
/// entry matched and compares only suffixes that start exactly there. Returns the entry and
/// where its value's bytes are (`start..end`), so an update can rewrite just those.
#[inline(always)]
pub(super) fn block_find(bytes: &[u8], key: &[u8]) -> Option<(Entry, std::ops::Range<usize>)> {
    let mut pos = 0;
    let base = get_varint(bytes, &mut pos);
    // The length `key` shares with the previous entry's key, which is below `key`.
    let mut matched = 0;
    while pos < bytes.len() {
        let (shared, suffix_len) = get_header(bytes, &mut pos);
        let suffix = &bytes[pos..pos + suffix_len];
        pos += suffix_len;
        if shared < matched {
            // This key leaves the previous one upward where the previous one still matched
            // `key`: it is above `key`, and so is every later key.
            return None;
        }
        if shared > matched {
            // This key still agrees with the previous one where that one was below `key`.
            skip_value(bytes, &mut pos);
            continue;
        }
        let rest = &key[matched..];
        let same = common_prefix(rest, suffix);
        if same == suffix.len() && same == rest.len() {
            let start = pos;
            let entry = get_value(bytes, &mut pos, base);
            return Some((entry, start..pos));
        }
        let below = same == suffix.len() || (same < rest.len() && suffix[same] < rest[same]);
        if !below {
            return None;
        }
        matched += same;
        skip_value(bytes, &mut pos);
    }
    None
}

pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    pub(super) base: u64,
    /// The key of the entry `next` returned last.
    pub(super) key: Vec<u8>,
}

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        let mut reader = Reader { bytes: &[], pos: 0, base: 0, key: Vec::new() };
        reader.reset(bytes);
        reader
    }

    pub(super) fn reset(&mut self, bytes: &'a [u8]) {
        self.bytes = bytes;
        self.pos = 0;
        self.key.clear();
        self.base = if bytes.is_empty() { 0 } else { get_varint(bytes, &mut self.pos) };
    }

    pub(super) fn next(&mut self) -> Option<Entry> {
        if self.pos == self.bytes.len() {
            return None;
        }
        let (shared, suffix_len) = get_header(self.bytes, &mut self.pos);
        assert!(shared <= self.key.len(), "an entry shares more than the previous key has");
        self.key.truncate(shared);
        self.key.extend_from_slice(&self.bytes[self.pos..self.pos + suffix_len]);
        self.pos += suffix_len;
        Some(get_value(self.bytes, &mut self.pos, self.base))
    }
}

pub(super) struct Writer {
    pub(super) out: Vec<u8>,
    pub(super) previous: Vec<u8>,
    base: u64,
    pub(super) count: usize,
}

impl Writer {
    pub(super) fn new(base: u64) -> Self {
        Self::with_capacity(base, 10)
    }

    pub(super) fn with_capacity(base: u64, capacity: usize) -> Self {
        let mut out = Vec::with_capacity(capacity);
        put_varint(&mut out, base);
        Writer { out, previous: Vec::new(), base, count: 0 }
    }

    /// Appends `key` (above every key pushed before) with its entry.
    pub(super) fn push(&mut self, key: &[u8], entry: Entry) {
        assert!(self.count == 0 || self.previous.as_slice() < key, "keys pushed out of order");
        let shared = common_prefix(&self.previous, key);
        put_key(&mut self.out, shared, key);
        put_value(&mut self.out, entry, self.base);
        self.previous.truncate(shared);
        self.previous.extend_from_slice(&key[shared..]);
        self.count += 1;
    }

    pub(super) fn finish(self) -> Box<[u8]> {
        self.out.into_boxed_slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn a_value_is_skipped_to_its_end_whatever_its_widths_and_what_follows() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for round in 0..200_000 {
            let slot = match round % 4 {
                0 => rng.gen_range(0..128),
                1 => rng.gen_range(0..1 << 20),
                _ => rng.gen_range(0..1u64 << 40),
            };
            let pages = if rng.gen_bool(0.3) { rng.gen_range(1..1 << 16) } else { 0 };
            let class = rng.gen_range(0..CLASS_COUNT as u8);
            let seq: u64 = rng.gen();
            let base: u64 = if rng.gen_bool(0.5) { seq.wrapping_sub(rng.gen_range(0..1 << 20)) } else { rng.gen() };
            let mut bytes = Vec::new();
            put_value(&mut bytes, Entry { loc: Loc::new(class, slot, pages), seq }, base);
            let end = bytes.len();
            // Whatever follows: another entry, or the block's end within a few bytes.
            for _ in 0..rng.gen_range(0..12) {
                bytes.push(rng.gen());
            }
            let (mut fast, mut slow) = (0, 0);
            skip_value(&bytes, &mut fast);
            skip_value_bytewise(&bytes, &mut slow);
            assert_eq!((fast, slow), (end, end), "slot {slot} pages {pages} class {class} {bytes:02x?}");
            let mut at = 0;
            assert_eq!(get_value(&bytes, &mut at, base), Entry { loc: Loc::new(class, slot, pages), seq });
            assert_eq!(at, end);
        }
    }
}
