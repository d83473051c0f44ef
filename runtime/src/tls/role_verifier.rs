//! The check that a caller may use a port: its certificate chains to the CA and holds one of
//! the port's roles (a DNS name, see [`Role`]). It runs inside the handshake, so a refused
//! client is told why at once rather than seeing its first call fail.

use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::CertificateDer;

use super::Role;

/// Checks a client's chain, then that it holds a role allowed on the port.
#[derive(Debug)]
pub(super) struct RoleVerifier {
    pub(super) chain: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    pub(super) allowed: &'static [Role],
}

/// A client certificate that chains to the CA but names no role allowed on the port.
#[derive(thiserror::Error)]
#[error("the client certificate names none of the roles allowed on this port ({0})")]
struct RoleRefused(String);

impl std::fmt::Debug for RoleRefused {
    // rustls shows its `Other` errors with `Debug`: say it in words.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

impl rustls::server::danger::ClientCertVerifier for RoleVerifier {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.chain.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let verified = self.chain.verify_client_cert(end_entity, intermediates, now)?;
        if holds_role(end_entity, self.allowed).is_some() {
            return Ok(verified);
        }
        let names: Vec<_> = self.allowed.iter().map(|r| r.dns_name()).collect();
        let refused = RoleRefused(names.join(", "));
        Err(rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
            Arc::new(refused),
        ))))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.chain.supported_verify_schemes()
    }
}

/// The role a certificate holds among `allowed`, if any.
pub(super) fn holds_role(cert: &CertificateDer<'_>, allowed: &[Role]) -> Option<Role> {
    let cert = webpki::EndEntityCert::try_from(cert).ok()?;
    allowed
        .iter()
        .copied()
        .find(|role| cert.verify_is_valid_for_subject_name(&role.server_name()).is_ok())
}
