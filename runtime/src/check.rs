//! `--check-config`: a dry run that parses and checks every flag as the service would, prints
//! `<program>: configuration ok` and exits, without binding a port, reading a model or
//! reaching etcd. Deployment tooling runs each rendered container's command line through it
//! (the Helm chart's tests do), so a flag the binary would refuse fails before anything starts.

/// The dry-run flag every binary takes.
#[derive(Clone, Copy, Debug, Default, clap::Args)]
pub struct CheckArgs {
    /// Check the flags and exit (0 and `configuration ok`, or an error naming the flag):
    /// nothing is bound, loaded or contacted.
    #[arg(long = "check-config")]
    pub check_config: bool,
}

impl CheckArgs {
    /// Call once every flag is checked: with `--check-config`, prints `<program>:
    /// configuration ok` and returns true (the caller exits); otherwise returns false.
    pub fn dry_run_done(&self, program: &str) -> bool {
        if self.check_config {
            println!("{program}: configuration ok");
        }
        self.check_config
    }
}

/// The checks of the flags every binary shares: its listen addresses (`(flag, value)`), the
/// log filter and the tracing flags.
pub fn shared_flags(
    listen: &[(&'static str, &str)],
    log: &crate::logging::LogArgs,
    trace: &crate::telemetry::TraceArgs,
) -> Result<(), String> {
    for &(flag, value) in listen {
        listen_address(flag, value).map_err(|e| e.to_string())?;
    }
    log.validate()?;
    trace.validate()
}

/// A flag whose value is not an address of the expected form.
#[derive(Debug, thiserror::Error)]
#[error("--{flag} {value:?} is not {expected}")]
pub struct AddressError {
    /// The flag, without dashes.
    pub flag: &'static str,
    /// The value as given.
    pub value: String,
    /// The form expected.
    pub expected: &'static str,
}

/// Checks a listen address: an IP address (or a host name such as `localhost`) and a port
/// (`0.0.0.0:8000`, `[::]:50051`; port 0 picks a free port).
pub fn listen_address(flag: &'static str, value: &str) -> Result<(), AddressError> {
    if value.parse::<std::net::SocketAddr>().is_ok() {
        return Ok(());
    }
    match value.rsplit_once(':') {
        Some((host, port))
            if !host.is_empty()
                && host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.'))
                && port.parse::<u16>().is_ok() =>
        {
            Ok(())
        }
        _ => Err(AddressError {
            flag,
            value: value.to_string(),
            expected: "HOST:PORT (for example 0.0.0.0:8000)",
        }),
    }
}

/// Checks an address other services dial: `host:port` or `http(s)://host:port`, with a
/// non-empty host and a port.
pub fn dial_address(flag: &'static str, value: &str) -> Result<(), AddressError> {
    let bad = || AddressError {
        flag,
        value: value.to_string(),
        expected: "HOST:PORT or http(s)://HOST:PORT",
    };
    let rest = match value.split_once("://") {
        Some(("http" | "https", rest)) => rest,
        Some(_) => return Err(bad()),
        None => value,
    };
    let rest = rest.trim_end_matches('/');
    match rest.rsplit_once(':') {
        Some((host, port))
            if !host.is_empty()
                && !host.contains(['/', ' '])
                && port.parse::<u16>().is_ok_and(|p| p > 0) =>
        {
            Ok(())
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_need_a_host_and_a_port() {
        assert!(listen_address("listen", "0.0.0.0:8000").is_ok());
        assert!(listen_address("listen", "[::]:0").is_ok());
        assert!(listen_address("listen", "localhost:0").is_ok());
        let e = listen_address("listen", "0.0.0.0").unwrap_err();
        assert!(e.to_string().contains("--listen \"0.0.0.0\" is not HOST:PORT"), "{e}");
        assert!(listen_address("listen", "http://0.0.0.0:80").is_err());
        assert!(listen_address("listen", ":80").is_err());
    }

    #[test]
    fn dial_addresses_need_a_host_and_a_port() {
        for ok in ["etcd:2379", "http://etcd-0.etcd:2379", "https://10.0.0.1:443/", "a:1"] {
            assert!(dial_address("x", ok).is_ok(), "{ok}");
        }
        for bad in ["etcd", ":2379", "etcd:0", "ftp://etcd:21", "http://etcd", "a b:1", "etcd:x"] {
            assert!(dial_address("x", bad).is_err(), "{bad}");
        }
    }
}
