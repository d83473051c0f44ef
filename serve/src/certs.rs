//! `ferry certs`: a private CA and one certificate per role, for mutual TLS between Ferry's
//! services (see `ferry_runtime::tls`), in a directory:
//!
//! - `ca.pem` (every service's `--tls-ca`) and `ca.key` (keep it elsewhere once done);
//! - `<role>.pem` and `<role>.key` for `front`, `scheduler`, `executor`, `kv` and `client`
//!   (grpcurl and other tools), each naming its role (`ferry-<role>`);
//! - `serve.pem` / `serve.key`, naming every role, for `ferry serve`;
//! - `etcd.pem` / `etcd.key` for etcd's members (server and client use).
//!
//! Every certificate also names `localhost`, `127.0.0.1`, `::1` and each `--hosts` entry, so
//! tools that check addresses (curl, grpcurl, etcd) accept them. For production, issue the
//! same names from your own CA (cert-manager, Vault): Ferry needs nothing else.

use std::path::{Path, PathBuf};

use anyhow::Context;
use ferry_runtime::tls::Role;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// The flags of `ferry certs`.
#[derive(Clone, Debug, clap::Args)]
pub struct CertsArgs {
    /// The directory to write into (created if missing; it must not already hold a CA).
    #[arg(long)]
    pub out: PathBuf,
    /// More names (DNS names or IP addresses) every certificate carries.
    #[arg(long, value_delimiter = ',')]
    pub hosts: Vec<String>,
    /// Days the certificates are valid.
    #[arg(long, default_value_t = 365)]
    pub days: u32,
}

/// The file stems of the role certificates and the roles each names.
const SETS: [(&str, &[Role]); 7] = [
    ("front", &[Role::Front]),
    ("scheduler", &[Role::Scheduler]),
    ("executor", &[Role::Executor]),
    ("kv", &[Role::KvAgent]),
    ("client", &[Role::Client]),
    ("serve", &Role::ALL),
    ("etcd", &[]),
];

/// Writes the CA and the certificates; returns the files written.
pub fn run(args: &CertsArgs) -> anyhow::Result<Vec<PathBuf>> {
    anyhow::ensure!((1..=3650).contains(&args.days), "--days must be between 1 and 3650");
    for host in &args.hosts {
        anyhow::ensure!(
            !host.is_empty() && !host.contains(char::is_whitespace),
            "--hosts {host:?} is not a host name or address"
        );
    }
    anyhow::ensure!(
        !args.out.join("ca.pem").exists(),
        "{} already holds a CA (ca.pem): choose another --out or remove it",
        args.out.display()
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let now = time::OffsetDateTime::now_utc();
    let validity = |p: &mut CertificateParams| {
        p.not_before = now - time::Duration::hours(1);
        p.not_after = now + time::Duration::days(i64::from(args.days));
    };

    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(DnType::CommonName, "Ferry CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut ca);
    let ca_cert = ca.self_signed(&ca_key)?;
    let mut written = vec![
        write(&args.out, "ca.pem", &ca_cert.pem(), false)?,
        write(&args.out, "ca.key", &ca_key.serialize_pem(), true)?,
    ];
    let issuer = Issuer::new(ca, ca_key);

    for (stem, roles) in SETS {
        let mut names: Vec<String> = roles.iter().map(|r| r.dns_name().to_string()).collect();
        names.extend(["localhost", "127.0.0.1", "::1"].map(String::from));
        names.extend(args.hosts.iter().cloned());
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(names)?;
        params.distinguished_name.push(DnType::CommonName, format!("ferry {stem}"));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        validity(&mut params);
        let cert = params.signed_by(&key, &issuer)?;
        written.push(write(&args.out, &format!("{stem}.pem"), &cert.pem(), false)?);
        written.push(write(&args.out, &format!("{stem}.key"), &key.serialize_pem(), true)?);
    }
    Ok(written)
}

/// Writes `text` to `dir/name` (readable by its owner only if `secret`).
fn write(dir: &Path, name: &str, text: &str, secret: bool) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    let path = dir.join(name);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(&path).with_context(|| format!("writing {}", path.display()))?;
    file.write_all(text.as_bytes()).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
