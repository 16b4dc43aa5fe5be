//! One suite of c10d semantics, for every backend: this crate's, PyTorch's
//! servers, and stores built on other systems (the etcd store). Enabled by the
//! `conformance` feature, for tests.

use std::sync::Arc;
use std::time::Duration;

use crate::{Store, StoreError};

/// What a backend does with queues.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Queues {
    Supported,
    /// Refused with `StoreError::Unsupported`.
    Unsupported,
    /// Not exercised (a server that drops the connection on queue commands).
    Skip,
}

/// Everything every store must do the same way.
pub async fn conformance(store: Arc<dyn Store>, queues: Queues) {
    store.set_timeout(Duration::from_secs(5));
    // set / get / overwrite, binary values
    store.set("a", b"1").await.unwrap();
    store.set("a", b"\x00\xff2").await.unwrap();
    assert_eq!(store.get("a").await.unwrap(), b"\x00\xff2");
    // add: missing = 0, decimal storage, negative deltas
    assert_eq!(store.add("n", 5).await.unwrap(), 5);
    assert_eq!(store.add("n", -7).await.unwrap(), -2);
    assert_eq!(store.get("n").await.unwrap(), b"-2");
    assert_eq!(store.add("n", 0).await.unwrap(), -2);
    store.set("junk", b"abc").await.unwrap();
    assert!(store.add("junk", 1).await.is_err());
    // compare_set, all four cases
    assert_eq!(store.compare_set("cs", b"x", b"y").await.unwrap(), b"x");
    assert!(!store.check(&["cs"]).await.unwrap());
    assert_eq!(store.compare_set("cs", b"", b"v1").await.unwrap(), b"v1");
    assert_eq!(store.compare_set("cs", b"v1", b"v2").await.unwrap(), b"v2");
    assert_eq!(
        store.compare_set("cs", b"nope", b"v3").await.unwrap(),
        b"v2"
    );
    // check and delete
    assert!(store.check(&["a", "n"]).await.unwrap());
    assert!(store.check(&[]).await.unwrap());
    assert!(!store.check(&["a", "missing"]).await.unwrap());
    assert!(store.delete_key("a").await.unwrap());
    assert!(!store.delete_key("a").await.unwrap());
    assert!(!store.check(&["a"]).await.unwrap());
    // multi_set / multi_get, in order
    store
        .multi_set(&[("m1", b"one"), ("m2", b""), ("m1", b"uno")])
        .await
        .unwrap();
    assert_eq!(
        store.multi_get(&["m2", "m1"]).await.unwrap(),
        vec![b"".to_vec(), b"uno".to_vec()]
    );
    // append creates then extends
    store.append("ap", b"ab").await.unwrap();
    store.append("ap", b"cd").await.unwrap();
    assert_eq!(store.get("ap").await.unwrap(), b"abcd");
    // list_keys holds exactly the user keys
    let mut keys = store.list_keys().await.unwrap();
    keys.sort();
    assert_eq!(keys, ["ap", "cs", "junk", "m1", "m2", "n"]);
    assert!(store.num_keys().await.unwrap() >= 6);
    // a wait that times out names the missing key and takes about the timeout
    let t0 = std::time::Instant::now();
    let err = store
        .wait_timeout(&["ap", "never"], Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(t0.elapsed() >= Duration::from_millis(100));
    match &err {
        StoreError::Timeout { missing, keys, .. } => {
            assert_eq!(missing, &["never"]);
            assert_eq!(keys, &["ap", "never"]);
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(err.to_string().contains("never"), "{err}");
    // get with a zero timeout fails at once on a missing key
    store.set_timeout(Duration::ZERO);
    assert!(store.get("never").await.unwrap_err().is_timeout());
    store.set_timeout(Duration::from_secs(5));
    // a blocked get is released by a later set
    let (s2, setter) = (store.clone(), store.clone());
    let getter = tokio::spawn(async move { s2.get("late").await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    setter.set("late", b"here").await.unwrap();
    assert_eq!(getter.await.unwrap().unwrap(), b"here");
    // queues
    if queues == Queues::Supported {
        assert_eq!(store.queue_len("q").await.unwrap(), 0);
        assert!(matches!(
            store.queue_pop("q", false).await,
            Err(StoreError::QueueEmpty { .. })
        ));
        store.queue_push("q", b"i1").await.unwrap();
        store.queue_push("q", b"i2").await.unwrap();
        assert_eq!(store.queue_len("q").await.unwrap(), 2);
        assert_eq!(store.queue_pop("q", false).await.unwrap(), b"i1");
        assert_eq!(store.queue_pop("q", true).await.unwrap(), b"i2");
        let s3 = store.clone();
        let popper = tokio::spawn(async move { s3.queue_pop("q", true).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        store.queue_push("q", b"i3").await.unwrap();
        assert_eq!(popper.await.unwrap().unwrap(), b"i3");
        store.set_timeout(Duration::from_millis(50));
        assert!(store.queue_pop("q", true).await.unwrap_err().is_timeout());
        store.set_timeout(Duration::from_secs(5));
    } else if queues == Queues::Unsupported {
        assert!(matches!(
            store.queue_push("q", b"x").await,
            Err(StoreError::Unsupported { .. })
        ));
    }
}
