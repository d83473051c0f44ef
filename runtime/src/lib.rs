//! Plumbing that every Ferry binary shares, so each `main` stays thin: hosting gRPC services
//! with the standard health service and reflection (v1 and v1alpha), waiting for SIGTERM or
//! Ctrl-C, and setting up logs.
//!
//! Servers here take a bound `TcpListener` and a shutdown future, never a fixed port or a
//! global, so tests start them on port 0.

pub mod address;
pub mod backoff;
pub mod call_gate;
pub mod check;
pub mod clock;
pub mod cluster;
pub mod grpc;
pub mod logging;
pub mod prometheus;
pub mod secret;
pub mod service_flags;
pub mod shutdown;
pub mod side_channel;
pub mod telemetry;
pub mod tls;

pub use backoff::Backoff;
pub use service_flags::ServiceFlags;

/// An error and its sources on one line, `: `-separated (tonic's transport errors say only
/// "transport error", libloading's "dlopen failed": the reason is in the chain).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
pub use grpc::{GrpcHost, HostError};
pub use shutdown::{bounded_drain, shutdown_signal, when_set, DrainArgs, Shutdown};
