//! The limits every request must meet before it reaches a shard (`limits.rs` names them). The
//! embedded API checks them where a request enters the store, and the shard checks the writes
//! and reads that an exec program asks for, so that a bad request changes nothing.

use crate::engine::batch_codec::encoded_batch_bytes;
use crate::engine::BatchOp;
use crate::error::InputError;
use crate::limits::{
    KEY_BYTES_MAX, KEY_BYTES_MIN, VALUE_BYTES_MAX, WRITE_BATCH_BYTES_MAX, WRITE_BATCH_OPS_MAX,
};

pub fn check_key(key: &[u8]) -> Result<(), InputError> {
    if key.len() < KEY_BYTES_MIN {
        return Err(InputError::KeyEmpty);
    }
    if key.len() > KEY_BYTES_MAX {
        return Err(InputError::KeyTooLarge { bytes: key.len(), max: KEY_BYTES_MAX });
    }
    Ok(())
}

pub fn check_value(value: &[u8]) -> Result<(), InputError> {
    if value.len() > VALUE_BYTES_MAX {
        return Err(InputError::ValueTooLarge { bytes: value.len(), max: VALUE_BYTES_MAX });
    }
    Ok(())
}

pub fn check_batch(ops: &[BatchOp]) -> Result<(), InputError> {
    if ops.len() > WRITE_BATCH_OPS_MAX {
        return Err(InputError::BatchTooManyOps { ops: ops.len(), max: WRITE_BATCH_OPS_MAX });
    }
    for op in ops {
        check_key(op.key())?;
        if let BatchOp::Put { value, .. } = op {
            check_value(value)?;
        }
    }
    let bytes = encoded_batch_bytes(ops);
    if bytes > WRITE_BATCH_BYTES_MAX {
        return Err(InputError::BatchTooLarge { bytes, max: WRITE_BATCH_BYTES_MAX });
    }
    Ok(())
}

/// The checks one shard's part of a cross-shard batch must pass, beyond the whole batch's: its
/// stored form (the operations plus the part header, `part.rs`) stays within the batch bound, so
/// an engine stores it wherever it stores a batch record.
pub fn check_part(participants: usize, ops: &[BatchOp]) -> Result<(), InputError> {
    check_batch(ops)?;
    let bytes = crate::engine::part::encoded_bytes(participants, ops);
    if bytes > WRITE_BATCH_BYTES_MAX {
        return Err(InputError::BatchTooLarge { bytes, max: WRITE_BATCH_BYTES_MAX });
    }
    Ok(())
}

/// The checks one write of an exec program must pass. A single operation is written without a
/// batch record (one write instead of three), so only its key and value limits apply, not the
/// batch record's size.
pub fn check_write(ops: &[BatchOp]) -> Result<(), InputError> {
    match ops {
        [BatchOp::Put { key, value }] => check_key(key).and_then(|()| check_value(value)),
        [BatchOp::Delete { key }] => check_key(key),
        _ => check_batch(ops),
    }
}
