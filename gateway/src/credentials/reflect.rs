//! Answers to requests that carried a credential's value. An origin may send
//! a request's header back (a CORS `Origin` echo, an error page that quotes
//! a header, an echo service): with `replace: "headers"` the sandbox chooses
//! the header its placeholder goes in, so it could read the value there.
//! The value goes back to the sandbox as its placeholder instead, in the
//! answer's headers, body and trailers.
//!
//! - A value is looked for as sent, percent-encoded (a redirect's query)
//!   and with `/` escaped as `\/` (a JSON encoder that escapes it). Other
//!   transformations (base64, HTML entities, a changed case) are not read.
//! - The request goes with `accept-encoding: identity` and without `range`:
//!   a compressed answer hides the value, and ranges would let it out a
//!   piece at a time. An answer the origin encodes anyway is refused
//!   ([`encoded`]).
//! - A body is read with the last bytes of each chunk held back until the
//!   next (fewer than the longest form), so a value split over two chunks
//!   is replaced whole; its length changes, so `content-length` is dropped.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderValue};
use hyper::body::{Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;

use super::Secret;

/// The bytes escaped when a value is looked for percent-encoded: all but
/// RFC 3986's unreserved characters.
const ESCAPED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// One form of a value, and the placeholder that goes in its place.
struct Needle {
    form: Box<[u8]>,
    placeholder: Bytes,
}

/// The values one request carried, in each form they are looked for.
#[derive(Clone)]
pub struct Carried {
    needles: Arc<[Needle]>,
    /// The longest form's length.
    longest: usize,
    /// The first credential's index in the sandbox's list (for a refusal).
    pub index: usize,
}

impl std::fmt::Debug for Carried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Carried")
            .field("forms", &self.needles.len())
            .field("index", &self.index)
            .finish()
    }
}

impl Carried {
    /// The forms of `values` (each with its placeholder); `index` is the
    /// first one's credential. `None` when nothing was carried.
    pub(super) fn new<'a>(
        values: impl IntoIterator<Item = (&'a Secret, &'a str)>,
        index: usize,
    ) -> Option<Self> {
        let mut needles: Vec<Needle> = Vec::new();
        for (secret, placeholder) in values {
            let raw = &secret.0[..];
            let escaped: String = percent_encoding::percent_encode(raw, ESCAPED).collect();
            let slashed = String::from_utf8_lossy(raw).replace('/', "\\/");
            for form in [raw, escaped.as_bytes(), slashed.as_bytes()] {
                if form.is_empty() || needles.iter().any(|n| &n.form[..] == form) {
                    continue;
                }
                needles.push(Needle {
                    form: form.into(),
                    placeholder: Bytes::copy_from_slice(placeholder.as_bytes()),
                });
            }
        }
        let longest = needles.iter().map(|n| n.form.len()).max()?;
        Some(Self {
            needles: needles.into(),
            longest,
            index,
        })
    }

    /// Puts the placeholder in place of each value in `headers`' values;
    /// returns how many were replaced.
    pub fn headers(&self, headers: &mut HeaderMap) -> usize {
        let mut found = 0;
        for v in headers.values_mut() {
            let (out, n) = self.replaced(v.as_bytes());
            if n > 0 {
                found += n;
                // Placeholders are letters, digits, `-`, `_`, `.`: a value
                // that held the form is still one without it.
                *v = HeaderValue::from_bytes(&out).unwrap_or(HeaderValue::from_static(""));
            }
        }
        found
    }

    /// The request as it goes to the origin: in plain encoding, whole.
    pub fn request(headers: &mut HeaderMap) {
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        headers.remove(header::RANGE);
        headers.remove(header::IF_RANGE);
    }

    /// The answer's coding when it is one the gateway cannot read for the
    /// values (anything but `identity`).
    pub fn encoded(headers: &HeaderMap) -> Option<String> {
        let codings = headers.get_all(header::CONTENT_ENCODING);
        let unread = codings.iter().any(|v| {
            v.as_bytes()
                .split(|b| *b == b',')
                .map(<[u8]>::trim_ascii)
                .any(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity"))
        });
        unread.then(|| {
            let all: Vec<String> = codings
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect();
            all.join(", ")
        })
    }

    /// `body` with each value replaced as it passes; each one found is
    /// counted in `found`.
    pub fn body(&self, body: crate::pool::Body, found: Counter) -> crate::pool::Body {
        use http_body_util::BodyExt;
        Scrubbed {
            inner: body,
            carried: self.clone(),
            held: Bytes::new(),
            trailers: None,
            done: false,
            found,
        }
        .boxed()
    }

    /// `hay` with each form replaced, earliest first (the longest of those
    /// that start at one place), and how many were.
    fn replaced(&self, hay: &[u8]) -> (Vec<u8>, usize) {
        let (mut out, mut last, mut n) = (Vec::new(), 0, 0);
        while let Some((at, needle)) = self.next_match(hay, last) {
            out.extend_from_slice(&hay[last..at]);
            out.extend_from_slice(&needle.placeholder);
            last = at + needle.form.len();
            n += 1;
        }
        if n > 0 {
            out.extend_from_slice(&hay[last..]);
        }
        (out, n)
    }

    fn next_match(&self, hay: &[u8], from: usize) -> Option<(usize, &Needle)> {
        let rest = &hay[from..];
        self.needles
            .iter()
            .filter_map(|n| memchr::memmem::find(rest, &n.form).map(|at| (from + at, n)))
            .min_by_key(|(at, n)| (*at, std::cmp::Reverse(n.form.len())))
    }

    /// `buf` scrubbed: what may go on now, and what is held back (a form
    /// may start there and end in the next chunk; nothing when `end`).
    fn scrub(&self, buf: Bytes, end: bool) -> (Bytes, Bytes, usize) {
        let (mut out, mut last, mut n) = (BytesMut::new(), 0, 0);
        while let Some((at, needle)) = self.next_match(&buf, last) {
            out.extend_from_slice(&buf[last..at]);
            out.extend_from_slice(&needle.placeholder);
            last = at + needle.form.len();
            n += 1;
        }
        let keep = if end {
            0
        } else {
            (self.longest - 1).min(buf.len() - last)
        };
        let cut = buf.len() - keep;
        let pass = if n == 0 {
            buf.slice(..cut)
        } else {
            out.extend_from_slice(&buf[last..cut]);
            out.freeze()
        };
        (pass, buf.slice(cut..), n)
    }
}

/// A body with a request's values replaced by their placeholders.
struct Scrubbed {
    inner: crate::pool::Body,
    carried: Carried,
    /// The end of the last chunk, not passed on yet.
    held: Bytes,
    /// Trailers to pass on after `held`.
    trailers: Option<HeaderMap>,
    done: bool,
    found: Counter,
}

impl Scrubbed {
    /// `data` after what is held, scrubbed: what goes on now, if anything.
    fn next_chunk(&mut self, data: Bytes, end: bool) -> Option<Bytes> {
        let buf = if self.held.is_empty() {
            data
        } else {
            let mut joined = BytesMut::with_capacity(self.held.len() + data.len());
            joined.extend_from_slice(&self.held);
            joined.extend_from_slice(&data);
            joined.freeze()
        };
        let (pass, held, n) = self.carried.scrub(buf, end);
        self.held = held;
        self.found.inc_by(n as u64);
        (!pass.is_empty()).then_some(pass)
    }
}

impl hyper::body::Body for Scrubbed {
    type Data = Bytes;
    type Error = crate::pool::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(trailers) = self.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            let frame = match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                Some(Ok(frame)) => frame,
                // What is held is dropped with the body.
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => {
                    self.done = true;
                    let rest = self.next_chunk(Bytes::new(), true);
                    return Poll::Ready(rest.map(|b| Ok(Frame::data(b))));
                }
            };
            let frame = match frame.into_data() {
                Ok(data) => match self.next_chunk(data, false) {
                    Some(pass) => return Poll::Ready(Some(Ok(Frame::data(pass)))),
                    None => continue,
                },
                Err(frame) => frame,
            };
            // Trailers end the body: what is held goes first.
            let Ok(mut trailers) = frame.into_trailers() else {
                continue;
            };
            let n = self.carried.headers(&mut trailers);
            self.found.inc_by(n as u64);
            self.done = true;
            return Poll::Ready(Some(Ok(match self.next_chunk(Bytes::new(), true) {
                Some(rest) => {
                    self.trailers = Some(trailers);
                    Frame::data(rest)
                }
                None => Frame::trailers(trailers),
            })));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.trailers.is_none() && self.held.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn carried(value: &str) -> Carried {
        let secret = Secret(value.as_bytes().into());
        Carried::new([(&secret, "PH_0001")], 0).expect("a value")
    }

    /// A body of the frames given, one per poll.
    struct Frames(std::collections::VecDeque<Frame<Bytes>>);

    impl hyper::body::Body for Frames {
        type Data = Bytes;
        type Error = crate::pool::BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    /// `chunks` through a scrubbed body, collected: the bytes, the
    /// trailers, and the count of values found.
    async fn through(
        c: &Carried,
        chunks: &[&str],
        trailers: Option<HeaderMap>,
    ) -> (String, Option<HeaderMap>, u64) {
        let mut frames: std::collections::VecDeque<Frame<Bytes>> = chunks
            .iter()
            .map(|s| Frame::data(Bytes::copy_from_slice(s.as_bytes())))
            .collect();
        if let Some(t) = trailers {
            frames.push_back(Frame::trailers(t));
        }
        let body = Frames(frames).boxed();
        let found = Counter::default();
        let out = c.body(body, found.clone()).collect().await.expect("a body");
        let trailers = out.trailers().cloned();
        let text = String::from_utf8(out.to_bytes().to_vec()).expect("text");
        (text, trailers, found.get())
    }

    #[tokio::test]
    async fn a_value_split_over_chunks_goes_back_as_its_placeholder() {
        let c = carried("sk-live-0123456789");
        let chunks = [
            "{\"echo\": \"Bearer sk-li",
            "ve-01234",
            "56789\", \"n\": 1}",
        ];
        let (text, _, found) = through(&c, &chunks, None).await;
        assert_eq!(text, "{\"echo\": \"Bearer PH_0001\", \"n\": 1}");
        assert_eq!(found, 1);
        // One byte at a time, and twice over.
        let twice = "a sk-live-0123456789 b sk-live-0123456789";
        let bytes: Vec<String> = twice.chars().map(String::from).collect();
        let one_by_one: Vec<&str> = bytes.iter().map(String::as_str).collect();
        let (text, _, found) = through(&c, &one_by_one, None).await;
        assert_eq!((text.as_str(), found), ("a PH_0001 b PH_0001", 2));
        // A body without it is passed on as it was, its end included.
        let (text, _, found) = through(&c, &["sk-live-012345678", "x"], None).await;
        assert_eq!((text.as_str(), found), ("sk-live-012345678x", 0));
    }

    #[tokio::test]
    async fn encoded_forms_and_trailers_are_replaced_too() {
        let c = carried("k/y+z=");
        let (text, _, found) = through(&c, &["?t=k%2Fy%2Bz%3D&j=\"k\\/y+z=\""], None).await;
        assert_eq!((text.as_str(), found), ("?t=PH_0001&j=\"PH_0001\"", 2));
        let mut t = HeaderMap::new();
        t.insert("x-echo", HeaderValue::from_static("was k/y+z= here"));
        let (text, trailers, found) = through(&c, &["tail k/y"], Some(t)).await;
        assert_eq!(text, "tail k/y");
        assert_eq!(trailers.expect("trailers")["x-echo"], "was PH_0001 here");
        assert_eq!(found, 1);
    }

    #[test]
    fn headers_get_the_placeholder_and_encodings_are_read() {
        let c = carried("s3cr3t-value");
        let mut h = HeaderMap::new();
        h.insert(
            "access-control-allow-origin",
            HeaderValue::from_static("s3cr3t-value"),
        );
        h.insert("vary", HeaderValue::from_static("origin"));
        assert_eq!(c.headers(&mut h), 1);
        assert_eq!(h["access-control-allow-origin"], "PH_0001");
        assert_eq!(h["vary"], "origin");
        let mut enc = HeaderMap::new();
        enc.append(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        assert_eq!(Carried::encoded(&enc), None);
        enc.append(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert_eq!(Carried::encoded(&enc).as_deref(), Some("identity, gzip"));
    }
}
