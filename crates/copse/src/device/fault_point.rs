//! Named fault points: the places in the engine where a crash or an I/O error is most likely to
//! expose a recovery bug, announced to the device with [`BlockDevice::fault_point`].
//!
//! A crash drawn at a random device operation reaches these places only by luck; a named point
//! lets the simulator aim at each of them and count how often it did (tests/sim.rs). The real
//! devices ignore the announcement (the trait's default method returns `Ok`); the simulated
//! device counts every hit and, when armed for that point, crashes the disk or fails there.
//!
//! Contract at every point: the engine handles an `Err` exactly like the failure of the device
//! operation next to the point (the same error path, the same poisoning), so a fault injected
//! here tests the code a real failure would run. Points are not persisted; their names appear in
//! test output and docs/reliability.md.
//!
//! [`BlockDevice::fault_point`]: super::BlockDevice::fault_point

/// A named place in the engine's write or recovery path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultPoint {
    /// Slab writes are durable (completed under `Dsync`, or flushed), and neither the index nor
    /// any client has seen them: a crash here must not lose them once recovered, and a failure
    /// here answers them with the error (they may then survive, as in-flight writes may).
    SlabWrittenBeforeIndexUpdate,
    /// A new slab file has its first size, and its header page is not written yet.
    SlabFileCreatedBeforeHeader,
    /// A slab file has grown (durably), and the engine has not recorded the new size or put
    /// anything in the new space.
    SlabFileGrown,
    /// A write batch's record is durable, and none of its members is written: recovery must
    /// replay the batch whole.
    BatchRecordedBeforeMembers,
    /// Recovery has read every slab file of the shard, and has judged, repaired and indexed
    /// nothing yet.
    RecoveryScanned,
    /// Recovery is replaying a write batch: the members' writes of this round are submitted and
    /// not yet complete.
    RecoveryReplayingBatch,
}

impl FaultPoint {
    pub const ALL: [FaultPoint; 6] = [
        FaultPoint::SlabWrittenBeforeIndexUpdate,
        FaultPoint::SlabFileCreatedBeforeHeader,
        FaultPoint::SlabFileGrown,
        FaultPoint::BatchRecordedBeforeMembers,
        FaultPoint::RecoveryScanned,
        FaultPoint::RecoveryReplayingBatch,
    ];

    /// Whether the point lies in recovery (reached while a shard opens).
    pub fn in_recovery(self) -> bool {
        matches!(self, FaultPoint::RecoveryScanned | FaultPoint::RecoveryReplayingBatch)
    }
}

impl std::fmt::Display for FaultPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            FaultPoint::SlabWrittenBeforeIndexUpdate => "slab-written-before-index-update",
            FaultPoint::SlabFileCreatedBeforeHeader => "slab-file-created-before-header",
            FaultPoint::SlabFileGrown => "slab-file-grown",
            FaultPoint::BatchRecordedBeforeMembers => "batch-recorded-before-members",
            FaultPoint::RecoveryScanned => "recovery-scanned",
            FaultPoint::RecoveryReplayingBatch => "recovery-replaying-batch",
        };
        f.write_str(name)
    }
}
