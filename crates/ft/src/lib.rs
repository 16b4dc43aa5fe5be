//! The replica group's manager of per-step fault tolerance (torchft's
//! `ManagerServer`, ours).
//!
//! # Layers
//!
//! | layer | modules |
//! |---|---|
//! | one group rank's view of an issued quorum, pure | `results` |

pub mod results;
pub mod wire;
pub mod round;
pub mod lighthouse;
