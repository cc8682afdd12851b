//! Answers to requests that carried a credential's value, and every answer
//! of a host a `replace: "headers"` credential is for. An origin may send
//! a request's header back (a CORS `Origin` echo, an error page that quotes
//! a header, an echo service), or keep it and send it later (object
//! metadata): with `replace: "headers"` the sandbox chooses the header its
//! placeholder goes in, so it could read the value there.
//! The value goes back to the sandbox as its placeholder instead, in the
//! answer's headers, reason phrase, body and trailers.
//!
//! - A value is found in any spelling that writes each of its bytes as
//!   itself, percent-encoded (either case of hex, `%25` for a `%` too) or
//!   as a JSON escape (`\u00hh`, `\/`, `\"`, `\\`), and a space also as
//!   `+`: what URL, form and JSON encoders write, once. Other
//!   transformations (base64, HTML entities, a changed case, an encoding
//!   of an encoding) are not read.
//! - The request goes with `accept-encoding: identity` and without `range`:
//!   a compressed answer hides the value, and ranges would let it out a
//!   piece at a time. An answer the origin encodes anyway is refused
//!   ([`Carried::encoded`]).
//! - A body's chunk goes on at once, but for an end that may begin a
//!   value (held until the next chunk shows whether it does), so a value
//!   split over two chunks is replaced whole and a stream that waits on
//!   its last chunk is not held up; the length changes, so
//!   `content-length` is dropped.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderValue};
use hyper::body::{Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;

use super::Secret;

/// One value a request carried, and the placeholder that stood for it.
struct Value {
    bytes: Box<[u8]>,
    placeholder: Bytes,
}

/// The values one request carried.
#[derive(Clone)]
pub struct Carried {
    values: Arc<[Value]>,
    /// The bytes a spelling of a value may start with.
    starts: Arc<[bool; 256]>,
    /// The first credential's index in the sandbox's list (for a refusal).
    pub index: usize,
}

/// How a value reads at one place: the length of its longest spelling
/// there, and whether the bytes end inside one that has begun.
struct Spelled {
    whole: Option<usize>,
    begun: bool,
}

impl std::fmt::Debug for Carried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Carried")
            .field("values", &self.values.len())
            .field("index", &self.index)
            .finish()
    }
}

impl Carried {
    /// `values`, each with its placeholder; `index` is the first one's
    /// credential. `None` when nothing was carried.
    pub(super) fn new<'a>(
        values: impl IntoIterator<Item = (&'a Secret, &'a str)>,
        index: usize,
    ) -> Option<Self> {
        let mut starts = [false; 256];
        let values: Vec<Value> = values
            .into_iter()
            .filter(|(secret, _)| !secret.0.is_empty())
            .map(|(secret, placeholder)| {
                for way in ways(secret.0[0]).iter().flatten() {
                    starts[usize::from(way.bytes[0])] = true;
                }
                Value {
                    bytes: secret.0[..].into(),
                    placeholder: Bytes::copy_from_slice(placeholder.as_bytes()),
                }
            })
            .collect();
        if values.is_empty() {
            return None;
        }
        Some(Self {
            values: values.into(),
            starts: Arc::new(starts),
            index,
        })
    }

    /// Puts the placeholder in place of each value in `headers`' values;
    /// returns how many were replaced.
    pub fn headers(&self, headers: &mut HeaderMap) -> usize {
        let mut found = 0;
        for v in headers.values_mut() {
            let (out, _, n) = self.scrub(v.as_bytes(), true);
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
        codings_but(headers, &header::CONTENT_ENCODING, b"identity").then(|| {
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

    /// The HTTP/1.1 reason phrase an origin sent, with each value in
    /// its placeholder's place (a phrase can quote a header too).
    pub fn reason(&self, extensions: &mut http::Extensions) -> usize {
        let Some(phrase) = extensions.get::<hyper::ext::ReasonPhrase>() else {
            return 0;
        };
        let (out, _, n) = self.scrub(phrase.as_bytes(), true);
        if n > 0 {
            extensions.remove::<hyper::ext::ReasonPhrase>();
            if let Ok(phrase) = hyper::ext::ReasonPhrase::try_from(out) {
                extensions.insert(phrase);
            }
        }
        n
    }

    /// `hay` with each value, in any spelling, replaced by its placeholder
    /// (earliest first, the longest of those at one place), up to where
    /// one may have begun and not ended (all of it when `end`): the bytes
    /// to pass on (empty when nothing was replaced: then `hay[..held]`),
    /// where what is held starts, and how many were replaced.
    fn scrub(&self, hay: &[u8], end: bool) -> (Vec<u8>, usize, usize) {
        let (mut out, mut last, mut n, mut at) = (Vec::new(), 0, 0, 0);
        while at < hay.len() {
            if !self.starts[usize::from(hay[at])] {
                at += 1;
                continue;
            }
            let (mut whole, mut begun) = (None::<(usize, &Value)>, false);
            for v in self.values.iter() {
                let read = spelled(&v.bytes, &hay[at..]);
                begun |= read.begun;
                if let Some(len) = read.whole.filter(|&len| whole.is_none_or(|(l, _)| len > l)) {
                    whole = Some((len, v));
                }
            }
            if begun && !end {
                // A longer one may end in the next chunk: held from here.
                break;
            }
            match whole {
                Some((len, v)) => {
                    out.extend_from_slice(&hay[last..at]);
                    out.extend_from_slice(&v.placeholder);
                    n += 1;
                    at += len;
                    last = at;
                }
                None => at += 1,
            }
        }
        if n > 0 {
            out.extend_from_slice(&hay[last..at]);
        }
        (out, at, n)
    }

    /// [`Self::scrub`] of a chunk: what goes on now, what is held back,
    /// and how many values were replaced.
    fn scrub_chunk(&self, buf: Bytes, end: bool) -> (Bytes, Bytes, usize) {
        let (out, held, n) = self.scrub(&buf, end);
        let pass = if n == 0 {
            buf.slice(..held)
        } else {
            Bytes::from(out)
        };
        (pass, buf.slice(held..), n)
    }
}

/// Whether `headers`' `name` (a comma list of codings) names any coding
/// but `only`, in any case.
pub(crate) fn codings_but(headers: &HeaderMap, name: &header::HeaderName, only: &[u8]) -> bool {
    headers.get_all(name).iter().any(|v| {
        v.as_bytes()
            .split(|b| *b == b',')
            .map(<[u8]>::trim_ascii)
            .any(|c| !c.is_empty() && !c.eq_ignore_ascii_case(only))
    })
}

/// How `value` reads at the start of `hay`, each of its bytes written in
/// any of the ways [`ways`] lists: the longest whole spelling there, and
/// whether `hay` ends inside a spelling that has begun. Every way is
/// followed (a `%` of the value may be `%` or `%25`), as a set of places in
/// `hay` reached so far: a few at most.
fn spelled(value: &[u8], hay: &[u8]) -> Spelled {
    // Most places fail at the first byte: no set made for them.
    let first = value.first().map(|&b| ways(b));
    let no_way = |ways: &[Option<Way>; 4]| {
        ways.iter()
            .flatten()
            .all(|w| matches!(w.reads(hay), Reads::No))
    };
    if first.as_ref().is_none_or(no_way) {
        return Spelled {
            whole: None,
            begun: false,
        };
    }
    let (mut at, mut next, mut begun) = (vec![0usize], Vec::new(), false);
    for &b in value {
        next.clear();
        for &p in &at {
            for way in ways(b).iter().flatten() {
                match way.reads(&hay[p..]) {
                    Reads::Whole(len) => next.push(p + len),
                    Reads::Begun => begun = true,
                    Reads::No => {}
                }
            }
        }
        next.sort_unstable();
        next.dedup();
        std::mem::swap(&mut at, &mut next);
        if at.is_empty() {
            break;
        }
    }
    Spelled {
        whole: at.iter().max().copied(),
        begun,
    }
}

/// One way of writing a byte: its bytes, those from `fold` on compared
/// without regard to case (hex digits).
struct Way {
    bytes: [u8; 6],
    len: usize,
    fold: usize,
}

/// How a way reads at the start of some bytes.
enum Reads {
    Whole(usize),
    /// The bytes end inside it.
    Begun,
    No,
}

impl Way {
    fn new(bytes: &[u8], fold: usize) -> Option<Self> {
        let mut b = [0; 6];
        b[..bytes.len()].copy_from_slice(bytes);
        Some(Self {
            bytes: b,
            len: bytes.len(),
            fold,
        })
    }

    fn reads(&self, rest: &[u8]) -> Reads {
        let same = |k: usize, c: u8| {
            let w = self.bytes[k];
            c == w || (k >= self.fold && c.eq_ignore_ascii_case(&w))
        };
        let n = rest.len().min(self.len);
        if !(0..n).all(|k| same(k, rest[k])) {
            Reads::No
        } else if n == self.len {
            Reads::Whole(self.len)
        } else {
            Reads::Begun
        }
    }
}

/// The ways byte `b` is written by URL, form and JSON encoders: as itself;
/// `%hh`; `\u00hh` (JSON); `/` also as `\/`, `"` and `\` as `\"` and `\\`,
/// a tab as `\t` (JSON), a space as `+` (forms).
fn ways(b: u8) -> [Option<Way>; 4] {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let (hi, lo) = (HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]);
    let other = match b {
        b'/' | b'"' | b'\\' => Way::new(&[b'\\', b], usize::MAX),
        b' ' => Way::new(b"+", usize::MAX),
        b'\t' => Way::new(b"\\t", usize::MAX),
        _ => None,
    };
    [
        Way::new(&[b], usize::MAX),
        Way::new(&[b'%', hi, lo], 1),
        Way::new(&[b'\\', b'u', b'0', b'0', hi, lo], 4),
        other,
    ]
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
        let (pass, held, n) = self.carried.scrub_chunk(buf, end);
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

    /// Every encoder's spelling: either case of hex, `/` left as it is
    /// (Python's `quote`), every byte escaped, `\/`.
    #[tokio::test]
    async fn each_spelling_of_a_value_is_read() {
        let c = carried("k/y+z=");
        for spelled in [
            "k%2fy%2bz%3d",
            "k/y%2Bz%3D",
            "%6B%2F%79%2B%7A%3D",
            "k\\/y+z=",
        ] {
            let (text, _, found) = through(&c, &["[", spelled, "]"], None).await;
            assert_eq!((text.as_str(), found), ("[PH_0001]", 1), "{spelled}");
        }
        let (text, _, found) = through(&c, &["k/y+z", "%3"], None).await;
        assert_eq!(
            (text.as_str(), found),
            ("k/y+z%3", 0),
            "an escape cut short"
        );
        // A tab, as JSON writes it.
        let (text, _, found) = through(&carried("a\tb"), &["[a\\tb]"], None).await;
        assert_eq!((text.as_str(), found), ("[PH_0001]", 1), "a tab");
        // A value already encoded, encoded again (`%` as `%25`), and JSON's
        // escapes (Go's encoder writes `&` as `\u0026`).
        let c = carried(r#"a%2Bb"c\d&e"#);
        for spelled in [
            r#"a%2Bb"c\d&e"#,
            r#"a%252Bb%22c%5Cd%26e"#,
            r#"a%2Bb\"c\\d\u0026e"#,
            r#"\u0061%2Bb\u0022c\u005Cd\u0026e"#,
        ] {
            let (text, _, found) = through(&c, &["[", spelled, "]"], None).await;
            assert_eq!((text.as_str(), found), ("[PH_0001]", 1), "{spelled}");
        }
    }

    /// A chunk goes on at once (an event stream's `\n\n` is not held for
    /// the next), but for an end that begins a value.
    #[tokio::test]
    async fn a_chunk_goes_on_at_once_unless_its_end_may_begin_a_value() {
        let c = carried("sk-live-0123456789");
        let frames = ["event: a\n\n", "data: sk-li", "ve-0123456789\n\n"];
        let frames = frames
            .iter()
            .map(|f| Frame::data(Bytes::copy_from_slice(f.as_bytes())));
        let mut body = c.body(Frames(frames.collect()).boxed(), Counter::default());
        let mut next = async || {
            let frame = body.frame().await.expect("a frame").expect("data");
            String::from_utf8(frame.into_data().expect("data").to_vec()).expect("text")
        };
        assert_eq!(next().await, "event: a\n\n");
        assert_eq!(next().await, "data: ");
        assert_eq!(next().await, "PH_0001\n\n");
    }

    /// Of two values where one begins the other, the longer is replaced
    /// where it is, however the chunks fall.
    #[tokio::test]
    async fn the_longer_of_two_values_at_one_place_is_replaced() {
        let (a, b) = (Secret(b"tok"[..].into()), Secret(b"tok123"[..].into()));
        let c = Carried::new([(&a, "PH_A"), (&b, "PH_B")], 0).expect("values");
        for chunks in [&["x tok123 tok y"][..], &["x tok", "123 tok", " y"]] {
            let (text, _, found) = through(&c, chunks, None).await;
            assert_eq!((text.as_str(), found), ("x PH_B PH_A y", 2), "{chunks:?}");
        }
    }

    proptest::proptest! {
        /// A value, spelled any way each of its bytes may be, between
        /// arbitrary bytes: replaced (no raw copy left), and the answer is
        /// the same however its body is cut into chunks.
        #[test]
        fn a_spelled_value_is_replaced_however_the_chunks_fall(
            value in "[abc%/\"\\\\& +2B]{1,10}",
            before in "[abc%/\\\\ 2Bu0]{0,8}",
            after in "[abc%/\\\\ 2Bu0]{0,8}",
            picks in proptest::collection::vec(0usize..4, 10),
            cuts in proptest::collection::vec(0usize..64, 0..6),
        ) {
            let c = carried(&value);
            let mut text = before.into_bytes();
            for (i, b) in value.bytes().enumerate() {
                let spellings: Vec<Way> = ways(b).into_iter().flatten().collect();
                let way = &spellings[picks[i] % spellings.len()];
                text.extend_from_slice(&way.bytes[..way.len]);
            }
            text.extend_from_slice(after.as_bytes());
            let text = String::from_utf8(text).expect("ASCII");
            let mut at: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).collect();
            at.sort_unstable();
            at.dedup();
            let mut chunks = Vec::new();
            let mut from = 0;
            for &cut in at.iter().chain(std::iter::once(&text.len())) {
                chunks.push(&text[from..cut]);
                from = cut;
            }
            let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
            let (whole, _, found) = rt.block_on(through(&c, &[&text], None));
            let (cut, _, _) = rt.block_on(through(&c, &chunks, None));
            proptest::prop_assert!(found >= 1, "{text:?}: {whole:?}");
            proptest::prop_assert!(!whole.contains(value.as_str()), "{text:?}: {whole:?}");
            proptest::prop_assert_eq!(whole, cut, "{:?} in {:?}", text, chunks);
        }
    }

    #[test]
    fn a_reason_phrase_gets_the_placeholder() {
        let c = carried("s3cr3t-value");
        let mut ext = http::Extensions::new();
        let phrase = hyper::ext::ReasonPhrase::try_from(&b"bad key s3cr3t-value"[..]);
        ext.insert(phrase.expect("a phrase"));
        assert_eq!(c.reason(&mut ext), 1);
        let phrase = ext.get::<hyper::ext::ReasonPhrase>().expect("kept");
        assert_eq!(phrase.as_bytes(), b"bad key PH_0001");
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
