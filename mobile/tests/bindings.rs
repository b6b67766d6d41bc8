//! The app library's binding tests, in one test binary: the C ABI under
//! valgrind (`c_abi.rs`), the generated Kotlin on the JVM (`kotlin.rs`),
//! the pytest suite (`python.rs`), the README's Python program
//! (`readme_python.rs`) and the Swift bindings (`swift.rs`).
//!
//! Why one binary: cargo runs test binaries one after another, and the
//! README's program spends most of its minute waiting on the README's job
//! (its server and agents are processes of their own); here the other
//! suites run beside it. As five binaries they took 133 s one after the
//! other on CI's two cores (2026-12-01), 69 s of it the README's program
//! using 4 s of CPU. Each also compiled the server's test harness again.
//! Tests share nothing through this process: each starts its own server
//! and writes its bindings to a directory of its own.
//!
//! Run one suite with its module's name as the filter:
//! `cargo test --release -p canopy-mobile --test bindings kotlin::`
//! (the README's program is `a_readme_python::`).

mod common;
mod python_package;

// The test runner starts tests in the order of their names, two at a
// time here: the README's program, which waits most, is named to start
// first, so that the other four run beside it instead of after it.
#[path = "readme_python.rs"]
mod a_readme_python;
mod c_abi;
mod kotlin;
mod python;
mod swift;
