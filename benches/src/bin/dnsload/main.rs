//! `egress-dnsload`: DNS load for the side-by-side benchmark (`benches/dns-load.sh`).
//!
//! `serve --listen ADDR` is the local upstream: hickory-server answering every
//! A query with one record in 203.0.113.0/24 (TTL 300; with `--spread`, an
//! address of 10.0.0.0/8 hashed from the name, so distinct names get
//! distinct addresses). `query --target ADDR`
//! sends `--count` queries for distinct names, `--concurrency` outstanding at
//! a time, each from its own UDP socket bound to `--source` (with
//! `--sources N`, N consecutive addresses from `--source` on, each a
//! sandbox: every worker has sockets on its share of them and asks from
//! each in turn), and prints one
//! JSON line: answered (NOERROR), refused (REFUSED), failed (anything else,
//! or no answer in time), seconds, queries/s answered, p50/p90/p99 in µs. Every
//! query waits at most `--timeout-ms` and no query starts after
//! `--deadline-s`, so a run always ends.
//!
//! The generator encodes its queries by hand and reads only the answer's
//! header (id, QR, RCODE): it shares the machine with the upstream and the
//! proxy under test, so the less CPU it takes, the more the figures say about
//! the path being measured. Every path gets the same generator.

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

mod doh;
use hdrhistogram::Histogram;
use hickory_proto::op::Metadata;
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};
use hickory_server::net::runtime::Time;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use tokio::net::UdpSocket;

#[derive(Parser)]
#[command(about = "DNS load: a local upstream and a query generator")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Answer every A query with one record (the benchmark's upstream).
    Serve {
        #[arg(long)]
        listen: SocketAddr,
        /// Each name's address hashed into 10.0.0.0/8 rather than 203.0.113.0/24.
        #[arg(long)]
        spread: bool,
    },
    /// Send queries and report throughput and latency as one JSON line.
    Query {
        #[arg(long)]
        target: SocketAddr,
        /// Local address the queries come from (the sandbox's address).
        #[arg(long, default_value = "127.0.0.1")]
        source: IpAddr,
        /// Source addresses, consecutive from `--source` (IPv4): each worker
        /// asks from its share of them in turn.
        #[arg(long, default_value_t = 1)]
        sources: u32,
        #[arg(long, default_value_t = 10_000)]
        count: u32,
        #[arg(long, default_value_t = 1)]
        concurrency: u32,
        #[arg(long, default_value_t = 2_000)]
        timeout_ms: u64,
        /// Prefix of the query names, so rounds ask for names not yet cached.
        #[arg(long, default_value = "q")]
        prefix: String,
        /// No query is started after this many seconds (the run is bounded in time).
        #[arg(long, default_value_t = 120)]
        deadline_s: u64,
        /// DNS over HTTPS instead of UDP: POSTs (RFC 8484) over one HTTP/2
        /// connection to `target` with this server name, `concurrency`
        /// streams at a time.
        #[arg(long)]
        doh_sni: Option<String>,
        /// The CA the DoH server's certificate chains to (the gateway's).
        #[arg(long)]
        doh_ca: Option<std::path::PathBuf>,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let result = match Args::parse().command {
        Command::Serve { listen, spread } => serve(listen, spread).await,
        Command::Query {
            target,
            source,
            sources,
            count,
            concurrency,
            timeout_ms,
            prefix,
            deadline_s,
            doh_sni,
            doh_ca,
        } => {
            let load = Load {
                target,
                source,
                sources: sources.max(1),
                count,
                timeout: Duration::from_millis(timeout_ms),
                prefix,
                deadline: Instant::now() + Duration::from_secs(deadline_s),
            };
            match (doh_sni, doh_ca) {
                (None, None) => load.run(concurrency.max(1)).await,
                (Some(sni), Some(ca)) => doh::run(load, &sni, &ca, concurrency.max(1)).await,
                _ => Err("give both --doh-sni and --doh-ca, or neither".to_owned()),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("egress-dnsload: {e}");
            ExitCode::FAILURE
        }
    }
}

// === the upstream ===

struct AnswerEverything {
    spread: bool,
}

#[async_trait::async_trait]
impl RequestHandler for AnswerEverything {
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        handle: R,
    ) -> ResponseInfo {
        let mut metadata = Metadata::response_from_request(&request.metadata);
        metadata.authoritative = true;
        let mut records = Vec::new();
        if let Some(q) = request.queries.queries().first() {
            if q.query_type() == RecordType::A {
                let name = q.name().to_string();
                let a = if self.spread {
                    let h = name.bytes().fold(0x811c_9dc5_u32, |h, b| {
                        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
                    });
                    let [_, x, y, z] = h.to_be_bytes();
                    A::new(10, x, y, z)
                } else {
                    let last = name.bytes().fold(0u8, |h, b| h.wrapping_mul(31) ^ b) | 1;
                    A::new(203, 0, 113, last)
                };
                records.push(Record::from_rdata(q.name().into(), 300, RData::A(a)));
            }
        }
        egress_integration::answer(request, handle, metadata, &records).await
    }
}

async fn serve(listen: SocketAddr, spread: bool) -> Result<(), String> {
    let udp = UdpSocket::bind(listen)
        .await
        .map_err(|e| format!("bind {listen}: {e}"))?;
    let mut server = hickory_server::Server::new(AnswerEverything { spread });
    server.register_socket(udp);
    println!("ready");
    server.block_until_done().await.map_err(|e| e.to_string())
}

// === the generator ===

struct Load {
    target: SocketAddr,
    source: IpAddr,
    sources: u32,
    count: u32,
    timeout: Duration,
    prefix: String,
    deadline: Instant,
}

#[derive(Default)]
struct Tally {
    answered: u32,
    /// Answered REFUSED (a budget, in the flood); not in `failed`.
    refused: u32,
    failed: u32,
}

impl Load {
    async fn run(self, concurrency: u32) -> Result<(), String> {
        let this = Arc::new(self);
        let next = Arc::new(AtomicU32::new(0));
        let started = Instant::now();
        let mut workers = Vec::new();
        for k in 0..concurrency {
            // Worker k asks from sources k, k + concurrency, …, in turn.
            let mut sockets = Vec::new();
            for j in (k..this.sources.max(concurrency)).step_by(concurrency as usize) {
                let source = this.source_of(j)?;
                let socket = UdpSocket::bind((source, 0))
                    .await
                    .map_err(|e| format!("bind {source}: {e}"))?;
                socket
                    .connect(this.target)
                    .await
                    .map_err(|e| format!("connect to {}: {e}", this.target))?;
                sockets.push(socket);
            }
            let (this, next) = (this.clone(), next.clone());
            workers.push(tokio::spawn(
                async move { this.worker(&sockets, &next).await },
            ));
        }
        finish(workers, started).await
    }

    /// Source address `j`: the (j mod `sources`)-th from `source`.
    fn source_of(&self, j: u32) -> Result<IpAddr, String> {
        match self.source {
            _ if self.sources == 1 => Ok(self.source),
            IpAddr::V4(v4) => u32::from(v4)
                .checked_add(j % self.sources)
                .map(|a| IpAddr::V4(a.into()))
                .ok_or_else(|| format!("{} sources from {v4}", self.sources)),
            IpAddr::V6(_) => Err("--sources takes an IPv4 --source".to_owned()),
        }
    }

    /// Takes query numbers until `count` is reached (or the deadline passes);
    /// one query outstanding, from each of `sockets` in turn.
    async fn worker(
        &self,
        sockets: &[UdpSocket],
        next: &AtomicU32,
    ) -> Result<(Histogram<u64>, Tally), String> {
        let mut hist = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
        let mut tally = Tally::default();
        let mut buf = vec![0u8; 4_096];
        let mut q = Vec::with_capacity(512);
        for turn in 0.. {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= self.count || Instant::now() >= self.deadline {
                break;
            }
            let socket = &sockets[turn % sockets.len()];
            let id = (i & 0xffff) as u16;
            encode_query(&mut q, id, &format!("{}{i}.bench.test", self.prefix))?;
            let sent = Instant::now();
            socket
                .send(&q)
                .await
                .map_err(|e| format!("send to {}: {e}", self.target))?;
            match self.answer(socket, id, &mut buf).await {
                Some(0) => {
                    tally.answered += 1;
                    let us = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
                    hist.record(us.max(1)).map_err(|e| e.to_string())?;
                }
                Some(5) => tally.refused += 1,
                _ => tally.failed += 1,
            }
        }
        Ok((hist, tally))
    }

    /// The RCODE of the answer to query `id` on `socket`; `None`: none in time.
    async fn answer(&self, socket: &UdpSocket, id: u16, buf: &mut [u8]) -> Option<u8> {
        let answered = tokio::time::timeout(self.timeout, async {
            loop {
                let n = socket.recv(buf).await?;
                // The header: id, QR set, and RCODE.
                if let Some(h) = buf.get(..12).filter(|_| n >= 12) {
                    if u16::from_be_bytes([h[0], h[1]]) == id && h[2] & 0x80 != 0 {
                        return Ok::<_, std::io::Error>(h[3] & 0x0f);
                    }
                }
            }
        })
        .await;
        answered.ok()?.ok()
    }
}

/// Every worker's histogram and tally, summed, printed as the run's line.
async fn finish(workers: Vec<Worker>, started: Instant) -> Result<(), String> {
    let mut hist = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
    let mut tally = Tally::default();
    for w in workers {
        let (h, t) = w.await.map_err(|e| e.to_string())??;
        hist.add(h).map_err(|e| e.to_string())?;
        tally.answered += t.answered;
        tally.failed += t.failed;
        tally.refused += t.refused;
    }
    report(&hist, &tally, started.elapsed().as_secs_f64());
    Ok(())
}

/// A generator task: its latencies and counts.
type Worker = tokio::task::JoinHandle<Result<(Histogram<u64>, Tally), String>>;

/// The run's one JSON line.
fn report(hist: &Histogram<u64>, tally: &Tally, secs: f64) {
    println!(
        "{{\"answered\": {}, \"refused\": {}, \"failed\": {}, \"secs\": {secs:.3}, \"qps\": {:.0}, \"p50_us\": {}, \"p90_us\": {}, \"p99_us\": {}}}",
        tally.answered,
        tally.refused,
        tally.failed,
        f64::from(tally.answered) / secs,
        hist.value_at_quantile(0.5),
        hist.value_at_quantile(0.9),
        hist.value_at_quantile(0.99),
    );
}

/// A recursion-desired query for `name` (type A, class IN) with `id`, into `out`.
fn encode_query(out: &mut Vec<u8>, id: u16, name: &str) -> Result<(), String> {
    out.clear();
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.') {
        let len = u8::try_from(label.len())
            .ok()
            .filter(|l| (1..=63).contains(l))
            .ok_or_else(|| format!("bad label {label:?} in {name}"))?;
        out.push(len);
        out.extend_from_slice(label.as_bytes());
    }
    out.extend_from_slice(&[0, 0, 1, 0, 1]);
    if out.len() > 12 + 255 + 4 {
        return Err(format!("name too long: {name}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{Message, MessageType, OpCode};
    use hickory_proto::rr::Name;

    #[test]
    fn hand_encoded_query_parses_as_the_same_query() {
        let mut q = Vec::new();
        encode_query(&mut q, 0x1234, "r1-load-gateway-42.bench.test").expect("encodes");
        let m = Message::from_vec(&q).expect("parses");
        assert_eq!(m.metadata.id, 0x1234);
        assert_eq!(m.metadata.message_type, MessageType::Query);
        assert_eq!(m.metadata.op_code, OpCode::Query);
        assert!(m.metadata.recursion_desired);
        let [question] = m.queries.as_slice() else {
            panic!("one question")
        };
        assert_eq!(
            question.name,
            Name::from_ascii("r1-load-gateway-42.bench.test.").expect("name")
        );
        assert_eq!(question.query_type, RecordType::A);
        assert!(encode_query(&mut q, 1, "a..b").is_err());
    }
}
