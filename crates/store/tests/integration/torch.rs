//! Interop with real PyTorch.
