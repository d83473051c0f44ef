//! The check that a caller may use a port: its certificate chains to the CA (inside the
//! handshake: another CA or none is refused there) and holds one of the port's roles (a DNS
//! name, see [`Role`]; checked right after the handshake by the accept loop, which answers a
//! gRPC caller of another role `UNAUTHENTICATED` saying which roles the port takes — refused
//! inside the handshake, a client saw only "broken pipe").

use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::CertificateDer;

use super::Role;

/// Checks a client's chain (its role is checked after the handshake: [`role_refusal`]).
#[derive(Debug)]
pub(super) struct RoleVerifier {
    pub(super) chain: Arc<dyn rustls::server::danger::ClientCertVerifier>,
}

/// Why a caller whose certificate is `cert` may not use a port that takes `allowed`, if it
/// may not.
pub(super) fn role_refusal(cert: Option<&CertificateDer<'_>>, allowed: &[Role]) -> Option<String> {
    if cert.is_some_and(|c| holds_role(c, allowed).is_some()) {
        return None;
    }
    let names: Vec<_> = allowed.iter().map(|r| r.dns_name()).collect();
    Some(format!(
        "the client certificate names none of the roles this port takes ({}): present a \
         certificate that names one",
        names.join(", ")
    ))
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
        self.chain.verify_client_cert(end_entity, intermediates, now)
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
