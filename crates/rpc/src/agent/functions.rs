//! The functions and methods a worker serves: registered by name (methods
//! by the type of value they run on and name), each with its argument and
//! result types ([`crate::types`]) so that a call expecting others is refused
//! with both sides named instead of decoding garbage.

use std::collections::HashMap;
use std::fmt::Display;
use std::future::Future;
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use rallypoint_sync::RwLockExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::rrefs::{Adopted, Held};
use super::{Rpc, Value};
use crate::error::{Error, Result};
use crate::transport::BoxFuture;
use crate::types::{shape, Signature};

/// A request's arguments, still encoded.
pub struct Args {
    pub(super) rpc: Rpc,
    pub(super) bytes: Vec<u8>,
    pub(super) bulk: Bytes,
    pub(super) adopted: Adopted,
}

impl Args {
    /// Decodes the arguments; waits until every RRef among them is confirmed
    /// by its owner (user functions run only then), within the default
    /// timeout (with none, a confirmation still ends: the owner records the
    /// fork, or is found gone by membership or the heartbeat).
    async fn decode<A: DeserializeOwned>(self) -> std::result::Result<A, String> {
        let Adopted { handles, new_users } = self.adopted;
        let a = self
            .rpc
            .0
            .decode_from::<A>(&self.bytes, self.bulk, handles)?;
        let agent = &self.rpc.0;
        let confirmed = async {
            for u in new_users {
                agent.rrefs.user_usable(agent, u).await?;
            }
            Ok::<(), Error>(())
        };
        let t = agent.default_timeout;
        if t.is_zero() {
            confirmed.await.map_err(|e| e.to_string())?;
        } else {
            tokio::time::timeout(t, confirmed)
                .await
                .map_err(|_| {
                    format!(
                        "an RRef among the arguments was not confirmed by its owner within {} ms",
                        t.as_millis()
                    )
                })?
                .map_err(|e| e.to_string())?;
        }
        Ok(a)
    }
}

type FnHandler = Arc<
    dyn Fn(Args) -> BoxFuture<'static, std::result::Result<Box<dyn Value>, String>> + Send + Sync,
>;
type MethodHandler = Arc<
    dyn Fn(Args, Held) -> BoxFuture<'static, std::result::Result<Box<dyn Value>, String>>
        + Send
        + Sync,
>;

/// A registered function: its types and its handler.
#[derive(Clone)]
pub(crate) struct Func {
    pub(crate) sig: Signature,
    pub(crate) run: FnHandler,
}

/// A registered method: its types and its handler.
#[derive(Clone)]
pub(crate) struct Method {
    pub(crate) sig: Signature,
    pub(crate) run: MethodHandler,
}

#[derive(Default)]
struct FnTable {
    funcs: HashMap<String, Func>,
    /// By (the shape of the value's type, name).
    methods: HashMap<(String, String), Method>,
}

/// The functions (and methods) a worker serves, by name.
///
/// Give it to [`RpcBackendOptions::functions`](crate::RpcBackendOptions) so
/// they exist from the moment the worker can be called; more may be added
/// later through [`Rpc::functions`].
#[derive(Clone, Default)]
pub struct Functions(Arc<RwLock<FnTable>>);

fn dup(kind: &str, name: &str) -> Error {
    Error::Invalid(format!("a {kind} named {name:?} is already registered"))
}

impl Functions {
    pub fn new() -> Functions {
        Functions::default()
    }

    fn add(&self, name: &str, sig: Signature, run: FnHandler) -> Result<()> {
        let mut t = self.0.write_locked();
        if t.funcs.contains_key(name) {
            return Err(dup("function", name));
        }
        t.funcs.insert(name.to_owned(), Func { sig, run });
        Ok(())
    }

    fn add_method<T: ?Sized>(&self, name: &str, sig: Signature, run: MethodHandler) -> Result<()> {
        let key = (shape(std::any::type_name::<T>()), name.to_owned());
        let mut t = self.0.write_locked();
        if t.methods.contains_key(&key) {
            return Err(dup(&format!("method on {}", key.0), name));
        }
        t.methods.insert(key, Method { sig, run });
        Ok(())
    }

    /// Registers `f`, which cannot fail.
    pub fn register<A, R, F>(&self, name: &str, f: F) -> Result<()>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        F: Fn(A) -> R + Send + Sync + 'static,
    {
        self.register_fallible(name, move |a: A| Ok::<R, String>(f(a)))
    }

    /// Registers `f`; its error comes back to the caller as text.
    pub fn register_fallible<A, R, E, F>(&self, name: &str, f: F) -> Result<()>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        E: Display + Send + 'static,
        F: Fn(A) -> std::result::Result<R, E> + Send + Sync + 'static,
    {
        self.register_async(name, move |_rpc: Rpc, a: A| std::future::ready(f(a)))
    }

    /// Registers a function that blocks (a long computation, blocking I/O,
    /// a lock held for long): it runs on the runtime's blocking threads, at
    /// most `num_worker_threads` at once (PyTorch's option, default 16; more
    /// calls wait their turn), never on the threads that read messages and
    /// run timers. [`Functions::register`] runs on those threads: use it for
    /// functions that return at once.
    pub fn register_blocking<A, R, E, F>(&self, name: &str, f: F) -> Result<()>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        E: Display + Send + 'static,
        F: Fn(A) -> std::result::Result<R, E> + Send + Sync + 'static,
    {
        let f = Arc::new(f);
        self.register_async(name, move |rpc: Rpc, a: A| {
            let f = f.clone();
            async move {
                let _turn = blocking_turn(&rpc).await?;
                tokio::task::spawn_blocking(move || f(a).map_err(|e| e.to_string()))
                    .await
                    .map_err(|e| format!("the function panicked: {e}"))?
            }
        })
    }

    /// Registers an async function; it gets this worker's [`Rpc`] to make
    /// calls of its own (PyTorch's `@rpc.functions.async_execution`: the
    /// answer goes when the future completes, and no thread waits for it).
    pub fn register_async<A, R, E, F, Fut>(&self, name: &str, f: F) -> Result<()>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        E: Display,
        F: Fn(Rpc, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<R, E>> + Send + 'static,
    {
        let f = Arc::new(f);
        self.add(
            name,
            Signature::of::<A, R>(),
            Arc::new(move |args: Args| {
                let f = f.clone();
                Box::pin(async move {
                    let rpc = args.rpc.clone();
                    let a: A = args.decode().await?;
                    f(rpc, a)
                        .await
                        .map(|r| Box::new(r) as Box<dyn Value>)
                        .map_err(|e| e.to_string())
                })
            }),
        )
    }

    /// Registers method `name` on values of type `T` held behind RRefs,
    /// called by [`crate::RRef::call`] at the owner. Methods are found by
    /// the value's type and their name: types may share method names. A
    /// method runs with the value locked; a call waiting for the value holds
    /// no thread. A method that blocks belongs in
    /// [`Functions::register_method_blocking`].
    pub fn register_method<T, A, R, E, F>(&self, name: &str, f: F) -> Result<()>
    where
        T: 'static,
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        E: Display,
        F: Fn(&mut T, A) -> std::result::Result<R, E> + Send + Sync + 'static,
    {
        let f = Arc::new(f);
        let h: MethodHandler = Arc::new(move |args: Args, v: Held| {
            let f = f.clone();
            Box::pin(async move {
                let a: A = args.decode().await?;
                let mut g = v.lock().await;
                let t = downcast::<T>(&mut g)?;
                f(t, a)
                    .map(|r| Box::new(r) as Box<dyn Value>)
                    .map_err(|e| e.to_string())
            })
        });
        self.add_method::<T>(name, Signature::of::<A, R>(), h)
    }

    /// [`Functions::register_method`] for a method that blocks: it runs on
    /// the blocking pool, within `num_worker_threads` as
    /// [`Functions::register_blocking`] does.
    pub fn register_method_blocking<T, A, R, E, F>(&self, name: &str, f: F) -> Result<()>
    where
        T: Send + 'static,
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        E: Display + Send + 'static,
        F: Fn(&mut T, A) -> std::result::Result<R, E> + Send + Sync + 'static,
    {
        let f = Arc::new(f);
        let h: MethodHandler = Arc::new(move |args: Args, v: Held| {
            let f = f.clone();
            Box::pin(async move {
                let rpc = args.rpc.clone();
                let a: A = args.decode().await?;
                let _turn = blocking_turn(&rpc).await?;
                let mut g = v.lock_owned().await;
                tokio::task::spawn_blocking(move || {
                    let t = downcast::<T>(&mut g)?;
                    f(t, a)
                        .map(|r| Box::new(r) as Box<dyn Value>)
                        .map_err(|e| e.to_string())
                })
                .await
                .map_err(|e| format!("the method panicked: {e}"))?
            })
        });
        self.add_method::<T>(name, Signature::of::<A, R>(), h)
    }

    pub(crate) fn func(&self, name: &str) -> Option<Func> {
        self.0.read_locked().funcs.get(name).cloned()
    }

    /// Method `name` for a value of type `value_type` (its full type name),
    /// or why there is none: the types it is registered for.
    pub(crate) fn method(
        &self,
        value_type: &str,
        name: &str,
    ) -> std::result::Result<Method, Vec<String>> {
        let t = self.0.read_locked();
        let key = (shape(value_type), name.to_owned());
        match t.methods.get(&key) {
            Some(m) => Ok(m.clone()),
            None => {
                let mut on: Vec<String> = t
                    .methods
                    .keys()
                    .filter(|(_, n)| n == name)
                    .map(|(ty, _)| ty.clone())
                    .collect();
                on.sort();
                Err(on)
            }
        }
    }
}

/// A turn on the blocking pool (at most `num_worker_threads` at once).
async fn blocking_turn(
    rpc: &Rpc,
) -> std::result::Result<tokio::sync::OwnedSemaphorePermit, String> {
    rpc.0
        .blocking
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| "the agent is shutting down".to_owned())
}

fn downcast<T: 'static>(g: &mut Box<dyn Value>) -> std::result::Result<&mut T, String> {
    let held = g.type_name();
    g.as_any().downcast_mut::<T>().ok_or_else(|| {
        format!(
            "the RRef holds a {}, and the method is registered for {}",
            shape(held),
            shape(std::any::type_name::<T>())
        )
    })
}
