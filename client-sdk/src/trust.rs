//! How a device decides to trust the server's certificate.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};

#[derive(Clone, Debug)]
pub enum Trust {
    /// The SHA-256 of the server's leaf certificate, as printed by
    /// `canopy-server serve --tls self-signed` (`sha256:HEX` or `HEX`).
    PinnedSha256(String),
    /// A PEM file of CA certificates.
    CaFile(PathBuf),
    /// The public web PKI: Mozilla's root program, as compiled into the SDK
    /// by the `webpki-roots` crate, for a server whose certificate comes
    /// from a public CA.
    ///
    /// Compiled in rather than read from the operating system's store
    /// (`rustls-native-certs`) because the SDK runs on phones:
    /// `rustls-native-certs` reads Linux, macOS and Windows stores but not
    /// Android's or iOS's, which only platform APIs reach. Compiled-in
    /// roots behave the same on every device, need no file access at
    /// startup and cannot be widened by a CA that malware or a captive
    /// profile installed. The cost: the set changes with SDK releases, not
    /// OS updates, and a CA that an organisation added to its devices is
    /// not trusted; for a private CA use [`Trust::CaFile`], for a
    /// self-signed server [`Trust::PinnedSha256`].
    SystemRoots,
}

#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("fingerprint `{0}` is not 64 hex digits (optionally prefixed with `sha256:`)")]
    BadFingerprint(String),
    #[error("cannot read CA certificates from {path}: {reason}")]
    CaFile { path: PathBuf, reason: String },
    #[error("cannot build the TLS configuration: {0}")]
    Config(String),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Trust {
    pub fn client_config(&self) -> Result<rustls::ClientConfig, TrustError> {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|error| TrustError::Config(error.to_string()))?;
        let config = match self {
            Trust::PinnedSha256(text) => {
                let hex_digits = text
                    .strip_prefix("sha256:")
                    .unwrap_or(text)
                    .to_ascii_lowercase();
                let pinned: [u8; 32] = hex::decode(&hex_digits)
                    .ok()
                    .and_then(|bytes| bytes.try_into().ok())
                    .ok_or_else(|| TrustError::BadFingerprint(text.clone()))?;
                let verifier = PinnedVerifier {
                    pinned,
                    algorithms: provider().signature_verification_algorithms,
                };
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(verifier))
                    .with_no_client_auth()
            }
            Trust::CaFile(path) => {
                let mut roots = RootCertStore::empty();
                let certs =
                    CertificateDer::pem_file_iter(path).map_err(|error| TrustError::CaFile {
                        path: path.clone(),
                        reason: error.to_string(),
                    })?;
                for cert in certs {
                    let cert = cert.map_err(|error| TrustError::CaFile {
                        path: path.clone(),
                        reason: error.to_string(),
                    })?;
                    roots.add(cert).map_err(|error| TrustError::CaFile {
                        path: path.clone(),
                        reason: error.to_string(),
                    })?;
                }
                builder.with_root_certificates(roots).with_no_client_auth()
            }
            Trust::SystemRoots => {
                let roots: RootCertStore = webpki_roots::TLS_SERVER_ROOTS.iter().cloned().collect();
                builder.with_root_certificates(roots).with_no_client_auth()
            }
        };
        Ok(config)
    }
}

/// The server's certificate is not the pinned one.
#[derive(Debug, thiserror::Error)]
#[error(
    "server certificate sha256:{} does not match the pinned sha256:{}",
    hex::encode(.actual),
    hex::encode(.pinned)
)]
pub struct PinMismatch {
    pub actual: [u8; 32],
    pub pinned: [u8; 32],
}

/// Accepts exactly one certificate, by its SHA-256; the handshake
/// signature is still verified against that certificate's key.
#[derive(Debug)]
struct PinnedVerifier {
    pinned: [u8; 32],
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let actual: [u8; 32] = Sha256::digest(end_entity.as_ref()).into();
        if actual == self.pinned {
            Ok(ServerCertVerified::assertion())
        } else {
            // Typed, so that `ConnectProblem::of` finds it under the
            // request error's causes.
            Err(rustls::Error::Other(rustls::OtherError(Arc::new(
                PinMismatch {
                    actual,
                    pinned: self.pinned,
                },
            ))))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_trust_builds_a_configuration_on_ring() {
        let pinned = Trust::PinnedSha256(format!("sha256:{}", "ab".repeat(32)));
        for trust in [pinned, Trust::SystemRoots] {
            let config = trust.client_config().expect("config");
            assert!(
                config.crypto_provider().cipher_suites.len() > 1,
                "{trust:?}"
            );
        }
        assert!(!webpki_roots::TLS_SERVER_ROOTS.is_empty());
        assert!(matches!(
            Trust::PinnedSha256("12".to_string()).client_config(),
            Err(TrustError::BadFingerprint(_))
        ));
        assert!(matches!(
            Trust::CaFile(PathBuf::from("/nonexistent/ca.pem")).client_config(),
            Err(TrustError::CaFile { .. })
        ));
    }
}
