//! Machine egress's durable state: `state_dir/machines/`, one file per VM
//! (`vm-<id>.json`, the VM as [`Vm`]) and one for the node default
//! (`default.json`). Each is written atomically (write, fsync, rename), and
//! a change writes only the files of what it changed, so applying one VM's
//! policy costs the same with 1 VM or 500.
//!
//! A change that touches several VMs (the node default with
//! `apply_running`) writes their files one after another: the kernel took
//! them in one transaction before, and if a write fails the files written
//! are put back as they were and the rules with them. A crash between two
//! writes leaves each file whole; the start installs what the files say.
//!
//! The earlier layout, one `machines.json` holding everything, is read once
//! and moved: written whole into `machines.new/`, renamed to `machines/`
//! (one step), then removed.

use std::path::{Path, PathBuf};

use egress_policy::machine::MachineEgress;
use serde::{Deserialize, Serialize};

use crate::{valid_id, MachineError, State, Vm};

/// The folder under `state_dir`.
pub const DIR: &str = "machines";
/// The earlier layout's file under `state_dir`, moved at the first start.
pub const LEGACY_FILE: &str = "machines.json";
const DEFAULT_FILE: &str = "default.json";
const NEW_DIR: &str = "machines.new";

/// `default.json`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct DefaultDoc {
    version: u32,
    default: MachineEgress,
}

/// Where the state lives: `state_dir/machines/`.
#[derive(Debug)]
pub(crate) struct Store {
    dir: PathBuf,
}

fn corrupt(path: &Path, message: impl std::fmt::Display) -> MachineError {
    MachineError::Persist {
        path: path.to_owned(),
        message: format!("corrupt machine egress state: {message}; fix or remove it"),
    }
}

fn io(path: &Path, e: std::io::Error) -> MachineError {
    MachineError::Persist {
        path: path.to_owned(),
        message: e.to_string(),
    }
}

fn vm_file(id: &str) -> String {
    format!("vm-{id}.json")
}

impl Store {
    /// The file VM `id` is kept in.
    pub(crate) fn vm_path(&self, id: &str) -> PathBuf {
        self.dir.join(vm_file(id))
    }
}

impl Store {
    pub(crate) fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join(DIR),
        }
    }

    /// Reads the state; `None` when there is none yet. The earlier layout
    /// is moved to this one first.
    pub(crate) fn load(&self, state_dir: &Path) -> Result<Option<State>, MachineError> {
        self.load_as_stored(state_dir).map_err(|e| match e {
            MachineError::Persist { path, message } => MachineError::Load { path, message },
            other => other,
        })
    }

    /// Reads the state as [`Store::load`] does and changes nothing (the
    /// earlier layout is read, not moved): what a successor checks before
    /// it asks for a takeover.
    pub(crate) fn check(&self, state_dir: &Path) -> Result<Option<State>, MachineError> {
        let read = match self.dir.exists() {
            true => self.read_dir().map(Some),
            // Each VM checked as the files it would be moved to are read.
            false => {
                let legacy = state_dir.join(LEGACY_FILE);
                read_legacy(&legacy).and_then(|state| {
                    for vm in state.iter().flat_map(|s| s.vms.values()) {
                        checked(vm, &vm.id, &legacy)?;
                    }
                    Ok(state)
                })
            }
        };
        read.map_err(|e| match e {
            MachineError::Persist { path, message } => MachineError::Load { path, message },
            other => other,
        })
    }

    fn load_as_stored(&self, state_dir: &Path) -> Result<Option<State>, MachineError> {
        let legacy = state_dir.join(LEGACY_FILE);
        if !self.dir.exists() {
            let Some(state) = read_legacy(&legacy)? else {
                return Ok(None);
            };
            self.migrate(state_dir, &state)?;
        }
        if legacy.exists() {
            std::fs::remove_file(&legacy).map_err(|e| io(&legacy, e))?;
        }
        self.read_dir().map(Some)
    }

    fn read_dir(&self) -> Result<State, MachineError> {
        let mut state = State::empty();
        let entries = std::fs::read_dir(&self.dir).map_err(|e| io(&self.dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| io(&self.dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name == DEFAULT_FILE {
                let Some(doc) = read_listed::<DefaultDoc>(&path)? else {
                    continue;
                };
                state.default = doc.default;
            } else if let Some(id) = name
                .strip_prefix("vm-")
                .and_then(|n| n.strip_suffix(".json"))
            {
                let Some(vm) = read_listed::<Vm>(&path)? else {
                    continue;
                };
                checked(&vm, id, &path)?;
                state.vms.insert(vm.id.clone(), std::sync::Arc::new(vm));
            } else if !name.starts_with('.') {
                tracing::warn!(path = %path.display(), "machine egress: ignoring a file that is not a VM's");
            }
        }
        Ok(state)
    }

    /// Writes the earlier layout's state whole as a new folder, then puts
    /// the folder in place in one rename.
    fn migrate(&self, state_dir: &Path, state: &State) -> Result<(), MachineError> {
        let new = state_dir.join(NEW_DIR);
        if new.exists() {
            std::fs::remove_dir_all(&new).map_err(|e| io(&new, e))?;
        }
        write_default(&new, &state.default)?;
        for vm in state.vms.values() {
            write_vm(&new, vm)?;
        }
        std::fs::rename(&new, &self.dir).map_err(|e| io(&self.dir, e))?;
        sync_dir(state_dir)?;
        tracing::info!(
            vms = state.vms.len(),
            "machine egress: moved machines.json to one file per VM"
        );
        Ok(())
    }

    /// Makes `to` durable for the VMs of `touched` and the node default,
    /// from `from`. Every file is written beside its target first: one that
    /// cannot be written (a full disk, a read-only mount) leaves every
    /// target as it was. Only then are they renamed into place; should a
    /// rename fail, what was renamed is put back as `from` has it, and the
    /// error names the file that failed (and says when the putting back
    /// failed too: the next start reads what is on disk).
    pub(crate) fn save(
        &self,
        from: &State,
        to: &State,
        touched: &[String],
    ) -> Result<(), MachineError> {
        let staged = self.stage(from, to, touched)?;
        let Err(failed) = self.put_in_place(staged, to, touched) else {
            return Ok(());
        };
        match self
            .stage(to, from, touched)
            .and_then(|back| self.put_in_place(back, from, touched))
        {
            Ok(()) => Err(failed),
            Err(e) => {
                tracing::error!(error = %e, "machine egress: could not put the previous state files back");
                Err(match failed {
                    MachineError::Persist { path, message } => MachineError::Persist {
                        path,
                        message: format!("{message}; the files already replaced could not be put back ({e}): the next start reads them"),
                    },
                    other => other,
                })
            }
        }
    }

    /// The files of `to` for the VMs of `touched` and the default (when it
    /// changed or has no file), written beside their targets.
    fn stage(
        &self,
        from: &State,
        to: &State,
        touched: &[String],
    ) -> Result<Vec<egress_api::file::Staged>, MachineError> {
        let mut staged = Vec::new();
        for id in touched {
            if let Some(vm) = to.vms.get(id) {
                staged.push(stage_json(&self.dir, &vm_file(id), vm.as_ref())?);
            }
        }
        if from.default != to.default || !self.dir.join(DEFAULT_FILE).exists() {
            let doc = DefaultDoc {
                version: 1,
                default: to.default.clone(),
            };
            staged.push(stage_json(&self.dir, DEFAULT_FILE, &doc)?);
        }
        Ok(staged)
    }

    /// Renames the staged files into place, removes the files of the VMs
    /// of `touched` that `to` no longer has, and syncs the folder.
    fn put_in_place(
        &self,
        staged: Vec<egress_api::file::Staged>,
        to: &State,
        touched: &[String],
    ) -> Result<(), MachineError> {
        for file in staged {
            let path = file.target().to_owned();
            file.put_in_place().map_err(|e| io(&path, e))?;
        }
        for id in touched.iter().filter(|id| !to.vms.contains_key(*id)) {
            self.remove_vm(id)?;
        }
        sync_dir(&self.dir)
    }

    fn remove_vm(&self, id: &str) -> Result<(), MachineError> {
        let path = self.dir.join(vm_file(id));
        match std::fs::remove_file(&path) {
            Ok(()) => sync_dir(&self.dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path, e)),
        }
    }
}

fn read_legacy(path: &Path) -> Result<Option<State>, MachineError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str::<State>(&text)
            .map(Some)
            .map_err(|e| corrupt(path, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path, e)),
    }
}

/// A VM read from `path` as it would be registered, under the id its file
/// is named for: these fields are written into nft's script text.
fn checked(vm: &Vm, id: &str, path: &Path) -> Result<(), MachineError> {
    if vm.id != id || valid_id(id).is_err() {
        return Err(corrupt(path, format!("holds VM {:?}", vm.id)));
    }
    crate::check_stored(vm).map_err(|e| corrupt(path, e.to_string()))
}

/// A file the directory listed, `None` when it is gone since: a VM
/// removed meanwhile (a successor's check reads while the running gateway
/// writes).
fn read_listed<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, MachineError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| corrupt(path, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path, e)),
    }
}

fn write_vm(dir: &Path, vm: &Vm) -> Result<(), MachineError> {
    write_json(dir, &vm_file(&vm.id), vm)
}

fn write_default(dir: &Path, default: &MachineEgress) -> Result<(), MachineError> {
    let doc = DefaultDoc {
        version: 1,
        default: default.clone(),
    };
    write_json(dir, DEFAULT_FILE, &doc)
}

fn write_json<T: Serialize>(dir: &Path, name: &str, value: &T) -> Result<(), MachineError> {
    let staged = stage_json(dir, name, value)?;
    let path = staged.target().to_owned();
    staged.put_in_place().map_err(|e| io(&path, e))?;
    sync_dir(dir)
}

fn stage_json<T: Serialize>(
    dir: &Path,
    name: &str,
    value: &T,
) -> Result<egress_api::file::Staged, MachineError> {
    let path = dir.join(name);
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| MachineError::Persist {
        path: path.clone(),
        message: e.to_string(),
    })?;
    egress_api::file::stage(dir, name, &bytes).map_err(|e| io(&path, e))
}

fn sync_dir(dir: &Path) -> Result<(), MachineError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| io(dir, e))
}

#[cfg(test)]
mod tests;
