//! `canopy authority`: a device authority's key, and the certificates it
//! makes of devices' enrolled keys.
//!
//! In a secure round the server relays each device's enrolled key to its
//! neighbours; a device that pins the authority takes a key only with the
//! authority's certificate, so the server cannot substitute keys (see
//! `docs/secure-aggregation.md`). That holds only while the server cannot
//! read the authority's key: keep it on another machine, and hand the
//! server (`--device-authority`) and the apps only its public key.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use canopy_protocol::device_cert::DeviceAuthority;
use clap::Args;

use crate::files::{self, Hint};

/// The key file: 64 hex digits and a newline.
const KEY_FILE_BYTES: u64 = 65;
/// Owner read/write only: the key is a secret.
const KEY_FILE_MODE: u32 = 0o600;

#[derive(Args)]
pub struct NewArgs {
    /// Where to write the authority's secret key (mode 0600).
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing key file (certificates it made stop holding).
    #[arg(long)]
    force: bool,
}

#[derive(Args)]
pub struct CertifyArgs {
    /// The authority's key file, from `canopy authority new`.
    #[arg(long)]
    key: PathBuf,
    /// The device's id, as `canopy device ls` shows it.
    #[arg(long)]
    device: u64,
    /// The device's enrolled public key (64 hex digits, `canopy device ls --json`).
    #[arg(long)]
    device_key: String,
}

/// Makes a key and prints its public half.
pub fn new(args: NewArgs) -> Result<()> {
    if args.out.exists() && !args.force {
        return Err(Hint::attach(
            anyhow::anyhow!("`{}` already exists", args.out.display()),
            "pass --force to replace it; devices certified by the old key must be certified again",
        ));
    }
    let authority = DeviceAuthority::generate();
    let text = format!("{}\n", hex::encode(authority.to_bytes()));
    files::write_atomic(&args.out, text.as_bytes(), KEY_FILE_MODE)
        .with_context(|| format!("cannot write the key file `{}`", args.out.display()))?;
    crate::output::outln!("{}", authority.public_key_hex())?;
    Ok(())
}

/// Prints the certificate of one device's id and key, as hex.
pub fn certify(args: CertifyArgs) -> Result<()> {
    let authority = read_key(&args.key)?;
    let device_key =
        canopy_protocol::auth::parse_public_key_hex(&args.device_key).map_err(|cause| {
            Hint::attach(
                anyhow::anyhow!("--device-key is not an Ed25519 public key: {cause}"),
                "give the 64 hex digits of `public_key` from `canopy device ls --json`",
            )
        })?;
    let certificate = authority.certify(args.device, &device_key);
    crate::output::outln!("{}", hex::encode(certificate))?;
    Ok(())
}

fn read_key(path: &Path) -> Result<DeviceAuthority> {
    let bytes = files::read_bounded(path, KEY_FILE_BYTES)
        .with_context(|| format!("cannot read the authority key `{}`", path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    let mut secret = [0u8; 32];
    if hex::decode_to_slice(text.trim_end(), &mut secret).is_err() {
        bail!(
            "`{}` is not an authority key: expected 64 hex digits",
            path.display()
        );
    }
    Ok(DeviceAuthority::from_bytes(&secret))
}
