//! Hosting a set of gRPC services the way every Ferry service is hosted: the services
//! themselves, the standard `grpc.health.v1.Health` service, and server reflection in both
//! `v1` and `v1alpha` (grpcurl 1.8 speaks only v1alpha) with the health service's descriptors
//! registered too, so `grpcurl list`, `describe` and calls work without `.proto` files.
//!
//! Health follows the service's life: each hosted service (and the overall "" entry) is
//! SERVING once the listener is up, and `NOT_SERVING` from the moment shutdown begins, so load
//! balancers stop sending work while in-flight work drains.
//!
//! A service may also open a **probe port** ([`ProbeArgs`], `--probe-listen`): plaintext, it
//! serves only the health service and `GET /metrics`. Under mutual TLS every API port wants a
//! client certificate, which neither the kubelet's gRPC probes nor a Prometheus scrape present;
//! the probe port answers them without opening the API. (etcd's `--listen-metrics-urls` is the
//! same idea.)

use std::future::Future;
use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::StreamExt;
use tonic::codegen::{http, Service};
use tonic::service::RoutesBuilder;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// Why hosting failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The reflection service could not be built from the descriptor sets.
    #[error("building gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The transport failed while serving.
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The listener has no local address.
    #[error("listener address: {0}")]
    Io(#[from] std::io::Error),
}

/// A set of gRPC services to host on one listener, with health and reflection added.
pub struct GrpcHost {
    routes: RoutesBuilder,
    /// The probe port's routes: the same health service.
    probe_routes: RoutesBuilder,
    service_names: Vec<&'static str>,
    health: HealthReporter,
    metrics: Vec<std::sync::Arc<dyn crate::prometheus::Render>>,
    /// HTTP/2 flow-control windows for bulk data, when set.
    bulk: bool,
    /// A raw protocol sharing the port, if any.
    side: Option<crate::side_channel::SideChannel>,
    /// Under mutual TLS, the roles whose certificates may connect.
    callers: &'static [crate::tls::Role],
    /// What every call on the API port must pass (API keys), but its open paths.
    gate: crate::call_gate::CallGate,
}

/// HTTP/2 flow-control windows for services that move bulk data (KV blocks): a stream may have
/// this much in flight before the receiver must read it. The defaults (64 KiB) cap a loopback
/// stream far below what the memory copies allow.
pub const BULK_STREAM_WINDOW: u32 = 16 << 20;
/// The connection-wide window for bulk services (several streams at once).
pub const BULK_CONNECTION_WINDOW: u32 = 64 << 20;
/// HTTP/2 frames of up to 1 MiB for bulk services (the default, 16 KiB, cuts a 2 MiB chunk
/// into 128 frames).
pub const BULK_FRAME_SIZE: u32 = 1 << 20;

impl Default for GrpcHost {
    fn default() -> Self {
        Self::new()
    }
}

impl GrpcHost {
    /// An empty host: health and reflection only.
    pub fn new() -> Self {
        let (health, health_service) = tonic_health::server::health_reporter();
        let mut routes = RoutesBuilder::default();
        let mut probe_routes = RoutesBuilder::default();
        probe_routes.add_service(health_service.clone());
        routes.add_service(health_service);
        Self {
            routes,
            probe_routes,
            service_names: Vec::new(),
            health,
            metrics: Vec::new(),
            bulk: false,
            side: None,
            callers: &crate::tls::Role::ALL,
            gate: crate::call_gate::CallGate::default(),
        }
    }

    /// Adds a service; reflection advertises it and health reports on it by its name.
    #[must_use]
    pub fn add_service<S>(mut self, service: S) -> Self
    where
        S: Service<
                http::Request<tonic::body::Body>,
                Response = http::Response<tonic::body::Body>,
                Error = std::convert::Infallible,
            > + tonic::server::NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        self.service_names.push(S::NAME);
        self.routes.add_service(service);
        self
    }

    /// Large HTTP/2 flow-control windows, for a service that moves bulk data.
    #[must_use]
    pub fn bulk(mut self) -> Self {
        self.bulk = true;
        self
    }

    /// Shares the port with a raw protocol: connections that open with `side.magic` go to its
    /// handler (see [`crate::side_channel`]).
    #[must_use]
    pub fn with_side_channel(mut self, side: crate::side_channel::SideChannel) -> Self {
        self.side = Some(side);
        self
    }

    /// Under mutual TLS ([`crate::tls`]), takes connections only from certificates holding
    /// one of `roles` (default: any role the CA vouches for).
    #[must_use]
    pub fn callers(mut self, roles: &'static [crate::tls::Role]) -> Self {
        self.callers = roles;
        self
    }

    /// Puts every call on the API port (reflection and `/metrics` included) behind `gate`;
    /// the probe port is not gated.
    #[must_use]
    pub fn gate(mut self, gate: crate::call_gate::CallGate) -> Self {
        self.gate = gate;
        self
    }

    /// Serves `GET /metrics` (Prometheus text) on the same port, over HTTP/1.1 beside gRPC;
    /// several calls add families in order.
    #[must_use]
    pub fn with_metrics(mut self, metrics: std::sync::Arc<dyn crate::prometheus::Render>) -> Self {
        self.metrics.push(metrics);
        self
    }

    /// The health reporter, for services that change their status while running.
    pub fn health(&self) -> HealthReporter {
        self.health.clone()
    }

    /// A switch that reports every hosted service `NOT_SERVING` before shutdown begins (a
    /// drain's first step). Take it once every service is added.
    pub fn health_switch(&self) -> HealthSwitch {
        HealthSwitch { health: self.health.clone(), names: self.service_names.clone() }
    }

    /// Serves on `ports` until `shutdown` resolves, then reports `NOT_SERVING` and stops
    /// accepting; in-flight calls finish before this returns. With the process's TLS
    /// installed ([`crate::tls::install`]), every connection to the API port is mutual TLS
    /// from one of [`Self::callers`], and the side channel is chosen by ALPN inside TLS. The
    /// probe port, if any, answers health checks (the same statuses) and `/metrics` in
    /// plaintext until the API port has stopped.
    pub async fn serve(
        self,
        ports: impl Into<Ports>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), HostError> {
        let Self {
            mut routes,
            probe_routes,
            service_names,
            health,
            metrics,
            bulk,
            side,
            callers,
            gate,
        } = self;
        let Ports { grpc: listener, probe } = ports.into();
        let mut metrics = metrics;
        if !metrics.is_empty() && crate::tls::current().is_some() {
            metrics.push(std::sync::Arc::new(crate::tls::HandshakeMetrics));
        }
        let mut v1 = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(ferry_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name("grpc.health.v1.Health")
            .with_service_name("grpc.reflection.v1.ServerReflection");
        let mut v1alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(ferry_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name("grpc.health.v1.Health")
            .with_service_name("grpc.reflection.v1alpha.ServerReflection");
        for name in &service_names {
            v1 = v1.with_service_name(*name);
            v1alpha = v1alpha.with_service_name(*name);
        }
        routes.add_service(v1.build_v1()?);
        routes.add_service(v1alpha.build_v1alpha()?);
        // The probe port reflects only what it serves: health.
        let mut probe_routes = probe_routes;
        if probe.is_some() {
            let health_only = || {
                tonic_reflection::server::Builder::configure()
                    .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                    .with_service_name("grpc.health.v1.Health")
            };
            probe_routes.add_service(health_only().build_v1()?);
            probe_routes.add_service(health_only().build_v1alpha()?);
        }
        set_all(&health, &service_names, ServingStatus::Serving).await;

        let draining = async {
            shutdown.await;
            set_all(&health, &service_names, ServingStatus::NotServing).await;
        };
        let mut routes = routes.routes();
        let mut probe_routes = probe_routes.routes();
        let http1 = !metrics.is_empty();
        if http1 {
            let all: std::sync::Arc<dyn crate::prometheus::Render> =
                std::sync::Arc::new(crate::prometheus::All(metrics));
            let router = routes.into_axum_router().merge(crate::prometheus::router(all.clone()));
            routes = tonic::service::Routes::from(router);
            let router = probe_routes.into_axum_router().merge(crate::prometheus::router(all));
            probe_routes = tonic::service::Routes::from(router);
        }
        // The probe port outlives the API port's drain (it reports NOT_SERVING meanwhile) and
        // stops when this returns, however it returns.
        let _probe = probe.map(|listener| {
            let server = tonic::transport::Server::builder()
                .accept_http1(http1)
                .add_routes(probe_routes)
                .serve_with_incoming(TcpListenerStream::new(listener));
            AbortOnDrop(tokio::spawn(async move {
                if let Err(e) = server.await {
                    tracing::warn!(error = %e, "probe port");
                }
            }))
        });
        let mut server = tonic::transport::Server::builder();
        if bulk {
            server = server
                .initial_stream_window_size(BULK_STREAM_WINDOW)
                .initial_connection_window_size(BULK_CONNECTION_WINDOW)
                .max_frame_size(BULK_FRAME_SIZE)
                .tcp_nodelay(true);
        }
        let server = server.accept_http1(http1).layer(gate).add_routes(routes);
        // Each way of serving is boxed: three servers' state inline would make every caller's
        // future large.
        if let Some(tls) = crate::tls::current() {
            let conns = crate::tls::accept(tls, listener, crate::tls::Callers::Roles(callers));
            let incoming = ReceiverStream::new(conns).filter_map(move |(conn, _remote)| {
                if let Some(side) = side.as_ref().filter(|_| crate::tls::is_data_channel(&conn)) {
                    (side.handler)(crate::side_channel::Conn::Tls(Box::new(conn)));
                    None
                } else {
                    Some(Ok::<_, std::io::Error>(conn))
                }
            });
            Box::pin(server.serve_with_incoming_shutdown(incoming, draining)).await?;
        } else if let Some(side) = side {
            let incoming = crate::side_channel::split(listener, side);
            Box::pin(server.serve_with_incoming_shutdown(incoming, draining)).await?;
        } else {
            let incoming = TcpListenerStream::new(listener);
            Box::pin(server.serve_with_incoming_shutdown(incoming, draining)).await?;
        }
        Ok(())
    }
}

/// The ports a host serves: its API and, if asked for, a plaintext probe port.
pub struct Ports {
    /// The gRPC API (and `/metrics`, and a side channel if the host has one).
    pub grpc: TcpListener,
    /// Health and `/metrics` only, in plaintext ([`ProbeArgs`]).
    pub probe: Option<TcpListener>,
}

impl From<TcpListener> for Ports {
    fn from(grpc: TcpListener) -> Self {
        Self { grpc, probe: None }
    }
}

/// The probe port's flag, which every service binary takes.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ProbeArgs {
    /// A plaintext port (HOST:PORT) serving only health checks (`grpc.health.v1.Health`, the
    /// API's statuses) and `GET /metrics`: for kubelet probes and Prometheus, which cannot
    /// present the client certificate the API port wants under mutual TLS. Off by default.
    #[arg(long = "probe-listen", env = "FERRY_PROBE_LISTEN")]
    pub probe_listen: Option<String>,
}

impl ProbeArgs {
    /// Checks the address's form, binding nothing.
    pub fn validate(&self) -> Result<(), crate::address::AddressError> {
        match &self.probe_listen {
            Some(addr) => crate::address::listen_address("probe-listen", addr),
            None => Ok(()),
        }
    }

    /// Binds the probe port, if asked for, and announces it as `probe=ADDR`.
    pub async fn bind(&self, program: &str) -> Result<Option<TcpListener>, BindError> {
        let Some(addr) = &self.probe_listen else { return Ok(None) };
        let (listener, local) = bind(addr).await?;
        announce(program, "probe", local);
        Ok(Some(listener))
    }
}

/// A task aborted when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reports a host's services `NOT_SERVING` ahead of its shutdown ([`GrpcHost::health_switch`]).
#[derive(Clone)]
pub struct HealthSwitch {
    health: HealthReporter,
    names: Vec<&'static str>,
}

impl HealthSwitch {
    /// Every hosted service (and the "" entry) reports `NOT_SERVING` from now on.
    pub async fn not_serving(&self) {
        set_all(&self.health, &self.names, ServingStatus::NotServing).await;
    }
}

async fn set_all(health: &HealthReporter, names: &[&'static str], status: ServingStatus) {
    health.set_service_status("", status).await;
    for name in names {
        health.set_service_status(*name, status).await;
    }
}

/// A listen address that could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr:?} (expected HOST:PORT; port 0 picks a free port)")]
pub struct BindError {
    /// The address as given.
    pub addr: String,
    /// Why binding failed.
    #[source]
    pub source: std::io::Error,
}

/// Binds a TCP listener (port 0 picks a free port) and returns it with its actual address.
pub async fn bind(addr: &str) -> Result<(TcpListener, SocketAddr), BindError> {
    let wrap = |source| BindError { addr: addr.to_string(), source };
    let listener = TcpListener::bind(addr).await.map_err(wrap)?;
    let local = listener.local_addr().map_err(wrap)?;
    Ok((listener, local))
}

/// Prints the line that tells a supervisor (or a test) where a server listens:
/// `<program> listening <kind>=<addr>`, on stdout, flushed.
pub fn announce(program: &str, kind: &str, addr: SocketAddr) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{program} listening {kind}={addr}");
    let _ = out.flush();
}

/// vLLM's `--host` and `--port` for the OpenAI HTTP API, beside Ferry's `--http-listen`, so a
/// vLLM command line moves over unchanged. No environment variables: Kubernetes sets
/// `<SERVICE>_PORT` for every service, and a service named `ferry` would set `FERRY_PORT`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct HostPortArgs {
    /// Host of the OpenAI HTTP API (vLLM's flag); replaces --http-listen's host.
    #[arg(long)]
    pub host: Option<String>,
    /// Port of the OpenAI HTTP API (vLLM's flag); replaces --http-listen's port.
    #[arg(long)]
    pub port: Option<u16>,
}

impl HostPortArgs {
    /// `http_listen` with `--host` and `--port` put in where given.
    pub fn http_listen(&self, http_listen: &str) -> String {
        if self.host.is_none() && self.port.is_none() {
            return http_listen.to_string();
        }
        let (host, port) = http_listen.rsplit_once(':').unwrap_or((http_listen, "8000"));
        let host = self.host.as_deref().unwrap_or(host);
        let port = self.port.map_or_else(|| port.to_string(), |p| p.to_string());
        // An IPv6 address given bare gets its brackets.
        if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        }
    }
}

#[cfg(test)]
mod host_port_tests {
    use super::HostPortArgs;

    #[test]
    fn host_and_port_replace_their_part_of_the_listen_address() {
        let hp = |host: Option<&str>, port: Option<u16>| HostPortArgs {
            host: host.map(str::to_string),
            port,
        };
        assert_eq!(hp(None, None).http_listen("127.0.0.1:8000"), "127.0.0.1:8000");
        assert_eq!(hp(Some("0.0.0.0"), None).http_listen("127.0.0.1:8000"), "0.0.0.0:8000");
        assert_eq!(hp(None, Some(9000)).http_listen("127.0.0.1:8000"), "127.0.0.1:9000");
        assert_eq!(hp(Some("::"), Some(1)).http_listen("127.0.0.1:8000"), "[::]:1");
        assert_eq!(hp(Some("[::1]"), None).http_listen("[::]:8000"), "[::1]:8000");
    }
}
