//! Hand-built ClientHellos for tests and benchmarks: any SNI, ALPN list,
//! 0-RTT offer and padding (a post-quantum key share makes a hello ~2 KB),
//! wrapped in TLS records of any size.

/// Builds a ClientHello by hand: SNI, ALPN, optional 0-RTT and padding.
pub fn hello(sni: Option<&str>, alpn: &[&str], padding: usize, early: bool) -> Vec<u8> {
    let mut exts = Vec::new();
    let mut ext = |ty: u16, data: Vec<u8>| {
        exts.extend_from_slice(&ty.to_be_bytes());
        exts.extend_from_slice(&(data.len() as u16).to_be_bytes());
        exts.extend_from_slice(&data);
    };
    if let Some(name) = sni {
        let mut d = ((name.len() + 3) as u16).to_be_bytes().to_vec();
        d.push(0);
        d.extend_from_slice(&(name.len() as u16).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        ext(0x0000, d);
    }
    if !alpn.is_empty() {
        let list: Vec<u8> = alpn
            .iter()
            .flat_map(|p| std::iter::once(p.len() as u8).chain(p.bytes()))
            .collect();
        let mut d = (list.len() as u16).to_be_bytes().to_vec();
        d.extend_from_slice(&list);
        ext(0x0010, d);
    }
    if early {
        ext(0x002a, vec![]);
    }
    if padding > 0 {
        ext(0x0015, vec![0; padding]);
    }
    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&[7; 32]);
    body.push(32);
    body.extend_from_slice(&[9; 32]);
    body.extend_from_slice(&[0, 2, 0x13, 0x01, 1, 0]);
    body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
    body.extend_from_slice(&exts);
    let mut hs = vec![1, 0, 0, 0];
    hs[1..4].copy_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&body);
    hs
}

/// Wraps a handshake message in TLS records of at most `fragment` bytes each.
pub fn records(hs: &[u8], fragment: usize) -> Vec<u8> {
    hs.chunks(fragment)
        .flat_map(|c| {
            let mut r = vec![0x16, 0x03, 0x01];
            r.extend_from_slice(&(c.len() as u16).to_be_bytes());
            r.extend_from_slice(c);
            r
        })
        .collect()
}
