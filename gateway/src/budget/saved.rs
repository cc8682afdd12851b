//! Budget states across a cold restart: a gateway that stops without a
//! successor writes the states that are not full to `budgets.json` in its
//! state directory, after its flows drained, and the next gateway on that
//! directory takes them over at start, as a successor takes a handed-over
//! set, then removes the file once it serves (a start that fails before
//! leaves it for the next). The buckets' time is kept as an age, and
//! the time the gateway was down is added to it (by the wall clock: a clock
//! set back adds nothing), so a state refills as it would have. A gateway
//! that crashed wrote nothing: its sandboxes start full.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::Spent;

/// The file in the state directory.
pub(crate) const FILE: &str = "budgets.json";

/// The file: its states, and when it was written (Unix milliseconds).
/// Read back with each state as it is, and then each read as a [`Spent`]
/// on its own (`B`): one this build does not read (a destination a newer
/// or older build wrote differently) is dropped, not every state with it.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Saved<B> {
    written_at_ms: u64,
    budgets: Vec<B>,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Writes `budgets` (atomically) for the next start on `dir`.
pub(crate) fn save(dir: &Path, budgets: Vec<Spent>, now: SystemTime) -> std::io::Result<()> {
    let saved = Saved {
        written_at_ms: unix_ms(now),
        budgets,
    };
    let bytes = serde_json::to_vec(&saved).map_err(std::io::Error::other)?;
    egress_api::file::write_atomically(dir, FILE, &bytes)
}

/// The states the last gateway on `dir` wrote, aged by the time since. None
/// written: none. A file that does not read back is an error: its states
/// start full. The file stays until [`taken`].
pub(crate) fn read(dir: &Path, now: SystemTime) -> Result<Vec<Spent>, String> {
    let path = dir.join(FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let saved: Saved<serde_json::Value> =
        serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let down = unix_ms(now).saturating_sub(saved.written_at_ms);
    let mut budgets = super::each_read(saved.budgets, &path.display().to_string());
    for spent in &mut budgets {
        for bucket in [&mut spent.requests, &mut spent.bytes]
            .into_iter()
            .flatten()
        {
            bucket.age_ms = bucket.age_ms.saturating_add(down);
        }
    }
    Ok(budgets)
}

/// The file [`read`] at start removed, once the gateway serves: a state
/// taken is not taken again by a later start (which would find it aged by
/// then, and the spending since unrecorded). None there: nothing to do.
pub(crate) fn taken(dir: &Path) -> Result<(), String> {
    let path = dir.join(FILE);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::SpentBucket;
    use std::time::Duration;

    fn spent(age_ms: u64) -> Spent {
        Spent {
            sandbox: "sb1".into(),
            destination: serde_json::from_str(r#""*.example.test""#).expect("destination"),
            requests: Some(SpentBucket {
                units: 7,
                age_ms,
                rate: 3,
                period: 60_000,
            }),
            bytes: None,
        }
    }

    #[test]
    fn states_come_back_aged_by_the_time_down_once() {
        let dir = tempfile::tempdir().expect("dir");
        let at = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(read(dir.path(), at), Ok(Vec::new()), "none written");
        save(dir.path(), vec![spent(500)], at).expect("save");
        let later = at + Duration::from_secs(20);
        let back = read(dir.path(), later).expect("read");
        assert_eq!(back, [spent(20_500)]);
        assert_eq!(read(dir.path(), later), Ok(back), "kept until taken");
        taken(dir.path()).expect("taken");
        assert_eq!(read(dir.path(), later), Ok(Vec::new()), "taken once");
        taken(dir.path()).expect("none there");

        // A clock set back adds nothing.
        save(dir.path(), vec![spent(500)], later).expect("save");
        assert_eq!(read(dir.path(), at).expect("read"), [spent(500)]);

        // A state this build does not read (here a destination it refuses)
        // is dropped alone; before, the whole file was, every state full.
        let good = serde_json::to_value(spent(500)).expect("json");
        let mut bad = good.clone();
        bad["destination"] = serde_json::json!("bad..name");
        let text = serde_json::json!({"written_at_ms": unix_ms(at), "budgets": [bad, good]});
        std::fs::write(dir.path().join(FILE), text.to_string()).expect("write");
        assert_eq!(read(dir.path(), at).expect("read"), [spent(500)]);

        std::fs::write(dir.path().join(FILE), b"{not json").expect("write");
        let e = read(dir.path(), at).expect_err("corrupt");
        assert!(e.contains(FILE), "{e}");
    }
}
