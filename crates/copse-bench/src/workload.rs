//! What a benchmark asks of an engine: YCSB's core workloads A–F (as YCSB's `workloads/workload*`
//! files define them), the load phase, and KVell's production mix; the request distributions; the
//! size of each record; and the per-thread generator that turns them into a stream of operations.
//!
//! Invariants: a record's key and value size depend only on its record number (so a reader can
//! check the length it gets back, and every engine sees the same data); a request never names a
//! record that has not been acknowledged as inserted (YCSB redraws such choices), so a missing key
//! is always an engine error, never a workload artefact.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::generator::{self, AcknowledgedCounter, ScrambledZipfian, SkewedLatest, Uniform};

/// YCSB workload E's `maxscanlength`: a scan asks for 1..=100 items, uniformly.
pub const SCAN_ITEMS_MAX: usize = 100;
/// YCSB's default record: 10 fields of 100 bytes, stored by key-value bindings as one value.
pub const RECORD_BYTES_DEFAULT: usize = 1024;
/// KVell's production mix: value sizes and how often each occurs. The paper reports items of
/// 250 B to 1 KiB with a median of 400 B; the issue asks for 100/400/1024/4096, so the weights put
/// the median at 400 B and keep 4 KiB items rare.
pub const KVELL_VALUE_BYTES: [usize; 4] = [100, 400, 1024, 4096];
pub const KVELL_VALUE_WEIGHTS_PERCENT: [u64; 4] = [20, 40, 30, 10];

/// One kind of request; the names are the JSON keys of the per-operation figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpKind {
    Read,
    Update,
    Insert,
    Scan,
    ReadModifyWrite,
}

impl OpKind {
    pub const ALL: [OpKind; 5] =
        [OpKind::Read, OpKind::Update, OpKind::Insert, OpKind::Scan, OpKind::ReadModifyWrite];

    pub fn name(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Update => "update",
            OpKind::Insert => "insert",
            OpKind::Scan => "scan",
            OpKind::ReadModifyWrite => "read-modify-write",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether the operation writes a value (counted in user bytes written).
    pub fn writes(self) -> bool {
        matches!(self, OpKind::Update | OpKind::Insert | OpKind::ReadModifyWrite)
    }
}

/// A workload: the proportions of each operation and its default request distribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// Inserts every record once, in record-number order (which is hashed key order).
    Load,
    A,
    B,
    C,
    D,
    E,
    F,
    /// KVell's production mix: 58% updates, 40% reads, 2% scans, mixed item sizes.
    Kvell,
}

/// Proportions of each operation, summing to 1.
#[derive(Clone, Copy, Debug)]
pub struct Mix {
    pub read: f64,
    pub update: f64,
    pub insert: f64,
    pub scan: f64,
    pub read_modify_write: f64,
}

impl Workload {
    pub fn parse(name: &str) -> Option<Workload> {
        Some(match name.to_ascii_lowercase().as_str() {
            "load" => Workload::Load,
            "a" => Workload::A,
            "b" => Workload::B,
            "c" => Workload::C,
            "d" => Workload::D,
            "e" => Workload::E,
            "f" => Workload::F,
            "kvell" => Workload::Kvell,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Workload::Load => "load",
            Workload::A => "a",
            Workload::B => "b",
            Workload::C => "c",
            Workload::D => "d",
            Workload::E => "e",
            Workload::F => "f",
            Workload::Kvell => "kvell",
        }
    }

    /// YCSB's `workloads/workload{a..f}` proportions.
    pub fn mix(self) -> Mix {
        let none = Mix { read: 0.0, update: 0.0, insert: 0.0, scan: 0.0, read_modify_write: 0.0 };
        match self {
            Workload::Load => Mix { insert: 1.0, ..none },
            Workload::A => Mix { read: 0.5, update: 0.5, ..none },
            Workload::B => Mix { read: 0.95, update: 0.05, ..none },
            Workload::C => Mix { read: 1.0, ..none },
            Workload::D => Mix { read: 0.95, insert: 0.05, ..none },
            Workload::E => Mix { scan: 0.95, insert: 0.05, ..none },
            Workload::F => Mix { read: 0.5, read_modify_write: 0.5, ..none },
            Workload::Kvell => Mix { read: 0.40, update: 0.58, scan: 0.02, ..none },
        }
    }

    /// YCSB's `requestdistribution` for the workload (D: latest; the rest zipfian).
    pub fn default_distribution(self) -> Distribution {
        match self {
            Workload::D => Distribution::Latest,
            _ => Distribution::Zipfian,
        }
    }
}

/// How requests pick records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Distribution {
    Uniform,
    /// YCSB's scrambled zipfian (constant 0.99): hot records spread over the key space.
    Zipfian,
    /// YCSB's skewed-latest: the most recently inserted records are the hottest.
    Latest,
}

impl Distribution {
    pub fn parse(name: &str) -> Option<Distribution> {
        Some(match name.to_ascii_lowercase().as_str() {
            "uniform" => Distribution::Uniform,
            "zipfian" => Distribution::Zipfian,
            "latest" => Distribution::Latest,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Distribution::Uniform => "uniform",
            Distribution::Zipfian => "zipfian",
            Distribution::Latest => "latest",
        }
    }
}

/// One phase of a run: a workload under a distribution, written `a` (YCSB's own distribution) or
/// `a@uniform`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhaseSpec {
    pub workload: Workload,
    pub distribution: Distribution,
}

impl PhaseSpec {
    pub fn parse(text: &str) -> Result<PhaseSpec, String> {
        let (workload_name, distribution_name) = match text.split_once('@') {
            Some((workload, distribution)) => (workload, Some(distribution)),
            None => (text, None),
        };
        let workload = Workload::parse(workload_name.trim()).ok_or_else(|| {
            format!("unknown workload {workload_name:?} (known: load, a, b, c, d, e, f, kvell)")
        })?;
        let distribution = match distribution_name {
            None => workload.default_distribution(),
            Some(name) => Distribution::parse(name.trim()).ok_or_else(|| {
                format!("unknown distribution {name:?} (known: uniform, zipfian, latest)")
            })?,
        };
        Ok(PhaseSpec { workload, distribution })
    }

    /// `load`, or `a@zipfian`: the label in reports.
    pub fn label(&self) -> String {
        match self.workload {
            Workload::Load => "load".to_string(),
            workload => format!("{}@{}", workload.name(), self.distribution.name()),
        }
    }
}

/// The size of each record's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordSize {
    Fixed(usize),
    /// KVell's production mix: [`KVELL_VALUE_BYTES`] with [`KVELL_VALUE_WEIGHTS_PERCENT`].
    KvellMix,
}

impl RecordSize {
    pub fn parse(text: &str) -> Result<RecordSize, String> {
        if text.eq_ignore_ascii_case("kvell") {
            return Ok(RecordSize::KvellMix);
        }
        match text.parse::<usize>() {
            Ok(bytes) if bytes > 0 => Ok(RecordSize::Fixed(bytes)),
            _ => {
                Err(format!("record size {text:?} is neither a positive byte count nor \"kvell\""))
            }
        }
    }

    pub fn label(&self) -> String {
        match self {
            RecordSize::Fixed(bytes) => bytes.to_string(),
            RecordSize::KvellMix => "kvell".to_string(),
        }
    }

    /// The value size of `record`: fixed, or drawn from the mix by a hash of the record number
    /// so that it is the same on every write and checkable on every read.
    pub fn value_bytes(&self, record: u64) -> usize {
        match self {
            RecordSize::Fixed(bytes) => *bytes,
            RecordSize::KvellMix => {
                // A different hash from the key's, so sizes do not follow key order.
                let draw = generator::fnv_hash64(record ^ 0x9e37_79b9_7f4a_7c15) % 100;
                let mut cumulative = 0;
                for (bytes, weight) in KVELL_VALUE_BYTES.iter().zip(KVELL_VALUE_WEIGHTS_PERCENT) {
                    cumulative += weight;
                    if draw < cumulative {
                        return *bytes;
                    }
                }
                KVELL_VALUE_BYTES[KVELL_VALUE_BYTES.len() - 1]
            }
        }
    }

    /// Mean value bytes (for sizing a dataset against the cache).
    pub fn mean_value_bytes(&self) -> f64 {
        match self {
            RecordSize::Fixed(bytes) => *bytes as f64,
            RecordSize::KvellMix => {
                KVELL_VALUE_BYTES
                    .iter()
                    .zip(KVELL_VALUE_WEIGHTS_PERCENT)
                    .map(|(bytes, weight)| *bytes as f64 * weight as f64)
                    .sum::<f64>()
                    / 100.0
            }
        }
    }
}

/// One request, as a client thread issues it.
#[derive(Clone, Copy, Debug)]
pub struct Op {
    pub kind: OpKind,
    pub record: u64,
    /// Items a scan asks for; 0 for other kinds.
    pub scan_items: usize,
}

/// What a phase's client threads share: the insert sequence (YCSB's acknowledged counter), so
/// that reads only name acknowledged records and "latest" follows the inserts.
pub struct Shared {
    /// Shared by every phase of a run, so inserts continue where the last phase stopped.
    pub inserts: Arc<AcknowledgedCounter>,
    /// Records present when the phase starts.
    pub record_count: u64,
    /// YCSB's `expectednewkeys`: the zipfian chooser's range covers the records the phase may
    /// insert, and draws beyond the last acknowledged insert are redrawn.
    pub expected_new_records: u64,
    /// Zipfian draws beyond the last insert are redrawn at most this many times in a row; then
    /// the draw is taken modulo the records present (a tiny dataset cannot livelock).
    pub redraws_max: u32,
}

/// The per-thread key chooser (each thread owns its generator and random source).
#[derive(Clone, Debug)]
enum Chooser {
    Uniform(Uniform),
    Zipfian(ScrambledZipfian),
    Latest(SkewedLatest),
}

/// Turns a phase's mix and distribution into operations, for one client thread.
pub struct OpGenerator {
    workload: Workload,
    cumulative: [(f64, OpKind); 5],
    chooser: Chooser,
    rng: StdRng,
    shared: Arc<Shared>,
}

impl OpGenerator {
    /// A template holding the precomputed generator state (zeta sums take time for large
    /// counts); clone it per thread with [`OpGenerator::for_thread`].
    pub fn new(spec: PhaseSpec, shared: Arc<Shared>, seed: u64) -> OpGenerator {
        let mix = spec.workload.mix();
        let mut cumulative = [(0.0, OpKind::Read); 5];
        let mut total = 0.0;
        for (index, (share, kind)) in [
            (mix.read, OpKind::Read),
            (mix.update, OpKind::Update),
            (mix.insert, OpKind::Insert),
            (mix.scan, OpKind::Scan),
            (mix.read_modify_write, OpKind::ReadModifyWrite),
        ]
        .into_iter()
        .enumerate()
        {
            total += share;
            cumulative[index] = (total, kind);
        }
        let records = shared.record_count.max(1);
        let chooser = match spec.distribution {
            Distribution::Uniform => Chooser::Uniform(Uniform::new(0, records - 1)),
            Distribution::Zipfian => Chooser::Zipfian(ScrambledZipfian::new(
                0,
                records + shared.expected_new_records - 1,
            )),
            Distribution::Latest => Chooser::Latest(SkewedLatest::new(records - 1)),
        };
        OpGenerator {
            workload: spec.workload,
            cumulative,
            chooser,
            rng: StdRng::seed_from_u64(seed),
            shared,
        }
    }

    /// A copy for client thread `thread`, with its own random stream.
    pub fn for_thread(&self, thread: u64, seed: u64) -> OpGenerator {
        OpGenerator {
            workload: self.workload,
            cumulative: self.cumulative,
            chooser: self.chooser.clone(),
            rng: StdRng::seed_from_u64(seed ^ generator::fnv_hash64(thread + 1)),
            shared: self.shared.clone(),
        }
    }

    /// The next operation. Inserts take the next record number from the shared sequence; the
    /// caller must [`AcknowledgedCounter::acknowledge`] it once the insert is durable.
    pub fn next_op(&mut self) -> Op {
        if self.workload == Workload::Load {
            unreachable!("the load phase numbers records itself");
        }
        let draw: f64 = self.rng.gen();
        let kind = self
            .cumulative
            .iter()
            .find(|(bound, _)| draw < *bound)
            .map_or(self.cumulative[4].1, |(_, kind)| *kind);
        match kind {
            OpKind::Insert => Op { kind, record: self.shared.inserts.next(), scan_items: 0 },
            OpKind::Scan => {
                let record = self.choose_record();
                Op { kind, record, scan_items: self.rng.gen_range(1..=SCAN_ITEMS_MAX) }
            }
            _ => Op { kind, record: self.choose_record(), scan_items: 0 },
        }
    }

    /// A record that has been acknowledged as inserted (YCSB's `nextKeynum`).
    fn choose_record(&mut self) -> u64 {
        let last = self.shared.inserts.last_value();
        match &mut self.chooser {
            Chooser::Uniform(uniform) => uniform.next(&mut self.rng),
            Chooser::Latest(latest) => latest.next(&mut self.rng, last),
            Chooser::Zipfian(zipfian) => {
                let mut record = zipfian.next(&mut self.rng);
                let mut redraws = 0;
                while record > last {
                    if redraws == self.shared.redraws_max {
                        return record % (last + 1);
                    }
                    record = zipfian.next(&mut self.rng);
                    redraws += 1;
                }
                record
            }
        }
    }
}

/// Fills `value` with fresh random bytes (incompressible, so no engine gains from compression).
pub fn fill_value(rng: &mut StdRng, value: &mut Vec<u8>, bytes: usize) {
    value.resize(bytes, 0);
    rng.fill(&mut value[..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(records: u64) -> Arc<Shared> {
        Arc::new(Shared {
            inserts: Arc::new(AcknowledgedCounter::new(records)),
            record_count: records,
            expected_new_records: records / 10,
            redraws_max: 1000,
        })
    }

    #[test]
    fn phase_specs_parse_with_ycsb_defaults() {
        assert_eq!(PhaseSpec::parse("d").unwrap().distribution, Distribution::Latest);
        assert_eq!(PhaseSpec::parse("a").unwrap().distribution, Distribution::Zipfian);
        let spec = PhaseSpec::parse("E@uniform").unwrap();
        assert_eq!((spec.workload, spec.label()), (Workload::E, "e@uniform".to_string()));
        assert!(PhaseSpec::parse("g").is_err());
        assert!(PhaseSpec::parse("a@gaussian").is_err());
    }

    #[test]
    fn mixes_follow_ycsb_proportions() {
        let mut generator = OpGenerator::new(PhaseSpec::parse("b").unwrap(), shared(1000), 7);
        let mut counts = [0u64; 5];
        for _ in 0..100_000 {
            counts[generator.next_op().kind.index()] += 1;
        }
        let reads = counts[OpKind::Read.index()] as f64 / 100_000.0;
        assert!((reads - 0.95).abs() < 0.005, "read share {reads}");
        assert_eq!(counts[OpKind::Scan.index()] + counts[OpKind::Insert.index()], 0);
    }

    #[test]
    fn records_are_never_beyond_the_acknowledged_inserts() {
        let shared = shared(100);
        let mut generator = OpGenerator::new(PhaseSpec::parse("e").unwrap(), shared.clone(), 3);
        for _ in 0..20_000 {
            let op = generator.next_op();
            match op.kind {
                OpKind::Insert => shared.inserts.acknowledge(op.record),
                _ => {
                    assert!(op.record <= shared.inserts.last_value());
                    assert!((1..=SCAN_ITEMS_MAX).contains(&op.scan_items));
                }
            }
        }
        assert!(shared.inserts.last_value() > 100, "inserts advanced the sequence");
    }

    #[test]
    fn kvell_sizes_are_stable_and_weighted() {
        let size = RecordSize::KvellMix;
        let mut counts = [0u64; 4];
        for record in 0..100_000u64 {
            let bytes = size.value_bytes(record);
            assert_eq!(bytes, size.value_bytes(record));
            counts[KVELL_VALUE_BYTES.iter().position(|b| *b == bytes).unwrap()] += 1;
        }
        for (count, weight) in counts.iter().zip(KVELL_VALUE_WEIGHTS_PERCENT) {
            let share = *count as f64 / 1000.0;
            assert!((share - weight as f64).abs() < 1.0, "share {share}% vs {weight}%");
        }
    }
}
