//! Cross-shard atomic batches: the router coordinates a two-phase commit with presumed abort
//! over the shards a batch touches (docs/atomic-batches.md).
//!
//! Each batch gets a global sequence number (gsn) and a [`Txn`], shared by every participant.
//! The coordinator queues one exec per participant, in ascending shard order, each only once the
//! previous one started (holds its exec locks): batches acquire shards in one global order, so
//! two batches never wait for each other in a cycle. Each exec prepares its part (durable,
//! invisible, keys locked in the shard's gate); the last prepare decides *committed*, any
//! failure decides *aborted*. Participants then apply or erase their parts; the batch is
//! answered once every participant applied; then every part is forgotten.
//!
//! Invariants:
//! 1. The decision changes once. The store-wide decision count ([`Decisions`]) is raised before
//!    the decision is stored, so a multi-key read that saw the same count before and after it
//!    saw no decision happen, hence no half batch (`Decisions::read`).
//! 2. A batch is acknowledged only after every part is applied (durable and visible), and parts
//!    are forgotten only after that, so recovery's rule holds: a batch is committed if any part
//!    is marked committed or every participant holds a part ([`resolve`]).
//! 3. A coordinator dropped midway (its caller went away) drops the votes it did not hand out,
//!    which aborts the batch: no participant waits forever.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::channel::oneshot;

use super::Router;
use crate::engine::part::{PartRecord, PartState};
use crate::engine::{BatchOp, Request};
use crate::error::WriteError;
use crate::limits::MULTI_READ_ATTEMPTS_BEFORE_EXCLUSIVE;
use crate::shard::coordinator::{Coordinator, Decision};
use crate::shard::exec::{lock_ids, Exec, ExecRequest, ExecStep, ExecView, LockIds, StepInput, Vote};

/// The store-wide count of batch decisions, and the means for a reader that keeps missing a
/// quiet moment to get one (invariant 1).
#[derive(Default)]
pub struct Decisions {
    count: AtomicU64,
    /// Readers that asked new batches to wait, and the batches waiting for them.
    exclusive: Mutex<(usize, Vec<oneshot::Sender<()>>)>,
}

impl Decisions {
    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, Vec<oneshot::Sender<()>>)> {
        self.exclusive.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Waits while a starving reader holds new batches back.
    async fn admit(&self) {
        loop {
            let receiver = {
                let mut state = self.lock();
                if state.0 == 0 {
                    return;
                }
                let (sender, receiver) = oneshot::channel();
                state.1.push(sender);
                receiver
            };
            let _ = receiver.await;
        }
    }

    /// Runs `attempt` until no batch decision happened during it: its reads then saw every
    /// cross-shard batch whole. After `MULTI_READ_ATTEMPTS_BEFORE_EXCLUSIVE` attempts, new
    /// batches wait until this read is done (batches already started still finish and decide,
    /// so the wait ends); errors end the loop at once.
    pub async fn read<T, E, F, Fut>(&self, mut attempt: F) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut attempts = 0;
        let mut exclusive = false;
        let result = loop {
            let before = self.count.load(Ordering::SeqCst);
            let result = attempt().await;
            if result.is_err() || self.count.load(Ordering::SeqCst) == before {
                break result;
            }
            attempts += 1;
            if attempts >= MULTI_READ_ATTEMPTS_BEFORE_EXCLUSIVE && !exclusive {
                self.lock().0 += 1;
                exclusive = true;
            }
        };
        if exclusive {
            let waiting = {
                let mut state = self.lock();
                state.0 -= 1;
                if state.0 == 0 {
                    std::mem::take(&mut state.1)
                } else {
                    Vec::new()
                }
            };
            for waiter in waiting {
                let _ = waiter.send(());
            }
        }
        result
    }
}

struct TxnState {
    prepared: usize,
    applied: usize,
    decision: Decision,
}

/// One cross-shard batch's coordinator, shared by its participants.
pub struct Txn {
    gsn: u64,
    participants: Vec<u32>,
    router: Router,
    decisions: Arc<Decisions>,
    state: Mutex<TxnState>,
}

impl Txn {
    fn lock(&self) -> std::sync::MutexGuard<'_, TxnState> {
        self.state.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Stores the decision if none was made (invariant 1), then wakes every participant.
    fn decide(&self, decision: Decision) {
        {
            let mut state = self.lock();
            if state.decision != Decision::Pending {
                return;
            }
            self.decisions.count.fetch_add(1, Ordering::SeqCst);
            state.decision = decision;
        }
        self.wake_all();
    }

    fn wake_all(&self) {
        for &shard in &self.participants {
            self.router.wake(shard);
        }
    }
}

impl Coordinator for Txn {
    fn gsn(&self) -> u64 {
        self.gsn
    }

    fn participants(&self) -> &[u32] {
        &self.participants
    }

    fn decision(&self) -> Decision {
        self.lock().decision.clone()
    }

    fn prepared(&self, shard: u32, result: Result<(), WriteError>) {
        match result {
            Ok(()) => {
                let all = {
                    let mut state = self.lock();
                    state.prepared += 1;
                    state.prepared == self.participants.len()
                };
                if all {
                    self.decide(Decision::Committed);
                }
            }
            Err(err) => {
                tracing::warn!(gsn = self.gsn, shard, %err, "a part failed to prepare; aborting its batch");
                self.decide(Decision::Aborted(err));
            }
        }
    }

    fn refuse(&self, reason: WriteError) {
        self.decide(Decision::Aborted(reason));
    }

    fn applied(&self, _shard: u32, result: Result<(), WriteError>) {
        if result.is_ok() {
            let all = {
                let mut state = self.lock();
                state.applied += 1;
                state.applied == self.participants.len()
            };
            if all {
                self.wake_all();
            }
        }
    }

    fn all_applied(&self) -> bool {
        self.lock().applied == self.participants.len()
    }
}

/// Hands out gsns and coordinates cross-shard batches.
pub struct Coordination {
    next_gsn: AtomicU64,
    pub decisions: Arc<Decisions>,
}

impl Coordination {
    pub fn new(next_gsn: u64) -> Coordination {
        Coordination { next_gsn: AtomicU64::new(next_gsn), decisions: Arc::default() }
    }

    /// A new batch over `participants` (ascending, at least two), and one vote per participant.
    pub fn begin(&self, router: &Router, participants: Vec<u32>) -> (Arc<Txn>, Vec<Vote>) {
        assert!(participants.len() >= 2 && participants.windows(2).all(|p| p[0] < p[1]));
        let txn = Arc::new(Txn {
            gsn: self.next_gsn.fetch_add(1, Ordering::Relaxed),
            participants,
            router: router.clone(),
            decisions: self.decisions.clone(),
            state: Mutex::new(TxnState { prepared: 0, applied: 0, decision: Decision::Pending }),
        });
        let votes = txn
            .participants
            .iter()
            .map(|&shard| Vote::new(txn.clone() as Arc<dyn Coordinator>, shard))
            .collect();
        (txn, votes)
    }

    /// Runs one exec per participant as one cross-shard batch: `parts` are (shard, lock keys,
    /// a builder that makes the exec from its vote), in ascending shard order, at least two.
    /// Each exec must end in `ExecStep::Prepare` with its vote (or refuse it) and answers its
    /// caller itself. Returns once every exec is queued and started, or the batch was called
    /// off; the execs finish on their own.
    pub async fn run(&self, router: &Router, parts: Vec<AtomicExec>) {
        self.decisions.admit().await;
        let participants: Vec<u32> = parts.iter().map(|part| part.shard).collect();
        let (_txn, votes) = self.begin(router, participants);
        // In shard order, each exec queued only once the previous one holds its locks (the
        // module comment); votes not handed out are dropped when the loop ends (invariant 3).
        for (part, vote) in parts.into_iter().zip(votes) {
            let (started, on_start) = oneshot::channel();
            let exec = Started { inner: (part.build)(vote), started: Some(started) };
            let mut locks = lock_ids(&part.locks);
            if !part.lock_ids.is_empty() {
                locks.extend(part.lock_ids);
                locks.sort_unstable();
                locks.dedup();
            }
            let request = ExecRequest { locks, exec: Box::new(exec) };
            if !router.send_exec_async(part.shard, request).await || on_start.await.is_err() {
                break;
            }
        }
    }

    /// Writes a batch whose operations live in several shards, all or nothing (`by_shard`:
    /// ascending shards, each with its operations, already checked). Returns once every part is
    /// applied, or with the error that called the batch off.
    pub async fn write(
        &self,
        router: &Router,
        by_shard: Vec<(u32, Vec<BatchOp>)>,
    ) -> Result<(), WriteError> {
        let mut answers = Vec::with_capacity(by_shard.len());
        let mut parts = Vec::with_capacity(by_shard.len());
        for (shard, ops) in by_shard {
            let (answer, on_answer) = oneshot::channel();
            answers.push(on_answer);
            let locks = ops.iter().map(|op| op.key().to_vec()).collect();
            parts.push(AtomicExec {
                shard,
                locks,
                lock_ids: LockIds::new(),
                build: Box::new(move |vote| {
                    Box::new(PartExec { part: Some((vote, ops)), answer: Some(answer) })
                }),
            });
        }
        self.run(router, parts).await;
        let mut result = Ok(());
        for answer in answers {
            let outcome = answer.await.unwrap_or(Err(WriteError::Closed));
            if let Err(err) = outcome {
                // Report the cause rather than the abort it led to elsewhere.
                if result.is_ok() || matches!(result, Err(WriteError::Aborted(_))) {
                    result = Err(err);
                }
            }
        }
        result
    }
}

/// One participant of a cross-shard batch of execs (`Coordination::run`, `Db::exec_atomic`).
pub struct AtomicExec {
    pub shard: u32,
    pub locks: Vec<Vec<u8>>,
    /// More locks, given as ids (`exec::lock_ids`): a sequence's steps carry theirs so.
    pub lock_ids: LockIds,
    pub build: Box<dyn FnOnce(Vote) -> Box<dyn Exec> + Send>,
}

/// Tells the coordinator when its exec started (holds its locks), then is that exec.
struct Started {
    inner: Box<dyn Exec>,
    started: Option<oneshot::Sender<()>>,
}

impl Exec for Started {
    fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep {
        if let Some(started) = self.started.take() {
            let _ = started.send(());
        }
        self.inner.step(view, input)
    }
}

/// One participant's exec for `Db::write_batch`: its locks are the part's keys.
struct PartExec {
    part: Option<(Vote, Vec<BatchOp>)>,
    answer: Option<oneshot::Sender<Result<(), WriteError>>>,
}

impl Exec for PartExec {
    fn step(&mut self, _view: &ExecView<'_>, input: StepInput) -> ExecStep {
        match input {
            StepInput::Start => match self.part.take() {
                Some((vote, ops)) => ExecStep::Prepare { vote, ops },
                None => ExecStep::Done,
            },
            StepInput::Written(result) => {
                if let Some(answer) = self.answer.take() {
                    let _ = answer.send(result);
                }
                ExecStep::Done
            }
            StepInput::Read(_) => ExecStep::Done,
        }
    }
}

/// What recovery does with the parts every shard reported (invariant 2): the parts to apply
/// (shard, gsn), the parts to forget afterwards, and the next gsn to hand out.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Resolution {
    pub commit: Vec<(u32, u64)>,
    pub forget: Vec<(u32, u64)>,
    pub committed_batches: usize,
    pub aborted_batches: usize,
    pub next_gsn: u64,
}

/// Decides every batch from its parts: committed if any part is marked committed or every
/// participant holds a part; aborted otherwise (a missing part was never durable, since parts
/// are forgotten only after every participant committed).
pub fn resolve(found: &[(u32, PartRecord)]) -> Resolution {
    let mut by_gsn: BTreeMap<u64, Vec<(u32, &PartRecord)>> = BTreeMap::new();
    for (shard, part) in found {
        by_gsn.entry(part.gsn).or_default().push((*shard, part));
    }
    let mut resolution = Resolution { next_gsn: 1, ..Resolution::default() };
    for (gsn, parts) in by_gsn {
        resolution.next_gsn = resolution.next_gsn.max(gsn + 1);
        let participants = &parts[0].1.participants;
        let holders: std::collections::BTreeSet<u32> =
            parts.iter().map(|(shard, _)| *shard).collect();
        let every_part = participants.iter().all(|shard| holders.contains(shard))
            && holders.iter().all(|shard| participants.contains(shard));
        let committed =
            every_part || parts.iter().any(|(_, part)| part.state == PartState::Committed);
        if committed {
            resolution.committed_batches += 1;
            for (shard, part) in &parts {
                if part.state == PartState::Prepared {
                    resolution.commit.push((*shard, gsn));
                }
            }
        } else {
            resolution.aborted_batches += 1;
        }
        for (shard, _) in &parts {
            resolution.forget.push((*shard, gsn));
        }
    }
    resolution
}

/// Carries out a resolution on freshly opened shards (nothing else is running yet): applies,
/// then forgets. A crash in between leaves parts the next open resolves the same way.
pub fn carry_out(router: &Router, resolution: &Resolution) -> Result<(), WriteError> {
    let send = |shard: u32, build: &dyn Fn(crate::engine::Reply<(), WriteError>) -> Request| {
        let (reply, receiver) = oneshot::channel();
        router.send_to(shard, WriteError::Closed, build(reply), receiver)
    };
    let commits: Vec<_> = resolution
        .commit
        .iter()
        .map(|&(shard, gsn)| send(shard, &|reply| Request::CommitPart { gsn, reply }))
        .collect();
    for pending in commits {
        pending.wait()?;
    }
    let forgets: Vec<_> = resolution
        .forget
        .iter()
        .map(|&(shard, gsn)| send(shard, &|reply| Request::ForgetPart { gsn, reply }))
        .collect();
    for pending in forgets {
        pending.wait()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(state: PartState, gsn: u64, participants: &[u32]) -> PartRecord {
        PartRecord {
            state,
            gsn,
            participants: participants.to_vec(),
            ops: vec![BatchOp::Delete { key: b"k".to_vec() }],
        }
    }

    #[test]
    fn recovery_commits_a_batch_only_when_its_parts_prove_it() {
        use PartState::{Committed, Prepared};
        let found = vec![
            // 5: every participant prepared: committed (the decision may have been seen).
            (0, part(Prepared, 5, &[0, 1])),
            (1, part(Prepared, 5, &[0, 1])),
            // 6: one part missing, none committed: aborted.
            (0, part(Prepared, 6, &[0, 1, 2])),
            (2, part(Prepared, 6, &[0, 1, 2])),
            // 9: one committed mark, one part already forgotten, one still prepared: committed.
            (1, part(Committed, 9, &[0, 1, 2])),
            (2, part(Prepared, 9, &[0, 1, 2])),
        ];
        let resolution = resolve(&found);
        assert_eq!(resolution.commit, vec![(0, 5), (1, 5), (2, 9)]);
        assert_eq!(resolution.forget, vec![(0, 5), (1, 5), (0, 6), (2, 6), (1, 9), (2, 9)]);
        assert_eq!((resolution.committed_batches, resolution.aborted_batches), (2, 1));
        assert_eq!(resolution.next_gsn, 10);
        assert_eq!(resolve(&[]).next_gsn, 1);
    }
}
