//! The TLS sessions the gateway resumes with origins: every registration's,
//! in one store bounded in tickets across all of them.
//!
//! - A ticket one registration got is resumed only by that registration's
//!   connections ([`RegistrationSessions`]): an origin cannot link two
//!   tenants' connections through one ticket.
//! - An origin chooses how large its tickets are (up to 64 KiB), and each
//!   one keeps a copy of the origin's certificate chain; rustls does not
//!   say either size. So the bound is in tickets: at most [`MAX_TICKETS`]
//!   in all and [`TICKETS_PER_SERVER`] per registration and server, the
//!   least recently used going first. At about 6 KiB a ticket (a small ticket, a
//!   chain of two certificates) that is 24 MiB; an origin sending the
//!   largest tickets it may, behind the largest chain, can make it some
//!   512 MiB, however many registrations it is sent to. (rustls' own store,
//!   one per registration, kept 64 tickets for each of up to 16,384
//!   registrations: a million tickets.)
//! - TLS 1.2 sessions are not kept: an origin that speaks only TLS 1.2 is
//!   met with a full handshake each time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::client::{ClientSessionStore, Tls12ClientSessionValue, Tls13ClientSessionValue};
use rustls::pki_types::ServerName;
use rustls::NamedGroup;

/// Tickets kept in all.
pub(crate) const MAX_TICKETS: u64 = 4_096;
/// Tickets kept for one registration and server (origins send two after
/// each handshake, as rustls and OpenSSL do by default).
pub(crate) const TICKETS_PER_SERVER: usize = 4;
/// A ticket or a server's hint unused this long goes.
const IDLE: Duration = Duration::from_secs(30 * 60);

/// What one registration knows of one server: its tickets' numbers in
/// [`Sessions::tickets`], newest last, and the key exchange it chose.
#[derive(Debug, Default)]
struct Server {
    tickets: VecDeque<u64>,
    kx: Option<NamedGroup>,
}

/// Every registration's sessions.
#[derive(Debug)]
pub(crate) struct Sessions {
    servers: moka::sync::Cache<(u64, ServerName<'static>), Arc<Mutex<Server>>>,
    /// Tickets by number, each taken at most once.
    tickets: moka::sync::Cache<u64, Arc<Mutex<Option<Tls13ClientSessionValue>>>>,
    next: AtomicU64,
}

impl Default for Sessions {
    fn default() -> Self {
        Self::holding(MAX_TICKETS)
    }
}

impl Sessions {
    /// A store of at most `max` tickets (and as many servers' hints). The
    /// least recently used go first: moka's default policy admits a new
    /// entry to a full cache only if it was looked up more often than the
    /// one it would push out, and a ticket is never looked up before it is
    /// taken, so a full store would refuse every new one.
    fn holding(max: u64) -> Self {
        let lru = moka::policy::EvictionPolicy::lru;
        Self {
            servers: moka::sync::Cache::builder()
                .max_capacity(max)
                .eviction_policy(lru())
                .time_to_idle(IDLE)
                .build(),
            tickets: moka::sync::Cache::builder()
                .max_capacity(max)
                .eviction_policy(lru())
                .time_to_idle(IDLE)
                .build(),
            next: AtomicU64::new(0),
        }
    }

    /// Registration `serial`'s view, for its client configs.
    pub(crate) fn of(self: &Arc<Self>, serial: u64) -> Arc<RegistrationSessions> {
        Arc::new(RegistrationSessions {
            serial,
            all: self.clone(),
        })
    }

    /// Tickets held now (after pending evictions are carried out).
    #[cfg(test)]
    fn tickets_held(&self) -> u64 {
        self.tickets.run_pending_tasks();
        self.tickets.entry_count()
    }

    fn server(&self, serial: u64, name: &ServerName<'static>) -> Arc<Mutex<Server>> {
        self.servers
            .get_with((serial, name.clone()), Default::default)
    }

    fn known(&self, serial: u64, name: &ServerName<'_>) -> Option<Arc<Mutex<Server>>> {
        self.servers.get(&(serial, name.to_owned()))
    }
}

/// One registration's sessions, as rustls asks for them.
#[derive(Debug)]
pub(crate) struct RegistrationSessions {
    serial: u64,
    all: Arc<Sessions>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ClientSessionStore for RegistrationSessions {
    fn set_kx_hint(&self, name: ServerName<'static>, group: NamedGroup) {
        locked(&self.all.server(self.serial, &name)).kx = Some(group);
    }

    fn kx_hint(&self, name: &ServerName<'_>) -> Option<NamedGroup> {
        self.all
            .known(self.serial, name)
            .and_then(|s| locked(&s).kx)
    }

    fn set_tls12_session(&self, _: ServerName<'static>, _: Tls12ClientSessionValue) {}

    fn tls12_session(&self, _: &ServerName<'_>) -> Option<Tls12ClientSessionValue> {
        None
    }

    fn remove_tls12_session(&self, _: &ServerName<'static>) {}

    fn insert_tls13_ticket(&self, name: ServerName<'static>, value: Tls13ClientSessionValue) {
        let number = self.all.next.fetch_add(1, Ordering::Relaxed);
        self.all
            .tickets
            .insert(number, Arc::new(Mutex::new(Some(value))));
        let server = self.all.server(self.serial, &name);
        let mut server = locked(&server);
        server.tickets.push_back(number);
        while server.tickets.len() > TICKETS_PER_SERVER {
            if let Some(oldest) = server.tickets.pop_front() {
                self.all.tickets.invalidate(&oldest);
            }
        }
    }

    fn take_tls13_ticket(&self, name: &ServerName<'static>) -> Option<Tls13ClientSessionValue> {
        let server = self.all.known(self.serial, name)?;
        let mut server = locked(&server);
        // The newest first; one the store let go meanwhile is skipped.
        while let Some(number) = server.tickets.pop_back() {
            if let Some(ticket) = self.all.tickets.remove(&number) {
                if let Some(value) = locked(&ticket).take() {
                    return Some(value);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use egress_certs::{CertificateAuthority, LeafMinter, MintConfig};
    use rustls::{ClientConnection, HandshakeKind, ServerConnection};

    /// The gateway's own terminating config as the origin (it mints a leaf
    /// for any name and sends two tickets after each handshake), and a
    /// client config per registration trusting its CA.
    struct Origin {
        server: Arc<rustls::ServerConfig>,
        roots: Arc<rustls::RootCertStore>,
        provider: Arc<rustls::crypto::CryptoProvider>,
        /// Each registration's client config, made once (a ticket resumes
        /// only under the config, and so the verifier, it was got with).
        clients: Mutex<std::collections::HashMap<u64, Arc<rustls::ClientConfig>>>,
        _dir: tempfile::TempDir,
    }

    impl Origin {
        fn new() -> Self {
            let dir = tempfile::tempdir().expect("temp");
            let ca = CertificateAuthority::load_or_create(&dir.path().join("ca")).expect("ca");
            let mut roots = rustls::RootCertStore::empty();
            roots.add(ca.cert_der().clone()).expect("root");
            let minter =
                Arc::new(LeafMinter::new(Arc::new(ca), MintConfig::default()).expect("minter"));
            let provider = crate::aes_gcm::provider(crate::aes_gcm::AesGcm::Auto);
            Self {
                server: crate::upstream::server_tls(&provider, &minter, None),
                roots: Arc::new(roots),
                provider,
                clients: Mutex::default(),
                _dir: dir,
            }
        }

        /// One handshake of `store`'s registration with `name`, tickets read.
        fn handshake(&self, store: &Arc<RegistrationSessions>, name: &str) -> HandshakeKind {
            let config = locked(&self.clients)
                .entry(store.serial)
                .or_insert_with(|| {
                    let mut c = crate::upstream::client_builder(&self.provider)
                        .with_root_certificates(self.roots.clone())
                        .with_no_client_auth();
                    c.resumption = rustls::client::Resumption::store(store.clone());
                    Arc::new(c)
                })
                .clone();
            let name = ServerName::try_from(name.to_owned()).expect("name");
            let mut client = ClientConnection::new(config, name).expect("client");
            let mut server = ServerConnection::new(self.server.clone()).expect("server");
            for _ in 0..10 {
                let mut bytes = Vec::new();
                while client.wants_write() {
                    client.write_tls(&mut bytes).expect("client writes");
                }
                server.read_tls(&mut &bytes[..]).expect("server reads");
                server.process_new_packets().expect("server");
                bytes.clear();
                while server.wants_write() {
                    server.write_tls(&mut bytes).expect("server writes");
                }
                client.read_tls(&mut &bytes[..]).expect("client reads");
                client.process_new_packets().expect("client");
            }
            assert!(!client.is_handshaking(), "handshake done");
            client.handshake_kind().expect("kind")
        }
    }

    /// Tickets resume their registration's connections to their server,
    /// never another registration's; at most four are kept per
    /// registration and server, and at most the store's bound in all,
    /// however many servers and registrations send them.
    #[test]
    fn tickets_are_bounded_in_all_and_kept_per_registration() {
        let origin = Origin::new();
        let sessions = Arc::new(Sessions::holding(8));
        let (one, two) = (sessions.of(1), sessions.of(2));
        assert_eq!(origin.handshake(&one, "a.test"), HandshakeKind::Full);
        assert_eq!(origin.handshake(&one, "a.test"), HandshakeKind::Resumed);
        assert_eq!(
            origin.handshake(&two, "a.test"),
            HandshakeKind::Full,
            "another registration's"
        );
        assert_eq!(
            origin.handshake(&one, "b.test"),
            HandshakeKind::Full,
            "another server's"
        );
        for _ in 0..3 {
            origin.handshake(&one, "a.test");
        }
        let kept = sessions.known(1, &ServerName::try_from("a.test").expect("name"));
        let kept = kept.map(|s| locked(&s).tickets.len());
        assert_eq!(kept, Some(TICKETS_PER_SERVER));
        for n in 0..12 {
            origin.handshake(&sessions.of(10 + n), "c.test");
            assert!(sessions.tickets_held() <= 8, "{}", sessions.tickets_held());
        }
        // The store full, a newcomer's tickets push out the least recently
        // used and resume its next connection (a full store that refused
        // them left every other tenant with full handshakes).
        let newcomer = sessions.of(99);
        assert_eq!(origin.handshake(&newcomer, "z.test"), HandshakeKind::Full);
        sessions.tickets_held();
        assert_eq!(
            origin.handshake(&newcomer, "z.test"),
            HandshakeKind::Resumed
        );
    }
}
