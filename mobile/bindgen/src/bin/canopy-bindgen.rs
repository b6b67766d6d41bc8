//! `canopy-bindgen --library target/release/libcanopy_mobile.so --out-dir bindings [--language kotlin ...]`:
//! the bindings of every language (or those named), one folder each.

use std::path::PathBuf;

use anyhow::Result;
use canopy_bindgen::{Language, generate};
use clap::Parser;

#[derive(Parser)]
#[command(about = "Generates canopy-mobile's Kotlin, Swift, Python and C bindings")]
struct Args {
    /// The built cdylib: target/release/libcanopy_mobile.so (.dylib on macOS).
    #[arg(long)]
    library: PathBuf,
    /// Where to write: one folder per language.
    #[arg(long)]
    out_dir: PathBuf,
    /// Languages to generate; all by default.
    #[arg(long, value_enum)]
    language: Vec<Language>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let languages = if args.language.is_empty() {
        Language::ALL.to_vec()
    } else {
        args.language
    };
    for language in languages {
        let dir = args.out_dir.join(format!("{language:?}").to_lowercase());
        generate(language, &args.library, &dir)?;
        println!("{language:?}: {}", dir.display());
    }
    Ok(())
}
