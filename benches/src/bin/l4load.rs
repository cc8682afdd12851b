//! `egress-l4load`: plain TCP load for the machine egress benchmark
//! (`benches/machine-egress.sh`), where the kernel, not the gateway process,
//! forwards a VM's traffic.
//!
//! `serve --listen ADDR --close-at ADDR2` accepts connections and discards
//! what they send; on ADDR2 it closes each at once. `connect --target ADDR2`
//! opens connections and waits for the server's close, `--concurrency` at
//! a time, for `--seconds` (or `--count` connections, whichever ends first)
//! and prints `{"connects", "seconds", "per_s", "failed"}`. `bulk --target
//! ADDR` writes 64 KiB buffers on one connection for `--seconds` and prints
//! `{"bytes", "seconds", "mib_per_s"}`. Every connect waits at most a second,
//! so a run always ends.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
#[command(about = "Plain TCP load: a discarding server, a connect-rate and a bulk client")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Accept and discard; on `--close-at`, accept and close at once.
    Serve {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        close_at: SocketAddr,
    },
    /// Connections opened and closed per second.
    Connect {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, default_value_t = 8)]
        concurrency: u32,
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        #[arg(long, default_value_t = 10_000_000)]
        count: u64,
    },
    /// Bytes per second on one connection.
    Bulk {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, default_value_t = 5)]
        seconds: u64,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let result = match Args::parse().command {
        Command::Serve { listen, close_at } => serve(listen, close_at).await,
        Command::Connect {
            target,
            concurrency,
            seconds,
            count,
        } => connect(target, concurrency, Duration::from_secs(seconds), count).await,
        Command::Bulk { target, seconds } => bulk(target, Duration::from_secs(seconds)).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("egress-l4load: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(listen: SocketAddr, close_at: SocketAddr) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    // The server closes first, so TIME_WAIT stays on its side and the
    // client's ports are free again at once.
    let closer = TcpListener::bind(close_at).await?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = closer.accept().await {
            drop(stream);
        }
    });
    println!("ready");
    loop {
        let (mut stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let mut buf = vec![0u8; 256 * 1024];
            while let Ok(n) = stream.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        });
    }
}

async fn connect(
    target: SocketAddr,
    concurrency: u32,
    duration: Duration,
    count: u64,
) -> std::io::Result<()> {
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (done, failed) = (done.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            while start.elapsed() < duration && done.load(Ordering::Relaxed) < count {
                match tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(target)).await
                {
                    Ok(Ok(mut s)) => {
                        // Wait for the server's close (it closes first).
                        let mut byte = [0u8; 1];
                        let closed =
                            tokio::time::timeout(Duration::from_secs(1), s.read(&mut byte)).await;
                        if matches!(closed, Ok(Ok(0))) {
                            done.fetch_add(1, Ordering::Relaxed);
                        } else {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    _ => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let secs = start.elapsed().as_secs_f64();
    let n = done.load(Ordering::Relaxed);
    println!(
        "{}",
        serde_json::json!({
            "connects": n,
            "failed": failed.load(Ordering::Relaxed),
            "seconds": secs,
            "per_s": n as f64 / secs,
        })
    );
    Ok(())
}

async fn bulk(target: SocketAddr, duration: Duration) -> std::io::Result<()> {
    let mut s = tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(target))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
    let buf = vec![0x5au8; 64 * 1024];
    let start = Instant::now();
    let mut bytes = 0u64;
    while start.elapsed() < duration {
        s.write_all(&buf).await?;
        bytes += buf.len() as u64;
    }
    s.shutdown().await?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "bytes": bytes,
            "seconds": secs,
            "mib_per_s": bytes as f64 / secs / (1024.0 * 1024.0),
        })
    );
    Ok(())
}
