//! What a command prints and how it exits, shared by every command.
//!
//! A command that answers with a document returns `Result<Output, CliError>`;
//! [`finish`] writes the document as one JSON line on stdout, or the error as
//! one `egress-gateway: …` line on stderr, and picks the exit code. Commands
//! that print plain text report their errors through [`fail`], in the same
//! format. This module imports no other CLI module: every command may import
//! it and it imports none of them back.

use std::fmt::Display;
use std::io::Write;
use std::process::ExitCode;

/// What a command prints and how it exits.
#[derive(Debug)]
pub(super) struct Output {
    /// A JSON document for stdout.
    pub(super) json: serde_json::Value,
    /// Exit 1 (the document still describes the failure).
    pub(super) failed: bool,
}

/// A command that could not produce its document (bad input files, bad environment).
#[derive(Debug, thiserror::Error)]
pub(super) enum CliError {
    #[error("{0}")]
    Config(String),
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{flag}: {message}")]
    Arg { flag: &'static str, message: String },
}

/// Prints a command's result and returns its exit code: the document on
/// stdout (exit 1 if it describes a failure), or the error on stderr (exit 1).
pub(super) fn finish(result: Result<Output, CliError>) -> ExitCode {
    let out = match result {
        Ok(out) => out,
        Err(e) => return fail(e),
    };
    let mut stdout = std::io::stdout().lock();
    let written = serde_json::to_writer(&mut stdout, &out.json)
        .map_err(std::io::Error::from)
        .and_then(|()| writeln!(stdout));
    if let Err(e) = written {
        return fail(format_args!("writing output: {e}"));
    }
    if out.failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Reports an error on stderr as `egress-gateway: {error}` and returns exit 1.
pub(super) fn fail(error: impl Display) -> ExitCode {
    eprintln!("egress-gateway: {error}");
    ExitCode::FAILURE
}
