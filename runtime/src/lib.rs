//! Plumbing that every Ferry binary shares, so each `main` stays thin: hosting gRPC services
//! with the standard health service and reflection (v1 and v1alpha), waiting for SIGTERM or
//! Ctrl-C, and setting up logs.
//!
//! Servers here take a bound `TcpListener` and a shutdown future, never a fixed port or a
//! global, so tests start them on port 0.

pub mod backoff;
pub mod check;
pub mod clock;
pub mod cluster;
pub mod grpc;
pub mod logging;
pub mod metrics;
pub mod secret;
pub mod shutdown;
pub mod side_channel;
pub mod telemetry;
pub mod tls;

pub use backoff::Backoff;
pub use grpc::{GrpcHost, HostError};
pub use shutdown::{bounded_drain, shutdown_signal, DrainArgs};
