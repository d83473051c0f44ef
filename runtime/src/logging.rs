//! Log set-up for binaries: `tracing` events to stderr, filtered by a directive string
//! (`FERRY_LOG`, same syntax as `RUST_LOG`).

use tracing_subscriber::{fmt, EnvFilter};

/// Installs the global `tracing` subscriber. `filter` is an `EnvFilter` directive such as
/// `info` or `ferry_scheduler=debug,info`. Calling it twice is harmless (the second call is
/// ignored), which keeps in-process tests simple.
pub fn init(filter: &str) -> Result<(), String> {
    let filter =
        EnvFilter::try_new(filter).map_err(|e| format!("invalid log filter {filter:?}: {e}"))?;
    let _ = fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    Ok(())
}
