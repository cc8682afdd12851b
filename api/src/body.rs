//! Request bodies, read within a cap.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Limited};
use serde::de::DeserializeOwned;

use crate::reply::{error, too_large, Reply};

/// The cap every listener of this project puts on a request body (an NDJSON
/// body caps each line instead).
pub const MAX_BODY: usize = 1 << 20;

/// How long a body of at most [`MAX_BODY`] may take to arrive. A
/// connection is busy while its request is handled, so the listeners' idle
/// timeout does not end a body that stalls.
pub const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads a body of at most `max` bytes within [`BODY_TIMEOUT`]: `413`
/// beyond, `408` past the time, `400` when reading it fails.
pub async fn bytes<B>(body: B, max: usize) -> Result<Bytes, Reply>
where
    B: hyper::body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let Ok(collected) = tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, max).collect()).await
    else {
        let why = format!("the body did not arrive within {}s", BODY_TIMEOUT.as_secs());
        return Err(error(StatusCode::REQUEST_TIMEOUT, &why, None));
    };
    match collected {
        Ok(b) => Ok(b.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(too_large(max))
        }
        Err(e) => {
            let why = format!("reading the body: {e}");
            Err(error(StatusCode::BAD_REQUEST, &why, None))
        }
    }
}

/// Reads a body of at most `max` bytes of UTF-8: `413` beyond, `400` for
/// anything else that goes wrong.
pub async fn text<B>(body: B, max: usize) -> Result<String, Reply>
where
    B: hyper::body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let bytes = bytes(body, max).await?;
    String::from_utf8(bytes.to_vec())
        .map_err(|_| error(StatusCode::BAD_REQUEST, "body is not UTF-8", None))
}

/// Parses `text` as a `T` (an object: no duplicate keys, no unknown fields
/// where `T` refuses them); a `400` names the field at fault.
pub fn json<T: DeserializeOwned>(text: &str) -> Result<T, Reply> {
    egress_policy::from_json(text).map_err(|e| {
        let field = (!e.path.is_empty()).then_some(e.path.trim_start_matches('.'));
        error(StatusCode::BAD_REQUEST, &e.message, field)
    })
}

/// An NDJSON body cut into lines as its frames arrive, wherever the frames
/// were cut: blank lines are skipped, a last line without `\n` is read too,
/// and no line may be longer than the cap. Errors name the line.
#[derive(Debug)]
pub struct Lines {
    pending: Vec<u8>,
    /// How much of `pending` is known to hold no `\n`: a line arriving in
    /// many frames is searched once, not once a frame.
    scanned: usize,
    line_no: usize,
    max: usize,
}

/// One line of an NDJSON body: its number (from 1) and its text.
pub type Line = (usize, String);

impl Lines {
    pub fn new(max: usize) -> Self {
        Self {
            pending: Vec::new(),
            scanned: 0,
            line_no: 0,
            max,
        }
    }

    /// Takes in a frame's bytes; gives back the lines it completed. The
    /// lines are read in place and what they took is dropped once a frame:
    /// a frame of many short lines costs its length, not its length times
    /// its lines.
    pub fn feed(&mut self, data: &[u8]) -> Result<Vec<Line>, Reply> {
        self.pending.extend_from_slice(data);
        let mut lines = Vec::new();
        let (mut start, mut from) = (0, self.scanned);
        while let Some(at) = self.pending[from..].iter().position(|b| *b == b'\n') {
            let nl = from + at;
            self.line_no += 1;
            if let Some(l) = self.line(&self.pending[start..nl])? {
                lines.push(l);
            }
            (start, from) = (nl + 1, nl + 1);
        }
        self.pending.drain(..start);
        self.scanned = self.pending.len();
        if self.pending.len() > self.max {
            return Err(self.too_long(self.line_no + 1));
        }
        Ok(lines)
    }

    /// The body ended: its last line, if it had one without a `\n`.
    pub fn finish(mut self) -> Result<Option<Line>, Reply> {
        if self.pending.is_empty() {
            return Ok(None);
        }
        self.line_no += 1;
        let last = std::mem::take(&mut self.pending);
        self.line(&last)
    }

    fn line(&self, bytes: &[u8]) -> Result<Option<Line>, Reply> {
        if bytes.len() > self.max {
            return Err(self.too_long(self.line_no));
        }
        let no = self.line_no;
        let text = std::str::from_utf8(bytes).map_err(|_| {
            error(
                StatusCode::BAD_REQUEST,
                &format!("line {no} is not UTF-8"),
                None,
            )
        })?;
        Ok((!text.trim().is_empty()).then(|| (no, text.to_owned())))
    }

    fn too_long(&self, no: usize) -> Reply {
        let why = format!("line {no} is longer than {} bytes", self.max);
        error(StatusCode::PAYLOAD_TOO_LARGE, &why, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    #[tokio::test]
    async fn bodies_are_capped_and_must_be_utf8() {
        let ok = text(Full::new(bytes::Bytes::from_static(b"{}")), 2).await;
        assert_eq!(ok.ok().as_deref(), Some("{}"));
        let big = text(Full::new(bytes::Bytes::from_static(b"{ }")), 2).await;
        assert_eq!(
            big.err().map(|r| r.status()),
            Some(StatusCode::PAYLOAD_TOO_LARGE)
        );
        let bad = text(Full::new(bytes::Bytes::from_static(b"\xff")), 2).await;
        assert_eq!(bad.err().map(|r| r.status()), Some(StatusCode::BAD_REQUEST));
    }

    /// A body whose frames never come.
    struct Stalled;

    impl hyper::body::Body for Stalled {
        type Data = bytes::Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>>
        {
            std::task::Poll::Pending
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_is_408_after_the_body_timeout() {
        let stalled = tokio::spawn(bytes(Stalled, MAX_BODY));
        tokio::time::sleep(BODY_TIMEOUT - std::time::Duration::from_secs(1)).await;
        assert!(!stalled.is_finished(), "still waiting within the time");
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        let got = stalled.await.expect("joined");
        assert_eq!(
            got.err().map(|r| r.status()),
            Some(StatusCode::REQUEST_TIMEOUT)
        );
    }

    #[test]
    fn lines_are_the_same_wherever_the_frames_were_cut() {
        let body = b"a\n\n  \nbc\nd";
        let whole = {
            let mut l = Lines::new(8);
            let mut out = l.feed(body).expect("fits");
            out.extend(l.finish().expect("fits"));
            out
        };
        assert_eq!(
            whole,
            vec![(1, "a".into()), (4, "bc".into()), (5, "d".into())]
        );
        for cut in 0..body.len() {
            let mut l = Lines::new(8);
            let mut out = l.feed(&body[..cut]).expect("fits");
            out.extend(l.feed(&body[cut..]).expect("fits"));
            out.extend(l.finish().expect("fits"));
            assert_eq!(out, whole, "cut at {cut}");
        }
        // A byte a frame: each line is found once its `\n` comes.
        let mut l = Lines::new(8);
        let mut out = Vec::new();
        for b in body {
            out.extend(l.feed(std::slice::from_ref(b)).expect("fits"));
        }
        out.extend(l.finish().expect("fits"));
        assert_eq!(out, whole, "a byte a frame");
    }

    #[test]
    fn a_line_over_the_cap_or_not_utf8_is_refused_by_number() {
        let mut l = Lines::new(3);
        let r = l.feed(b"abc\nabcd\n").expect_err("line 2 is too long");
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let mut l = Lines::new(3);
        assert!(l.feed(b"ab").expect("fits").is_empty());
        let r = l.feed(b"cd").expect_err("a pending line past the cap");
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let mut l = Lines::new(3);
        let r = l.feed(b"a\n\xff\n").expect_err("line 2 is not UTF-8");
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    }
}
