//! The server's integration tests, in one test binary: every suite here
//! but the two that measure a server's time and memory (`load.rs`,
//! `request_slots.rs`), which keep binaries of their own so that nothing
//! competes with them for the cores.
//!
//! Why one binary: each test binary compiles `support` again and links the
//! server's whole dependency tree, on CI's two cores. After a change to
//! `support`, these 32 suites rebuilt in 4 m 28 s as binaries of their
//! own and in 1 m 59 s as this one (2026-12-01, 490 s and 210 s of CPU).
//! Tests share nothing through this process: each starts real
//! `canopy-server` processes with databases of their own and talks to
//! them over HTTPS.
//!
//! Run one suite with its module's name as the filter:
//! `cargo test --release -p canopy-server --test integration rounds::`.

#[path = "support/raw.rs"]
mod raw;
mod support;

mod api_contract;
mod central_evaluation;
mod central_sandbox;
mod connections;
mod dashboard_browser;
mod database_checks;
mod datasets;
mod datasets_per_job;
mod eligibility;
mod evaluation;
mod evaluator_race;
mod fairness;
mod fedprox;
mod internal_errors;
mod job_warnings;
mod jobs;
mod learning;
mod operations;
mod privacy;
mod robust;
mod rounds;
mod schemathesis;
mod sdk;
mod secure;
mod signing_keys;
mod smoke;
mod starts;
mod statistics;
mod strategies;
mod tiers;
mod upgrades;
mod upload_timeout;
