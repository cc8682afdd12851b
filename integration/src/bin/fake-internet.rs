//! `fake-internet --ca-dir DIR`: DNS on 203.0.113.53:53, HTTPS on :443, HTTP on :80,
//! an SSH-like banner and echo on :22
//! (IPv4 and IPv6).
//! Run it inside the "internet" namespace; it prints `ready` once listening.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Where the fake internet's CA lives (created when missing).
    #[arg(long)]
    ca_dir: PathBuf,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let minter = match egress_integration::origin_minter(&args.ca_dir) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("fake-internet: {e}");
            return ExitCode::FAILURE;
        }
    };
    let dns: SocketAddr = (
        egress_integration::DNS_IP
            .parse::<std::net::IpAddr>()
            .unwrap_or([0, 0, 0, 0].into()),
        53,
    )
        .into();
    // Dual stack: `[::]` takes IPv4 too (as `::ffff:a.b.c.d`).
    let tls: SocketAddr = (std::net::Ipv6Addr::UNSPECIFIED, 443).into();
    let http: SocketAddr = (std::net::Ipv6Addr::UNSPECIFIED, 80).into();
    let dns_task = tokio::spawn(egress_integration::serve_dns(dns));
    let tls_task = tokio::spawn(egress_integration::serve_tls(tls, minter));
    let http_task = tokio::spawn(egress_integration::serve_http(http));
    let ssh: SocketAddr = (std::net::Ipv6Addr::UNSPECIFIED, 22).into();
    let ssh_task = tokio::spawn(egress_integration::serve_ssh(ssh));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    for (what, t) in [
        ("dns", &dns_task),
        ("https", &tls_task),
        ("http", &http_task),
        ("ssh", &ssh_task),
    ] {
        if t.is_finished() {
            eprintln!("fake-internet: the {what} server stopped at start");
            return ExitCode::FAILURE;
        }
    }
    println!("ready");
    let _ = tokio::join!(dns_task, tls_task, http_task, ssh_task);
    ExitCode::FAILURE
}
