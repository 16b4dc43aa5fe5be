//! torchft's quorum rules as pure functions (being written).
