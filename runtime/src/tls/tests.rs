//! The flags' checks, reading and reloading the files, and what a certificate's role is.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::CertificateDer;

use super::role_verifier::holds_role;
use super::*;

fn args(cert: bool, plaintext: bool) -> TlsArgs {
    let p = |s: &str| cert.then(|| PathBuf::from(s));
    TlsArgs { cert: p("c.pem"), key: p("k.pem"), ca: p("ca.pem"), plaintext }
}

#[test]
fn plaintext_only_on_loopback_unless_asked() {
    let lo = [("listen", "127.0.0.1:0"), ("http-listen", "localhost:8000")];
    let wide = [("listen", "127.0.0.1:0"), ("http-listen", "0.0.0.0:8000")];
    assert!(args(false, false).validate(&lo).is_ok());
    assert!(args(false, false).validate(&[("listen", "[::1]:1")]).is_ok());
    let err = args(false, false).validate(&wide).unwrap_err().to_string();
    assert!(err.contains("--http-listen 0.0.0.0:8000") && err.contains("--plaintext"), "{err}");
    assert!(args(false, true).validate(&wide).is_ok());
    assert!(args(true, false).validate(&wide).is_ok());
    assert!(matches!(args(true, true).validate(&lo), Err(TlsError::Contradiction)));
    let partial = TlsArgs { cert: Some("c.pem".into()), ..TlsArgs::default() };
    assert!(matches!(partial.validate(&lo), Err(TlsError::Partial)));
}

/// Writes a CA and a certificate for `names` signed by it into `dir` (`cert.pem`,
/// `key.pem`, `ca.pem`); returns the key's PEM.
fn write_set(dir: &Path, names: &[&str]) -> String {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|n| (*n).to_string()).collect();
    let cert = rcgen::CertificateParams::new(names).unwrap().signed_by(&key, &issuer).unwrap();
    std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
    std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    key.serialize_pem()
}

#[test]
fn a_changed_set_is_used_and_a_broken_one_is_not() {
    let dir = std::env::temp_dir().join(format!("ferry-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_set(&dir, &["ferry-kv"]);
    let args = TlsArgs {
        cert: Some(dir.join("cert.pem")),
        key: Some(dir.join("key.pem")),
        ca: Some(dir.join("ca.pem")),
        plaintext: false,
    };
    let tls = args.load().unwrap().expect("TLS on");
    let first = tls.configs();
    assert!(!tls.reload_if_changed(), "nothing changed");
    assert!(Arc::ptr_eq(&first, &tls.configs()));

    // A key that is not the certificate's: refused, the first set stays in use.
    let other = tempfile_key(&dir);
    std::fs::write(dir.join("key.pem"), other).unwrap();
    assert!(!tls.reload_if_changed(), "a mismatched key was taken");
    assert!(Arc::ptr_eq(&first, &tls.configs()));

    // A whole new valid set: used from now on.
    write_set(&dir, &["ferry-kv"]);
    assert!(tls.reload_if_changed(), "a valid new set was not taken");
    assert!(!Arc::ptr_eq(&first, &tls.configs()));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The key of a fresh, unrelated set (written to a side directory).
fn tempfile_key(dir: &Path) -> String {
    let side = dir.join("side");
    std::fs::create_dir_all(&side).unwrap();
    write_set(&side, &["ferry-kv"])
}

#[test]
fn a_role_is_a_dns_name_of_the_certificate() {
    let dir = std::env::temp_dir().join(format!("ferry-tls-role-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_set(&dir, &["ferry-executor", "node-a"]);
    let pem = std::fs::read(dir.join("cert.pem")).unwrap();
    let cert = CertificateDer::from_pem_slice(&pem).unwrap();
    assert_eq!(holds_role(&cert, &Role::ALL), Some(Role::Executor));
    assert_eq!(holds_role(&cert, EXECUTOR_CALLERS), None, "an executor may not drive one");
    assert_eq!(holds_role(&cert, AGENT_CALLERS), Some(Role::Executor));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_files_are_named() {
    let err = args(true, false).load().err().expect("no such files").to_string();
    assert!(err.starts_with("--tls-cert c.pem"), "{err}");
}
