//! Strips the `ech` SvcParam (key 5) from SVCB (type 64) and HTTPS (type 65)
//! records before an answer reaches the sandbox.
//!
//! A client that finds an ECH configuration in an HTTPS answer encrypts its
//! real server name and sends the provider's public name as the outer SNI:
//! the gateway would then judge the wrong name. Without the parameter the
//! client sends its real name in the clear, as it does for any site that
//! does not publish ECH. Every other parameter (`alpn`, `port`, the address
//! hints, unknown keys) is kept as it was; in a record that loses `ech`,
//! key 5 also leaves the `mandatory` list (and `mandatory` itself goes when
//! nothing else is in it), so the record stays valid for a client that
//! never heard of ECH rather than becoming one it must discard.
//!
//! Answers without `ech` are not touched: the proxy returns their bytes as
//! the upstream sent them. An answer with `ech` is re-encoded from hickory's
//! parse, and the re-encoding is parsed again and must equal what was meant
//! (the original minus `ech`): when it does not, or cannot be encoded at
//! all, the proxy answers SERVFAIL rather than risk passing an `ech` on.
//! An answer hickory cannot parse never gets here (the proxy treats it as a
//! failed upstream). The attribution is read from the same answer and does
//! not depend on SVCB records.
//!
//! A validating stub in the sandbox sees the rewritten RRset's RRSIG fail:
//! DNSSEC validation of HTTPS/SVCB answers that carried `ech` is given up
//! for the same reason the parameter is.

use hickory_proto::op::Message;
use hickory_proto::rr::rdata::svcb::{SvcParamKey, SvcParamValue, SVCB};
use hickory_proto::rr::{RData, Record};

/// An answer with its `ech` parameters removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EchStripped {
    /// The re-encoded answer, as the sandbox will receive it.
    pub bytes: Vec<u8>,
    /// `bytes` parsed: equal to the original minus `ech`.
    pub message: Message,
    /// `ech` parameters removed (one per record that had one).
    pub removed: usize,
}

/// Why an answer carrying `ech` could not be rewritten (the proxy answers SERVFAIL).
#[derive(Debug, thiserror::Error)]
pub enum EchStripError {
    #[error("the answer without ech cannot be encoded: {0}")]
    Encode(String),
    #[error("the re-encoded answer does not parse: {0}")]
    Reparse(String),
    #[error("the re-encoded answer differs from the original minus ech")]
    Unfaithful,
}

/// Removes `ech` from every SVCB and HTTPS record of `answer`, in every
/// section. `Ok(None)`: there was none, send the original bytes.
pub fn strip_ech(answer: &Message) -> Result<Option<EchStripped>, EchStripError> {
    if !has_ech(answer) {
        return Ok(None);
    }
    let mut message = answer.clone();
    let mut removed = 0;
    for r in message
        .answers
        .iter_mut()
        .chain(message.authorities.iter_mut())
        .chain(message.additionals.iter_mut())
    {
        if let Some(svcb) = svcb_mut(r) {
            removed += usize::from(strip_record(svcb));
        }
    }
    let bytes = message
        .to_vec()
        .map_err(|e| EchStripError::Encode(e.to_string()))?;
    let reparsed = Message::from_vec(&bytes).map_err(|e| EchStripError::Reparse(e.to_string()))?;
    if reparsed != message || has_ech(&reparsed) {
        return Err(EchStripError::Unfaithful);
    }
    Ok(Some(EchStripped {
        bytes,
        message: reparsed,
        removed,
    }))
}

/// Whether any SVCB or HTTPS record of `m`, in any section, carries `ech`.
pub fn has_ech(m: &Message) -> bool {
    m.answers
        .iter()
        .chain(&m.authorities)
        .chain(&m.additionals)
        .filter_map(|r| svcb(&r.data))
        .any(carries_ech)
}

fn svcb(data: &RData) -> Option<&SVCB> {
    match data {
        RData::SVCB(s) => Some(s),
        RData::HTTPS(h) => Some(&h.0),
        _ => None,
    }
}

fn svcb_mut(r: &mut Record) -> Option<&mut SVCB> {
    match &mut r.data {
        RData::SVCB(s) => Some(s),
        RData::HTTPS(h) => Some(&mut h.0),
        _ => None,
    }
}

fn carries_ech(s: &SVCB) -> bool {
    s.svc_params
        .iter()
        .any(|(k, _)| *k == SvcParamKey::EchConfigList)
}

/// Removes `ech` from one record, and key 5 from its `mandatory` list
/// (dropping the list when it empties); whether `ech` was there.
fn strip_record(s: &mut SVCB) -> bool {
    if !carries_ech(s) {
        return false;
    }
    s.svc_params
        .retain(|(k, _)| *k != SvcParamKey::EchConfigList);
    for (_, v) in &mut s.svc_params {
        if let SvcParamValue::Mandatory(m) = v {
            m.0.retain(|k| *k != SvcParamKey::EchConfigList);
        }
    }
    s.svc_params
        .retain(|(_, v)| !matches!(v, SvcParamValue::Mandatory(m) if m.0.is_empty()));
    true
}

#[cfg(test)]
mod tests;
