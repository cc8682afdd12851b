//! The state files the gateway and machine egress keep are written one way:
//! to a temporary file beside the target, synced, renamed over it, and the
//! directory synced, so a crash leaves the old file or the new one, never
//! half of either.

use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `dir/name` atomically (creating `dir` if needed).
pub fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{name}.tmp"));
    // A new file, never one already there (a crash's leftover is removed
    // first; a link planted in its place is refused, not followed).
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, dir.join(name))?;
    std::fs::File::open(dir)?.sync_all()
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
