//! The registry of rendezvous backends (torchrun's `--rdzv-backend`).
//!
//! A backend is registered under a name with a creator function. Registering a
//! name again with a different creator is an error (the same creator is a no-op),
//! and a created handler must report the name it was asked for.

use std::collections::BTreeMap;
use std::sync::Mutex;

use rallypoint_sync::MutexExt;

pub use crate::api::{Created, Creator};
use crate::api::{RendezvousError, RendezvousHandler, RendezvousParameters};

/// Backend name → creator.
#[derive(Default)]
pub struct Registry {
    creators: Mutex<BTreeMap<String, Creator>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry with the built-in backends (`static`, `c10d`, and `etcd` when
    /// built with the `etcd` feature).
    pub fn with_builtins() -> Self {
        let r = Self::new();
        r.register("static", crate::static_tcp::create)
            .expect("built-ins register once");
        r.register("c10d", crate::dynamic::create)
            .expect("built-ins register once");
        #[cfg(feature = "etcd")]
        r.register("etcd", crate::etcd::create)
            .expect("built-ins register once");
        r
    }

    /// Registers `creator` under `name`.
    pub fn register(&self, name: &str, creator: Creator) -> Result<(), RendezvousError> {
        let mut creators = self.creators.locked();
        match creators.get(name) {
            Some(existing) if std::ptr::fn_addr_eq(*existing, creator) => Ok(()),
            Some(_) => Err(RendezvousError::Registry(format!(
                "rendezvous backend {name:?} is already registered with a different creator"
            ))),
            None => {
                creators.insert(name.to_owned(), creator);
                Ok(())
            }
        }
    }

    /// Registered names.
    pub fn names(&self) -> Vec<String> {
        let creators = self.creators.locked();
        creators.keys().cloned().collect()
    }

    /// Creates the handler for `params.backend`.
    pub async fn create_handler(
        &self,
        params: RendezvousParameters,
    ) -> Result<Box<dyn RendezvousHandler>, RendezvousError> {
        let name = params.backend.clone();
        let creator = {
            let creators = self.creators.locked();
            creators.get(&name).copied()
        };
        let creator = creator.ok_or_else(|| {
            RendezvousError::Registry(format!(
                "no rendezvous backend named {name:?} (registered: {})",
                self.names().join(", ")
            ))
        })?;
        let handler = creator(params).await?;
        if handler.backend() != name {
            return Err(RendezvousError::Registry(format!(
                "the creator registered as {name:?} made a {:?} handler",
                handler.backend()
            )));
        }
        Ok(handler)
    }
}
