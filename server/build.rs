//! Embeds the SQL migrations (`migrations/sqlite`, `migrations/postgres`)
//! in the binary: one `(file name, contents)` list per backend, which
//! `src/migrations.rs` turns into sqlx migrations. The folder is the one
//! home of the list; sqlx's `migrate!` did this with a proc-macro that
//! compiled both database drivers a second time for the host
//! (ARCHITECTURE.md, "Build time").

use std::fmt::Write as _;
use std::path::Path;
use std::{env, fs};

const BACKENDS: [&str; 2] = ["sqlite", "postgres"];

fn main() {
    let manifest_dir = env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let migrations = Path::new(&manifest_dir).join("../migrations");
    let mut out = String::new();
    for backend in BACKENDS {
        let folder = migrations.join(backend);
        println!("cargo:rerun-if-changed={}", folder.display());
        let mut files: Vec<_> = fs::read_dir(&folder)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", folder.display()))
            .map(|entry| entry.expect("a readable folder entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "sql"))
            .collect();
        files.sort();
        let name = backend.to_uppercase();
        writeln!(out, "pub(crate) const {name}: &[(&str, &str)] = &[").unwrap();
        for path in files {
            println!("cargo:rerun-if-changed={}", path.display());
            let file_name = path.file_name().unwrap().to_string_lossy();
            let path = path.canonicalize().expect("a migration file that exists");
            writeln!(
                out,
                "    ({file_name:?}, include_str!({:?})),",
                path.display()
            )
            .unwrap();
        }
        writeln!(out, "];").unwrap();
    }
    let target = Path::new(&env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("migrations.rs");
    fs::write(&target, out).unwrap_or_else(|e| panic!("cannot write {}: {e}", target.display()));
}
