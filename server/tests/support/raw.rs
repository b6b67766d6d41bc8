//! Clients that misbehave on purpose, below the HTTP library: raw TCP and
//! TLS sockets from chosen loopback addresses, and the server's memory as
//! the kernel reports it. Included by the server's own tests next to
//! `support` (`#[path = "support/raw.rs"] mod raw;`), not by `support`
//! itself, so that the end-to-end crate that shares `support` needs no TLS
//! crates of its own.
#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use anyhow::{Context, Result};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::support::TestServer;

/// The n-th extra loopback address, 127.0.0.(base + n): Linux routes all
/// of 127.0.0.0/8 to the loopback interface, so tests can stand in for
/// many client addresses without leaving the machine.
pub fn loopback(base: u8, n: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, base.wrapping_add(n as u8)))
}

impl TestServer {
    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// A TLS connector that pins this server's certificate.
    pub fn tls_connector(&self) -> Result<TlsConnector> {
        let config = self.trust().client_config()?;
        Ok(TlsConnector::from(Arc::new(config)))
    }

    /// The server process's resident memory in KiB: `VmRSS` now, or
    /// `VmHWM` for its peak so far.
    pub fn memory_kib(&self, field: &str) -> Result<u64> {
        let pid = self.pid().context("server not running")?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        status
            .lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("no {field} in /proc/{pid}/status"))
    }
}

/// A TCP connection to `server` from `source`.
pub async fn tcp_from(source: IpAddr, server: SocketAddr) -> Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(source, 0))?;
    Ok(socket.connect(server).await?)
}

/// A TLS connection (handshake done) to `server` from `source`.
pub async fn tls_from(
    connector: &TlsConnector,
    source: IpAddr,
    server: SocketAddr,
) -> Result<TlsStream<TcpStream>> {
    let tcp = tcp_from(source, server).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?.to_owned();
    Ok(connector.connect(name, tcp).await?)
}

/// A reqwest client whose connections come from `source`.
pub fn http_client_from(server: &TestServer, source: IpAddr) -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .use_preconfigured_tls(server.trust().client_config()?)
        .local_address(source)
        .build()?)
}
