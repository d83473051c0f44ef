//! The flags every Ferry service binary takes, in one struct each binary flattens into its
//! command line: logs, tracing, mutual TLS, the plaintext probe port, the drain's timeout and
//! `--check-config`. One definition means one spelling, one set of defaults and one set of
//! checks for `ferry-scheduler`, `ferry-executor`, `ferry-kv` and `ferry serve`.

use std::time::Duration;

use crate::check::CheckArgs;
use crate::grpc::ProbeArgs;
use crate::logging::LogArgs;
use crate::shutdown::DrainArgs;
use crate::telemetry::{Telemetry, TraceArgs};
use crate::tls::TlsArgs;

/// The flags every service binary shares.
#[derive(Clone, Debug, clap::Args)]
pub struct ServiceFlags {
    /// Log filter and format.
    #[command(flatten)]
    pub log: LogArgs,
    /// Tracing (OTLP).
    #[command(flatten)]
    pub trace: TraceArgs,
    /// Mutual TLS between services.
    #[command(flatten)]
    pub tls: TlsArgs,
    /// The plaintext probe port.
    #[command(flatten)]
    pub probe: ProbeArgs,
    /// How long the drain may take.
    #[command(flatten)]
    pub drain: DrainArgs,
    /// `--check-config`.
    #[command(flatten)]
    pub check: CheckArgs,
}

/// A shared flag that the service will not start with; the message names the flag.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ServiceFlagError(String);

impl ServiceFlags {
    /// Checks every shared flag, with the service's listen addresses (`(flag, value)`: TLS
    /// must cover every one reachable from other machines), and returns the drain's timeout.
    pub fn validate(&self, listen: &[(&'static str, &str)]) -> Result<Duration, ServiceFlagError> {
        let err = |e: &dyn std::fmt::Display| ServiceFlagError(e.to_string());
        for &(flag, value) in listen {
            crate::address::listen_address(flag, value).map_err(|e| err(&e))?;
        }
        self.log.validate().map_err(|e| err(&e))?;
        self.trace.validate().map_err(|e| err(&e))?;
        self.tls.validate(listen).map_err(|e| err(&e))?;
        self.probe.validate().map_err(|e| err(&e))?;
        self.drain.timeout().map_err(|e| err(&e))
    }

    /// Starts logs, tracing (as `service`) and TLS. Keep the returned handle for the life of
    /// the process: dropping it flushes and stops tracing.
    pub fn start(&self, service: &'static str) -> Result<Telemetry, ServiceFlagError> {
        let err = |e: &dyn std::fmt::Display| ServiceFlagError(e.to_string());
        self.log.init().map_err(|e| err(&e))?;
        let telemetry = self.trace.init(service).map_err(|e| err(&e))?;
        crate::tls::start(&self.tls).map_err(|e| err(&e))?;
        Ok(telemetry)
    }
}
