//! HTTPS: certificate files, or a development certificate made once and
//! kept in the data directory so that its fingerprint (which devices pin)
//! survives restarts.

use std::path::{Path, PathBuf};

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use sha2::{Digest, Sha256};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot create the development certificate")]
    Generate(#[source] rcgen::Error),
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read a PEM certificate from {path}: {reason}")]
    ReadCert { path: PathBuf, reason: String },
    #[error("cannot load the TLS certificate {cert} and key {key}")]
    Load {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the TLS private key {path}")]
    ReadKey {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the TLS private key {path} can be read by other users (mode {mode:04o}); whoever reads \
         it can impersonate this server"
    )]
    KeyOpenToOthers { path: PathBuf, mode: u32 },
}

impl TlsError {
    /// What the operator can do about it, for the `hint:` line.
    pub fn hint(&self) -> Option<String> {
        match self {
            TlsError::KeyOpenToOthers { path, .. } => Some(format!(
                "run `chmod 600 {}` (and check who else could have read it; if someone could, \
                 replace the key and its certificate)",
                path.display()
            )),
            _ => None,
        }
    }
}

/// Refuses a private key that group or others can access, by the rule
/// of every file the server keeps secrets in (`file_modes`). The key is
/// followed through symbolic links, as the server reads it.
pub fn check_key_private(key: &Path) -> Result<(), TlsError> {
    let meta = std::fs::metadata(key).map_err(|source| TlsError::ReadKey {
        path: key.to_path_buf(),
        source,
    })?;
    match crate::file_modes::open_to_others(&meta) {
        Some(mode) => Err(TlsError::KeyOpenToOthers {
            path: key.to_path_buf(),
            mode,
        }),
        None => Ok(()),
    }
}

/// Installs ring as rustls's crypto provider; harmless when one is set.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Paths of the development certificate and key, created on first use.
pub fn self_signed(
    data_dir: &Path,
    extra_name: Option<String>,
) -> Result<(PathBuf, PathBuf), TlsError> {
    let dir = data_dir.join("tls");
    let cert_path = dir.join("self-signed-cert.pem");
    let key_path = dir.join("self-signed-key.pem");
    if cert_path.exists() && key_path.exists() {
        check_key_private(&key_path)?;
        return Ok((cert_path, key_path));
    }
    let mut names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    names.extend(extra_name);
    let certified = rcgen::generate_simple_self_signed(names).map_err(TlsError::Generate)?;
    crate::file_modes::create_private_dir_all(&dir).map_err(|source| TlsError::Write {
        path: dir.clone(),
        source,
    })?;
    write_private(&key_path, certified.signing_key.serialize_pem().as_bytes())?;
    std::fs::write(&cert_path, certified.cert.pem()).map_err(|source| TlsError::Write {
        path: cert_path.clone(),
        source,
    })?;
    Ok((cert_path, key_path))
}

/// Writes a key the server made: 0600 whatever the umask, including over
/// a file left with a wider mode (an interrupted first start).
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), TlsError> {
    use std::io::Write;
    let failed = |source| TlsError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(crate::file_modes::PRIVATE_FILE_MODE);
    }
    let mut file = options.open(path).map_err(failed)?;
    crate::file_modes::make_private(path).map_err(failed)?;
    file.write_all(bytes).map_err(failed)
}

/// SHA-256 of the leaf certificate's DER, as `sha256:HEX`.
pub fn fingerprint(cert_path: &Path) -> Result<String, TlsError> {
    let cert = CertificateDer::from_pem_file(cert_path).map_err(|error| TlsError::ReadCert {
        path: cert_path.to_path_buf(),
        reason: error.to_string(),
    })?;
    Ok(format!(
        "sha256:{}",
        hex::encode(Sha256::digest(cert.as_ref()))
    ))
}
