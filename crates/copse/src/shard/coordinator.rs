//! What a shard's exec programs and gate know of a cross-shard batch's coordinator (the
//! router's `Txn`, docs/atomic-batches.md): its gsn, its participants and its decision. Both
//! `exec.rs` (which prepares and applies parts) and `gate.rs` (which answers reads of locked keys
//! as of the decision) depend on this, and on nothing of each other's for it.

use crate::error::WriteError;

/// A cross-shard batch's outcome, as its coordinator knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Pending,
    Committed,
    /// Called off: nothing of the batch is applied anywhere; the reason.
    Aborted(WriteError),
}

/// The coordinator of one cross-shard batch (the router's `Txn`), as its participants see it.
/// Every participant shares it; the decision changes once, from pending to final.
pub trait Coordinator: Send + Sync {
    fn gsn(&self) -> u64;
    /// Every shard holding a part, ascending.
    fn participants(&self) -> &[u32];
    fn decision(&self) -> Decision;
    /// Shard `shard`'s part is durable (Ok), or could not be made so; may decide the batch.
    fn prepared(&self, shard: u32, result: Result<(), WriteError>);
    /// A participant does not take part (a condition failed, the exec was dropped): aborts.
    fn refuse(&self, reason: WriteError);
    /// Shard `shard` applied its part (Ok) or failed to.
    fn applied(&self, shard: u32, result: Result<(), WriteError>);
    /// Every participant applied its part: parts may be erased (forgotten) now.
    fn all_applied(&self) -> bool;
}
