use super::*;

/// A query for `example.test A` with id 0, as DoH clients send it.
fn wire() -> Vec<u8> {
    let mut m = vec![0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in ["example", "test"] {
        m.push(label.len() as u8);
        m.extend_from_slice(label.as_bytes());
    }
    m.extend_from_slice(&[0, 0, 1, 0, 1]);
    m
}

fn get(target: &str) -> Result<Vec<u8>, DohError> {
    query("GET", target, None, b"")
}

#[test]
fn get_and_post_carry_the_same_query() {
    let q = wire();
    let encoded = URL_SAFE_NO_PAD.encode(&q);
    assert_eq!(get(&format!("/dns-query?dns={encoded}")), Ok(q.clone()));
    // Other parameters are not the query's business.
    assert_eq!(
        get(&format!("/dns-query?ct=x&dns={encoded}&x")),
        Ok(q.clone())
    );
    for ct in [
        &b"application/dns-message"[..],
        b"Application/DNS-Message; charset=x",
    ] {
        assert_eq!(query("POST", "/dns-query", Some(ct), &q), Ok(q.clone()));
    }
}

#[test]
fn what_two_readers_could_take_two_ways_is_refused() {
    let encoded = URL_SAFE_NO_PAD.encode(wire());
    let padded = base64::engine::general_purpose::URL_SAFE.encode([0u8; 13]);
    let standard = base64::engine::general_purpose::STANDARD_NO_PAD.encode([0xfb_u8; 13]);
    for target in [
        format!("/dns-query?dns={encoded}&dns={encoded}"),
        format!("/dns-query?dns={padded}"),
        format!("/dns-query?dns={standard}"),
        format!("/dns-query?dns=%41{encoded}"),
        "/dns-query".to_owned(),
        "/dns-query?dns=".to_owned(),
    ] {
        assert_eq!(get(&target).map_err(|e| e.status()), Err(400), "{target}");
    }
}

#[test]
fn every_refusal_has_its_status() {
    let q = wire();
    let long = URL_SAFE_NO_PAD.encode(vec![0u8; MAX_QUERY + 1]);
    /// method, target, content-type, body, the status expected.
    type Case<'a> = (&'a str, &'a str, Option<&'a [u8]>, &'a [u8], u16);
    let cases: [Case<'_>; 7] = [
        ("GET", "/resolve?name=example.test", None, b"", 404),
        ("GET", "/dns-query/", None, b"", 404),
        (
            "PUT",
            "/dns-query",
            Some(b"application/dns-message"),
            &q,
            405,
        ),
        ("POST", "/dns-query", None, &q, 415),
        ("POST", "/dns-query", Some(b"application/dns-json"), &q, 415),
        (
            "POST",
            "/dns-query",
            Some(b"application/dns-message"),
            &[0u8; MAX_QUERY + 1],
            413,
        ),
        (
            "POST",
            "/dns-query",
            Some(b"application/dns-message"),
            &q[..11],
            400,
        ),
    ];
    for (method, target, ct, body, status) in cases {
        let got = query(method, target, ct, body).map_err(|e| e.status());
        assert_eq!(got, Err(status), "{method} {target}");
    }
    assert_eq!(
        get(&format!("/dns-query?dns={long}")).map_err(|e| e.status()),
        Err(413)
    );
}

#[test]
fn max_age_is_the_smallest_ttl() {
    use hickory_proto::op::{Message, MessageType};
    use hickory_proto::rr::{rdata::A, Name, RData, Record};
    let mut m = Message::query();
    m.metadata.message_type = MessageType::Response;
    let name = Name::from_ascii("example.test.").expect("name");
    for ttl in [300, 60, 120] {
        m.answers.push(Record::from_rdata(
            name.clone(),
            ttl,
            RData::A(A::new(203, 0, 113, 7)),
        ));
    }
    let answer = m.to_vec().expect("encode");
    assert_eq!(max_age(&answer, 3600), Some(60));
    assert_eq!(max_age(&answer, 30), Some(30), "no longer than dns.max_ttl");
    let empty = Message::query().to_vec().expect("encode");
    assert_eq!(max_age(&empty, 3600), None);
    assert_eq!(max_age(b"junk", 3600), None);
}
