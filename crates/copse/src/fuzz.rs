//! Fuzz targets for the decoders that read bytes copse did not necessarily write (a slab page,
//! the manifest), and the time-boxed driver every fuzz target runs under (docs/reliability.md).
//!
//! A target takes arbitrary bytes and checks more than "no panic": whatever a decoder accepts
//! must encode back to the very bytes it came from, so a decoder can never accept a damaged or
//! foreign page as something else. The driver is a mutation fuzzer, not a coverage-guided one:
//! it starts from a corpus of valid encodings and applies random byte-level mutations, and it
//! *seals* mutated records (recomputes their crc32c) on request, so mutations reach the value
//! decoders and recovery's judgement behind the checksums instead of stopping at them.
//!
//! Every input derives from `(seed, index)` alone: a failure prints the seed to replay it with
//! (`COPSE_FUZZ_SEED=<seed> COPSE_FUZZ_INPUTS=1`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::engine::batch_codec::{decode_batch, encode_batch};
use crate::engine::native::format::{
    checksum, decode_slab_header, decode_slot, encode_record, encode_slab_header, header_checksum,
    peek_damaged_key, Loc, RecordKind, RecordLayout, SizeClass, SlabHeader, Slot,
    RECORD_HEADER_BYTES, RECORD_MAGIC, SLAB_FORMAT_VERSION,
};
use crate::engine::native::recovery::ShardScan;
use crate::engine::part::{self, PartState};
use crate::engine::{BatchOp, EngineKind};
use crate::limits::PAGE_BYTES;
use crate::store::manifest::{self, Manifest};

/// Size classes whose slots lie inside one page (the slab-page target decodes one page).
const IN_PAGE_CLASSES: u8 = 13;
/// Mutations applied to one corpus entry, at most.
const MUTATIONS_PER_INPUT_MAX: u32 = 8;
/// Bytes of a failing input printed in the report.
const FAILING_INPUT_SHOWN_BYTES_MAX: usize = 256;

/// How long a fuzz run goes on: until either bound is reached.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub time: Duration,
    pub inputs_max: u64,
}

impl Budget {
    /// From `COPSE_FUZZ_SECONDS` and `COPSE_FUZZ_INPUTS`, else `default_seconds` and no count.
    pub fn from_env(default_seconds: u64) -> Budget {
        let env = |name: &str| std::env::var(name).ok().and_then(|value| value.parse().ok());
        Budget {
            time: Duration::from_secs(env("COPSE_FUZZ_SECONDS").unwrap_or(default_seconds)),
            inputs_max: env("COPSE_FUZZ_INPUTS").unwrap_or(u64::MAX),
        }
    }
}

/// What a fuzz run did.
#[derive(Clone, Debug)]
pub struct FuzzReport {
    pub target: String,
    pub inputs: u64,
    pub seconds: f64,
    /// The first failure: the input's seed and what went wrong.
    pub failure: Option<String>,
}

impl FuzzReport {
    /// Prints the figures (for `make torture`'s log) and panics with the failure, if any: what a
    /// fuzz test ends with.
    pub fn assert_clean(self) {
        eprintln!(
            "fuzz {}: {} inputs in {:.1} s ({:.0}/s)",
            self.target,
            self.inputs,
            self.seconds,
            self.inputs as f64 / self.seconds.max(1e-9)
        );
        if let Some(failure) = self.failure {
            panic!("{failure}");
        }
        assert!(self.inputs > 0, "the fuzz budget ran no input");
    }
}

/// Runs `target` on mutated corpus entries until the budget is spent or an input fails. Input
/// `i` is made from seed `seed_start + i` (`COPSE_FUZZ_SEED` sets `seed_start`; default 0).
pub fn run(name: &str, corpus: &[Vec<u8>], target: fn(&[u8]), budget: Budget) -> FuzzReport {
    assert!(!corpus.is_empty());
    let seed_start =
        std::env::var("COPSE_FUZZ_SEED").ok().and_then(|value| value.parse().ok()).unwrap_or(0u64);
    let started = Instant::now();
    let mut inputs = 0u64;
    let mut failure = None;
    // A failing target panics; keep the default hook from printing every one.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    while inputs < budget.inputs_max && started.elapsed() < budget.time {
        let seed = seed_start.wrapping_add(inputs);
        let input = make_input(corpus, seed);
        inputs += 1;
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| target(&input))) {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|text| text.to_string()))
                .unwrap_or_else(|| "a panic".into());
            let shown = &input[..input.len().min(FAILING_INPUT_SHOWN_BYTES_MAX)];
            failure = Some(format!(
                "{name}: {what}\n  replay: COPSE_FUZZ_SEED={seed} COPSE_FUZZ_INPUTS=1\n  input ({} bytes, first {}): {}",
                input.len(),
                shown.len(),
                shown.iter().map(|byte| format!("{byte:02x}")).collect::<String>()
            ));
            break;
        }
    }
    std::panic::set_hook(hook);
    FuzzReport {
        target: name.to_string(),
        inputs,
        seconds: started.elapsed().as_secs_f64(),
        failure,
    }
}

/// One input: a corpus entry (or random bytes) under a few random mutations.
pub fn make_input(corpus: &[Vec<u8>], seed: u64) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut input = if rng.gen_ratio(1, 16) {
        let len = rng.gen_range(0..2 * PAGE_BYTES);
        (0..len).map(|_| rng.gen()).collect()
    } else {
        corpus[rng.gen_range(0..corpus.len())].clone()
    };
    for _ in 0..rng.gen_range(0..=MUTATIONS_PER_INPUT_MAX) {
        mutate(&mut input, corpus, &mut rng);
    }
    input
}

fn mutate(input: &mut Vec<u8>, corpus: &[Vec<u8>], rng: &mut ChaCha8Rng) {
    const INTERESTING: [u64; 10] = [0, 1, 2, 0x7f, 0x80, 0xff, 0xffff, 0xffff_ffff, 4096, 4097];
    let at = |rng: &mut ChaCha8Rng, len: usize| if len == 0 { 0 } else { rng.gen_range(0..len) };
    match rng.gen_range(0..8) {
        0 if !input.is_empty() => {
            let i = at(rng, input.len());
            input[i] ^= 1 << rng.gen_range(0..8);
        }
        1 if !input.is_empty() => {
            let i = at(rng, input.len());
            input[i] = rng.gen();
        }
        2 => {
            let width = [1usize, 2, 4, 8][rng.gen_range(0..4)];
            if input.len() >= width {
                let i = rng.gen_range(0..=input.len() - width);
                let value = INTERESTING[rng.gen_range(0..INTERESTING.len())];
                input[i..i + width].copy_from_slice(&value.to_le_bytes()[..width]);
            }
        }
        3 => {
            let i = at(rng, input.len() + 1).min(input.len());
            let count = rng.gen_range(1..=16);
            for _ in 0..count {
                input.insert(i, rng.gen());
            }
        }
        4 if !input.is_empty() => {
            let i = at(rng, input.len());
            let end = (i + rng.gen_range(1..=64)).min(input.len());
            input.drain(i..end);
        }
        5 => {
            let len = at(rng, input.len() + 1);
            input.truncate(len);
        }
        6 => {
            // Splice a piece of another entry over this one.
            let other = &corpus[rng.gen_range(0..corpus.len())];
            if !other.is_empty() && !input.is_empty() {
                let from = at(rng, other.len());
                let len = rng.gen_range(1..=64).min(other.len() - from);
                let to = at(rng, input.len());
                let end = (to + len).min(input.len());
                input[to..end].copy_from_slice(&other[from..from + (end - to)]);
            }
        }
        _ => {
            if !input.is_empty() {
                let i = at(rng, input.len());
                let end = (i + rng.gen_range(1..=32)).min(input.len());
                let piece = input[i..end].to_vec();
                let to = at(rng, input.len() + 1).min(input.len());
                input.splice(to..to, piece);
            }
        }
    }
}

// ---- Slab page --------------------------------------------------------------------------------

/// Input: a selector byte, then a page. The selector (mod 13) chooses the in-page class whose
/// slots the page is read as; its top bit asks to seal every slot that looks like a record;
/// bit 4 reads the page in the record layout of format versions 1 and 2 (else version 3).
/// Checks: no decoder panics (header page, slots, damaged-key peek, batch and part values,
/// recovery's judgement of the whole page), and every accepted header, record, batch and part
/// encodes back to the same bytes.
pub fn slab_page(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else { return };
    let class = SizeClass::get(selector % IN_PAGE_CLASSES);
    let seal = selector & 0x80 != 0;
    let layout = if selector & 0x10 != 0 { RecordLayout::Magic } else { RecordLayout::HeaderCrc };
    let shard_id = u32::from(selector >> 5 & 0x3);
    let mut page = vec![0u8; PAGE_BYTES];
    let copied = rest.len().min(PAGE_BYTES);
    page[..copied].copy_from_slice(&rest[..copied]);

    if let Ok(header) = decode_slab_header(&page) {
        let mut again = vec![0u8; PAGE_BYTES];
        encode_slab_header(&mut again, &header);
        assert_eq!(again[..36], page[..36], "a slab header decoded but encodes otherwise");
    }

    let slot_bytes = class.slot_bytes as usize;
    let mut scan = ShardScan::default();
    for index in 0..class.slots_per_unit as usize {
        let loc = Loc::new(class.id, class.slots_starting_in_page(1).start + index as u64, 0);
        let bytes = &mut page[index * slot_bytes..(index + 1) * slot_bytes];
        if seal {
            seal_slot(bytes, layout, shard_id, loc);
        }
        let bytes = &*bytes;
        if let Some(damaged) = peek_damaged_key(bytes, layout, shard_id, loc, slot_bytes) {
            assert_eq!(
                damaged.attributable,
                layout == RecordLayout::HeaderCrc,
                "only a header check makes a damaged record attributable"
            );
        }
        let result = decode_slot(bytes, layout, shard_id, loc, slot_bytes);
        if let Ok(Slot::Record { header, key, value }) = &result {
            let total = header.record_bytes();
            let mut again = vec![0u8; total];
            encode_record(
                &mut again,
                layout,
                shard_id,
                loc,
                header.kind,
                header.seq,
                header.aux,
                key,
                value,
            );
            assert_eq!(again[..], bytes[..total], "a record decoded but encodes otherwise");
            match header.kind {
                RecordKind::Batch => {
                    if let Ok(ops) = decode_batch(value) {
                        assert_eq!(
                            encode_batch(&ops),
                            *value,
                            "a batch decoded but encodes otherwise"
                        );
                    }
                }
                RecordKind::Part => {
                    if let Ok(found) = part::decode(value) {
                        let again =
                            part::encode(found.state, found.gsn, &found.participants, &found.ops);
                        assert_eq!(again, *value, "a part decoded but encodes otherwise");
                    }
                }
                RecordKind::Chunk => {
                    if let Ok(chunk) = crate::engine::native::chain::decode_chunk(value) {
                        assert!(chunk.index < chunk.count, "a chunk past its chain");
                    }
                }
                _ => {}
            }
        }
        scan.visit(shard_id, layout, loc, result, bytes);
    }
    let counts = scan.key_counts();
    assert!(counts.live + counts.deleted <= class.slots_per_unit as u64 * 64);
}

/// Recomputes the checks of a slot whose header could be a record (format 1/2: the magic is
/// there) and whose lengths fit: the header check (format 3), then the record crc.
fn seal_slot(bytes: &mut [u8], layout: RecordLayout, shard_id: u32, loc: Loc) {
    if bytes.len() < RECORD_HEADER_BYTES
        || bytes[..RECORD_HEADER_BYTES].iter().all(|&b| b == 0)
        || (layout == RecordLayout::Magic
            && u16::from_le_bytes([bytes[28], bytes[29]]) != RECORD_MAGIC)
    {
        return;
    }
    let key_bytes = u16::from_le_bytes([bytes[2], bytes[3]]) as usize;
    let value_bytes = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes")) as usize;
    let Some(total) = (RECORD_HEADER_BYTES + key_bytes).checked_add(value_bytes) else { return };
    if total > bytes.len() {
        return;
    }
    let (header, body) = bytes.split_at_mut(RECORD_HEADER_BYTES);
    if layout == RecordLayout::HeaderCrc {
        let check = header_checksum(shard_id, loc, header, &body[..key_bytes]);
        header[28..32].copy_from_slice(&check.to_le_bytes());
    }
    let crc = checksum(shard_id, loc, header, &body[..total - RECORD_HEADER_BYTES]);
    header[24..28].copy_from_slice(&crc.to_le_bytes());
}

/// Valid pages: a slab header, and pages of records of every kind (puts, tombstones, free
/// records, a batch, parts prepared and committed, a batch chained in two Chunk records), with
/// the selector byte in front.
pub fn slab_corpus() -> Vec<Vec<u8>> {
    let mut corpus = Vec::new();
    let mut header = vec![0u8; PAGE_BYTES];
    encode_slab_header(
        &mut header,
        &SlabHeader {
            format_version: SLAB_FORMAT_VERSION,
            class_id: 2,
            slot_bytes: SizeClass::get(2).slot_bytes,
            slots_per_unit: SizeClass::get(2).slots_per_unit,
            pages_per_unit: 1,
            shard_id: 0,
        },
    );
    corpus.push([&[0x02u8][..], &header].concat());
    let ops = vec![
        BatchOp::Put { key: b"k1".to_vec(), value: b"v1".to_vec() },
        BatchOp::Delete { key: b"k2".to_vec() },
    ];
    let classes = [0u8, 2, 4, 8];
    let layouts = [(RecordLayout::HeaderCrc, 0u8), (RecordLayout::Magic, 0x10u8)];
    for (class_id, (layout, layout_bit)) in
        classes.iter().flat_map(|&class| layouts.iter().map(move |&layout| (class, layout)))
    {
        let class = SizeClass::get(class_id);
        let slot_bytes = class.slot_bytes as usize;
        let mut page = vec![0u8; PAGE_BYTES];
        let mut seq: u64 = 1;
        for index in 0..class.slots_per_unit as usize {
            let loc = Loc::new(class_id, class.slots_starting_in_page(1).start + index as u64, 0);
            let key = format!("k{}", index % 3).into_bytes();
            // A batch (24 bytes) chained in two Chunk records, both with one seq.
            let chunks = crate::engine::native::chain::encode_chunks(
                RecordKind::Batch,
                &encode_batch(&ops),
                12 + crate::engine::native::chain::CHUNK_HEADER_BYTES,
            );
            let (kind, key, value): (RecordKind, Vec<u8>, Vec<u8>) = match index % 8 {
                0 => (RecordKind::Put, key, b"value".to_vec()),
                1 => (RecordKind::Tombstone, key, Vec::new()),
                2 => (RecordKind::Free, Vec::new(), Vec::new()),
                3 => (RecordKind::Batch, Vec::new(), encode_batch(&ops)),
                4 => (
                    RecordKind::Part,
                    Vec::new(),
                    part::encode(PartState::Prepared, 7, &[0, 1], &ops),
                ),
                5 => (
                    RecordKind::Part,
                    Vec::new(),
                    part::encode(PartState::Committed, 7, &[0, 1], &ops),
                ),
                chunk => (RecordKind::Chunk, Vec::new(), chunks[chunk % 2].clone()),
            };
            let total = crate::engine::native::format::record_bytes(key.len(), value.len());
            if total > slot_bytes {
                continue;
            }
            let slot = &mut page[index * slot_bytes..(index + 1) * slot_bytes];
            // Each pair of chunks (slots 8n+6 and 8n+7) shares a seq: a whole chain of two.
            let record_seq = if kind == RecordKind::Chunk { 1_000 + index as u64 / 8 } else { seq };
            encode_record(
                slot,
                layout,
                0,
                loc,
                kind,
                record_seq,
                seq.saturating_sub(2),
                &key,
                &value,
            );
            seq += 1;
        }
        corpus.push([&[class_id | layout_bit][..], &page].concat());
        corpus.push([&[class_id | layout_bit | 0x80][..], &page].concat());
    }
    corpus
}

// ---- Manifest ---------------------------------------------------------------------------------

/// Input: a selector byte, then a manifest page. With the selector's low bit set, the crc is
/// recomputed over the header bytes the page's version field names, so mutations get past it.
/// Checks: no panic, and an accepted version-2 manifest encodes back to the same header bytes.
pub fn manifest_page(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else { return };
    let mut page = vec![0u8; PAGE_BYTES];
    let copied = rest.len().min(PAGE_BYTES);
    page[..copied].copy_from_slice(&rest[..copied]);
    let version = u32::from_le_bytes(page[8..12].try_into().expect("4 bytes"));
    if selector & 1 != 0 {
        let covered = match version {
            1 => 24,
            2 => 28,
            _ => 48,
        };
        let crc = crc32c::crc32c(&page[..covered]);
        page[covered..covered + 4].copy_from_slice(&crc.to_le_bytes());
    }
    if let Ok(Some(found)) = manifest::decode(&page) {
        assert!(found.shard_count >= 1);
        if version == manifest::MANIFEST_FORMAT_VERSION {
            let again = manifest::encode(&found);
            assert_eq!(again[..52], page[..52], "a manifest decoded but encodes otherwise");
        }
    }
}

/// Valid manifests of both engines and every format version, sealed or not.
pub fn manifest_corpus() -> Vec<Vec<u8>> {
    let mut corpus = Vec::new();
    for manifest in [
        Manifest::new(4, EngineKind::Native),
        Manifest::new(1, EngineKind::RocksDb),
        Manifest { slab_format_version: 1, ..Manifest::new(256, EngineKind::Native) },
        Manifest {
            placement_setting: Some(crate::engine::placement::PlacementSetting::Auto),
            placements: std::array::from_fn(|class| {
                if SizeClass::get(class as u8).is_placeable() {
                    crate::engine::placement::Placement::Append
                } else {
                    crate::engine::placement::Placement::InPlace
                }
            }),
            probe_ratio_milli: 5123,
            ..Manifest::new(2, EngineKind::Native)
        },
    ] {
        let page = manifest::encode(&manifest).to_vec();
        corpus.push([&[0u8][..], &page].concat());
        corpus.push([&[1u8][..], &page].concat());
    }
    let mut v1 = vec![0u8; PAGE_BYTES];
    v1[0..8].copy_from_slice(&manifest::MANIFEST_MAGIC);
    v1[8..12].copy_from_slice(&1u32.to_le_bytes());
    v1[12..16].copy_from_slice(&2u32.to_le_bytes());
    v1[16..20].copy_from_slice(&1u32.to_le_bytes());
    v1[20..24].copy_from_slice(&1u32.to_le_bytes());
    corpus.push([&[1u8][..], &v1].concat());
    corpus
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_corpora_pass_their_targets() {
        for input in slab_corpus() {
            slab_page(&input);
        }
        for input in manifest_corpus() {
            manifest_page(&input);
        }
    }

    #[test]
    fn the_same_seed_makes_the_same_input() {
        let corpus = manifest_corpus();
        assert_eq!(make_input(&corpus, 42), make_input(&corpus, 42));
        assert_ne!(make_input(&corpus, 42), make_input(&corpus, 43));
    }

    /// The driver reports a failing target with the seed that replays it.
    #[test]
    fn a_failing_target_is_reported_with_its_seed() {
        fn fails_on_long_inputs(data: &[u8]) {
            assert!(data.len() < 4000, "long input");
        }
        let budget = Budget { time: Duration::from_secs(10), inputs_max: 10_000 };
        let report = run("long", &slab_corpus(), fails_on_long_inputs, budget);
        let failure = report.failure.expect("corpus entries are over 4000 bytes");
        assert!(failure.contains("long input") && failure.contains("COPSE_FUZZ_SEED="));
    }
}
