//! The Canopy cloud server: keeps models and their versions, runs
//! federated jobs as durable rounds over enrolled devices, aggregates their
//! updates (FedAvg), and serves admins a REST API and devices a signed
//! device API, over HTTPS, on SQLite or PostgreSQL.
//!
//! Codemap: [`config`] merges flags, environment and file; [`db`] and
//! [`store`] are the only modules that speak SQL; [`blobs`] keeps model
//! files; [`api`] is the HTTP surface; [`orchestrator`] drives rounds;
//! [`fedavg`] is the arithmetic; [`server`] wires it all together.

pub mod api;
pub mod blobs;
pub mod bootstrap;
pub mod central;
pub mod config;
pub mod conn;
pub mod datasets;
pub mod db;
pub mod device_keys;
pub mod fedavg;
pub mod file_modes;
pub mod group_commit;
pub mod inflight;
pub mod metrics;
pub mod migrations;
pub mod orchestrator;
pub mod privacy;
pub mod request_slots;
pub mod robust;
pub mod round_failure;
pub mod secure;
pub mod server;
pub mod signing;
pub mod slots;
pub mod sqlite_files;
pub mod state;
pub mod store;
pub mod strategy;
pub mod tls;
