//! Who a worker is: its unique name and its id (rank), as PyTorch's
//! `WorkerInfo`. The hello of a connection carries it ([`crate::wire`]), the
//! agent keeps one per peer, and programs look peers up by either.

use serde::{Deserialize, Serialize};

/// A worker: its unique name and its id (rank).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub name: String,
    pub id: u32,
}
