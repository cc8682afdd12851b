//! The state files the gateway and machine egress keep are written one way:
//! to a temporary file beside the target, synced, renamed over it, and the
//! directory synced, so a crash leaves the old file or the new one, never
//! half of either.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `dir/name` atomically (creating `dir` if needed).
pub fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let staged = stage(dir, name, bytes)?;
    staged.put_in_place()?;
    std::fs::File::open(dir)?.sync_all()
}

/// A file written and synced beside its target, not yet in its place:
/// several are staged first and put in place only when all were written,
/// so a write that fails (a full disk) changes none of the targets.
/// Dropped without [`Staged::put_in_place`], the temporary file goes.
pub struct Staged {
    tmp: PathBuf,
    target: PathBuf,
    placed: bool,
}

/// Writes `bytes` to a temporary file beside `dir/name` and syncs it; on
/// failure nothing of it is left.
pub fn stage(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<Staged> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{name}.tmp"));
    // A new file, never one already there (a crash's leftover is removed
    // first; a link planted in its place is refused, not followed).
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let staged = Staged {
        tmp,
        target: dir.join(name),
        placed: false,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&staged.tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    Ok(staged)
}

impl Staged {
    /// The file it replaces.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Renames the file over its target (the caller syncs the directory).
    pub fn put_in_place(mut self) -> std::io::Result<()> {
        std::fs::rename(&self.tmp, &self.target)?;
        self.placed = true;
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.placed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("egress-api-file-{}", std::process::id()));
        write_atomically(&dir, "state.json", b"one").expect("first write");
        write_atomically(&dir, "state.json", b"two").expect("second write");
        assert_eq!(std::fs::read(dir.join("state.json")).expect("read"), b"two");
        assert!(!dir.join(".state.json.tmp").exists());
        // A link planted as the temporary file is not written through.
        let elsewhere = dir.join("elsewhere");
        std::fs::write(&elsewhere, b"mine").expect("write");
        std::os::unix::fs::symlink(&elsewhere, dir.join(".state.json.tmp")).expect("link");
        write_atomically(&dir, "state.json", b"three").expect("third write");
        assert_eq!(std::fs::read(&elsewhere).expect("read"), b"mine");
        assert_eq!(
            std::fs::read(dir.join("state.json")).expect("read"),
            b"three"
        );
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
