//! Integration tests of the store crate.
