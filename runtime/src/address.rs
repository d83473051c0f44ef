//! What an address flag may hold, checked at start-up so a typo fails before anything binds or
//! dials: an address a service listens on (`--listen`, `--probe-listen`), and an address it
//! dials (`--etcd-endpoints`, `--otlp-endpoint`, `--kv-agent`, …). A leaf: the flag modules
//! that take addresses call it.

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
