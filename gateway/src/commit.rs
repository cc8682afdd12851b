//! The commit path of the control API: one thread owns the journal and
//! applies changes to the registry in order. Pushes that arrive together
//! share one fsync (group commit); each still swaps the registry atomically
//! on its own. A change is acknowledged only once durable; if the write
//! fails, the batch's changes are undone, so what is acknowledged never
//! runs ahead of what a restart would enforce. The changes are applied
//! before the append, though: for the fsync's milliseconds flows are judged
//! by a change that a failed write then takes back (or a crash loses).
//! Compiling a pushed policy — the costly part — happens before,
//! concurrently, in the request's task.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dns_attrib::AttributionCache;
use egress_policy::SandboxId;
use tokio::sync::{mpsc, oneshot};

use crate::journal::{self, Journal, Record};
use crate::persist;
use crate::registry::{Registry, RegistryError, Sandbox};
use crate::shadow::Shadow;
pub(crate) use revisions::Stale;

/// Pushes committed together at most.
const MAX_BATCH: usize = 1_024;

/// Changes waiting for the commit thread at most: past it, a change is
/// refused at once ([`NotApplied::Busy`]). A stalled disk (an fsync that
/// does not return) then holds a bounded queue, not one compiled sandbox
/// for every retry of every push.
const MAX_QUEUED: usize = 4 * MAX_BATCH;

/// One change the control API asks for.
pub(crate) enum Change {
    /// A push; the sandbox's shadow, if it has one, is kept.
    Put(Arc<Sandbox>),
    /// A delete, and the writer's revision of it, if it named one.
    Delete(SandboxId, Option<u64>),
    /// Sets (or, `None`, drops) a sandbox's shadow, compiled by the
    /// request against the credentials it read: compiled again here only if
    /// the sandbox's credentials changed since (the commit thread every
    /// push waits on does not compile a candidate of up to 1 MiB itself).
    Shadow(SandboxId, Option<Box<Candidate>>),
    /// The shadow's candidate becomes the policy, the shadow goes: one put.
    Promote(SandboxId),
    /// A resync: everything at once, written as a new snapshot.
    Replace(Vec<Arc<Sandbox>>),
    /// The last change (a takeover): the thread answers and stops, so every
    /// change acknowledged before is durable and none is after.
    Seal,
}

/// A shadow compiled outside the commit thread, and the credentials it was
/// compiled against.
#[derive(Debug)]
pub(crate) struct Candidate {
    pub(crate) shadow: Arc<Shadow>,
    pub(crate) credentials: Vec<crate::credentials::Credential>,
}

/// Why a change was not applied.
#[derive(Debug)]
pub(crate) enum NotApplied {
    Refused(RegistryError),
    /// A delete (or a shadow change) of a sandbox that is not there, a
    /// promotion of a shadow that is not there.
    Missing,
    /// Not durable: not applied.
    Failed(String),
    /// A promotion of a shadow a push has changed the policy under.
    Conflict(String),
    /// The commit thread has [`MAX_QUEUED`] changes waiting: not applied,
    /// try again.
    Busy,
    /// A push or delete naming a revision below the one held ([`revisions`]).
    Stale(Stale),
}

/// What became of a change: applied, with the generation that counts it
/// (for a change committed in a batch, the batch's last), or why not.
pub(crate) type Outcome = Result<u64, NotApplied>;

/// Whether one change of a batch applied, before the batch is durable.
type Applied = Result<(), NotApplied>;

struct Job {
    change: Change,
    reply: oneshot::Sender<Outcome>,
}

/// The handle the API submits changes through.
#[derive(Debug, Clone)]
pub(crate) struct Committer {
    jobs: mpsc::Sender<JobBox>,
    /// Changes committed since the state was first written: the state's
    /// generation, reported to controllers.
    pub(crate) generation: Arc<AtomicU64>,
    /// Set when no change can be committed until a restart: the state
    /// directory is in doubt, or the commit thread did not start.
    pub(crate) stuck: Arc<AtomicBool>,
}

/// Whether `job` puts a sandbox `batch` deletes.
fn deleted_in(batch: &[JobBox], job: &Job) -> bool {
    let Change::Put(s) = &job.change else {
        return false;
    };
    batch
        .iter()
        .any(|j| matches!(&j.change, Change::Delete(id, _) if *id == s.id))
}

/// Tells [`Committer::stuck`] when the commit thread ends in a panic:
/// every change would then be refused.
struct Died(Arc<AtomicBool>);

impl Drop for Died {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

/// A job, boxed so the channel's item stays small.
type JobBox = Box<Job>;

impl Committer {
    /// Starts the commit thread; `seq` is the last sequence number applied
    /// (the snapshot's, or the journal's last record).
    pub(crate) fn start(
        (registry, cache): (Arc<Registry>, Arc<AttributionCache>),
        state_dir: PathBuf,
        journal: Journal,
        seq: u64,
    ) -> Self {
        let (jobs, rx) = mpsc::channel(MAX_QUEUED);
        let generation = Arc::new(AtomicU64::new(seq));
        let stuck = Arc::new(AtomicBool::new(false));
        let worker = Worker {
            registry,
            cache: Some(cache),
            state_dir,
            journal,
            generation: generation.clone(),
            deleted: revisions::Deleted::default(),
            doubt: None,
            stuck: stuck.clone(),
        };
        let died = Died(stuck.clone());
        let spawned = std::thread::Builder::new()
            .name("egress-commit".into())
            .spawn(move || {
                let _died = died;
                worker.run(rx);
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the commit thread: every push will fail");
            stuck.store(true, Ordering::Release);
        }
        Self {
            jobs,
            generation,
            stuck,
        }
    }

    /// Stops the commit thread once everything submitted before is durable;
    /// later submissions fail ("the commit thread has stopped"). Waits at
    /// most `within`: a thread stuck on a stalled disk has not sealed, and
    /// may still write, so the state directory must not be handed on.
    pub(crate) async fn seal(&self, within: Duration) -> Result<(), String> {
        let (reply, answer) = oneshot::channel();
        let job = Box::new(Job {
            change: Change::Seal,
            reply,
        });
        let sealed = async {
            // Waits for a place: the seal is never refused for a full queue.
            if self.jobs.send(job).await.is_ok() {
                let _ = answer.await;
            }
        };
        tokio::time::timeout(within, sealed).await.map_err(|_| {
            format!(
                "the commit thread did not seal the pushed state within {}s (a stalled disk?)",
                within.as_secs_f64()
            )
        })
    }

    /// Submits a change and waits until it is durable (or refused).
    pub(crate) async fn submit(&self, change: Change) -> Outcome {
        Self::outcome(self.queue(change)?).await
    }

    /// Queues a change, at once: the commit thread applies the changes in
    /// the order they were queued. Its outcome comes on the receiver
    /// ([`Committer::outcome`]).
    pub(crate) fn queue(&self, change: Change) -> Result<oneshot::Receiver<Outcome>, NotApplied> {
        let (reply, answer) = oneshot::channel();
        match self.jobs.try_send(Box::new(Job { change, reply })) {
            Ok(()) => Ok(answer),
            Err(mpsc::error::TrySendError::Full(_)) => Err(NotApplied::Busy),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                Err(NotApplied::Failed("the commit thread has stopped".into()))
            }
        }
    }

    /// Waits until a queued change is durable (or refused).
    pub(crate) async fn outcome(answer: oneshot::Receiver<Outcome>) -> Outcome {
        answer
            .await
            .unwrap_or_else(|_| Err(NotApplied::Failed("the commit thread has stopped".into())))
    }
}

struct Worker {
    registry: Arc<Registry>,
    /// The DNS evidence, forgotten for a removed sandbox once its removal
    /// is durable, before the next change applies: a sandbox registered
    /// again under its id is not judged on the removed one's evidence, nor
    /// loses its own afterwards; a removal rolled back keeps it.
    cache: Option<Arc<AttributionCache>>,
    state_dir: PathBuf,
    journal: Journal,
    generation: Arc<AtomicU64>,
    /// The revisions of the sandboxes deleted lately ([`revisions`]).
    deleted: revisions::Deleted,
    /// Set when a resync's snapshot may be on disk though its write failed.
    doubt: Option<String>,
    /// [`Committer::stuck`], told after each change.
    stuck: Arc<AtomicBool>,
}

impl Worker {
    fn run(mut self, mut rx: mpsc::Receiver<JobBox>) {
        let mut carry: Option<JobBox> = None;
        loop {
            let Some(first) = carry.take().or_else(|| rx.blocking_recv()) else {
                return;
            };
            let Some(first) = self.unless_in_doubt(first) else {
                continue;
            };
            match first.change {
                Change::Replace(_) => {
                    self.replace(*first);
                    self.tell_if_stuck();
                    continue;
                }
                Change::Seal => {
                    rx.close();
                    let _ = first
                        .reply
                        .send(Ok(self.generation.load(Ordering::Acquire)));
                    return;
                }
                Change::Put(_) | Change::Delete(..) | Change::Shadow(..) | Change::Promote(_) => {}
            }
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(job) if matches!(job.change, Change::Replace(_) | Change::Seal) => {
                        carry = Some(job);
                        break;
                    }
                    // A sandbox registered again after a delete in this
                    // batch waits for the next: its id's evidence goes once
                    // the delete is durable, before it is registered.
                    Ok(job) if deleted_in(&batch, &job) => {
                        carry = Some(job);
                        break;
                    }
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
            self.commit(batch);
            self.compact_if_due();
            self.tell_if_stuck();
        }
    }

    /// Tells readiness when no change can be committed any more.
    fn tell_if_stuck(&self) {
        if self.in_doubt().is_some() {
            self.stuck.store(true, Ordering::Release);
        }
    }

    /// Why no change may be committed, if none may: what is on disk is not
    /// known, so a change acknowledged now might not be what a restart
    /// enforces. A restart recovers what was acknowledged.
    fn in_doubt(&self) -> Option<String> {
        let why = self.doubt.as_deref().or(self.journal.in_doubt())?;
        Some(format!(
            "not applied: the state directory is in doubt ({why}); restart the gateway"
        ))
    }

    /// `job`, unless the state is in doubt: then it is refused (a seal
    /// still seals).
    fn unless_in_doubt(&self, job: JobBox) -> Option<JobBox> {
        match self.in_doubt() {
            Some(why) if !matches!(job.change, Change::Seal) => {
                let _ = job.reply.send(Err(NotApplied::Failed(why)));
                None
            }
            _ => Some(job),
        }
    }

    /// Applies a batch of puts and deletes in order, then makes them durable
    /// with one append and one fsync.
    fn commit(&mut self, batch: Vec<JobBox>) {
        let before = self.registry.checkpoint();
        let mut records = Vec::with_capacity(batch.len());
        let mut outcomes: Vec<Applied> = Vec::with_capacity(batch.len());
        for job in &batch {
            let outcome = match &job.change {
                Change::Put(s) => self.put_unless_stale(s, &mut records),
                Change::Shadow(id, candidate) => match self.shadowed(id, candidate.as_deref()) {
                    Some(s) => self.put(Arc::new(s), &mut records),
                    None => Err(NotApplied::Missing),
                },
                Change::Promote(id) => self.promote(id, &mut records),
                Change::Delete(id, revision) => self.delete(id, *revision, &mut records),
                Change::Replace(_) | Change::Seal => Err(NotApplied::Failed(
                    "a resync or a seal is committed on its own".into(),
                )),
            };
            outcomes.push(outcome);
        }
        if !records.is_empty() {
            let first = self.generation.load(Ordering::Acquire) + 1;
            let records: Vec<Record> = (first..)
                .zip(records)
                .map(|(seq, change)| Record { seq, change })
                .collect();
            if let Err(e) = self.journal.append(&records) {
                self.rolled_back(before);
                tracing::error!(error = %e, "journal write failed; pushes rolled back");
                // Every answer was found against the state rolled back: a
                // second delete's "already gone" with the first undone,
                // a put's address taken by one undone. Each is refused as
                // not applied, and a retry is answered on the state as it is.
                for o in &mut outcomes {
                    *o = Err(NotApplied::Failed(format!("not applied: {e}")));
                }
            } else {
                self.generation
                    .fetch_add(records.len() as u64, Ordering::Release);
                self.forget_deleted(&batch, &outcomes);
            }
        }
        let generation = self.generation.load(Ordering::Acquire);
        for (job, outcome) in batch.into_iter().zip(outcomes) {
            let _ = job.reply.send(outcome.map(|()| generation));
        }
    }

    /// Puts back the state from `before` a change that failed. An allow
    /// entry that lapsed since (the lapse watch compiled it away meanwhile)
    /// is compiled away again at once, not at the watch's next tick.
    fn rolled_back(&self, before: Arc<crate::registry::Generation>) {
        self.registry.restore(before);
        self.registry
            .recompile_lapsed(time::OffsetDateTime::now_utc());
        // A sandbox the rolled-back change registered may have had queries
        // answered meanwhile: its evidence goes with it.
        self.forget_gone();
    }

    /// A push, unless it names a revision below the one held for its
    /// sandbox: its registration's, or the delete's of one deleted lately.
    fn put_unless_stale(
        &mut self,
        s: &Arc<Sandbox>,
        records: &mut Vec<journal::Change>,
    ) -> Applied {
        let held = match self.registry.get(&s.id) {
            Some(old) => old.revision,
            None => self.deleted.revision(&s.id, std::time::Instant::now()),
        };
        if let Some(stale) = revisions::stale(held, s.revision) {
            return Err(NotApplied::Stale(stale));
        }
        self.put(self.kept_shadow(s), records)?;
        self.deleted.forget(&s.id);
        Ok(())
    }

    /// A delete, unless it names a revision below the registration's. The
    /// revision it names is kept, even when the sandbox is not there: a
    /// push below it that arrives later is stale.
    fn delete(
        &mut self,
        id: &SandboxId,
        revision: Option<u64>,
        records: &mut Vec<journal::Change>,
    ) -> Applied {
        let held = self.registry.get(id).and_then(|s| s.revision);
        if let Some(stale) = revisions::stale(held, revision) {
            return Err(NotApplied::Stale(stale));
        }
        if let Some(revision) = revision {
            self.deleted.note(id, revision, std::time::Instant::now());
        }
        if !self.registry.remove(id) {
            return Err(NotApplied::Missing);
        }
        records.push(journal::Change::Delete(id.to_string()));
        Ok(())
    }

    /// Applies one put and queues its record.
    fn put(&self, s: Arc<Sandbox>, records: &mut Vec<journal::Change>) -> Applied {
        self.registry
            .put_prepared(s.clone())
            .map_err(NotApplied::Refused)?;
        records.push(journal::Change::Put(Box::new(persist::stored(&s))));
        Ok(())
    }

    /// A pushed sandbox that names no shadow keeps the one it has (its
    /// report too), compiled again if its credentials changed (its report
    /// then starts again).
    fn kept_shadow(&self, s: &Arc<Sandbox>) -> Arc<Sandbox> {
        if s.shadow.is_some() {
            return s.clone();
        }
        let Some(old) = self.registry.get(&s.id) else {
            return s.clone();
        };
        let Some(shadow) = &old.shadow else {
            return s.clone();
        };
        let same_credentials = old.credentials == s.credentials;
        let shadow = if old.policy.policy() != s.policy.policy() {
            let candidate = match same_credentials {
                true => shadow.policy.clone(),
                false => Arc::new(
                    self.registry
                        .compile_policy(shadow.policy.policy().clone(), &s.credentials),
                ),
            };
            Arc::new(shadow.over_changed_policy(candidate))
        } else if same_credentials {
            shadow.clone()
        } else {
            Arc::new(self.registry.compile_shadow(shadow.doc(), &s.credentials))
        };
        Arc::new(s.with_shadow(Some(shadow)))
    }

    /// Sandbox `id` with its shadow's candidate as its policy; refused
    /// when a push changed the policy after the shadow was put (its report
    /// never judged that change, and the promotion would undo it).
    fn promote(&self, id: &SandboxId, records: &mut Vec<journal::Change>) -> Applied {
        let Some(s) = self.registry.get(id) else {
            return Err(NotApplied::Missing);
        };
        if let Some(changed) = s.shadow.as_ref().and_then(|sh| sh.policy_changed.as_ref()) {
            return Err(NotApplied::Conflict(format!(
                "the policy of sandbox {id} changed at {changed}, after its shadow was put: put the shadow again, and read its report, before promoting it"
            )));
        }
        match s.promoted() {
            Some(s) => self.put(Arc::new(s), records),
            None => Err(NotApplied::Missing),
        }
    }

    /// Sandbox `id` with the shadow `doc` (or none); `None` without the sandbox.
    fn shadowed(&self, id: &SandboxId, candidate: Option<&Candidate>) -> Option<Sandbox> {
        let s = self.registry.get(id)?;
        let shadow = candidate.map(|c| match c.credentials == s.credentials {
            true => c.shadow.clone(),
            false => Arc::new(self.registry.compile_shadow(c.shadow.doc(), &s.credentials)),
        });
        Some(s.with_shadow(shadow))
    }

    /// A resync: the new state goes to a new snapshot, and the journal starts over.
    fn replace(&mut self, job: Job) {
        let Change::Replace(sandboxes) = job.change else {
            return;
        };
        let before = self.registry.checkpoint();
        // A resync is the writer's whole view: what it registers is no
        // longer deleted, whatever revision it names.
        for s in &sandboxes {
            self.deleted.forget(&s.id);
        }
        let sandboxes = sandboxes.iter().map(|s| self.kept_shadow(s)).collect();
        let seq = self.generation.load(Ordering::Acquire) + 1;
        let outcome = match self.registry.replace_prepared(sandboxes) {
            Err(e) => Err(NotApplied::Refused(e)),
            Ok(()) => match persist::save(&self.state_dir, &self.registry, seq) {
                Ok(bytes) => {
                    self.forget_gone();
                    // The snapshot is the state now: the journal's records
                    // are at or below `seq`, skipped on replay whether or
                    // not it is emptied.
                    self.generation.fetch_add(1, Ordering::Release);
                    if let Err(e) = self.journal.reset(bytes) {
                        tracing::warn!(error = %e, "the journal was not emptied after a resync (the snapshot covers its records)");
                    }
                    Ok(seq)
                }
                Err(e) => {
                    self.rolled_back(before);
                    tracing::error!(error = %e, "snapshot write failed; resync rolled back");
                    if !self.snapshot_before(seq) {
                        self.doubt = Some(format!(
                            "a resync's snapshot may be in place though writing it failed: {e}"
                        ));
                    }
                    Err(NotApplied::Failed(format!("not applied: {e}")))
                }
            },
        };
        let _ = job.reply.send(outcome);
    }

    /// Forgets the DNS evidence of the sandboxes a durable resync removed,
    /// before the next change applies.
    fn forget_gone(&self) {
        if let Some(cache) = &self.cache {
            cache.retain_sandboxes(|id| self.registry.get(id).is_some());
        }
    }

    /// Forgets the DNS evidence of the sandboxes a durable batch deleted,
    /// before the next change applies (a put of one of them waits for the
    /// next batch).
    fn forget_deleted(&self, batch: &[JobBox], outcomes: &[Applied]) {
        let Some(cache) = &self.cache else {
            return;
        };
        for (job, outcome) in batch.iter().zip(outcomes) {
            if let (Change::Delete(id, _), Ok(())) = (&job.change, outcome) {
                cache.remove_sandbox(id);
            }
        }
    }

    /// Whether the snapshot on disk (if any) is one from before `seq`: a
    /// failed write left the last one in place.
    fn snapshot_before(&self, seq: u64) -> bool {
        match persist::load(&self.state_dir) {
            Ok(None) => true,
            Ok(Some(doc)) => doc.seq < seq,
            Err(_) => false,
        }
    }

    /// Writes the whole state as the snapshot covering `seq`, and empties the journal.
    fn snapshot(&mut self, seq: u64) -> Result<(), persist::PersistError> {
        let bytes = persist::save(&self.state_dir, &self.registry, seq)?;
        self.journal.reset(bytes)
    }

    fn compact_if_due(&mut self) {
        if !self.journal.compaction_due() {
            return;
        }
        let journal_bytes = self.journal.bytes();
        match self.snapshot(self.generation.load(Ordering::Acquire)) {
            Ok(()) => tracing::info!(journal_bytes, "compacted the journal into the snapshot"),
            // The journal still holds everything: nothing is lost, compaction retries later.
            Err(e) => {
                let retry_at_bytes = self.journal.compaction_failed();
                tracing::warn!(error = %e, journal_bytes, retry_at_bytes, "journal compaction failed; tried again once the journal has grown by the snapshot's size (at least 4 MiB)");
            }
        }
    }
}

mod revisions;
#[cfg(test)]
mod tests;
