//! The peek over a socket that delivers its bytes in arbitrary segments.
//!
//! Input: `[max: u16 LE][n: u8][n × cut: u16 LE][bytes…]`. The flow's bytes
//! are fed to `egress_gateway::peek::peek` (bound `512 + max`) once in the
//! segments the cuts describe (a cut's low 12 bits are the segment length,
//! bit 15 makes the read before it return `Pending` first), the rest in one
//! segment, and once all in one segment. Properties:
//!
//! - the verdict — the classification, or the kind of error — is the same
//!   however the bytes were cut;
//! - the bytes handed back are a prefix of the flow, never longer than the bound;
//! - what `classify_bytes` says about the bytes handed back is the verdict,
//!   unless it needs more (the verdict was reached at the end of the flow or
//!   at the bound);
//! - the second ClientHello's reader (`second_client_hello`, after a
//!   HelloRetryRequest) gives on every prefix the flow's own answer or asks
//!   for more, never another answer; and on a flow that starts with the
//!   hello it reads it as the first hello's reader does;
//! - a classified ClientHello's records end (`client_hello_end`) within the
//!   flow, and those records alone classify as the same hello.
//!
//! Seeds: every captured ClientHello (`gateway/src/peek/captured/`), hand-built
//! hellos and request heads, each behind a header of `max = 15872`
//! (bound 16 KiB) and no cuts.
#![no_main]

use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Duration;

use egress_gateway::peek::{
    classify_bytes, client_hello_end, peek, second_client_hello, Classified, PeekError,
};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, ReadBuf};

/// Segments longer than this are cut by the reader's buffer anyway.
const SEGMENT_MASK: u16 = 0x0fff;
const PENDING_BIT: u16 = 0x8000;
const MAX_CUTS: usize = 64;

/// A socket whose reads return the flow in the given segments.
struct Segmented<'a> {
    data: &'a [u8],
    pos: usize,
    /// (length, pending first), in order; the rest comes as one segment.
    cuts: Vec<(usize, bool)>,
    /// What is left of the current segment.
    left: usize,
    next_cut: usize,
    pending_given: bool,
}

impl<'a> Segmented<'a> {
    fn new(data: &'a [u8], cuts: Vec<(usize, bool)>) -> Self {
        Self {
            data,
            pos: 0,
            cuts,
            left: 0,
            next_cut: 0,
            pending_given: false,
        }
    }
}

impl AsyncRead for Segmented<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.pos >= this.data.len() {
            return Poll::Ready(Ok(())); // EOF
        }
        if this.left == 0 {
            match this.cuts.get(this.next_cut) {
                Some(&(len, pending)) => {
                    if pending && !this.pending_given {
                        this.pending_given = true;
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    this.pending_given = false;
                    this.next_cut += 1;
                    this.left = len;
                }
                None => this.left = usize::MAX,
            }
        }
        let n = this
            .left
            .min(this.data.len() - this.pos)
            .min(buf.remaining());
        buf.put_slice(&this.data[this.pos..this.pos + n]);
        this.pos += n;
        this.left -= n;
        Poll::Ready(Ok(()))
    }
}

/// The verdict with error messages dropped: which error, not its wording.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Classified(Classified),
    Timeout,
    Closed,
    TooLarge,
    Malformed,
    MalformedRequest,
    Io,
}

fn verdict(r: &Result<(Classified, Vec<u8>), PeekError>) -> Verdict {
    match r {
        Ok((c, _)) => Verdict::Classified(c.clone()),
        Err(PeekError::Timeout) => Verdict::Timeout,
        Err(PeekError::Closed) => Verdict::Closed,
        Err(PeekError::TooLarge) => Verdict::TooLarge,
        Err(PeekError::Malformed(_)) => Verdict::Malformed,
        Err(PeekError::MalformedRequest(_)) => Verdict::MalformedRequest,
        Err(PeekError::Io(_)) => Verdict::Io,
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime")
    })
}

fn run(
    data: &[u8],
    cuts: Vec<(usize, bool)>,
    max: usize,
) -> Result<(Classified, Vec<u8>), PeekError> {
    let mut io = Segmented::new(data, cuts);
    // Generous: the reader never stalls, so the timeout must never fire.
    runtime().block_on(peek(&mut io, max, Duration::from_secs(3600)))
}

fn check(data: &[u8], max: usize, r: &Result<(Classified, Vec<u8>), PeekError>, how: &str) {
    let Ok((c, read)) = r else { return };
    assert!(read.len() <= max, "{how}: read {} > max {max}", read.len());
    assert!(data.starts_with(read), "{how}: not a prefix of the flow");
    match classify_bytes(read) {
        Ok(Some(again)) => assert_eq!(&again, c, "{how}: classify_bytes disagrees"),
        // Decided at the end of the flow or at the bound.
        Ok(None) => assert!(
            read.len() == data.len() || read.len() >= max,
            "{how}: verdict {c:?} while the bytes read need more"
        ),
        Err(e) => panic!("{how}: peek classified {c:?}, classify_bytes refuses: {e}"),
    }
}

fuzz_target!(|input: &[u8]| {
    let [m0, m1, n, rest @ ..] = input else {
        return;
    };
    let max = 512 + usize::from(u16::from_le_bytes([*m0, *m1]));
    let n = usize::from(*n) % (MAX_CUTS + 1);
    let Some((cut_bytes, data)) = rest.split_at_checked(2 * n) else {
        return;
    };
    let cuts: Vec<(usize, bool)> = cut_bytes
        .chunks_exact(2)
        .map(|c| {
            let v = u16::from_le_bytes([c[0], c[1]]);
            (usize::from(v & SEGMENT_MASK).max(1), v & PENDING_BIT != 0)
        })
        .collect();

    let segmented = run(data, cuts, max);
    let whole = run(data, Vec::new(), max);
    check(data, max, &segmented, "segmented");
    check(data, max, &whole, "one segment");
    assert_ne!(verdict(&whole), Verdict::Timeout, "the reader never stalls");
    assert_eq!(
        verdict(&segmented),
        verdict(&whole),
        "the verdict depends on how the bytes were cut: {segmented:?} vs {whole:?}"
    );
    second_hello(data, &cut_bytes);
});

/// The second ClientHello's reader on `data` and on prefixes of it (where
/// the cuts fall): the same answer, or "more", on each.
fn second_hello(data: &[u8], cut_bytes: &[u8]) {
    let full = second_client_hello(data);
    let mut at = 0;
    for c in cut_bytes.chunks_exact(2) {
        at = (at + usize::from(u16::from_le_bytes([c[0], c[1]]) & SEGMENT_MASK)).min(data.len());
        match (second_client_hello(&data[..at]), &full) {
            (Ok(None), _) => {}
            (Ok(Some(p)), Ok(Some(f))) => assert_eq!(&p, f, "prefix {at}: another hello"),
            (Err(_), Err(_)) => {}
            (p, f) => panic!("prefix {at}: {p:?}, the whole flow: {f:?}"),
        }
    }
    // Where the first hello ends: whole records, holding the hello alone.
    if let Ok(Some(Classified::Tls(first))) = classify_bytes(data) {
        let end = client_hello_end(data).expect("a hello classified has an end");
        assert!(end <= data.len());
        assert_eq!(
            classify_bytes(&data[..end]).ok().flatten(),
            Some(Classified::Tls(first)),
            "the records up to its end hold the same hello"
        );
    }
    if let (Some(0x16), Ok(Some(hello))) = (data.first(), &full) {
        match classify_bytes(data) {
            Ok(Some(Classified::Tls(first))) => assert_eq!(&first, hello, "two readings"),
            other => panic!("the second hello's reader took {hello:?}, the first's: {other:?}"),
        }
    }
}
