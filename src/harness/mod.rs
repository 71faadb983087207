//! The CLI's and the tests' harnesses: the serving simulation ([`sim`], with
//! its pool of worker threads), the transfer benchmarks ([`bench`]) and the
//! trace replayer ([`replay`]).
//!
//! This is not the library's API: it is public only so that the `kvoffload`
//! binary, the integration tests and the benchmarks can reach it, it is hidden
//! from the documentation, and it carries no stability promise.

pub mod bench;
pub mod replay;
pub mod sim;
