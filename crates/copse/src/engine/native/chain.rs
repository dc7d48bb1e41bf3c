//! Chains of Chunk records: how a Batch or Part record too large for one record is written.
//! Spec: docs/format/slab.md, "Chunk records".
//!
//! A batch (or a part's prepared or committed record) whose value is at most the engine's
//! `batch_record_bytes_max` is one record, as it always was. A larger value is cut into pieces,
//! each written as a Chunk record that names the kind of the whole, its index and the chain's
//! length; every record of a chain carries the chain's sequence number, which no other chain
//! shares (each chain takes a fresh one).
//!
//! Invariants:
//! - A batch's members are written only once every record of its chain is durable
//!   (`batch.rs`), and a prepared part is answered only then (`parts.rs`).
//! - So recovery replays a chain only when it finds every one of its records, and erases the
//!   records of any chain it finds incomplete: such a chain was never durable whole (none of
//!   its members was written, nothing was acknowledged), or its erasure had begun (every member
//!   was durable and applied), or one of its records rotted (as a lone batch record can).
//! - A chain is one logical record: its pieces joined in index order are exactly the value a
//!   single record of the whole's kind would hold, decoded by the same code.

use std::collections::BTreeMap;

use super::format::{Loc, RecordKind};

/// Bytes of a Chunk record's value before its piece: the whole's kind (u8), the index (u32 LE)
/// and the chain's length in records (u32 LE).
pub const CHUNK_HEADER_BYTES: usize = 1 + 4 + 4;

/// One decoded Chunk record's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk<'a> {
    /// What the chain's joined pieces are the value of: `Batch` or `Part`.
    pub whole: RecordKind,
    pub index: u32,
    pub count: u32,
    pub piece: &'a [u8],
}

/// The records a value of `value_bytes` takes when records hold at most `record_bytes_max`:
/// one if it fits, else the chain's length.
pub fn records_for(value_bytes: usize, record_bytes_max: usize) -> usize {
    if value_bytes <= record_bytes_max {
        return 1;
    }
    value_bytes.div_ceil(piece_bytes_max(record_bytes_max))
}

fn piece_bytes_max(record_bytes_max: usize) -> usize {
    assert!(record_bytes_max > CHUNK_HEADER_BYTES, "a chunk holds its header and a piece");
    record_bytes_max - CHUNK_HEADER_BYTES
}

/// The value of Chunk record `index` of the chain holding `value`, a value of kind `whole`
/// longer than `record_bytes_max` (every chunk is at most that long). Built one at a time, so a
/// huge batch is not held twice more while its records are written.
pub fn encode_chunk(
    whole: RecordKind,
    value: &[u8],
    index: usize,
    record_bytes_max: usize,
) -> Vec<u8> {
    assert!(matches!(whole, RecordKind::Batch | RecordKind::Part), "only batches and parts chain");
    let count = records_for(value.len(), record_bytes_max);
    assert!(count >= 2, "a value that fits one record is not chained");
    assert!(index < count);
    let count = u32::try_from(count).expect("a chain of fewer than 2^32 records");
    let piece_max = piece_bytes_max(record_bytes_max);
    let piece = &value[index * piece_max..value.len().min((index + 1) * piece_max)];
    let mut chunk = Vec::with_capacity(CHUNK_HEADER_BYTES + piece.len());
    chunk.push(whole as u8);
    chunk.extend_from_slice(&(index as u32).to_le_bytes());
    chunk.extend_from_slice(&count.to_le_bytes());
    chunk.extend_from_slice(piece);
    assert!(chunk.len() <= record_bytes_max);
    chunk
}

/// The values of every Chunk record of that chain (tests and the fuzzer).
#[cfg(any(test, feature = "testing"))]
pub fn encode_chunks(whole: RecordKind, value: &[u8], record_bytes_max: usize) -> Vec<Vec<u8>> {
    (0..records_for(value.len(), record_bytes_max))
        .map(|index| encode_chunk(whole, value, index, record_bytes_max))
        .collect()
}

/// The value lengths of the records that hold a value of `value_bytes`: itself if it fits one
/// record, else each chunk's.
pub fn record_value_lens(value_bytes: usize, record_bytes_max: usize) -> Vec<usize> {
    let count = records_for(value_bytes, record_bytes_max);
    if count == 1 {
        return vec![value_bytes];
    }
    let piece_max = piece_bytes_max(record_bytes_max);
    (0..count)
        .map(|index| CHUNK_HEADER_BYTES + (value_bytes - index * piece_max).min(piece_max))
        .collect()
}

/// Decodes a Chunk record's value (whose record checksum held), or says what is wrong.
pub fn decode_chunk(value: &[u8]) -> Result<Chunk<'_>, String> {
    if value.len() < CHUNK_HEADER_BYTES {
        return Err(format!("chunk record of {} bytes has no header", value.len()));
    }
    let whole = match value[0] {
        kind if kind == RecordKind::Batch as u8 => RecordKind::Batch,
        kind if kind == RecordKind::Part as u8 => RecordKind::Part,
        kind => return Err(format!("chunk record of a chain of kind {kind}, not a batch or part")),
    };
    let index = u32::from_le_bytes(value[1..5].try_into().expect("4 bytes"));
    let count = u32::from_le_bytes(value[5..9].try_into().expect("4 bytes"));
    if count < 2 || index >= count {
        return Err(format!("chunk record {index} of a chain of {count}"));
    }
    Ok(Chunk { whole, index, count, piece: &value[CHUNK_HEADER_BYTES..] })
}

/// A chain recovery found whole.
pub struct Assembled {
    /// Its records, in index order (the order they are erased in).
    pub records: Vec<Loc>,
    pub seq: u64,
    pub whole: RecordKind,
    /// The pieces joined: the value of one record of kind `whole`.
    pub value: Vec<u8>,
}

/// One Chunk record as recovery found it.
struct FoundChunk {
    loc: Loc,
    whole: RecordKind,
    index: u32,
    count: u32,
    piece: Vec<u8>,
}

/// The Chunk records recovery found, by chain (sequence number).
#[derive(Default)]
pub struct FoundChains {
    by_seq: BTreeMap<u64, Vec<FoundChunk>>,
}

/// What recovery does with the chains it found.
#[derive(Default)]
pub struct SortedChains {
    /// Chains found whole, in sequence order.
    pub whole: Vec<Assembled>,
    /// The records of every other chain, to erase, with what was wrong for chains that cannot
    /// be explained by a crash (records that disagree on the chain's length or kind).
    pub incomplete: Vec<Loc>,
    pub malformed: Vec<(u64, String)>,
}

impl FoundChains {
    pub fn add(&mut self, loc: Loc, seq: u64, chunk: Chunk<'_>) {
        self.by_seq.entry(seq).or_default().push(FoundChunk {
            loc,
            whole: chunk.whole,
            index: chunk.index,
            count: chunk.count,
            piece: chunk.piece.to_vec(),
        });
    }

    pub fn sort(self) -> SortedChains {
        let mut sorted = SortedChains::default();
        for (seq, mut chunks) in self.by_seq {
            chunks.sort_by_key(|chunk| chunk.index);
            let first = &chunks[0];
            let (whole, count) = (first.whole, first.count);
            let agree = chunks.iter().all(|chunk| chunk.whole == whole && chunk.count == count);
            let distinct = chunks.windows(2).all(|pair| pair[0].index != pair[1].index);
            if !agree || !distinct {
                sorted.malformed.push((
                    seq,
                    format!(
                        "the {} chunk records of seq {seq} disagree on their chain (or repeat an \
                         index): erased",
                        chunks.len()
                    ),
                ));
            }
            if agree && distinct && chunks.len() == count as usize {
                let bytes = chunks.iter().map(|chunk| chunk.piece.len()).sum();
                let mut value = Vec::with_capacity(bytes);
                let mut records = Vec::with_capacity(chunks.len());
                for chunk in chunks {
                    value.extend_from_slice(&chunk.piece);
                    records.push(chunk.loc);
                }
                sorted.whole.push(Assembled { records, seq, whole, value });
            } else {
                sorted.incomplete.extend(chunks.into_iter().map(|chunk| chunk.loc));
            }
        }
        sorted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(slot: u64) -> Loc {
        Loc::new(40, slot, 0)
    }

    #[test]
    fn a_value_cut_into_chunks_joins_back_whole() {
        let value: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        assert_eq!(records_for(value.len(), 1000), 1);
        assert_eq!(records_for(value.len(), 999), 2);
        let chunks = encode_chunks(RecordKind::Batch, &value, 100);
        assert_eq!(chunks.len(), records_for(value.len(), 100));
        assert_eq!(chunks.len(), 11, "91-byte pieces");
        let lens: Vec<usize> = chunks.iter().map(Vec::len).collect();
        assert_eq!(lens, record_value_lens(value.len(), 100));
        assert_eq!(record_value_lens(value.len(), 1000), vec![1000]);
        let mut found = FoundChains::default();
        // Found in any order, as recovery scans slabs.
        for (index, chunk) in chunks.iter().enumerate().rev() {
            assert!(chunk.len() <= 100);
            found.add(loc(index as u64), 9, decode_chunk(chunk).unwrap());
        }
        let sorted = found.sort();
        assert!(sorted.incomplete.is_empty() && sorted.malformed.is_empty());
        assert_eq!(sorted.whole.len(), 1);
        let chain = &sorted.whole[0];
        assert_eq!((chain.seq, chain.whole), (9, RecordKind::Batch));
        assert_eq!(chain.value, value);
        assert_eq!(chain.records, (0..11).map(loc).collect::<Vec<_>>());
    }

    #[test]
    fn a_chain_missing_a_record_is_erased_not_replayed() {
        let value = vec![5u8; 500];
        let chunks = encode_chunks(RecordKind::Part, &value, 200);
        assert_eq!(chunks.len(), 3);
        let mut found = FoundChains::default();
        for (index, chunk) in chunks.iter().enumerate().skip(1) {
            found.add(loc(index as u64), 4, decode_chunk(chunk).unwrap());
        }
        // Another chain, whole, beside it.
        for (index, chunk) in encode_chunks(RecordKind::Batch, &value, 300).iter().enumerate() {
            found.add(loc(100 + index as u64), 5, decode_chunk(chunk).unwrap());
        }
        let sorted = found.sort();
        assert_eq!(sorted.incomplete, vec![loc(1), loc(2)]);
        assert_eq!(sorted.whole.len(), 1);
        assert_eq!(sorted.whole[0].seq, 5);
        assert!(sorted.malformed.is_empty());
    }

    #[test]
    fn chunks_that_disagree_are_reported_and_erased() {
        let chunks = encode_chunks(RecordKind::Batch, &[1u8; 300], 100);
        let other = encode_chunks(RecordKind::Batch, &[1u8; 500], 100);
        let mut found = FoundChains::default();
        found.add(loc(0), 3, decode_chunk(&chunks[0]).unwrap());
        found.add(loc(1), 3, decode_chunk(&other[1]).unwrap());
        found.add(loc(2), 3, decode_chunk(&chunks[2]).unwrap());
        found.add(loc(3), 3, decode_chunk(&chunks[3]).unwrap());
        let sorted = found.sort();
        assert!(sorted.whole.is_empty());
        assert_eq!(sorted.incomplete.len(), 4);
        assert_eq!(sorted.malformed.len(), 1);
    }

    /// docs/format/slab.md, "Chunk records": a batch of two operations (24 bytes encoded) in
    /// records of at most 21 bytes is a chain of two.
    #[test]
    fn the_worked_example_of_the_spec_holds() {
        use crate::engine::batch_codec::encode_batch;
        use crate::engine::BatchOp;
        let batch = encode_batch(&[
            BatchOp::Put { key: b"k1".to_vec(), value: b"v1".to_vec() },
            BatchOp::Delete { key: b"k2".to_vec() },
        ]);
        assert_eq!(batch.len(), 24);
        let chunks = encode_chunks(RecordKind::Batch, &batch, 21);
        let expected: [&[u8]; 2] = [
            &[4, 0, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 1, 2, 0, 2, 0, 0, 0, b'k'],
            &[4, 1, 0, 0, 0, 2, 0, 0, 0, b'1', b'v', b'1', 2, 2, 0, 0, 0, 0, 0, b'k', b'2'],
        ];
        assert_eq!(chunks, expected.map(<[u8]>::to_vec));
    }

    #[test]
    fn bad_chunk_values_are_refused() {
        assert!(decode_chunk(&[4, 0, 0]).is_err());
        let mut chunk = encode_chunks(RecordKind::Batch, &[0u8; 300], 100).remove(0);
        chunk[0] = RecordKind::Put as u8;
        assert!(decode_chunk(&chunk).is_err());
        let mut chunk = encode_chunks(RecordKind::Batch, &[0u8; 300], 100).remove(0);
        chunk[1..5].copy_from_slice(&9u32.to_le_bytes());
        assert!(decode_chunk(&chunk).is_err(), "index past the count");
        let mut chunk = encode_chunks(RecordKind::Batch, &[0u8; 300], 100).remove(0);
        chunk[5..9].copy_from_slice(&1u32.to_le_bytes());
        assert!(decode_chunk(&chunk).is_err(), "a chain of one record");
    }
}
