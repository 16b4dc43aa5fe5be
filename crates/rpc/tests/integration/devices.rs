//! Device maps at init (PyTorch's rules, across workers) and payloads mapped
//! on the way out and back.

use rallypoint_rpc::{BackendType, Device, Inventory, Payload};

use crate::harness::*;

fn cuda(i: u32) -> Device {
    Device::Cuda(i)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_follow_the_maps_and_replies_the_inverse() {
    let ws: Vec<_> = group_with(2, BackendType::tcp(), |r, o| {
        o.inventory = Inventory::Declared(2);
        if r == 0 {
            o.set_device_map("w1", [(cuda(0), cuda(1))]).unwrap();
        }
    })
    .await
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    assert_eq!(ws[0].devices(), vec![cuda(0)]);
    assert_eq!(
        ws[1].devices(),
        vec![cuda(1)],
        "derived from the reverse map"
    );
    assert_eq!(ws[1].reverse_device_maps()["w0"][&cuda(1)], cuda(0));
    let (dev, len, _): (String, u64, u64) = ws[0]
        .rpc_sync("w1", "payload_info", &Payload::on(cuda(0), vec![1u8; 100]))
        .await
        .unwrap();
    assert_eq!((dev.as_str(), len), ("cuda:1", 100));
    // The reply comes back through the inverse map.
    let back: Payload = ws[0]
        .rpc_sync("w1", "payload_back", &Payload::on(cuda(0), vec![2u8; 10]))
        .await
        .unwrap();
    assert_eq!(back.device, cuda(0));
    // No map from w1 towards w0 for cuda:0, and none for cuda:1 from w0.
    let e = ws[0]
        .rpc_sync::<_, (String, u64, u64)>(
            "w1",
            "payload_info",
            &Payload::on(cuda(1), vec![0u8; 4]),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no device map entry for cuda:1 towards it"),
        "{e}"
    );
    shutdown_all(ws).await;
}

async fn init_error(adjust: impl Fn(usize, &mut rallypoint_rpc::RpcBackendOptions)) -> String {
    let rs = group_with(2, BackendType::tcp(), adjust).await;
    let errs: Vec<String> = rs
        .into_iter()
        .map(|r| r.err().expect("init must fail").to_string())
        .collect();
    assert_eq!(errs[0], errs[1], "every worker gives the same verdict");
    errs[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rule_fails_init_on_every_worker_naming_the_worker() {
    let e = init_error(|r, o| {
        o.inventory = Inventory::Declared(1);
        if r == 1 {
            o.set_device_map("w0", [(cuda(1), cuda(0))]).unwrap();
        }
    })
    .await;
    assert!(
        e.contains("Node w1 has source devices with invalid indices in its device map for w0"),
        "{e}"
    );

    let e = init_error(|r, o| {
        o.inventory = Inventory::Declared(2);
        if r == 0 {
            o.set_device_map("w7", [(cuda(0), cuda(0))]).unwrap();
        }
    })
    .await;
    assert!(
        e.contains("Node w0 has invalid target node names in its device maps"),
        "{e}"
    );

    let e = init_error(|r, o| {
        o.inventory = Inventory::Declared(if r == 1 { 1 } else { 2 });
        if r == 0 {
            o.set_device_map("w1", [(cuda(0), cuda(1))]).unwrap();
        }
    })
    .await;
    assert!(
        e.contains("Node w0 has target devices with invalid indices in its device map for w1"),
        "{e}"
    );

    let e = init_error(|r, o| {
        o.inventory = Inventory::Declared(2);
        if r == 1 {
            o.devices = vec![cuda(0), cuda(0)];
        }
    })
    .await;
    assert!(e.contains("Node w1 has duplicated devices"), "{e}");

    let e = init_error(|r, o| {
        o.inventory = Inventory::Declared(2);
        if r == 1 {
            o.set_devices(vec![cuda(0)]).unwrap();
        }
        if r == 0 {
            o.set_device_map("w1", [(cuda(0), cuda(1))]).unwrap();
        }
    })
    .await;
    assert!(
        e.contains("Node w0 has unexpected target devices in its device map for w1"),
        "{e}"
    );
}

#[test]
fn options_refuse_what_pytorch_refuses() {
    let mut o = rallypoint_rpc::RpcBackendOptions::default();
    o.set_device_map("w1", [(cuda(0), cuda(0))]).unwrap();
    let e = o
        .set_device_map("w1", [(cuda(1), cuda(0))])
        .unwrap_err()
        .to_string();
    assert!(e.contains("1-to-1"), "{e}");
    let e = o.set_devices(vec![Device::Cpu]).unwrap_err().to_string();
    assert!(e.contains("CUDA devices only"), "{e}");
}
