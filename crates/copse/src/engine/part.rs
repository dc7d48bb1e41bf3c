//! A *part*: one shard's share of a cross-shard atomic batch (docs/atomic-batches.md), and the
//! bytes every engine stores for it (spec: docs/format/part.md).
//!
//! An engine keeps a part durably and invisibly from `PreparePart` until `ForgetPart`: reads,
//! scans, index questions and item counts never see its operations until `CommitPart` applies
//! them. Recovery reports every part it finds (`ShardEngine::recovered_parts`); the router
//! decides each batch from the parts of all shards before the store answers anyone.
//!
//! Encoding (little-endian), the value an engine stores:
//! `state: u8, gsn: u64, participant_count: u16, participant_count × shard: u32 (ascending),
//! then the operations in the write-batch encoding (engine/native/batch.rs)`.

use super::batch_codec::{decode_batch, encode_batch, encoded_batch_bytes};
use super::BatchOp;

/// Whether a part was only made durable, or also applied. persisted: never renumber.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PartState {
    /// Durable, not applied: the batch's outcome depends on the other shards' parts.
    Prepared = 1,
    /// Applied together with this mark: the batch committed.
    Committed = 2,
}

impl PartState {
    pub fn from_persisted(value: u8) -> Option<PartState> {
        match value {
            1 => Some(PartState::Prepared),
            2 => Some(PartState::Committed),
            _ => None,
        }
    }
}

/// A part as stored, and as recovery reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartRecord {
    pub state: PartState,
    /// The batch's global sequence number, the same in every shard's part.
    pub gsn: u64,
    /// Every shard holding a part of the batch, ascending.
    pub participants: Vec<u32>,
    /// This shard's operations, one per key.
    pub ops: Vec<BatchOp>,
}

/// Bytes before the operations.
pub fn header_bytes(participants: usize) -> usize {
    1 + 8 + 2 + 4 * participants
}

/// Bytes `encode` produces for a part with these participants and operations.
pub fn encoded_bytes(participants: usize, ops: &[BatchOp]) -> usize {
    header_bytes(participants) + encoded_batch_bytes(ops)
}

pub fn encode(state: PartState, gsn: u64, participants: &[u32], ops: &[BatchOp]) -> Vec<u8> {
    assert!(participants.len() <= u16::MAX as usize);
    assert!(participants.windows(2).all(|pair| pair[0] < pair[1]), "participants ascending");
    let batch = encode_batch(ops);
    let mut out = Vec::with_capacity(header_bytes(participants.len()) + batch.len());
    out.push(state as u8);
    out.extend_from_slice(&gsn.to_le_bytes());
    out.extend_from_slice(&(participants.len() as u16).to_le_bytes());
    for shard in participants {
        out.extend_from_slice(&shard.to_le_bytes());
    }
    out.extend_from_slice(&batch);
    out
}

pub fn decode(bytes: &[u8]) -> Result<PartRecord, String> {
    let fixed = header_bytes(0);
    if bytes.len() < fixed {
        return Err(format!("part record of {} bytes is shorter than its header", bytes.len()));
    }
    let state = PartState::from_persisted(bytes[0])
        .ok_or_else(|| format!("unknown part state {}", bytes[0]))?;
    let gsn = u64::from_le_bytes(bytes[1..9].try_into().expect("8 bytes"));
    let count = u16::from_le_bytes(bytes[9..11].try_into().expect("2 bytes")) as usize;
    let ops_at = header_bytes(count);
    if bytes.len() < ops_at {
        return Err(format!("part record lists {count} participants but is truncated"));
    }
    let participants: Vec<u32> = bytes[fixed..ops_at]
        .chunks_exact(4)
        .map(|chunk| u32::from_le_bytes(chunk.try_into().expect("4 bytes")))
        .collect();
    if !participants.windows(2).all(|pair| pair[0] < pair[1]) {
        return Err("part record's participants are not ascending".into());
    }
    if participants.len() < 2 {
        return Err("part record names fewer than two participants".into());
    }
    let ops = decode_batch(&bytes[ops_at..])?;
    Ok(PartRecord { state, gsn, participants, ops })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_round_trips_and_damage_is_refused() {
        let ops = vec![
            BatchOp::Put { key: b"a".to_vec(), value: b"1".to_vec() },
            BatchOp::Delete { key: b"b".to_vec() },
        ];
        let bytes = encode(PartState::Prepared, 7, &[0, 3], &ops);
        assert_eq!(bytes.len(), encoded_bytes(2, &ops));
        let part = decode(&bytes).unwrap();
        assert_eq!(
            part,
            PartRecord { state: PartState::Prepared, gsn: 7, participants: vec![0, 3], ops }
        );
        let mut bad_state = bytes.clone();
        bad_state[0] = 9;
        assert!(decode(&bad_state).is_err());
        let mut unsorted = bytes.clone();
        unsorted[11..15].copy_from_slice(&5u32.to_le_bytes());
        assert!(decode(&unsorted).is_err());
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(decode(&bytes[..10]).is_err());
    }

    #[test]
    fn the_worked_example_of_the_spec() {
        let ops = vec![
            BatchOp::Put { key: b"a".to_vec(), value: b"1".to_vec() },
            BatchOp::Delete { key: b"b".to_vec() },
        ];
        let expected: [u8; 40] = [
            0x01, 0x07, 0, 0, 0, 0, 0, 0, 0, 0x02, 0, 0, 0, 0, 0, 0x03, 0, 0, 0, 0x02, 0, 0, 0,
            0x01, 0x01, 0, 0x01, 0, 0, 0, b'a', b'1', 0x02, 0x01, 0, 0, 0, 0, 0, b'b',
        ];
        assert_eq!(encode(PartState::Prepared, 7, &[0, 3], &ops), expected);
        let mut committed = expected;
        committed[0] = 0x02;
        assert_eq!(encode(PartState::Committed, 7, &[0, 3], &ops), committed);
    }
}
