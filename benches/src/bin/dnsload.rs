//! `egress-dnsload`: DNS load for the side-by-side benchmark (`benches/dns-load.sh`).
//!
//! `serve --listen ADDR` is the local upstream: hickory-server answering every
//! A query with one record in 203.0.113.0/24 (TTL 300). `query --target ADDR`
//! sends `--count` queries for distinct names, `--concurrency` outstanding at
//! a time, each from its own UDP socket bound to `--source`, and prints one
//! JSON line: answered, failed, seconds, queries/s, p50/p90/p99 in µs. Every
//! query waits at most `--timeout-ms`, so a run always ends.

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use hdrhistogram::Histogram;
use hickory_proto::op::{Message, MessageType, Metadata, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
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
    },
    /// Send queries and report throughput and latency as one JSON line.
    Query {
        #[arg(long)]
        target: SocketAddr,
        /// Local address the queries come from (the sandbox's address).
        #[arg(long, default_value = "127.0.0.1")]
        source: IpAddr,
        #[arg(long, default_value_t = 10_000)]
        count: u32,
        #[arg(long, default_value_t = 1)]
        concurrency: u32,
        #[arg(long, default_value_t = 2_000)]
        timeout_ms: u64,
        /// Prefix of the query names, so rounds ask for names not yet cached.
        #[arg(long, default_value = "q")]
        prefix: String,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let result = match Args::parse().command {
        Command::Serve { listen } => serve(listen).await,
        Command::Query {
            target,
            source,
            count,
            concurrency,
            timeout_ms,
            prefix,
        } => {
            let load = Load {
                target,
                source,
                count,
                timeout: Duration::from_millis(timeout_ms),
                prefix,
            };
            load.run(concurrency.max(1)).await
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

struct AnswerEverything;

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
                let last = name.bytes().fold(0u8, |h, b| h.wrapping_mul(31) ^ b) | 1;
                records.push(Record::from_rdata(
                    q.name().into(),
                    300,
                    RData::A(A::new(203, 0, 113, last)),
                ));
            }
        }
        egress_integration::answer(request, handle, metadata, &records).await
    }
}

async fn serve(listen: SocketAddr) -> Result<(), String> {
    let udp = UdpSocket::bind(listen)
        .await
        .map_err(|e| format!("bind {listen}: {e}"))?;
    let mut server = hickory_server::Server::new(AnswerEverything);
    server.register_socket(udp);
    println!("ready");
    server.block_until_done().await.map_err(|e| e.to_string())
}

// === the generator ===

struct Load {
    target: SocketAddr,
    source: IpAddr,
    count: u32,
    timeout: Duration,
    prefix: String,
}

#[derive(Default)]
struct Tally {
    answered: u32,
    failed: u32,
}

impl Load {
    async fn run(self, concurrency: u32) -> Result<(), String> {
        let this = Arc::new(self);
        let next = Arc::new(AtomicU32::new(0));
        let started = Instant::now();
        let mut workers = Vec::new();
        for _ in 0..concurrency {
            let socket = UdpSocket::bind((this.source, 0))
                .await
                .map_err(|e| format!("bind {}: {e}", this.source))?;
            let (this, next) = (this.clone(), next.clone());
            workers.push(tokio::spawn(
                async move { this.worker(socket, &next).await },
            ));
        }
        let mut hist = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
        let mut tally = Tally::default();
        for w in workers {
            let (h, t) = w.await.map_err(|e| e.to_string())??;
            hist.add(h).map_err(|e| e.to_string())?;
            tally.answered += t.answered;
            tally.failed += t.failed;
        }
        let secs = started.elapsed().as_secs_f64();
        println!(
            "{{\"answered\": {}, \"failed\": {}, \"secs\": {secs:.3}, \"qps\": {:.0}, \"p50_us\": {}, \"p90_us\": {}, \"p99_us\": {}}}",
            tally.answered,
            tally.failed,
            f64::from(tally.answered) / secs,
            hist.value_at_quantile(0.5),
            hist.value_at_quantile(0.9),
            hist.value_at_quantile(0.99),
        );
        Ok(())
    }

    /// Takes query numbers until `count` is reached; one query outstanding.
    async fn worker(
        &self,
        socket: UdpSocket,
        next: &AtomicU32,
    ) -> Result<(Histogram<u64>, Tally), String> {
        let mut hist = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
        let mut tally = Tally::default();
        let mut buf = vec![0u8; 4_096];
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= self.count {
                return Ok((hist, tally));
            }
            let id = (i & 0xffff) as u16;
            let name = Name::from_ascii(format!("{}{i}.bench.test.", self.prefix))
                .map_err(|e| e.to_string())?;
            let mut q = Message::new(id, MessageType::Query, OpCode::Query);
            q.metadata.recursion_desired = true;
            q.add_query(Query::query(name, RecordType::A));
            let bytes = q.to_vec().map_err(|e| e.to_string())?;
            let sent = Instant::now();
            socket
                .send_to(&bytes, self.target)
                .await
                .map_err(|e| format!("send to {}: {e}", self.target))?;
            let answered = tokio::time::timeout(self.timeout, async {
                loop {
                    let (n, _) = socket.recv_from(&mut buf).await?;
                    if let Ok(m) = Message::from_vec(&buf[..n]) {
                        if m.metadata.id == id {
                            return Ok::<_, std::io::Error>(m.metadata.response_code);
                        }
                    }
                }
            })
            .await;
            match answered {
                Ok(Ok(ResponseCode::NoError)) => {
                    tally.answered += 1;
                    let us = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
                    hist.record(us.max(1)).map_err(|e| e.to_string())?;
                }
                _ => tally.failed += 1,
            }
        }
    }
}
