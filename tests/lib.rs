//! End-to-end tests of the whole system: real `canopy-server` and
//! `canopy-agent` processes, talking HTTPS on loopback. The tests are in
//! `agents.rs`, `bounds.rs` and `transfer.rs`; they find the binaries in
//! the target directory that `cargo test --workspace` builds them into.
//!
//! The library holds what more than one of them needs.

use std::process::Command;

/// Overwrites one setting of a job as the server stored it, in its
/// PostgreSQL database (`database_url`), behind the API's validation: how
/// the tests make a real server send a task no valid job could produce.
/// `field` and `json_value` are the tests' own constants.
pub fn tamper_job_setting(
    database_url: &str,
    job_id: i64,
    field: &str,
    json_value: &str,
) -> std::io::Result<()> {
    let statement = format!(
        "UPDATE jobs SET config = jsonb_set(config::jsonb, '{{{field}}}', '{json_value}'::jsonb)::text \
         WHERE id = {job_id} RETURNING id"
    );
    let output = Command::new("psql")
        .args([
            database_url,
            "-v",
            "ON_ERROR_STOP=1",
            "-q",
            "-t",
            "-A",
            "-c",
            &statement,
        ])
        .output()?;
    let changed = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() || changed.trim() != job_id.to_string() {
        return Err(std::io::Error::other(format!(
            "psql `{statement}` did not change job {job_id}: {}{changed}",
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    Ok(())
}
