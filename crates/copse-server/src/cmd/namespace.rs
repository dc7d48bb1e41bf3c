//! Redis databases (SELECT 0–15) as namespaces of each shard's item keys.
//!
//! The items of *namespace* 0 are exactly the items of key space format 5: their first byte is
//! a tag (`keyspace::TAG_*`, all ≥ `NAMESPACE_FIRST_BYTE_MIN`) or the marker's 0xff. The items of
//! namespace `n` in 1..=15 are the same items with `n` as a leading byte. A Redis key goes to the
//! same shard in every database (routing looks at the key alone), so a command over two
//! databases (MOVE, COPY ... DB) is one exec.
//!
//! Which namespace a database's keys live in is the *database map* (`Databases`): SELECT names a
//! database, SWAPDB swaps two entries of the map with one durable write of the map's item, so it
//! costs the same whatever the databases hold.
//!
//! A command learns its namespace once, at dispatch (`Databases::resolve`), and every exec
//! program it builds carries it (`Namespace::current`, read by `CommandExec::new`): the program
//! is written for one key space, and its view, its reads and its writes are translated at the
//! exec's boundary (`View`, `Namespace::read_ops`, `Namespace::write_ops`). `Space::Raw` execs
//! (MOVE, the database map's own write) see item keys as stored and add prefixes themselves
//! (`prefixed`).
//!
//! Invariants:
//! - An item of namespace 0 never starts with a byte below `NAMESPACE_FIRST_BYTE_MIN`, and an
//!   item of namespace `n` > 0 always starts with `n`: so no item belongs to two namespaces, and
//!   a range of one namespace never reaches into another (`View` clamps ranges).
//! - The database map is a permutation of 0..DATABASES.
//! - A command's namespaces come from one read of the database map. SWAPDB answers only once no
//!   connection runs a wave started under the map it replaced (`databases.rs`), so a client that
//!   saw SWAPDB's reply never meets a command still writing through the old map.

use std::cell::Cell;
use std::future::Future;
use std::ops::Bound;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use copse::exec::{ExecView, ReadOp, ReadResult};
use copse::BatchOp;

pub use crate::databases::{Databases, DATABASES, DATABASE_MAP_KEY};
/// The lowest first byte of a namespace-0 item: every tag is above it, and the prefixes of the
/// other namespaces (1..=15) are below it.
pub const NAMESPACE_FIRST_BYTE_MIN: u8 = 0x10;

/// Where an exec's item keys live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Space {
    /// A namespace (0..DATABASES): keys are translated.
    Db(u8),
    /// Item keys as stored: the program adds prefixes itself.
    Raw,
}

/// An exec's namespace and the database map it was resolved under.
#[derive(Clone, Copy, Debug)]
pub struct Namespace {
    pub space: Space,
    /// Whether its execs count their key lookups (`context::Lookups`): a read command's do.
    counts_lookups: bool,
    /// The database map (packed, `databases::namespace_of`) this namespace was resolved under:
    /// a command's other databases (COPY ... DB, MOVE) come from the same map.
    map: Option<u64>,
}

thread_local! {
    /// The namespace of the command being handled on this thread (`scope`), read by the exec
    /// programs it builds. Outside any scope: namespace 0 (tests, the open-time upgrade).
    static CURRENT: Cell<Option<Namespace>> = const { Cell::new(None) };
}

impl Namespace {
    /// Namespace `number` outside any database map (background work, tests).
    pub fn detached(number: u8) -> Namespace {
        assert!((number as usize) < DATABASES);
        Namespace { space: Space::Db(number), counts_lookups: false, map: None }
    }

    pub fn raw() -> Namespace {
        Namespace { space: Space::Raw, counts_lookups: false, map: None }
    }

    /// A raw namespace under this one's map (an exec over two databases).
    pub fn as_raw(&self) -> Namespace {
        Namespace { space: Space::Raw, counts_lookups: self.counts_lookups, map: self.map }
    }

    /// The namespace of the command being handled on this thread.
    pub fn current() -> Namespace {
        CURRENT.get().unwrap_or_else(|| Namespace::detached(0))
    }

    /// Runs `f` with `self` as the current namespace.
    pub fn scope<R>(self, f: impl FnOnce() -> R) -> R {
        let previous = CURRENT.replace(Some(self));
        let result = f();
        CURRENT.set(previous);
        result
    }

    /// `future`, polled with `self` as the current namespace (so the execs it builds later are in
    /// it).
    pub fn bind<F: Future>(self, future: F) -> InNamespace<F> {
        InNamespace { namespace: self, future: Box::pin(future) }
    }

    /// Database `database`'s namespace under the same map as this one (COPY ... DB, MOVE: both
    /// ends of the command from one map, whatever SWAPDB does meanwhile).
    pub fn sibling(&self, database: u8) -> Namespace {
        let number = match self.map {
            Some(map) => crate::databases::namespace_of(map, database),
            None => database,
        };
        Namespace { space: Space::Db(number), counts_lookups: false, map: self.map }
    }

    /// This namespace, its execs counting key lookups (a read command's).
    pub fn counting_lookups(mut self) -> Namespace {
        self.counts_lookups = true;
        self
    }

    /// This namespace, its execs counting no lookups (a second look at a key already counted).
    pub fn uncounted(mut self) -> Namespace {
        self.counts_lookups = false;
        self
    }

    /// The namespace number, None for `Raw`.
    pub fn number(&self) -> Option<u8> {
        match self.space {
            Space::Db(number) => Some(number),
            Space::Raw => None,
        }
    }

    /// The prefix of this namespace's items (None: none, in namespace 0 and raw).
    fn prefix(&self) -> Option<u8> {
        match self.space {
            Space::Db(0) | Space::Raw => None,
            Space::Db(number) => Some(number),
        }
    }

    /// Item key `key` of this namespace as stored.
    pub fn item(&self, key: &[u8]) -> Vec<u8> {
        prefixed(self.number().unwrap_or(0), key)
    }

    /// A stored item key of this namespace as the program sees it.
    fn strip(&self, mut key: Vec<u8>) -> Vec<u8> {
        if self.prefix().is_some() {
            key.remove(0);
        }
        key
    }

    /// The lower bound of a range of this namespace, as stored.
    fn start(&self, bound: Bound<&[u8]>) -> Bound<Vec<u8>> {
        match (self.space, bound) {
            (Space::Raw, bound) => bound.map(<[u8]>::to_vec),
            (Space::Db(0), Bound::Unbounded) => Bound::Included(vec![NAMESPACE_FIRST_BYTE_MIN]),
            (Space::Db(0), Bound::Included(key) | Bound::Excluded(key))
                if key < [NAMESPACE_FIRST_BYTE_MIN].as_slice() =>
            {
                Bound::Included(vec![NAMESPACE_FIRST_BYTE_MIN])
            }
            (Space::Db(number), Bound::Unbounded) => Bound::Included(vec![number]),
            (_, bound) => bound.map(|key| self.item(key)),
        }
    }

    /// The upper bound of a range of this namespace, as stored.
    fn end(&self, bound: Bound<&[u8]>) -> Bound<Vec<u8>> {
        match (self.space, bound) {
            (Space::Raw | Space::Db(0), bound) => bound.map(<[u8]>::to_vec),
            (Space::Db(number), Bound::Unbounded) => Bound::Excluded(vec![number + 1]),
            (_, bound) => bound.map(|key| self.item(key)),
        }
    }

    /// A program's reads, as stored.
    pub fn read_ops(&self, ops: &mut [ReadOp]) {
        // Namespace 0 (nearly every command) changes only a scan's bounds: a GET's key as it is.
        let scans = ops.iter().any(|op| matches!(op, ReadOp::Scan { .. }));
        if self.space == Space::Raw || (self.space == Space::Db(0) && !scans) {
            return;
        }
        for op in ops {
            match op {
                ReadOp::Get(key) => {
                    if self.prefix().is_some() {
                        *key = self.item(key);
                    }
                }
                ReadOp::Scan { start, end, .. } => {
                    *start = self.start(bound_ref(start));
                    *end = self.end(bound_ref(end));
                }
            }
        }
    }

    /// The results of reads, as the program sees them.
    pub fn read_results(&self, results: &mut [ReadResult]) {
        if self.prefix().is_none() {
            return;
        }
        for result in results {
            if let ReadResult::Items(items) = result {
                for (key, _) in items.iter_mut() {
                    *key = self.strip(std::mem::take(key));
                }
            }
        }
    }

    /// A program's writes, as stored; Err when the prefix made an item key longer than copse's
    /// limit (the command then answers `too_long` and writes nothing).
    pub fn write_ops(&self, ops: &mut [BatchOp]) -> Result<(), TooLong> {
        if self.prefix().is_none() {
            return Ok(());
        }
        let mut fits = true;
        for op in ops {
            let (BatchOp::Put { key, .. } | BatchOp::Delete { key }) = op;
            *key = self.item(key);
            fits &= key.len() <= copse::limits::KEY_BYTES_MAX;
        }
        if fits {
            Ok(())
        } else {
            Err(TooLong)
        }
    }
}

/// A write whose item keys, with the namespace's byte, pass copse's key limit (`too_long`).
#[derive(Debug)]
pub struct TooLong;

/// The error of a write whose item keys, with the namespace's byte, pass copse's key limit:
/// every limit on keys, fields and members is one byte less outside namespace 0.
pub fn too_long(ops: &[BatchOp]) -> crate::resp::Reply {
    let longest = ops.iter().map(|op| op.key().len()).max().unwrap_or(0);
    crate::resp::Reply::Error(format!(
        "ERR an item of {longest} bytes is too long: outside database 0 every key, field and member limit is one byte less (docs/format/redis-keyspace.md, \"Limits\"); nothing was changed"
    ))
}

fn bound_ref(bound: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    bound.as_ref().map(Vec::as_slice)
}

/// The namespace number of the command being handled on this thread (blocked clients wait per
/// namespace and key).
pub fn current_number() -> u8 {
    Namespace::current().number().unwrap_or(0)
}

/// Item key `key` of namespace `number`, as stored.
pub fn prefixed(number: u8, key: &[u8]) -> Vec<u8> {
    assert!((number as usize) < DATABASES);
    if number == 0 {
        assert!(key.first().is_none_or(|&byte| byte >= NAMESPACE_FIRST_BYTE_MIN));
        return key.to_vec();
    }
    let mut out = Vec::with_capacity(key.len() + 1);
    out.push(number);
    out.extend_from_slice(key);
    out
}

/// What an exec program sees of its shard's index: `ExecView` in the program's namespace.
pub struct View<'a> {
    inner: &'a ExecView<'a>,
    namespace: &'a Namespace,
}

impl<'a> View<'a> {
    pub fn new(inner: &'a ExecView<'a>, namespace: &'a Namespace) -> View<'a> {
        View { inner, namespace }
    }

    /// The exec's namespace (blocked clients wait per namespace and key).
    pub fn namespace(&self) -> &Namespace {
        self.namespace
    }

    /// Counts a read command's lookup of a key that was `found` (`context::Lookups`); a write's
    /// lookups are not counted.
    pub fn note_lookup(&self, found: bool) {
        if self.namespace.counts_lookups {
            crate::context::Lookups::note(found);
        }
    }

    /// The same index seen in `namespace` (a raw exec over two databases: MOVE).
    pub fn in_namespace<'b>(&'b self, namespace: &'b Namespace) -> View<'b> {
        View { inner: self.inner, namespace }
    }

    /// The version of lock `lock` in the shard (`ExecView::lock_version`; WATCH).
    pub fn lock_version(&self, lock: u64) -> u64 {
        self.inner.lock_version(lock)
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        match self.namespace.prefix() {
            None => self.inner.contains(key),
            Some(_) => self.inner.contains(&self.namespace.item(key)),
        }
    }

    /// Whether a live key of the namespace starts with `byte` (no I/O).
    pub fn has_keys_starting_with(&self, byte: u8) -> bool {
        match self.namespace.prefix() {
            None => self.inner.has_keys_starting_with(byte),
            Some(_) => {
                let end = crate::keyspace::prefix_end(&[byte]);
                self.count(Bound::Included(&[byte]), bound_ref(&end), 1) > 0
            }
        }
    }

    /// Up to `limit` keys of the range, in order (no I/O).
    pub fn keys(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> Vec<Vec<u8>> {
        if self.namespace.space == Space::Raw {
            return self.inner.keys(start, end, limit);
        }
        let (start, end) = (self.namespace.start(start), self.namespace.end(end));
        let keys = self.inner.keys(bound_ref(&start), bound_ref(&end), limit);
        match self.namespace.prefix() {
            None => keys,
            Some(_) => keys.into_iter().map(|key| self.namespace.strip(key)).collect(),
        }
    }

    /// Keys in the range, counting no further than `limit` (no I/O).
    pub fn count(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, limit: usize) -> usize {
        if self.namespace.space == Space::Raw {
            return self.inner.count(start, end, limit);
        }
        let (start, end) = (self.namespace.start(start), self.namespace.end(end));
        self.inner.count(bound_ref(&start), bound_ref(&end), limit)
    }
}

/// A future polled in a namespace (`Namespace::bind`).
pub struct InNamespace<F: Future> {
    namespace: Namespace,
    future: Pin<Box<F>>,
}

impl<F: Future> Future for InNamespace<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        this.namespace.scope(|| this.future.as_mut().poll(cx))
    }
}

/// The namespace of database `database` (< DATABASES) under `databases`' map now.
pub fn resolve(databases: &Databases, database: u8) -> Namespace {
    let map = databases.current();
    let number = crate::databases::namespace_of(map, database);
    Namespace { space: Space::Db(number), counts_lookups: false, map: Some(map) }
}

/// A blocking command's future (BLPOP and the like), polled in its database's namespace as the
/// map has it at each poll: it holds no map while it waits, so SWAPDB never waits for it, and
/// after a swap it looks in the namespace its database now names (`lists::blocking` moves its
/// place in the queues there).
pub struct InDatabase<F: Future> {
    server: Arc<crate::context::Server>,
    database: u8,
    counts_lookups: bool,
    future: Pin<Box<F>>,
}

impl<F: Future> InDatabase<F> {
    pub fn new(
        server: Arc<crate::context::Server>,
        database: u8,
        counts_lookups: bool,
        future: F,
    ) -> InDatabase<F> {
        InDatabase { server, database, counts_lookups, future: Box::pin(future) }
    }
}

impl<F: Future> Future for InDatabase<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        let mut namespace = resolve(&this.server.databases, this.database);
        namespace.counts_lookups = this.counts_lookups;
        namespace.scope(|| this.future.as_mut().poll(cx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_never_overlap() {
        let zero = Namespace::detached(0);
        let three = Namespace::detached(3);
        assert_eq!(zero.item(b"mkey"), b"mkey");
        assert_eq!(three.item(b"mkey"), b"\x03mkey");
        assert_eq!(three.strip(b"\x03mkey".to_vec()), b"mkey");
        // Unbounded ranges stay inside their namespace.
        assert_eq!(zero.start(Bound::Unbounded), Bound::Included(vec![NAMESPACE_FIRST_BYTE_MIN]));
        assert_eq!(zero.start(Bound::Included(b"\x05")), Bound::Included(vec![0x10]));
        assert_eq!(three.start(Bound::Unbounded), Bound::Included(vec![3]));
        assert_eq!(three.end(Bound::Unbounded), Bound::Excluded(vec![4]));
        assert_eq!(three.end(Bound::Excluded(b"n")), Bound::Excluded(b"\x03n".to_vec()));
        for tag in [b'm', b'h', b'z', b'l', b's', b'o', b'e', b't'] {
            assert!(tag >= NAMESPACE_FIRST_BYTE_MIN);
        }
        assert!(DATABASES as u8 <= NAMESPACE_FIRST_BYTE_MIN);
    }
}
