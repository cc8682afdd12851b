//! Hand-built ClientHellos for tests and benchmarks: any SNI, ALPN list,
//! 0-RTT offer and padding (a post-quantum key share makes a hello ~2 KB),
//! wrapped in TLS records of any size.

/// Builds a ClientHello by hand: SNI, ALPN, optional 0-RTT and padding.
pub fn hello(sni: Option<&str>, alpn: &[&str], padding: usize, early: bool) -> Vec<u8> {
    let mut exts = Vec::new();
    if let Some(name) = sni {
        exts.push((0x0000, sni_data(&[(0, name.as_bytes())])));
    }
    if !alpn.is_empty() {
        let list: Vec<u8> = alpn
            .iter()
            .flat_map(|p| std::iter::once(p.len() as u8).chain(p.bytes()))
            .collect();
        let mut d = (list.len() as u16).to_be_bytes().to_vec();
        d.extend_from_slice(&list);
        exts.push((0x0010, d));
    }
    if early {
        exts.push((0x002a, vec![]));
    }
    if padding > 0 {
        exts.push((0x0015, vec![0; padding]));
    }
    hello_with(&exts)
}

/// The data of a `server_name` extension listing `entries` (name type, name),
/// every length as it should be.
pub fn sni_data(entries: &[(u8, &[u8])]) -> Vec<u8> {
    let mut list = Vec::new();
    for (kind, name) in entries {
        list.push(*kind);
        list.extend_from_slice(&(name.len() as u16).to_be_bytes());
        list.extend_from_slice(name);
    }
    let mut d = (list.len() as u16).to_be_bytes().to_vec();
    d.extend_from_slice(&list);
    d
}

/// The data of an outer `encrypted_client_hello` extension
/// (draft-ietf-tls-esni §5): HKDF-SHA256 with AES-128-GCM, `config_id`, an
/// `enc` of `enc` bytes and a `payload` of `payload` bytes. Real ECH and
/// GREASE ECH have this same shape; only the server's key tells them apart.
pub fn ech_outer(config_id: u8, enc: usize, payload: usize) -> Vec<u8> {
    let mut d = vec![0, 0x00, 0x01, 0x00, 0x01, config_id];
    d.extend_from_slice(&(enc as u16).to_be_bytes());
    d.extend((0..enc).map(|i| i as u8));
    d.extend_from_slice(&(payload as u16).to_be_bytes());
    d.extend((0..payload).map(|i| (i * 7) as u8));
    d
}

/// A ClientHello carrying exactly `exts` (type, data), in order.
pub fn hello_with(exts: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (ty, data) in exts {
        block.extend_from_slice(&ty.to_be_bytes());
        block.extend_from_slice(&(data.len() as u16).to_be_bytes());
        block.extend_from_slice(data);
    }
    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&[7; 32]);
    body.push(32);
    body.extend_from_slice(&[9; 32]);
    body.extend_from_slice(&[0, 2, 0x13, 0x01, 1, 0]);
    body.extend_from_slice(&(block.len() as u16).to_be_bytes());
    body.extend_from_slice(&block);
    handshake(&body)
}

/// A ClientHello handshake message around `body` (its header's length is `body`'s).
pub fn handshake(body: &[u8]) -> Vec<u8> {
    let mut hs = vec![1, 0, 0, 0];
    hs[1..4].copy_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(body);
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
