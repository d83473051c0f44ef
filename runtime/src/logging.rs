//! Log set-up for binaries: `tracing` events to stderr, filtered by a directive string
//! (`--log` / `FERRY_LOG`, same syntax as `RUST_LOG`), as text (colored only on a terminal) or
//! as one JSON object per line (`--log-format json`) for log shippers.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    /// A file holding the log filter (`RUST_LOG` syntax), read at start and again whenever it
    /// changes (checked every 2 s): a filter there replaces `--log`, an empty file restores it,
    /// a bad one is logged and ignored. A Kubernetes `ConfigMap` mounted as a volume changes it
    /// without restarting the pod (the Helm chart's `log.level`).
    #[arg(long = "log-filter-file", env = "FERRY_LOG_FILTER_FILE")]
    pub log_filter_file: Option<PathBuf>,
}

impl LogArgs {
    /// Checks the filter without installing anything.
    pub fn validate(&self) -> Result<(), String> {
        EnvFilter::try_new(&self.log)
            .map(drop)
            .map_err(|e| format!("invalid log filter {:?}: {e}", self.log))
    }

    /// Installs the global subscriber these flags describe (and, with `--log-filter-file`, the
    /// thread that follows the file).
    pub fn init(&self) -> Result<(), String> {
        let Some(path) = &self.log_filter_file else {
            return init_with(&self.log, self.log_format);
        };
        let from_file = read_filter(path);
        let first = from_file.as_deref().filter(|f| EnvFilter::try_new(f).is_ok());
        let reload = install(first.unwrap_or(&self.log), self.log_format)?;
        if let Some(reload) = reload {
            let watch = FilterFile { path: path.clone(), fallback: self.log.clone(), reload };
            let applied = first.map_or_else(|| self.log.clone(), str::to_string);
            std::thread::Builder::new()
                .name("log-filter-file".into())
                .spawn(move || watch.follow(applied, from_file))
                .map_err(|e| format!("--log-filter-file: starting its thread: {e}"))?;
        }
        Ok(())
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
    install(filter, format).map(drop)
}

/// Replaces the installed subscriber's filter.
type Reload = Box<dyn Fn(EnvFilter) -> Result<(), String> + Send>;

/// Installs the subscriber; returns how to change its filter (`None` if one was installed
/// already).
fn install(filter: &str, format: LogFormat) -> Result<Option<Reload>, String> {
    let filter =
        EnvFilter::try_new(filter).map_err(|e| format!("invalid log filter {filter:?}: {e}"))?;
    let base = fmt().with_writer(std::io::stderr);
    let (installed, reload): (bool, Reload) = match format {
        LogFormat::Text => {
            let builder = base
                .with_ansi(std::io::stderr().is_terminal())
                .with_env_filter(filter)
                .with_filter_reloading();
            let handle = builder.reload_handle();
            (
                builder.try_init().is_ok(),
                Box::new(move |f| handle.reload(f).map_err(|e| e.to_string())),
            )
        }
        LogFormat::Json => {
            let builder =
                base.json().with_current_span(true).with_env_filter(filter).with_filter_reloading();
            let handle = builder.reload_handle();
            (
                builder.try_init().is_ok(),
                Box::new(move |f| handle.reload(f).map_err(|e| e.to_string())),
            )
        }
    };
    Ok(installed.then_some(reload))
}

/// The file's filter, trimmed (`None`: unreadable or empty).
fn read_filter(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let filter = text.trim();
    (!filter.is_empty()).then(|| filter.to_string())
}

/// `--log-filter-file`, followed.
struct FilterFile {
    path: PathBuf,
    fallback: String,
    reload: Reload,
}

impl FilterFile {
    /// Every 2 s, [`Self::poll`].
    fn follow(self, mut applied: String, mut seen: Option<String>) {
        loop {
            std::thread::sleep(Duration::from_secs(2));
            self.poll(&mut applied, &mut seen);
        }
    }

    /// When the file's content differs from what was last `seen`, applies its filter (`--log`
    /// when empty or unreadable) unless it is the one `applied`; a bad one is reported once and
    /// the filter kept.
    fn poll(&self, applied: &mut String, seen: &mut Option<String>) {
        let now = read_filter(&self.path);
        if now == *seen {
            return;
        }
        seen.clone_from(&now);
        let wanted = now.unwrap_or_else(|| self.fallback.clone());
        if wanted == *applied {
            return;
        }
        let file = self.path.display();
        let result = EnvFilter::try_new(&wanted).map_err(|e| e.to_string()).and_then(&self.reload);
        if let Err(e) = result {
            tracing::warn!(filter = %wanted, error = %e, %file, "log filter file: ignored");
            return;
        }
        tracing::info!(from = %applied, to = %wanted, %file, "log filter changed");
        *applied = wanted;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// The file's filter is applied when it changes, a bad one is ignored (the filter kept), an
    /// emptied file restores `--log`, and an unchanged file applies nothing again.
    #[test]
    fn the_filter_file_is_followed() {
        let dir = std::env::temp_dir().join(format!("ferry-log-filter-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("filter");
        let applied_filters = Arc::new(Mutex::new(Vec::new()));
        let record = applied_filters.clone();
        let watch = FilterFile {
            path: path.clone(),
            fallback: "info".into(),
            reload: Box::new(move |f| {
                record.lock().unwrap().push(f.to_string());
                Ok(())
            }),
        };
        let (mut applied, mut seen) = ("info".to_string(), None);
        let mut write_and_poll = |text: &str| {
            std::fs::write(&path, text).unwrap();
            watch.poll(&mut applied, &mut seen);
            applied.clone()
        };
        assert_eq!(write_and_poll("ferry_runtime=debug,warn\n"), "ferry_runtime=debug,warn");
        assert_eq!(write_and_poll("ferry_runtime=debug,warn"), "ferry_runtime=debug,warn");
        assert_eq!(write_and_poll("[not a filter"), "ferry_runtime=debug,warn");
        assert_eq!(write_and_poll(""), "info");
        let got = applied_filters.lock().unwrap().clone();
        assert_eq!(got, ["ferry_runtime=debug,warn", "info"], "each change applied once");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
