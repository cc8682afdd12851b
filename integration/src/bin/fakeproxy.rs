//! `egress-fakeproxy --listen IP:PORT --log FILE [--answer STATUS]`: an HTTP
//! CONNECT proxy standing in for an operator's (Squid is not assumed), for
//! the namespace suite. Run it inside the "internet" namespace; it prints
//! `ready` once listening.
//!
//! Each request appends one line to `--log`: the request line and the
//! `Proxy-Authorization` it carried (`-` for none), e.g.
//! `CONNECT 203.0.113.10:443 HTTP/1.1 auth=Basic Z3c6czNjcmV0`. Then it
//! answers `--answer` (a refusal, e.g. 403) or dials the target and relays.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Largest request head read.
const MAX_HEAD: usize = 8 * 1024;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    listen: SocketAddr,
    /// Where each request's line is appended.
    #[arg(long)]
    log: PathBuf,
    /// Answer every CONNECT with this status instead of relaying.
    #[arg(long)]
    answer: Option<u16>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let listener = match TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("egress-fakeproxy: {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    println!("ready");
    let args = Arc::new(args);
    while let Ok((s, _)) = listener.accept().await {
        tokio::spawn(serve(s, args.clone()));
    }
    ExitCode::FAILURE
}

async fn serve(mut s: TcpStream, args: Arc<Args>) {
    let Some(head) = read_head(&mut s).await else {
        return;
    };
    let mut lines = head.lines();
    let request = lines.next().unwrap_or_default().to_owned();
    let auth = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("proxy-authorization"))
        .map_or("-", |(_, v)| v.trim());
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.log)
    {
        let _ = writeln!(f, "{request} auth={auth}");
    }
    if let Some(status) = args.answer {
        let answer =
            format!("HTTP/1.1 {status} Refused by the fake proxy\r\nContent-Length: 0\r\n\r\n");
        let _ = s.write_all(answer.as_bytes()).await;
        return;
    }
    let target = match request.split_whitespace().collect::<Vec<_>>()[..] {
        ["CONNECT", target, _] => target.parse::<SocketAddr>().ok(),
        _ => None,
    };
    let Some(target) = target else {
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        return;
    };
    let Ok(mut origin) = TcpStream::connect(target).await else {
        let _ = s.write_all(b"HTTP/1.1 502 Bad Gateway\r\n\r\n").await;
        return;
    };
    if s.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await
        .is_ok()
    {
        let _ = tokio::io::copy_bidirectional(&mut s, &mut origin).await;
    }
}

/// The request head (up to its blank line), byte by byte so nothing the
/// client sends after it is taken.
async fn read_head(s: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_HEAD || s.read(&mut b).await.ok()? == 0 {
            return None;
        }
        head.push(b[0]);
    }
    String::from_utf8(head).ok()
}
