//! The schema migrations, embedded by `build.rs` from `migrations/`, as
//! sqlx migrators. Versions, descriptions and checksums are derived from
//! each file exactly as sqlx's own resolver derives them, so a database
//! migrated by an earlier build (through `sqlx::migrate!`) is recognised:
//! the version is the file name before its first `_`, the description the
//! rest without `.sql` and with `_` read as spaces, and a file that starts
//! with `-- no-transaction` runs outside a transaction.

use std::borrow::Cow;
use std::sync::LazyLock;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, SqlSafeStr};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/migrations.rs"));
}

/// The SQLite schema's migrations, in version order.
pub static SQLITE: LazyLock<Migrator> = LazyLock::new(|| migrator(embedded::SQLITE));
/// The PostgreSQL schema's migrations, in version order.
pub static POSTGRES: LazyLock<Migrator> = LazyLock::new(|| migrator(embedded::POSTGRES));

fn migrator(files: &'static [(&'static str, &'static str)]) -> Migrator {
    Migrator::with_migrations(
        files
            .iter()
            .map(|&(name, sql)| migration(name, sql))
            .collect(),
    )
}

/// One migration from its file. The files are ours and checked by the
/// tests, so a misnamed one is a build defect, not a user's error.
fn migration(file_name: &'static str, sql: &'static str) -> Migration {
    let (version, rest) = file_name
        .split_once('_')
        .unwrap_or_else(|| panic!("migration `{file_name}` is not named VERSION_DESCRIPTION.sql"));
    let version: i64 = version
        .parse()
        .unwrap_or_else(|_| panic!("migration `{file_name}` does not start with a number"));
    let description = rest.trim_end_matches(".sql").replace('_', " ");
    Migration::new(
        version,
        Cow::Owned(description),
        MigrationType::Simple,
        AssertSqlSafe(sql).into_sql_str(),
        sql.starts_with("-- no-transaction"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_embedded_file_is_a_migration_in_version_order() {
        for migrator in [&*SQLITE, &*POSTGRES] {
            let versions: Vec<i64> = migrator.iter().map(|m| m.version).collect();
            assert!(!versions.is_empty());
            assert!(
                versions.windows(2).all(|pair| pair[0] < pair[1]),
                "{versions:?}"
            );
            assert_eq!(versions[0], 1);
        }
    }

    #[test]
    fn descriptions_and_checksums_are_sqlx_resolvers() {
        for (backend, migrator) in [("sqlite", &*SQLITE), ("postgres", &*POSTGRES)] {
            let folder = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../migrations")
                .join(backend);
            let resolved = sqlx::migrate::resolve_blocking(&folder).unwrap();
            assert_eq!(resolved.len(), migrator.iter().count());
            for ((expected, _), ours) in resolved.iter().zip(migrator.iter()) {
                assert_eq!(expected.version, ours.version);
                assert_eq!(expected.description, ours.description);
                assert_eq!(
                    expected.checksum, ours.checksum,
                    "{backend} {}",
                    ours.version
                );
                assert_eq!(expected.no_tx, ours.no_tx);
            }
        }
    }
}
