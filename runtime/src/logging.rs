//! Log set-up for binaries: `tracing` events to stderr, filtered by a directive string
//! (`--log` / `FERRY_LOG`, same syntax as `RUST_LOG`), as text (colored only on a terminal) or
//! as one JSON object per line (`--log-format json`) for log shippers.

use std::io::IsTerminal;

use tracing_subscriber::{fmt, EnvFilter};

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per event, with its fields and span context.
    Json,
}

/// The logging flags every binary takes.
#[derive(Clone, Debug, clap::Args)]
pub struct LogArgs {
    /// Log filter (`RUST_LOG` syntax).
    #[arg(long, env = "FERRY_LOG", default_value = "info")]
    pub log: String,
    /// Log line format.
    #[arg(long = "log-format", env = "FERRY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl LogArgs {
    /// Checks the filter without installing anything.
    pub fn validate(&self) -> Result<(), String> {
        EnvFilter::try_new(&self.log)
            .map(drop)
            .map_err(|e| format!("invalid log filter {:?}: {e}", self.log))
    }

    /// Installs the global subscriber these flags describe.
    pub fn init(&self) -> Result<(), String> {
        init_with(&self.log, self.log_format)
    }
}

/// Installs the global `tracing` subscriber with text lines. `filter` is an `EnvFilter`
/// directive such as `info` or `ferry_scheduler=debug,info`. Calling it twice is harmless (the
/// second call is ignored), which keeps in-process tests simple.
pub fn init(filter: &str) -> Result<(), String> {
    init_with(filter, LogFormat::Text)
}

/// [`init`] with a chosen format.
pub fn init_with(filter: &str, format: LogFormat) -> Result<(), String> {
    let filter =
        EnvFilter::try_new(filter).map_err(|e| format!("invalid log filter {filter:?}: {e}"))?;
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).try_init(),
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
    };
    Ok(())
}
