//! The lighthouse's state machine (being written).
