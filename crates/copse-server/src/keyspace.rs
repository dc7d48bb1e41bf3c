//! How Redis data lives in copse's ordered key space. The byte-level spec, with worked examples,
//! is docs/format/redis-keyspace.md; this file and that one change together.
//!
//! Every Redis key `K` has one meta item whose item key says its type, so that a command learns a
//! key's type from the shard's index alone, with no I/O. Hashes and sorted sets keep one item per
//! field or member (as Kvrocks does over RocksDB), never one big value, so a large hash stays
//! cheap to update. Every item of `K` is routed to the shard of `K` (execs run there), so one
//! exec can change all of them atomically.
//!
//! ```text
//! meta     'm' scan_hash(K):u64be K type      -> string: the value; hash, zset: CollectionMeta
//! field    'h' len(K)+8:u32be K version:u64be scan_hash(F):u64be F   -> the field's value
//! member   'z' len(K)+8:u32be K version:u64be 'm' M                  -> score: f64 bits, u64be
//! by score 'z' len(K)+8:u32be K version:u64be 's' sortable(score):u64be M   -> empty
//! element  'l' len(K)+8:u32be K version:u64be index:u64be                 -> the element
//! set      's' len(K)+8:u32be K version:u64be scan_hash(M):u64be M       -> empty
//! orphans  'o' len(K):u32be K                 -> empty: K has elements of dead versions
//! expiry   'e' len(K):u32be K deadline_ms:u64be -> empty: K expires at deadline_ms
//! due      't' deadline_ms:u64be K            -> empty: the same expiry, in deadline order
//! name     'n' N                              -> K: the Redis key of surrogate name N
//! ```
//!
//! `K` above is the key's *stored name* `N(K)` (`stored_name`), never a Redis key longer than
//! an item key can hold: `N(K)` is `K` itself when `K` is at most `NAME_INLINE_BYTES_MAX`
//! bytes and does not start with `SURROGATE_PREFIX`, else `SURROGATE_PREFIX ++ sha256(K)` (a
//! *surrogate*), and then a name item holds `K`. Commands see names only: the server converts
//! every key argument at dispatch (`cmd/names.rs`).
//!
//! A key's expiry lives in item keys, not values, so every command learns whether its key
//! expired from the index alone (no I/O), whatever the key's type; the due items are the
//! per-shard expiry index that active expiry walks in deadline order (`cmd/expiry.rs`).
//!
//! A collection's elements are keyed by its *id*, `K version` (`collection_id`): the version
//! lives in the meta item's value, so deleting or overwriting a collection of any size deletes
//! its meta item and writes its orphan record, two small items; the elements of the old version
//! are invisible at once (nothing reads a version the meta item does not name) and the orphan
//! collector (`cmd/orphans.rs`) deletes them in bounded batches.
//!
//! Meta items and fields are ordered by a 64-bit hash (`scan_hash`) so that a SCAN or HSCAN cursor
//! is a plain integer, as Redis clients expect: the cursor is the hash to continue from.
//!
//! Invariants:
//! - A live collection's elements are exactly the element items under its id; no other version
//!   of the key has elements unless the key has an orphan record (written in the batch that made
//!   that version dead, deleted only with that version's last element).
//! - A new collection's version has no element items when it is chosen (`version_is_unused`),
//!   so it never adopts a dead version's elements.
//! - A key has at most one expiry item, and it has one exactly when it has a due item with the
//!   same deadline: both are written and deleted in one batch. An expiry item belongs to a key
//!   whose meta item exists (a key's expiry is deleted with it).
//! - A stored name starting with `SURROGATE_PREFIX` is a surrogate, and an inline name never
//!   starts with it, so the two never meet. `NAME_INLINE_BYTES_MAX` is the same in every
//!   namespace, so a key keeps its name across databases (MOVE, COPY ... DB).
//! - A surrogate has a name item exactly while it has a meta item (`cmd/names.rs` adds the put
//!   or the delete to the batch that writes or deletes the meta item).

use std::ops::Bound;

use copse::limits::KEY_BYTES_MAX;

/// The item that says a store holds the Redis key space, and in which format version. Its tag
/// (0xff) sorts after every other item, so FLUSHALL and SCAN never meet it.
pub const MARKER_KEY: &[u8] = b"\xffcopse:redis-keyspace";
pub const MARKER_MAGIC: &[u8; 4] = b"CRKS";
/// Version of this encoding. History: 1 (copse 0.1, first version); 2 (2026-11-27: collections
/// carry a version, an element count and an expiry in their meta item; elements are keyed by
/// the collection's id; orphan records). A store in version 1 is upgraded at open
/// (`cmd/upgrade.rs`); 3 (2026-11-27: expiry and due items; a version 2 store has neither, so
/// it is upgraded by rewriting the marker); 4 (2026-11-27: lists); 5 (2026-11-27: sets); 6
/// (2026-11-28: databases 1-15 as namespaces, `cmd/namespace.rs`, and the database map); 7
/// (2026-11-28: stored names, surrogates for long keys, and name items).
pub const KEYSPACE_FORMAT_VERSION: u32 = 7;
/// The version whose collections `copse serve` moves to the current format at open.
pub const KEYSPACE_FORMAT_VERSION_UNVERSIONED: u32 = 1;
/// The versions that differ from the current one only by items they never wrote (expiry,
/// lists, databases, name items): their stores are upgraded by rewriting the marker, once no
/// stored key starts with `SURROGATE_PREFIX` (such a key would change its name; `cmd/names.rs`,
/// `prefixed_key_in_store`).
pub const KEYSPACE_FORMAT_VERSIONS_SUBSET: [u32; 5] = [2, 3, 4, 5, 6];

pub fn marker_value() -> Vec<u8> {
    let mut out = MARKER_MAGIC.to_vec();
    out.extend_from_slice(&KEYSPACE_FORMAT_VERSION.to_le_bytes());
    out
}

/// The format version a marker value names, or None if it is not a marker.
pub fn marker_version(value: &[u8]) -> Option<u32> {
    if value.len() != 8 || &value[..4] != MARKER_MAGIC {
        return None;
    }
    Some(u32::from_le_bytes(value[4..8].try_into().ok()?))
}

/// The byte that starts each kind of item. persisted: never renumber
pub const TAG_META: u8 = b'm';
pub const TAG_FIELD: u8 = b'h';
pub const TAG_ZSET: u8 = b'z';
pub const TAG_LIST: u8 = b'l';
pub const TAG_SET: u8 = b's';
pub const TAG_ORPHANS: u8 = b'o';
pub const TAG_EXPIRY: u8 = b'e';
pub const TAG_DUE: u8 = b't';
pub const TAG_NAME: u8 = b'n';
/// Sub-tags of a sorted set's items. persisted: never renumber
pub const ZSET_MEMBER: u8 = b'm';
pub const ZSET_SCORE: u8 = b's';

/// Bytes the meta item adds around a Redis key: tag, hash, type.
pub const META_OVERHEAD_BYTES: usize = 1 + 8 + 1;
/// Bytes a collection's id adds to its Redis key: the version.
pub const VERSION_BYTES: usize = 8;
/// Bytes a field item adds around key and field: tag, id length, version, field hash.
pub const FIELD_OVERHEAD_BYTES: usize = 1 + 4 + VERSION_BYTES + 8;
/// Bytes the larger of a member's two items adds around key and member: tag, id length,
/// version, sub-tag, sortable score.
pub const MEMBER_OVERHEAD_BYTES: usize = 1 + 4 + VERSION_BYTES + 1 + 8;
/// The version of every collection upgraded from format 1 (`cmd/upgrade.rs`). New collections
/// take versions from the clock (`new_version`), which are never 0.
pub const UPGRADED_VERSION: u64 = 0;
/// The longest Redis key copse serves: 1 MiB. Longer keys are refused at dispatch, whatever
/// the command, so a read and a write of one key get the same error. Any length up to it is
/// stored under a name that fits an item key (`stored_name`); the limit only bounds what the
/// server holds per key argument (the name item's value and the copies a command makes).
pub const REDIS_KEY_BYTES_MAX: usize = 1 << 20;
/// The longest stored name kept inline (the key itself): the longest key whose meta item fits
/// an item key in every namespace (a namespace other than 0 adds one byte), so a key has one
/// name in every database and no key of a version 6 store changes form (but one starting with
/// `SURROGATE_PREFIX`). Longer keys are surrogates.
pub const NAME_INLINE_BYTES_MAX: usize = KEY_BYTES_MAX - META_OVERHEAD_BYTES - 1;
/// What every surrogate name starts with: bytes no UTF-8 text contains (0xff and 0xc0 never
/// occur in UTF-8) and no byte-order mark starts with. A Redis key that starts with them is a
/// surrogate too, whatever its length, so an inline name never starts with them.
/// persisted: never change
pub const SURROGATE_PREFIX: &[u8; 4] = b"\xff\xc0#N";
/// Bytes of a surrogate name: the prefix and a SHA-256 digest.
pub const SURROGATE_NAME_BYTES: usize = SURROGATE_PREFIX.len() + 32;
/// Bytes an expiry item adds around a Redis key: tag, key length, deadline.
pub const EXPIRY_OVERHEAD_BYTES: usize = 1 + 4 + 8;
/// The longest stored name that can carry an expiry (its expiry item must fit an item key):
/// inline names of 1012 and 1013 bytes cannot, surrogates always can.
pub const EXPIRY_KEY_BYTES_MAX: usize = KEY_BYTES_MAX - EXPIRY_OVERHEAD_BYTES;

/// The name under which Redis key `key` is stored (module header): the key itself, or its
/// surrogate when it is longer than `NAME_INLINE_BYTES_MAX` or starts with `SURROGATE_PREFIX`.
/// A pure function of the key: every build, every database, every shard agrees.
pub fn stored_name(key: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if !needs_surrogate(key) {
        return std::borrow::Cow::Borrowed(key);
    }
    use sha2::Digest;
    let mut name = Vec::with_capacity(SURROGATE_NAME_BYTES);
    name.extend_from_slice(SURROGATE_PREFIX);
    name.extend_from_slice(&sha2::Sha256::digest(key));
    std::borrow::Cow::Owned(name)
}

/// Whether `key` is stored under a surrogate (the one test on every key argument's hot path).
pub fn needs_surrogate(key: &[u8]) -> bool {
    key.len() > NAME_INLINE_BYTES_MAX || key.starts_with(SURROGATE_PREFIX)
}

/// Whether stored name `name` is a surrogate (its Redis key is in its name item).
pub fn is_surrogate(name: &[u8]) -> bool {
    name.starts_with(SURROGATE_PREFIX)
}

/// The name item of surrogate `name`: its value is the Redis key.
pub fn name_key(name: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + name.len());
    out.push(TAG_NAME);
    out.extend_from_slice(name);
    out
}

/// The type of a Redis key, as its meta item's last byte. persisted: never renumber
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum KeyType {
    String = b's',
    Hash = b'h',
    ZSet = b'z',
    List = b'l',
    Set = b'S',
}

impl KeyType {
    pub const ALL: [KeyType; 5] =
        [KeyType::String, KeyType::Hash, KeyType::ZSet, KeyType::List, KeyType::Set];
    /// The types whose elements are items of their own, under the collection's id.
    pub const COLLECTIONS: [KeyType; 4] =
        [KeyType::Hash, KeyType::ZSet, KeyType::List, KeyType::Set];

    /// The tag of this type's element items (None for a string: it has none).
    pub fn element_tag(self) -> Option<u8> {
        match self {
            KeyType::String => None,
            KeyType::Hash => Some(TAG_FIELD),
            KeyType::ZSet => Some(TAG_ZSET),
            KeyType::List => Some(TAG_LIST),
            KeyType::Set => Some(TAG_SET),
        }
    }

    pub fn from_byte(byte: u8) -> Option<KeyType> {
        KeyType::ALL.into_iter().find(|ty| *ty as u8 == byte)
    }

    /// The name TYPE answers.
    pub fn name(self) -> &'static str {
        match self {
            KeyType::String => "string",
            KeyType::Hash => "hash",
            KeyType::ZSet => "zset",
            KeyType::List => "list",
            KeyType::Set => "set",
        }
    }
}

/// The position of a key or field in SCAN order: never 0, which is the cursor meaning "start"
/// and "done".
pub fn scan_hash(bytes: &[u8]) -> u64 {
    (xxhash_rust::xxh3::xxh3_64(bytes) >> 1) + 1
}

pub fn meta_key(key: &[u8], ty: KeyType) -> Vec<u8> {
    let mut out = Vec::with_capacity(META_OVERHEAD_BYTES + key.len());
    out.push(TAG_META);
    out.extend_from_slice(&scan_hash(key).to_be_bytes());
    out.extend_from_slice(key);
    out.push(ty as u8);
    out
}

/// Where a SCAN from `cursor` starts.
pub fn meta_scan_start(cursor: u64) -> Vec<u8> {
    let mut out = vec![TAG_META];
    out.extend_from_slice(&cursor.to_be_bytes());
    out
}

/// The end of the meta items (exclusive).
pub fn meta_scan_end() -> Vec<u8> {
    vec![TAG_META + 1]
}

/// A meta item's (scan hash, Redis key, type), or None for an item that is not a meta item.
pub fn decode_meta(item: &[u8]) -> Option<(u64, &[u8], KeyType)> {
    if item.len() < META_OVERHEAD_BYTES || item[0] != TAG_META {
        return None;
    }
    let hash = u64::from_be_bytes(item[1..9].try_into().ok()?);
    let ty = KeyType::from_byte(item[item.len() - 1])?;
    Some((hash, &item[9..item.len() - 1], ty))
}

/// Bits of `CollectionMeta`'s flags byte: an expiry deadline follows (reserved, never written),
/// a list's head index follows. persisted: never renumber
const META_FLAG_DEADLINE: u8 = 1;
const META_FLAG_HEAD: u8 = 2;
/// A collection meta value's bytes without and with a deadline.
pub const COLLECTION_META_BYTES: usize = 8 + 8 + 1;
pub const COLLECTION_META_DEADLINE_BYTES: usize = COLLECTION_META_BYTES + 8;

/// The value of a hash's or sorted set's meta item:
/// `version:u64be count:u64be flags:u8 [deadline_ms:u64be if flags & 1]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectionMeta {
    /// Keys the collection's elements (`collection_id`).
    pub version: u64,
    /// Elements: fields of a hash, members of a sorted set. Never 0 in a stored meta item (the
    /// command that removes the last element deletes the meta item).
    pub count: u64,
    /// Unix time in milliseconds at which the key expires, if it does (reserved: no version
    /// writes it; expiry items hold every key's deadline).
    pub deadline_ms: Option<u64>,
    /// A list's first element index (its elements are at `head .. head + count`).
    pub head: Option<u64>,
}

impl CollectionMeta {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(COLLECTION_META_DEADLINE_BYTES + 8);
        out.extend_from_slice(&self.version.to_be_bytes());
        out.extend_from_slice(&self.count.to_be_bytes());
        let flags = (if self.deadline_ms.is_some() { META_FLAG_DEADLINE } else { 0 })
            | (if self.head.is_some() { META_FLAG_HEAD } else { 0 });
        out.push(flags);
        if let Some(deadline) = self.deadline_ms {
            out.extend_from_slice(&deadline.to_be_bytes());
        }
        if let Some(head) = self.head {
            out.extend_from_slice(&head.to_be_bytes());
        }
        out
    }

    /// None for bytes that are not a meta value this version writes (unknown flags, a wrong
    /// length, or format 1's empty value).
    pub fn decode(bytes: &[u8]) -> Option<CollectionMeta> {
        let flags = *bytes.get(16)?;
        if flags & !(META_FLAG_DEADLINE | META_FLAG_HEAD) != 0 {
            return None;
        }
        let mut at = COLLECTION_META_BYTES;
        let mut next = |present: bool| -> Option<Option<u64>> {
            if !present {
                return Some(None);
            }
            let value = u64::from_be_bytes(bytes.get(at..at + 8)?.try_into().ok()?);
            at += 8;
            Some(Some(value))
        };
        let deadline_ms = next(flags & META_FLAG_DEADLINE != 0)?;
        let head = next(flags & META_FLAG_HEAD != 0)?;
        if at != bytes.len() {
            return None;
        }
        Some(CollectionMeta {
            version: u64::from_be_bytes(bytes[0..8].try_into().ok()?),
            count: u64::from_be_bytes(bytes[8..16].try_into().ok()?),
            deadline_ms,
            head,
        })
    }
}

/// The id that keys a collection's elements: the Redis key, then its version. Element item
/// keys carry the id's length, so the elements of two ids never interleave.
pub fn collection_id(key: &[u8], version: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + VERSION_BYTES);
    out.extend_from_slice(key);
    out.extend_from_slice(&version.to_be_bytes());
    out
}

/// The version of a collection id.
pub fn id_version(id: &[u8]) -> u64 {
    let at = id.len() - VERSION_BYTES;
    u64::from_be_bytes(id[at..].try_into().expect("an id ends with its version"))
}

/// A version for a new collection: the clock in microseconds, and past every version this
/// process handed out before. (Uniqueness per key is checked by `version_is_unused`; the clock
/// only makes a clash unlikely.)
pub fn new_version() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |elapsed| elapsed.as_micros() as u64)
        .max(1);
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let next = now_us.max(last + 1);
        match LAST.compare_exchange_weak(last, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(seen) => last = seen,
        }
    }
}

/// The orphan record of Redis key `key`: present while elements of a dead version of `key`
/// may remain.
pub fn orphans_key(key: &[u8]) -> Vec<u8> {
    sub_prefix(TAG_ORPHANS, key, 0)
}

/// The Redis key an orphan record names.
pub fn decode_orphans(item: &[u8]) -> Option<&[u8]> {
    if item.first() != Some(&TAG_ORPHANS) {
        return None;
    }
    let len = u32::from_be_bytes(item.get(1..5)?.try_into().ok()?) as usize;
    (item.len() == 5 + len).then(|| &item[5..])
}

/// A new list's head index: the middle of the index space, so that it can grow either way by
/// 2^63 elements.
pub const LIST_HEAD_INITIAL: u64 = 1 << 63;

/// Element `index` of the list with id `id`.
pub fn list_key(id: &[u8], index: u64) -> Vec<u8> {
    let mut out = sub_prefix(TAG_LIST, id, 8);
    out.extend_from_slice(&index.to_be_bytes());
    out
}

/// The element items of the list with id `id` at indexes `from .. to`.
pub fn list_range(id: &[u8], from: u64, to: u64) -> KeyRange {
    (Bound::Included(list_key(id, from)), Bound::Excluded(list_key(id, to)))
}

/// The expiry item of `key` expiring at `deadline_ms` (Unix time, milliseconds).
pub fn expiry_key(key: &[u8], deadline_ms: u64) -> Vec<u8> {
    let mut out = sub_prefix(TAG_EXPIRY, key, 8);
    out.extend_from_slice(&deadline_ms.to_be_bytes());
    out
}

/// Where `key`'s expiry item is, whatever its deadline: one item at most.
pub fn expiry_range(key: &[u8]) -> KeyRange {
    let prefix = sub_prefix(TAG_EXPIRY, key, 0);
    let end = prefix_end(&prefix);
    (Bound::Included(prefix), end)
}

/// The deadline an expiry item of `key` names, or None for an item that is not one.
pub fn decode_expiry(item: &[u8], key: &[u8]) -> Option<u64> {
    let prefix_bytes = 5 + key.len();
    if item.len() != prefix_bytes + 8 || item.first() != Some(&TAG_EXPIRY) {
        return None;
    }
    Some(u64::from_be_bytes(item[prefix_bytes..].try_into().ok()?))
}

/// The due item of `key` expiring at `deadline_ms`: due items sort by deadline.
pub fn due_key(deadline_ms: u64, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + key.len());
    out.push(TAG_DUE);
    out.extend_from_slice(&deadline_ms.to_be_bytes());
    out.extend_from_slice(key);
    out
}

/// A due item's (deadline, Redis key).
pub fn decode_due(item: &[u8]) -> Option<(u64, &[u8])> {
    if item.len() < 9 || item[0] != TAG_DUE {
        return None;
    }
    Some((u64::from_be_bytes(item[1..9].try_into().ok()?), &item[9..]))
}

/// The due items of keys that expire at or before `now_ms`.
pub fn due_range(now_ms: u64) -> (Vec<u8>, Vec<u8>) {
    let mut end = vec![TAG_DUE];
    end.extend_from_slice(&now_ms.saturating_add(1).to_be_bytes());
    (vec![TAG_DUE], end)
}

/// The element items of every version of `key` with tag `tag` (`TAG_FIELD` or `TAG_ZSET`).
pub fn all_versions_range(tag: u8, key: &[u8]) -> KeyRange {
    let mut prefix = Vec::with_capacity(5 + key.len());
    prefix.push(tag);
    prefix.extend_from_slice(&((key.len() + VERSION_BYTES) as u32).to_be_bytes());
    prefix.extend_from_slice(key);
    let end = prefix_end(&prefix);
    (Bound::Included(prefix), end)
}

/// The element items with tag `tag` under `owner`: a collection's id, or, in format 1 (which
/// the upgrade reads), its Redis key.
pub fn id_range(tag: u8, owner: &[u8]) -> KeyRange {
    let prefix = sub_prefix(tag, owner, 0);
    let end = prefix_end(&prefix);
    (Bound::Included(prefix), end)
}

/// What every element item of collection id `id` with tag `tag` starts with.
pub fn element_prefix(tag: u8, id: &[u8]) -> Vec<u8> {
    sub_prefix(tag, id, 0)
}

fn sub_prefix(tag: u8, key: &[u8], extra: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + key.len() + extra);
    out.push(tag);
    out.extend_from_slice(&(key.len() as u32).to_be_bytes());
    out.extend_from_slice(key);
    out
}

/// The exclusive end of the keys that start with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Bound<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return Bound::Excluded(end);
        }
    }
    Bound::Unbounded
}

/// Owned start and end of a key range.
pub type KeyRange = (Bound<Vec<u8>>, Bound<Vec<u8>>);

pub fn field_key(key: &[u8], field: &[u8]) -> Vec<u8> {
    hashed_key(TAG_FIELD, key, field)
}

/// Member `member` of the set with id `id` (its value is empty: the member is in the key).
pub fn set_member_key(id: &[u8], member: &[u8]) -> Vec<u8> {
    hashed_key(TAG_SET, id, member)
}

/// The member items of the set with id `id` from SSCAN cursor `cursor` on.
pub fn set_members_from(id: &[u8], cursor: u64) -> KeyRange {
    hashed_from(TAG_SET, id, cursor)
}

/// An element keyed by its name's scan hash (hash fields, set members).
fn hashed_key(tag: u8, id: &[u8], name: &[u8]) -> Vec<u8> {
    let mut out = sub_prefix(tag, id, 8 + name.len());
    out.extend_from_slice(&scan_hash(name).to_be_bytes());
    out.extend_from_slice(name);
    out
}

/// Every field item of the hash with id `id`.
pub fn fields_range(id: &[u8]) -> KeyRange {
    id_range(TAG_FIELD, id)
}

/// The field items of hash `key` from HSCAN cursor `cursor` on.
pub fn fields_from(key: &[u8], cursor: u64) -> KeyRange {
    hashed_from(TAG_FIELD, key, cursor)
}

/// The items with tag `tag` under `id` keyed by a scan hash (hash fields, set members), from
/// scan hash `cursor` on.
pub fn hashed_from(tag: u8, id: &[u8], cursor: u64) -> KeyRange {
    let prefix = sub_prefix(tag, id, 8);
    let end = prefix_end(&prefix);
    let mut start = prefix;
    start.extend_from_slice(&cursor.to_be_bytes());
    (Bound::Included(start), end)
}

/// A field's or set member's item's (scan hash, name), given the length of the id it is under.
pub fn decode_field(item: &[u8], key_bytes: usize) -> Option<(u64, &[u8])> {
    let at = 5 + key_bytes;
    let hash = u64::from_be_bytes(item.get(at..at + 8)?.try_into().ok()?);
    Some((hash, &item[at + 8..]))
}

pub fn member_key(key: &[u8], member: &[u8]) -> Vec<u8> {
    let mut out = sub_prefix(TAG_ZSET, key, 1 + member.len());
    out.push(ZSET_MEMBER);
    out.extend_from_slice(member);
    out
}

pub fn score_key(key: &[u8], score: f64, member: &[u8]) -> Vec<u8> {
    let mut out = sub_prefix(TAG_ZSET, key, 9 + member.len());
    out.push(ZSET_SCORE);
    out.extend_from_slice(&sortable_score(score));
    out.extend_from_slice(member);
    out
}

/// Every member item of sorted set `key`.
pub fn members_range(key: &[u8]) -> KeyRange {
    let mut prefix = sub_prefix(TAG_ZSET, key, 1);
    prefix.push(ZSET_MEMBER);
    let end = prefix_end(&prefix);
    (Bound::Included(prefix), end)
}

/// The by-score items of sorted set `key`, all of them.
pub fn scores_prefix(key: &[u8]) -> Vec<u8> {
    let mut prefix = sub_prefix(TAG_ZSET, key, 9);
    prefix.push(ZSET_SCORE);
    prefix
}

/// A by-score item's (score, member), given the Redis key's length.
pub fn decode_score(item: &[u8], key_bytes: usize) -> Option<(f64, &[u8])> {
    let at = 6 + key_bytes;
    let bits: [u8; 8] = item.get(at..at + 8)?.try_into().ok()?;
    Some((score_from_sortable(bits), &item[at + 8..]))
}

pub fn encode_score(score: f64) -> Vec<u8> {
    score.to_bits().to_be_bytes().to_vec()
}

pub fn decode_score_value(bytes: &[u8]) -> Option<f64> {
    Some(f64::from_bits(u64::from_be_bytes(bytes.try_into().ok()?)))
}

/// Big-endian bytes whose byte order is the numeric order of the scores (no NaN: commands
/// refuse it). Negative numbers have every bit flipped, positive ones only the sign bit.
pub fn sortable_score(score: f64) -> [u8; 8] {
    debug_assert!(!score.is_nan());
    // -0.0 and 0.0 are one score to Redis.
    let score = if score == 0.0 { 0.0 } else { score };
    let bits = score.to_bits();
    let ordered = if bits >> 63 == 1 { !bits } else { bits | (1 << 63) };
    ordered.to_be_bytes()
}

pub fn score_from_sortable(bytes: [u8; 8]) -> f64 {
    let ordered = u64::from_be_bytes(bytes);
    let bits = if ordered >> 63 == 1 { ordered & !(1 << 63) } else { !ordered };
    f64::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_keys_round_trip_and_order_by_scan_hash() {
        let item = meta_key(b"user:1", KeyType::Hash);
        assert_eq!(decode_meta(&item), Some((scan_hash(b"user:1"), &b"user:1"[..], KeyType::Hash)));
        assert_eq!(item.len(), META_OVERHEAD_BYTES + 6);
        let mut keys: Vec<_> =
            (0..100).map(|i| meta_key(format!("k{i}").as_bytes(), KeyType::String)).collect();
        keys.sort();
        let hashes: Vec<_> = keys.iter().map(|k| decode_meta(k).unwrap().0).collect();
        assert!(hashes.windows(2).all(|w| w[0] <= w[1]));
        assert!(decode_meta(b"h\0\0\0\x01k").is_none());
    }

    /// The worked examples of docs/format/redis-keyspace.md, byte for byte: a change here is a
    /// change of the on-disk format.
    #[test]
    fn the_documented_examples_hold() {
        let bytes = |hex: &str| -> Vec<u8> {
            hex.split(' ').map(|b| u8::from_str_radix(b, 16).unwrap()).collect()
        };
        assert_eq!(scan_hash(b"greeting"), 0x0fe4_04f0_4817_c3a1);
        assert_eq!(
            meta_key(b"greeting", KeyType::String),
            bytes("6d 0f e4 04 f0 48 17 c3 a1 67 72 65 65 74 69 6e 67 73")
        );
        assert_eq!(
            meta_key(b"user:1", KeyType::Hash),
            bytes("6d 1d ab bd 7e bf f6 ca 81 75 73 65 72 3a 31 68")
        );
        assert_eq!(
            field_key(b"user:1", b"name"),
            bytes("68 00 00 00 06 75 73 65 72 3a 31 06 1a a7 66 e1 25 3b eb 6e 61 6d 65")
        );
        assert_eq!(
            member_key(b"board", b"ann"),
            bytes("7a 00 00 00 05 62 6f 61 72 64 6d 61 6e 6e")
        );
        assert_eq!(
            score_key(b"board", 2.5, b"ann"),
            bytes("7a 00 00 00 05 62 6f 61 72 64 73 c0 04 00 00 00 00 00 00 61 6e 6e")
        );
        assert_eq!(encode_score(2.5), bytes("40 04 00 00 00 00 00 00"));
        // Version 2: collections are keyed by their id (key and version).
        let version = 0x0006_6136_bdc2_0000;
        let meta = CollectionMeta { version, count: 1, deadline_ms: None, head: None };
        assert_eq!(meta.encode(), bytes("00 06 61 36 bd c2 00 00 00 00 00 00 00 00 00 01 00"));
        assert_eq!(
            field_key(&collection_id(b"user:1", version), b"name"),
            bytes(
                "68 00 00 00 0e 75 73 65 72 3a 31 00 06 61 36 bd c2 00 00 06 1a a7 66 e1 25 3b \
                 eb 6e 61 6d 65"
            )
        );
        assert_eq!(orphans_key(b"user:1"), bytes("6f 00 00 00 06 75 73 65 72 3a 31"));
        // Version 4: a list `q` at version 1 holding "a" at the initial head.
        let list = CollectionMeta {
            version: 1,
            count: 1,
            deadline_ms: None,
            head: Some(LIST_HEAD_INITIAL),
        };
        assert_eq!(
            list.encode(),
            bytes("00 00 00 00 00 00 00 01 00 00 00 00 00 00 00 01 02 80 00 00 00 00 00 00 00")
        );
        assert_eq!(
            list_key(&collection_id(b"q", 1), LIST_HEAD_INITIAL),
            bytes("6c 00 00 00 09 71 00 00 00 00 00 00 00 01 80 00 00 00 00 00 00 00")
        );
        // Version 5: member "x" of the set `tags` at version 1.
        assert_eq!(
            set_member_key(&collection_id(b"tags", 1), b"x"),
            bytes("73 00 00 00 0c 74 61 67 73 00 00 00 00 00 00 00 01 75 78 36 32 40 59 66 89 78")
        );
        // Version 7: the 2000-byte key of 'a's is stored under its surrogate, whose name item
        // holds it.
        let name = stored_name(&[b'a'; 2000]).into_owned();
        assert_eq!(
            name,
            bytes(
                "ff c0 23 4e c4 a7 00 f8 5b 7e 9e 5c db dc 51 17 04 09 ee 2a d4 8b eb e2 f2 f0 95 \
                 7a 06 79 37 53 1a 0a 3c 42"
            )
        );
        assert_eq!(scan_hash(&name), 0x7235_5de2_23dd_2ff6);
        let mut meta = bytes("6d 72 35 5d e2 23 dd 2f f6");
        meta.extend_from_slice(&name);
        meta.push(b's');
        assert_eq!(meta_key(&name, KeyType::String), meta);
        let mut item = vec![TAG_NAME];
        item.extend_from_slice(&name);
        assert_eq!(name_key(&name), item);
        // Version 3: expiry and due items.
        let deadline = 1_795_741_200_000; // 2026-11-27 01:00 UTC
        assert_eq!(
            expiry_key(b"greeting", deadline),
            bytes("65 00 00 00 08 67 72 65 65 74 69 6e 67 00 00 01 a2 1a 84 2e 80")
        );
        assert_eq!(
            due_key(deadline, b"greeting"),
            bytes("74 00 00 01 a2 1a 84 2e 80 67 72 65 65 74 69 6e 67")
        );
        let board = collection_id(b"board", 1);
        assert_eq!(
            member_key(&board, b"ann"),
            bytes("7a 00 00 00 0d 62 6f 61 72 64 00 00 00 00 00 00 00 01 6d 61 6e 6e")
        );
        assert_eq!(
            score_key(&board, 2.5, b"ann"),
            bytes(
                "7a 00 00 00 0d 62 6f 61 72 64 00 00 00 00 00 00 00 01 73 c0 04 00 00 00 00 00 \
                 00 61 6e 6e"
            )
        );
    }

    #[test]
    fn collection_meta_round_trips_and_refuses_what_it_does_not_know() {
        for meta in [
            CollectionMeta { version: 0, count: 1, deadline_ms: None, head: None },
            CollectionMeta {
                version: u64::MAX,
                count: 3,
                deadline_ms: Some(1_795_737_600_000),
                head: Some(7),
            },
            CollectionMeta {
                version: 9,
                count: 4,
                deadline_ms: None,
                head: Some(LIST_HEAD_INITIAL),
            },
        ] {
            assert_eq!(CollectionMeta::decode(&meta.encode()), Some(meta));
        }
        let plain = CollectionMeta { version: 5, count: 2, deadline_ms: None, head: None }.encode();
        assert_eq!(CollectionMeta::decode(&[]), None, "format 1's empty meta value");
        let mut unknown_flag = plain.clone();
        unknown_flag[16] = 4;
        assert_eq!(CollectionMeta::decode(&unknown_flag), None);
        let mut missing_deadline = plain.clone();
        missing_deadline[16] = 1;
        assert_eq!(CollectionMeta::decode(&missing_deadline), None);
        let mut missing_head = plain.clone();
        missing_head[16] = 2;
        assert_eq!(CollectionMeta::decode(&missing_head), None);
        let mut trailing = plain.clone();
        trailing.push(0);
        assert_eq!(CollectionMeta::decode(&trailing), None);
        assert_eq!(CollectionMeta::decode(&plain[..16]), None);
    }

    #[test]
    fn versions_of_one_key_are_one_range_and_never_meet_format_1() {
        let id = collection_id(b"k", 42);
        assert_eq!(id_version(&id), 42);
        let field = field_key(&id, b"f");
        assert_eq!(field[6..14], 42u64.to_be_bytes(), "the version follows the key");
        let within = |range: &KeyRange, item: &[u8]| {
            matches!(&range.0, Bound::Included(s) if item >= &s[..])
                && matches!(&range.1, Bound::Excluded(e) if item < &e[..])
        };
        assert!(within(&all_versions_range(TAG_FIELD, b"k"), &field));
        assert!(within(&id_range(TAG_FIELD, &id), &field));
        assert!(!within(&id_range(TAG_FIELD, &collection_id(b"k", 43)), &field));
        // A longer key's elements, and format 1's, are outside.
        let longer = field_key(&collection_id(b"kk", 42), b"f");
        assert!(!within(&all_versions_range(TAG_FIELD, b"k"), &longer));
        assert!(!within(&all_versions_range(TAG_FIELD, b"k"), &field_key(b"k", b"f")));
        assert!(!within(&id_range(TAG_FIELD, b"k"), &field), "format 1's fields of k");
        assert_eq!(decode_orphans(&orphans_key(b"k")), Some(&b"k"[..]));
        assert!(new_version() < new_version(), "versions a process hands out increase");
    }

    #[test]
    fn expiry_items_round_trip_and_stay_within_their_key() {
        let item = expiry_key(b"k", 42);
        assert_eq!(item.len(), EXPIRY_OVERHEAD_BYTES + 1);
        assert_eq!(decode_expiry(&item, b"k"), Some(42));
        assert_eq!(decode_expiry(&item, b"kk"), None);
        let (start, end) = expiry_range(b"k");
        let within = |k: &Vec<u8>| {
            matches!(&start, Bound::Included(s) if k >= s)
                && matches!(&end, Bound::Excluded(e) if k < e)
        };
        assert!(within(&item) && within(&expiry_key(b"k", u64::MAX)));
        assert!(!within(&expiry_key(b"kk", 42)), "a longer key's expiry is outside");
        assert!(!within(&expiry_key(b"", 42)));
        let due = due_key(42, b"k");
        assert_eq!(decode_due(&due), Some((42, &b"k"[..])));
        let (start, end) = due_range(42);
        assert!(due >= start && due < end);
        assert!(due_key(43, b"") >= end, "later deadlines are not due");
        assert!(due_key(41, &[0xff; 40]) < end);
    }

    #[test]
    fn sortable_scores_sort_like_numbers() {
        let scores = [
            f64::NEG_INFINITY,
            -1e300,
            -2.5,
            -1.0,
            -1e-300,
            0.0,
            1e-300,
            1.0,
            2.5,
            1e300,
            f64::INFINITY,
        ];
        let encoded: Vec<_> = scores.iter().map(|s| sortable_score(*s)).collect();
        assert!(encoded.windows(2).all(|w| w[0] < w[1]), "{encoded:?}");
        for score in scores {
            assert_eq!(score_from_sortable(sortable_score(score)), score);
        }
        assert_eq!(sortable_score(-0.0), sortable_score(0.0));
    }

    #[test]
    fn ranges_hold_exactly_their_key_items() {
        let (start, end) = fields_range(b"a");
        let inside = field_key(b"a", b"f");
        let other = field_key(b"ab", b"f");
        let within = |k: &Vec<u8>| {
            matches!(&start, Bound::Included(s) if k >= s)
                && matches!(&end, Bound::Excluded(e) if k < e)
        };
        assert!(within(&inside));
        assert!(!within(&other), "a longer key's fields are outside (length prefix)");
        assert_eq!(decode_field(&inside, 1).unwrap().1, b"f");
        let by_score = score_key(b"z", -3.5, b"m1");
        assert_eq!(decode_score(&by_score, 1), Some((-3.5, &b"m1"[..])));
        assert_eq!(prefix_end(&[1, 0xff]), Bound::Excluded(vec![2]));
        assert_eq!(prefix_end(&[0xff]), Bound::Unbounded);
    }
}
