//! The encoding of a write batch's operations, shared by every engine and layer that stores or
//! sizes a batch: the native engine's Batch and Part records (docs/format/slab.md, part.md), the
//! limit checks of `engine/input.rs`, and the server's batching of writes. Engine-neutral: it
//! names no engine.
//!
//! Encoding (little-endian): `count: u32, then count × (kind: u8, key_len: u16, value_len: u32,
//! key, value)`, with kind 1 a put and 2 a delete (persisted: never renumber). Decoding refuses
//! a truncated record, an unknown kind, a delete with a value and trailing bytes.

use crate::engine::BatchOp;

/// The operations, encoded as above.
pub fn encode_batch(ops: &[BatchOp]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + ops.iter().map(|op| 7 + op.key().len()).sum::<usize>());
    out.extend_from_slice(&(ops.len() as u32).to_le_bytes());
    for op in ops {
        let (kind, key, value): (u8, &[u8], &[u8]) = match op {
            BatchOp::Put { key, value } => (1, key, value),
            BatchOp::Delete { key } => (2, key, &[]),
        };
        out.push(kind);
        out.extend_from_slice(&(key.len() as u16).to_le_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        out.extend_from_slice(key);
        out.extend_from_slice(value);
    }
    out
}

/// Bytes `encode_batch` produces, without producing them (for the limit check).
pub fn encoded_batch_bytes(ops: &[BatchOp]) -> usize {
    BATCH_HEADER_BYTES
        + ops
            .iter()
            .map(|op| {
                encoded_op_bytes(op.key(), match op {
                    BatchOp::Put { value, .. } => Some(value),
                    BatchOp::Delete { .. } => None,
                })
            })
            .sum::<usize>()
}

/// Bytes of a batch's encoding before its operations (the count).
pub const BATCH_HEADER_BYTES: usize = 4;

/// Bytes one operation adds to a batch's encoding: a put of `value`, or a delete (None).
pub fn encoded_op_bytes(key: &[u8], value: Option<&[u8]>) -> usize {
    7 + key.len() + value.map_or(0, <[u8]>::len)
}

/// The operations of an encoded batch, or why the bytes are not one.
pub fn decode_batch(bytes: &[u8]) -> Result<Vec<BatchOp>, String> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let end = at
            .checked_add(n)
            .filter(|&end| end <= bytes.len())
            .ok_or("batch record is truncated")?;
        let slice = &bytes[at..end];
        at = end;
        Ok(slice)
    };
    let count = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
    let mut ops = Vec::with_capacity(count.min(crate::limits::WRITE_BATCH_OPS_MAX));
    for _ in 0..count {
        let kind = take(1)?[0];
        let key_len = u16::from_le_bytes(take(2)?.try_into().unwrap()) as usize;
        let value_len = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
        let key = take(key_len)?.to_vec();
        let value = take(value_len)?.to_vec();
        ops.push(match kind {
            1 => BatchOp::Put { key, value },
            2 if value_len == 0 => BatchOp::Delete { key },
            _ => return Err(format!("unknown batch operation kind {kind}")),
        });
    }
    if at != bytes.len() {
        return Err("batch record has trailing bytes".into());
    }
    Ok(ops)
}

/// Keeps the last operation of each key, in the order of those last operations.
pub fn dedupe_batch(ops: Vec<BatchOp>) -> Vec<BatchOp> {
    let mut last = crate::hash::HashMap::default();
    for (position, op) in ops.iter().enumerate() {
        last.insert(op.key().to_vec(), position);
    }
    ops.into_iter()
        .enumerate()
        .filter(|(position, op)| last[op.key()] == *position)
        .map(|(_, op)| op)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_encoding_round_trips_and_rejects_garbage() {
        let ops = vec![
            BatchOp::Put { key: b"a".to_vec(), value: b"1".to_vec() },
            BatchOp::Delete { key: b"b".to_vec() },
        ];
        let bytes = encode_batch(&ops);
        assert_eq!(bytes.len(), encoded_batch_bytes(&ops));
        assert_eq!(decode_batch(&bytes).unwrap(), ops);
        assert!(decode_batch(&bytes[..bytes.len() - 1]).is_err());
        let mut bad = bytes.clone();
        bad[4] = 9;
        assert!(decode_batch(&bad).is_err());
    }

    #[test]
    fn dedupe_keeps_the_last_operation_of_each_key() {
        let ops = vec![
            BatchOp::Put { key: b"a".to_vec(), value: b"1".to_vec() },
            BatchOp::Put { key: b"b".to_vec(), value: b"2".to_vec() },
            BatchOp::Delete { key: b"a".to_vec() },
        ];
        assert_eq!(
            dedupe_batch(ops),
            vec![
                BatchOp::Put { key: b"b".to_vec(), value: b"2".to_vec() },
                BatchOp::Delete { key: b"a".to_vec() }
            ]
        );
    }
}
