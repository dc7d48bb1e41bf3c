//! YCSB's key choosers (`site.ycsb.generator` and `Utils.fnvhash64`), reproduced so that a copse
//! benchmark picks keys with exactly YCSB's skew: the FNV-1a key hash and key names, the zipfian
//! of Gray et al. (plain, scrambled, and "latest"), the uniform chooser, and the acknowledged insert
//! counter that keeps readers away from records not yet inserted.
//!
//! Invariants:
//! - Every chooser returns a value inside its documented range, for every input: a floating-point
//!   edge of the zipfian formula is clamped, never allowed to escape the range.
//! - Nothing here panics on any input. Degenerate inputs have a documented meaning instead: an item
//!   count of 0 is treated as 1, an inverted range `max < min` as the single item `min`, and a
//!   `theta` outside `[0, MAX_THETA]` (or NaN) is clamped into it (the workload layer is expected
//!   to reject such values before they get here; the clamp only keeps this module total).
//! - Given the same uniform draw `u` in `[0, 1)`, a zipfian at its constructed item count maps it
//!   to the item YCSB maps it to (`Zipfian::next_from_unit`). The random streams themselves differ
//!   from Java's `java.util.Random`, so sequences match YCSB in distribution, not draw for draw.
//!
//! Deliberate departures from YCSB's source, each where YCSB's behaviour is accidental:
//! - When a zipfian's item count changes, YCSB recomputes `eta` from the *constructed* item count
//!   and the new `zetan`; once the count has doubled this skips items 2 and 3 entirely. We compute
//!   `eta` from the current count, so a grown zipfian equals one built at that count. In a YCSB
//!   workload D run (count grows a few percent) the two differ by well under 1% in `eta`.
//! - When the count shrinks, YCSB (by default) keeps the larger count's `zetan`; we recompute it.
//! - `ScrambledZipfian::with_theta` for a theta other than 0.99 sums zeta over the real item count
//!   instead of YCSB's 10^10 items (which takes minutes); see its documentation.
//! - `fnv_hash64` returns a `u64`: for the single raw hash `i64::MIN`, whose Java `Math.abs` stays
//!   negative, YCSB would produce a negative key number; we produce 2^63.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rand::Rng;

const FNV_OFFSET_BASIS_64: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME_64: u64 = 0x0000_0100_0000_01b3;

/// YCSB's default zipfian constant (the skew of workloads A, B, C, E and F).
pub const ZIPFIAN_CONSTANT: f64 = 0.99;

/// The largest theta accepted; Gray et al.'s method needs `theta < 1` (`alpha = 1 / (1 - theta)`).
pub const MAX_THETA: f64 = 0.9999;

/// YCSB's ScrambledZipfianGenerator draws from a zipfian over this many items and hashes the draw
/// into the real range.
pub const SCRAMBLED_ITEM_COUNT: u64 = 10_000_000_000;

/// `zeta(SCRAMBLED_ITEM_COUNT, 0.99)`, precomputed by YCSB; computing it takes minutes.
pub const SCRAMBLED_ZETAN: f64 = 26.46902820178302;

/// FNV-1a 64 over the 8 little-endian bytes of `value`, then YCSB's `Math.abs` of the hash read as
/// a signed 64-bit integer (so the result is below 2^63, except for a raw hash of exactly 2^63,
/// which wrapping negation leaves at 2^63).
pub fn fnv_hash64(value: u64) -> u64 {
    let mut hash = FNV_OFFSET_BASIS_64;
    for byte in value.to_le_bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(FNV_PRIME_64);
    }
    (hash as i64).wrapping_abs() as u64
}

/// YCSB's key name for record number `record` when inserts are hashed (`insertorder=hashed`,
/// `zeropadding=1`): `"user"` followed by the decimal `fnv_hash64(record)`.
pub fn key_name(record: u64) -> String {
    format!("user{}", fnv_hash64(record))
}

/// YCSB's zeta: `sum_{i=0}^{n-1} 1 / (i+1)^theta`. Takes O(n) time.
pub fn zeta(n: u64, theta: f64) -> f64 {
    zeta_from(0, n, theta, 0.0)
}

/// `initial_sum + sum_{i=start}^{n-1} 1 / (i+1)^theta`: extends a zeta over `start` items to `n`.
pub fn zeta_from(start: u64, n: u64, theta: f64, initial_sum: f64) -> f64 {
    // Summed in YCSB's order (small terms last) so results match YCSB's to the last bit or two.
    let mut sum = initial_sum;
    for i in start..n {
        sum += 1.0 / ((i + 1) as f64).powf(theta);
    }
    sum
}

fn clamp_theta(theta: f64) -> f64 {
    if theta.is_nan() {
        ZIPFIAN_CONSTANT
    } else {
        theta.clamp(0.0, MAX_THETA)
    }
}

/// YCSB's ZipfianGenerator (Gray et al., "Quickly generating billion-record synthetic databases",
/// SIGMOD 1994): items `base..base+items`, item `base` the most popular, item `base + i` drawn with
/// probability close to `1 / ((i+1)^theta * zeta(items, theta))`. Items 0 and 1 are exact; the
/// closed-form inversion used for the rest overweights the next few items (item 2 by 17% at
/// 1000 items and theta 0.99), which is YCSB's skew and therefore ours.
#[derive(Clone, Debug)]
pub struct Zipfian {
    base: u64,
    /// The item count `next` draws over.
    items: u64,
    theta: f64,
    alpha: f64,
    zeta2theta: f64,
    /// Draws with `u * zetan` below this (and at least 1) are item 1: `1 + 0.5^theta`.
    item1_bound: f64,
    /// `zeta(count_for_zeta, theta)`.
    zetan: f64,
    eta: f64,
    count_for_zeta: u64,
}

impl Zipfian {
    /// A zipfian over `base..base+items`; computes `zeta(items, theta)` in O(items) time. `items`
    /// of 0 is treated as 1; `theta` is clamped into `[0, MAX_THETA]` (NaN becomes 0.99).
    pub fn new(base: u64, items: u64, theta: f64) -> Zipfian {
        let items = items.max(1);
        let theta = clamp_theta(theta);
        Zipfian::with_zetan(base, items, theta, zeta(items, theta))
    }

    /// As [`Zipfian::new`], with `zetan = zeta(items, theta)` supplied by the caller (it is
    /// trusted: a wrong value skews the distribution but results stay in range).
    pub fn with_zetan(base: u64, items: u64, theta: f64, zetan: f64) -> Zipfian {
        let items = items.max(1);
        let theta = clamp_theta(theta);
        let zeta2theta = zeta(2, theta);
        let mut zipfian = Zipfian {
            base,
            items,
            theta,
            alpha: 1.0 / (1.0 - theta),
            zeta2theta,
            item1_bound: 1.0 + 0.5_f64.powf(theta),
            zetan,
            eta: 0.0,
            count_for_zeta: items,
        };
        zipfian.eta = zipfian.eta_for(items);
        zipfian
    }

    fn eta_for(&self, item_count: u64) -> f64 {
        // With 2 items (or fewer) this is 0/0 = NaN, but then every draw is item 0 or 1 before
        // eta is used.
        (1.0 - (2.0 / item_count as f64).powf(1.0 - self.theta))
            / (1.0 - self.zeta2theta / self.zetan)
    }

    /// A draw over the first `item_count` items (`base..base+item_count`; 0 is treated as 1).
    /// The count may change between calls: `zetan` is then extended incrementally from the
    /// previous count when it grows (cheap for small growth), recomputed in O(item_count) when it
    /// shrinks.
    pub fn next_with_count<R: Rng>(&mut self, rng: &mut R, item_count: u64) -> u64 {
        let unit: f64 = rng.gen();
        self.next_from_unit(unit, item_count)
    }

    /// A draw over the constructed item count.
    pub fn next<R: Rng>(&mut self, rng: &mut R) -> u64 {
        self.next_with_count(rng, self.items)
    }

    /// The deterministic half of [`Zipfian::next_with_count`]: the item that the uniform draw
    /// `unit` in `[0, 1)` selects (values outside are clamped into the item range). Public so
    /// callers and tests can check the mapping against YCSB's without a random source.
    pub fn next_from_unit(&mut self, unit: f64, item_count: u64) -> u64 {
        let item_count = item_count.max(1);
        if item_count != self.count_for_zeta {
            self.zetan = if item_count > self.count_for_zeta {
                zeta_from(self.count_for_zeta, item_count, self.theta, self.zetan)
            } else {
                zeta(item_count, self.theta)
            };
            self.count_for_zeta = item_count;
            self.eta = self.eta_for(item_count);
        }
        let scaled = unit * self.zetan;
        let offset = if scaled < 1.0 {
            0
        } else if scaled < self.item1_bound {
            1
        } else {
            // `as` saturates and maps NaN to 0, so a degenerate eta cannot wrap around.
            (item_count as f64 * (self.eta * unit - self.eta + 1.0).powf(self.alpha)) as u64
        };
        // The power can round up to exactly 1.0 for `unit` just below 1, giving `item_count`.
        self.base.saturating_add(offset.min(item_count - 1))
    }
}

/// YCSB's ScrambledZipfianGenerator over `min..=max`: a zipfian draw over YCSB's 10^10 items,
/// hashed into the range (`min + fnv_hash64(draw) % item_count`), so that the popular items are
/// spread over the key space instead of clustered at `min`. The hashing merges draws, so the
/// skew is the zipfian's only approximately: at 100,000 items the 1% most popular keys get
/// about 30.5% of the draws.
#[derive(Clone, Debug)]
pub struct ScrambledZipfian {
    min: u64,
    /// `max - min`: the item count minus one, so the full `u64` range needs no 2^64.
    span: u64,
    zipfian: Zipfian,
}

impl ScrambledZipfian {
    /// Over `min..=max` with theta 0.99 (YCSB's only precomputed case; constant time). An
    /// inverted range is treated as the single item `min`.
    pub fn new(min: u64, max: u64) -> ScrambledZipfian {
        ScrambledZipfian::with_theta(min, max, ZIPFIAN_CONSTANT)
    }

    /// Over `min..=max` with the given theta. For 0.99 this is YCSB's generator. For any other
    /// theta YCSB would sum zeta over 10^10 items (minutes); we instead draw from a zipfian over
    /// the real item count and hash that into the range, which takes O(item count) time here.
    pub fn with_theta(min: u64, max: u64, theta: f64) -> ScrambledZipfian {
        let span = max.saturating_sub(min);
        // An exact comparison, as YCSB's: the precomputed zetan is valid for 0.99 only.
        let zipfian = if theta == ZIPFIAN_CONSTANT {
            // YCSB builds `ZipfianGenerator(0, ITEM_COUNT, ...)`, a min/max pair: ITEM_COUNT + 1
            // items, with the zetan of ITEM_COUNT. Kept so a uniform draw maps to YCSB's item.
            Zipfian::with_zetan(0, SCRAMBLED_ITEM_COUNT + 1, theta, SCRAMBLED_ZETAN)
        } else {
            Zipfian::new(0, span.saturating_add(1), theta)
        };
        ScrambledZipfian { min, span, zipfian }
    }

    /// A value in `min..=max`.
    pub fn next<R: Rng>(&mut self, rng: &mut R) -> u64 {
        let hash = fnv_hash64(self.zipfian.next(rng));
        let offset = match self.span.checked_add(1) {
            Some(item_count) => hash % item_count,
            None => hash,
        };
        self.min + offset
    }
}

/// YCSB's SkewedLatestGenerator: the most recently inserted record is the most popular. A draw is
/// `latest - zipfian.next_with_count(latest)` where `latest` is YCSB's `lastValue()` of the insert
/// counter: the highest record number acknowledged contiguously
/// ([`AcknowledgedCounter::last_value`]).
///
/// Because the zipfian draw is in `0..latest`, results are in `1..=latest`: record 0 is never
/// chosen. That is YCSB's behaviour and is kept. With `latest` 0 the result is 0.
#[derive(Clone, Debug)]
pub struct SkewedLatest {
    zipfian: Zipfian,
}

impl SkewedLatest {
    /// Computes `zeta(initial_latest, 0.99)` once (O(initial_latest)); clone the result per
    /// thread. Later, larger `latest` values extend zeta incrementally.
    pub fn new(initial_latest: u64) -> SkewedLatest {
        SkewedLatest { zipfian: Zipfian::new(0, initial_latest, ZIPFIAN_CONSTANT) }
    }

    /// A record number in `1..=latest` (0 when `latest` is 0), most likely `latest`.
    pub fn next<R: Rng>(&mut self, rng: &mut R, latest: u64) -> u64 {
        if latest == 0 {
            // Not passed on: the zipfian would recompute zeta from scratch for the shrunk count,
            // and again when `latest` next grows.
            return 0;
        }
        latest - self.zipfian.next_with_count(rng, latest)
    }
}

/// YCSB's UniformLongGenerator: uniform over `min..=max`. An inverted range is treated as the
/// single item `min`.
#[derive(Clone, Debug)]
pub struct Uniform {
    min: u64,
    max: u64,
}

impl Uniform {
    pub fn new(min: u64, max: u64) -> Uniform {
        Uniform { min, max: max.max(min) }
    }

    pub fn next<R: Rng>(&mut self, rng: &mut R) -> u64 {
        rng.gen_range(self.min..=self.max)
    }
}

/// YCSB's AcknowledgedCounterGenerator, shareable between threads: hands out increasing record
/// numbers for inserts, starting at `start`, and reports as [`last_value`](Self::last_value) the
/// highest number `n` such that every number from `start` to `n` has been acknowledged, so readers
/// never name a record whose insert (or an earlier one) is still in flight.
///
/// Acknowledge every number handed out, including those whose insert failed (YCSB acknowledges in
/// a `finally`): an unacknowledged number stalls `last_value` and the out-of-order set grows.
#[derive(Debug)]
pub struct AcknowledgedCounter {
    /// The next number to hand out.
    next: AtomicU64,
    /// One past the highest contiguously acknowledged number; written only under `pending`'s
    /// lock, read without it. Kept one past so that `start` 0 needs no -1.
    limit_end: AtomicU64,
    /// Acknowledged numbers above `limit_end`, waiting for the gap below them to fill.
    pending: Mutex<BTreeSet<u64>>,
}

impl AcknowledgedCounter {
    /// A counter whose first number is `start`. `last_value` is `start - 1` until `start` is
    /// acknowledged; with `start` 0 it is 0 both before and after 0 is acknowledged (YCSB's -1
    /// has no `u64`), so pass `start >= 1` when that distinction matters.
    pub fn new(start: u64) -> AcknowledgedCounter {
        AcknowledgedCounter {
            next: AtomicU64::new(start),
            limit_end: AtomicU64::new(start),
            pending: Mutex::new(BTreeSet::new()),
        }
    }

    /// The next record number to insert.
    pub fn next(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Marks `value` as inserted. Numbers never handed out, already covered by `last_value`, or
    /// already acknowledged are ignored: they would otherwise let readers name absent records.
    pub fn acknowledge(&self, value: u64) {
        // A panic elsewhere while holding the lock cannot leave the set inconsistent (each update
        // below is completed before anything can panic), so a poisoned lock is still usable.
        let mut pending = self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut limit_end = self.limit_end.load(Ordering::Relaxed);
        // `value` was handed out by `next` before this call (on this thread or one that
        // synchronised with it), so a value at or beyond `next` was never handed out.
        if value < limit_end || value >= self.next.load(Ordering::Relaxed) {
            return;
        }
        if value != limit_end {
            pending.insert(value);
            return;
        }
        limit_end += 1;
        while pending.first() == Some(&limit_end) {
            pending.pop_first();
            limit_end += 1;
        }
        // Release: a reader that sees the new limit also sees everything the acknowledging
        // threads did before acknowledging (the inserts themselves).
        self.limit_end.store(limit_end, Ordering::Release);
    }

    /// The highest number `n` such that every number from `start` to `n` is acknowledged;
    /// `start - 1` before any (0 if `start` is 0). Lock-free.
    pub fn last_value(&self) -> u64 {
        self.limit_end.load(Ordering::Acquire).saturating_sub(1)
    }
}
