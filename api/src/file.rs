//! The state files the gateway and machine egress keep are written one way:
//! to a temporary file beside the target, synced, renamed over it, and the
//! directory synced, so a crash leaves the old file or the new one, never
//! half of either. Files holding secrets that the binaries read are
//! checked one way too: [`warn_if_open`].

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

/// Warns, naming `what`, the file, its mode and owner, when a file holding
/// a secret (a bearer token, a password) is open to other users: readable
/// by others, writable by anyone but its owner, or owned by another user
/// than root or this process's. A group may read it (a Kubernetes Secret
/// mounted `0440` for the pod's `fsGroup`). Each file is warned about once
/// per mode and owner, however often it is read (a credential's file at
/// every push). The mode, if it is open; a file whose mode cannot be read
/// is left to its reader.
pub fn warn_if_open(what: &str, path: &Path) -> Option<u32> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(path).ok()?;
    let mode = meta.permissions().mode() & 0o7777;
    let me = rustix::process::geteuid().as_raw();
    let owner = meta.uid();
    if mode & 0o026 == 0 && (owner == 0 || owner == me) {
        return None;
    }
    if first_time(path, mode, owner) {
        tracing::warn!(
            file = %path.display(),
            mode = format!("{mode:04o}"),
            owner,
            "{what}: the file is open to other users (readable by others, writable by anyone but its owner, or owned by another user than root or this process's); chown root and chmod 600 it"
        );
    }
    Some(mode)
}

/// Whether `path` at `mode` and `owner` was not warned about before; the
/// record holds at most 4,096 (past it, every one is warned about).
fn first_time(path: &Path, mode: u32, owner: u32) -> bool {
    type Warned = std::collections::HashSet<(PathBuf, u32, u32)>;
    static WARNED: std::sync::Mutex<Option<Warned>> = std::sync::Mutex::new(None);
    let mut warned = WARNED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let warned = warned.get_or_insert_with(Warned::new);
    let key = (path.to_owned(), mode, owner);
    if warned.contains(&key) {
        return false;
    }
    if warned.len() < 4_096 {
        warned.insert(key);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_file_open_to_others_is_said() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("egress-api-mode-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("token");
        std::fs::write(&path, b"0123456789abcdef").expect("write");
        let mut said = Vec::new();
        for mode in [0o600, 0o400, 0o640, 0o440, 0o644, 0o604, 0o620, 0o602] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
            said.push(warn_if_open("a token", &path));
        }
        let open = [Some(0o644), Some(0o604), Some(0o620), Some(0o602)];
        assert_eq!(said, [[None; 4].as_slice(), &open].concat());
        assert_eq!(warn_if_open("a token", &dir.join("absent")), None);
        // Another user's file (as root, the tests can make one).
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        if std::os::unix::fs::chown(&path, Some(65_534), None).is_ok() {
            assert_eq!(warn_if_open("a token", &path), Some(0o600), "nobody's");
        }
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    /// A file is warned about once per mode and owner.
    #[test]
    fn a_file_is_warned_about_once_per_mode_and_owner() {
        let path = Path::new("/nonexistent/egress-api-once");
        assert!(first_time(path, 0o644, 0));
        assert!(!first_time(path, 0o644, 0), "again");
        assert!(first_time(path, 0o664, 0), "another mode");
        assert!(first_time(path, 0o644, 1000), "another owner");
    }

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
