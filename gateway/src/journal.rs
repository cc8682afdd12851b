//! Durable pushed state that costs O(change): the last compacted snapshot
//! (`snapshot.json`, see [`crate::persist`]) plus an append-only journal of
//! the pushes and deletes since (`journal.log`).
//!
//! A journal record is `[len: u32 LE][crc32: u32 LE][JSON: len bytes]`,
//! appended and fsynced (one fsync for every record of a group commit)
//! before any push in it is acknowledged. At start the snapshot is loaded and
//! the journal replayed on top. A record cut short or failing its checksum
//! at the very end is a torn write — it was never acknowledged — and is
//! dropped with a log line naming the file and offset; a bad record with
//! more after it is corruption, and startup stops naming the file and offset
//! rather than enforce a silently partial policy set. When the journal
//! outgrows the snapshot it is compacted: a new snapshot, then an empty
//! journal.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use egress_policy::SandboxId;

use crate::persist::{self, PersistError, SandboxDoc};
use crate::registry::Registry;

/// The file name under `state_dir`.
pub const JOURNAL_FILE: &str = "journal.log";

/// Largest record accepted when reading (a push body is capped at 1 MiB).
const MAX_RECORD: usize = 4 << 20;
/// Compaction waits until the journal is at least this large.
const MIN_COMPACT_BYTES: u64 = 4 << 20;

/// One change, as journaled.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Change {
    /// Boxed: a policy is large beside an id (clippy's large_enum_variant).
    Put(Box<SandboxDoc>),
    Delete(String),
}

/// A journal record: a change and its sequence number. Sequence numbers
/// never restart; the snapshot says the last one it covers, so records it
/// already holds are skipped on replay (a crash between writing a snapshot
/// and emptying the journal replays nothing twice).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub seq: u64,
    pub change: Change,
}

/// The open journal.
#[derive(Debug)]
pub struct Journal {
    file: File,
    path: PathBuf,
    /// Bytes in the journal now.
    bytes: u64,
    /// The snapshot's size when it was written: compaction is due once the
    /// journal outgrows it (and [`MIN_COMPACT_BYTES`]).
    snapshot_bytes: u64,
    /// After a failed compaction, the size the journal waits for before
    /// the next try ([`Journal::compaction_failed`]); 0 otherwise.
    retry_at: u64,
    /// Set when a failed append could not be cut back ([`Journal::append`]).
    doubt: Option<String>,
}

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(JOURNAL_FILE)
}

impl Journal {
    /// Opens (or creates) the journal; returns it and the records to replay,
    /// each with its offset in the file. A torn tail is cut off the file so
    /// appends continue from a clean end.
    pub fn open(
        state_dir: &Path,
        snapshot_bytes: u64,
    ) -> Result<(Self, Vec<(usize, Record)>), PersistError> {
        let path = path(state_dir);
        let io = |source| PersistError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(state_dir).map_err(io)?;
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(io)?;
        // The file's name (and the directory's, if it was made now) made
        // durable before the first append is acknowledged: an fsync of the
        // file alone need not keep a new name.
        std::fs::File::open(state_dir)
            .and_then(|d| d.sync_all())
            .map_err(io)?;
        if let Some(parent) = state_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            let _ = std::fs::File::open(parent).and_then(|d| d.sync_all());
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io)?;
        let (records, good) = read_records(&bytes, &path)?;
        if good < bytes.len() {
            tracing::warn!(path = %path.display(), offset = good, dropped_bytes = bytes.len() - good, "dropping a torn record at the end of the journal (it was never acknowledged)");
            file.set_len(good as u64).map_err(io)?;
            file.sync_all().map_err(io)?;
        }
        let journal = Self {
            file,
            path,
            bytes: good as u64,
            snapshot_bytes,
            retry_at: 0,
            doubt: None,
        };
        Ok((journal, records))
    }

    /// Appends `records` and makes them durable with one fsync. If that
    /// fails, the journal is cut back to what it held: nothing of a batch
    /// that was refused stays behind, to be replayed at the next start or to
    /// break the next append. If the cut fails too, the journal is in doubt
    /// ([`Journal::in_doubt`]).
    pub fn append(&mut self, records: &[Record]) -> Result<(), PersistError> {
        let mut buf = Vec::new();
        for r in records {
            let json = serde_json::to_vec(r).map_err(|e| self.io(e.into()))?;
            buf.extend_from_slice(&u32::try_from(json.len()).unwrap_or(u32::MAX).to_le_bytes());
            buf.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
            buf.extend_from_slice(&json);
        }
        let written = self
            .file
            .write_all(&buf)
            .and_then(|()| self.file.sync_data());
        if let Err(e) = written {
            let cut = self
                .file
                .set_len(self.bytes)
                .and_then(|()| self.file.sync_all());
            if let Err(cut) = cut {
                self.doubt = Some(format!(
                    "an append failed ({e}) and could not be cut back ({cut})"
                ));
            }
            return Err(self.io(e));
        }
        self.bytes += buf.len() as u64;
        Ok(())
    }

    /// Why the file may hold bytes of a batch that was refused, if it may:
    /// no change may be committed after them.
    pub fn in_doubt(&self) -> Option<&str> {
        self.doubt.as_deref()
    }

    /// Whether the journal has outgrown the snapshot, and the size a
    /// failed compaction put off the next try to.
    pub fn compaction_due(&self) -> bool {
        self.bytes
            >= MIN_COMPACT_BYTES
                .max(self.snapshot_bytes)
                .max(self.retry_at)
    }

    /// A compaction failed: the next is tried once the journal has grown by
    /// what made it due again (the snapshot's size, at least 4 MiB), not
    /// after every batch (a full disk would have every push write the
    /// whole state again). Returns the size it waits for.
    pub fn compaction_failed(&mut self) -> u64 {
        let step = MIN_COMPACT_BYTES.max(self.snapshot_bytes);
        self.retry_at = self.bytes.saturating_add(step);
        self.retry_at
    }

    /// Empties the journal after a new snapshot (`snapshot_bytes` long) was
    /// written: the snapshot now holds everything.
    pub fn reset(&mut self, snapshot_bytes: u64) -> Result<(), PersistError> {
        self.file.set_len(0).map_err(|e| self.io(e))?;
        // Cut, whether or not the sync below holds: a later append's cut
        // back must not lengthen the file again.
        self.bytes = 0;
        self.snapshot_bytes = snapshot_bytes;
        self.retry_at = 0;
        self.file.sync_all().map_err(|e| self.io(e))
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Puts `file` in place of the journal's handle (a test's way to make
    /// its writes fail, and to let them succeed again).
    #[cfg(test)]
    pub(crate) fn use_file(&mut self, file: File) {
        self.file = file;
    }

    fn io(&self, source: std::io::Error) -> PersistError {
        PersistError::Io {
            path: self.path.clone(),
            source,
        }
    }
}

/// The records in `bytes`, and where the good part ends. A record cut
/// short, or failing its checksum, with no whole record after it is a torn
/// tail (left out): a crash during an append (of a batch of records, in one
/// write) that was never acknowledged. Any bad record (a checksum that
/// fails, its length above what a writer writes, or past the end) with a
/// whole record somewhere after it is corruption: cutting there would drop
/// records that were acknowledged.
fn read_records(bytes: &[u8], path: &Path) -> Result<(Vec<(usize, Record)>, usize), PersistError> {
    let mut records = Vec::new();
    let mut off = 0;
    while off < bytes.len() {
        let corrupt = |why: String| PersistError::CorruptJournal {
            path: path.to_owned(),
            message: format!("record at offset {off}: {why}"),
        };
        let Some(header) = bytes.get(off..off + 8) else {
            return Ok((records, off));
        };
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        let end = off + 8 + len;
        // No writer writes a record shorter than `{}`: a length of 0 or 1
        // is a tail the file was extended by but never written (zeros
        // after a crash), whose empty payload would pass its checksum.
        let written = (2..=MAX_RECORD).contains(&len);
        let Some(payload) = bytes.get(off + 8..end).filter(|_| written) else {
            if let Some(later) = whole_record_after(bytes, off) {
                return Err(corrupt(format!(
                    "a length of {len} bytes, and a whole record at offset {later} after it"
                )));
            }
            return Ok((records, off));
        };
        if crc32fast::hash(payload) != crc {
            // A batch of records is one write: torn within, its later
            // records unwritten too (zeros, say), this is its tail.
            if let Some(later) = whole_record_after(bytes, off) {
                return Err(corrupt(format!(
                    "checksum mismatch, and a whole record at offset {later} after it"
                )));
            }
            return Ok((records, off));
        }
        let record: Record = egress_policy::from_json(
            std::str::from_utf8(payload).map_err(|e| corrupt(e.to_string()))?,
        )
        .map_err(|e| corrupt(e.to_string()))?;
        records.push((off, record));
        off = end;
    }
    Ok((records, off))
}

/// The offset of the first whole record (a length a writer writes, a JSON
/// object as its payload, its checksum right) that starts after `off`.
fn whole_record_after(bytes: &[u8], off: usize) -> Option<usize> {
    (off + 1..bytes.len().saturating_sub(8)).find(|&at| {
        let header = &bytes[at..at + 8];
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        (2..=MAX_RECORD).contains(&len)
            && bytes
                .get(at + 8..at + 8 + len)
                .is_some_and(|p| p.first() == Some(&b'{') && p.last() == Some(&b'}'))
            && crc32fast::hash(&bytes[at + 8..at + 8 + len]) == crc
    })
}

/// Loads the snapshot and replays the journal on top: the registry as last
/// acknowledged. Returns the open journal, the last sequence number applied
/// and the number of sandboxes.
pub fn recover(
    registry: &Registry,
    state_dir: &Path,
) -> Result<(Journal, u64, usize), PersistError> {
    let (snapshot_seq, snapshot_bytes) = load_snapshot(registry, state_dir)?;
    let (journal, records) = Journal::open(state_dir, snapshot_bytes)?;
    let seq = replay(registry, records, snapshot_seq, &journal.path)?;
    Ok((journal, seq, registry.len()))
}

/// Reads the state as [`recover`] does, into `registry` (a scratch one),
/// and changes no file: what a successor checks before it asks for a
/// takeover, while the running gateway still writes the state. A record
/// being appended meanwhile reads as a torn tail, which is no error; a
/// compaction meanwhile (a new snapshot, the journal emptied) is met by
/// reading again, at most three times. Returns the last sequence number
/// read and the number of sandboxes.
pub fn check(registry: &Registry, state_dir: &Path) -> Result<(u64, usize), PersistError> {
    // A new snapshot is written and renamed into place: another file.
    let snapshot = |dir: &Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(persist::path(dir))
            .ok()
            .map(|m| (m.ino(), m.len(), m.modified().ok()))
    };
    let mut tries = 0;
    loop {
        let before = snapshot(state_dir);
        let (snapshot_seq, _) = load_snapshot(registry, state_dir)?;
        let path = path(state_dir);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => return Err(PersistError::Io { path, source }),
        };
        tries += 1;
        let read = read_records(&bytes, &path)
            .and_then(|(records, _)| replay(registry, records, snapshot_seq, &path));
        if snapshot(state_dir) == before || tries == 3 {
            return read.map(|seq| (seq, registry.len()));
        }
    }
}

/// Loads the snapshot, if there is one, into `registry`: its sequence
/// number and its size (0 and 0 without one).
fn load_snapshot(registry: &Registry, state_dir: &Path) -> Result<(u64, u64), PersistError> {
    let Some(doc) = persist::load(state_dir)? else {
        return Ok((0, 0));
    };
    let seq = doc.seq;
    persist::apply(registry, doc, state_dir)?;
    let bytes = std::fs::metadata(persist::path(state_dir)).map_or(0, |m| m.len());
    Ok((seq, bytes))
}

/// Replays the journal's `records` (each with its offset in the file at
/// `path`) newer than the snapshot's `snapshot_seq`: the last sequence
/// number applied.
fn replay(
    registry: &Registry,
    records: Vec<(usize, Record)>,
    snapshot_seq: u64,
    path: &Path,
) -> Result<u64, PersistError> {
    let mut seq = snapshot_seq;
    for (off, r) in records.into_iter().filter(|(_, r)| r.seq > snapshot_seq) {
        // A record that reads but cannot be replayed: named by its offset,
        // where the journal may be cut.
        let corrupt = |e: &dyn std::fmt::Display| PersistError::CorruptJournal {
            path: path.to_owned(),
            message: format!("record {} at offset {off}: {e}", r.seq),
        };
        match r.change {
            Change::Put(doc) => {
                let id = SandboxId::parse(&doc.id).map_err(|e| corrupt(&e))?;
                let Some(doc) = persist::as_pushed_now(*doc) else {
                    registry.remove(&id);
                    seq = seq.max(r.seq);
                    continue;
                };
                let extras = crate::registry::Extras {
                    credentials: doc.credentials,
                    upstream_proxy: doc.upstream_proxy,
                    shadow: doc.shadow.map(|b| *b),
                    revision: doc.revision,
                };
                let sandbox = registry.prepare_with(id, doc.addresses, doc.policy, extras);
                registry.put_prepared(sandbox).map_err(|e| corrupt(&e))?;
            }
            Change::Delete(id) => {
                registry.remove(&SandboxId::new(&id));
            }
        }
        seq = seq.max(r.seq);
    }
    Ok(seq)
}

#[cfg(test)]
mod tests;
