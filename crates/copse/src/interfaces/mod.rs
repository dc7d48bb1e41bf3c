//! What users hold: the Rust API today; the RESP server, Python binding and CLI build on it.

pub mod check;
pub mod db;
