//! Devices and device maps, validated with exactly PyTorch's rules.
//!
//! A worker declares the devices it uses (`devices`) and, per destination, a map
//! from its devices to the destination's (`set_device_map`). At init every
//! worker's device count, maps and devices are all-gathered and checked by
//! [`validate`] (PyTorch's `_validate_device_maps`, same order, same cases): no
//! duplicate devices, no index beyond a worker's device count, no map naming a
//! worker outside a static group, no two sources mapped to one target, and keys
//! and values within the declared devices of source and target. Each error names
//! the worker and shows the offending map. Replies travel back through the
//! inverse maps ([`reverse_maps`]); a worker that declared no devices uses the
//! CUDA devices its maps mention ([`device_list`]).
//!
//! The local device count comes from an [`Inventory`]: by default the NVIDIA
//! device nodes the process can see, filtered by `CUDA_VISIBLE_DEVICES`; tests
//! and GPU-less machines declare a count instead. Moving bytes to a GPU is out
//! of scope: a [`Payload`](crate::Payload) is bytes tagged with a device, and
//! the maps decide which device tag it arrives with.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A device: the CPU or a CUDA device by index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Device {
    Cpu,
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;
    fn from_str(s: &str) -> Result<Device> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|i| i.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| Error::Invalid(format!("{s:?} is not a device (cpu or cuda:N)"))),
        }
    }
}

/// A map from this worker's devices to one destination's.
pub type DeviceMap = BTreeMap<Device, Device>;

/// Where the local CUDA device count comes from.
#[derive(Debug, Clone, Default)]
pub enum Inventory {
    /// The NVIDIA device nodes (`/dev/nvidiaN`), filtered by `CUDA_VISIBLE_DEVICES`.
    #[default]
    Visible,
    /// A declared count (tests; machines whose devices are not device nodes).
    Declared(u32),
}

impl Inventory {
    pub fn cuda_count(&self) -> u32 {
        match self {
            Inventory::Declared(n) => *n,
            Inventory::Visible => {
                let nodes = std::fs::read_dir("/dev")
                    .map(|d| {
                        d.filter_map(|e| e.ok())
                            .filter(|e| {
                                let n = e.file_name();
                                let n = n.to_string_lossy();
                                n.strip_prefix("nvidia").is_some_and(|i| {
                                    !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit())
                                })
                            })
                            .count() as u32
                    })
                    .unwrap_or(0);
                visible_count(nodes, std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref())
            }
        }
    }
}

/// CUDA's reading of `CUDA_VISIBLE_DEVICES` for `present` devices: a comma list
/// of indices (or UUIDs), cut at the first entry that is invalid or repeated;
/// unset means all of them.
pub fn visible_count(present: u32, var: Option<&str>) -> u32 {
    let Some(v) = var else { return present };
    let mut seen = BTreeSet::new();
    for item in v.split(',').map(str::trim) {
        let ok = match item.parse::<i64>() {
            Ok(i) => i >= 0 && (i as u64) < present as u64,
            Err(_) => item.starts_with("GPU-") || item.starts_with("MIG-"),
        };
        if !ok || !seen.insert(item.to_owned()) {
            break;
        }
    }
    seen.len() as u32
}

/// What each worker shares about its devices at init.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct DeviceInfo {
    pub cuda_count: u32,
    pub maps: BTreeMap<String, DeviceMap>,
    pub devices: Vec<Device>,
}

fn valid(d: &Device, cuda_count: u32) -> bool {
    match d {
        Device::Cpu => true,
        Device::Cuda(i) => *i < cuda_count,
    }
}

fn list<'a>(ds: impl IntoIterator<Item = &'a Device>) -> String {
    let v: Vec<String> = ds.into_iter().map(|d| d.to_string()).collect();
    format!("[{}]", v.join(", "))
}

fn show(m: &DeviceMap) -> String {
    let v: Vec<String> = m.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    format!("{{{}}}", v.join(", "))
}

/// PyTorch's `_validate_device_maps` over every worker's `(name, info)`, in rank
/// order. `static_group` also requires every map's target to be a member.
pub fn validate(all: &[(String, DeviceInfo)], static_group: bool) -> Result<()> {
    let by_name: BTreeMap<&str, &DeviceInfo> = all.iter().map(|(n, i)| (n.as_str(), i)).collect();
    let bad = |m: String| Err(Error::DeviceMap(m));
    for (node, info) in all {
        let set: BTreeSet<_> = info.devices.iter().collect();
        if set.len() != info.devices.len() {
            return bad(format!(
                "Node {node} has duplicated devices\ndevices = {}",
                list(&info.devices)
            ));
        }
        if !info.devices.iter().all(|d| valid(d, info.cuda_count)) {
            return bad(format!(
                "Node {node} has devices with invalid indices\ndevices = {}\ndevice count = {}",
                list(&info.devices),
                info.cuda_count
            ));
        }
    }
    for (source, info) in all {
        if static_group {
            if let Some(t) = info.maps.keys().find(|t| !by_name.contains_key(t.as_str())) {
                return bad(format!(
                    "Node {source} has invalid target node names in its device maps\ndevice maps = [{}]\nnode names = [{}]\n(no worker is named {t:?})",
                    info.maps.keys().cloned().collect::<Vec<_>>().join(", "),
                    all.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>().join(", ")
                ));
            }
        }
        for (target, map) in &info.maps {
            let values: BTreeSet<_> = map.values().collect();
            if values.len() != map.len() {
                return bad(format!(
                    "Node {source} has duplicated target devices in its device map for {target}\ndevice map = {}",
                    show(map)
                ));
            }
            if !info.devices.is_empty() {
                let own: BTreeSet<_> = info.devices.iter().collect();
                if !map.keys().all(|k| own.contains(k)) {
                    return bad(format!(
                        "Node {source} has unexpected source devices in its device map for {target}\ndevice map = {}\ndevices = {}",
                        show(map),
                        list(&info.devices)
                    ));
                }
            } else if !map.keys().all(|k| valid(k, info.cuda_count)) {
                return bad(format!(
                    "Node {source} has source devices with invalid indices in its device map for {target}\ndevice map = {}\ndevice count = {}",
                    show(map),
                    info.cuda_count
                ));
            }
            match by_name.get(target.as_str()) {
                Some(t) if !t.devices.is_empty() => {
                    let theirs: BTreeSet<_> = t.devices.iter().collect();
                    if !map.values().all(|v| theirs.contains(v)) {
                        return bad(format!(
                            "Node {source} has unexpected target devices in its device map for {target}\ndevice map = {}\ndevices = {}",
                            show(map),
                            list(&t.devices)
                        ));
                    }
                }
                Some(t) if !map.values().all(|v| valid(v, t.cuda_count)) => {
                    return bad(format!(
                        "Node {source} has target devices with invalid indices in its device map for {target}\ndevice map = {}\ndevice count = {}",
                        show(map),
                        t.cuda_count
                    ));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// For each worker that maps devices towards `me`, the inverse of that map:
/// how replies to it travel back.
pub fn reverse_maps(me: &str, all: &[(String, DeviceInfo)]) -> BTreeMap<String, DeviceMap> {
    all.iter()
        .filter_map(|(n, i)| {
            i.maps
                .get(me)
                .map(|m| (n.clone(), m.iter().map(|(k, v)| (*v, *k)).collect()))
        })
        .collect()
}

/// The devices a worker uses: its declared list, or else every CUDA device in
/// its own maps' keys and its reverse maps' keys, sorted.
pub fn device_list(
    declared: &[Device],
    maps: &BTreeMap<String, DeviceMap>,
    reverse: &BTreeMap<String, DeviceMap>,
) -> Vec<Device> {
    if !declared.is_empty() {
        return declared.to_vec();
    }
    let set: BTreeSet<Device> = maps
        .values()
        .chain(reverse.values())
        .flat_map(|m| m.keys().copied())
        .filter(|d| *d != Device::Cpu)
        .collect();
    set.into_iter().collect()
}

/// Adds `map` to the maps towards `to`, with PyTorch's options-level checks:
/// the result must stay one-to-one, and an entry must not change an earlier one.
pub fn add_map(maps: &mut BTreeMap<String, DeviceMap>, to: &str, map: &DeviceMap) -> Result<()> {
    let cur = maps.entry(to.to_owned()).or_default();
    let mut next = cur.clone();
    for (k, v) in map {
        if let Some(old) = next.insert(*k, *v) {
            if old != *v {
                return Err(Error::DeviceMap(format!(
                    "A mapping for {k} towards {to} already exists ({k} -> {old}); it cannot also map to {v}"
                )));
            }
        }
    }
    let values: BTreeSet<_> = next.values().collect();
    if values.len() != next.len() {
        return Err(Error::DeviceMap(format!(
            "Device maps only support 1-to-1 mapping: towards {to}, {} maps two devices to one",
            show(&next)
        )));
    }
    *cur = next;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda(i: u32) -> Device {
        Device::Cuda(i)
    }

    fn info(count: u32, devices: &[Device], maps: &[(&str, &[(Device, Device)])]) -> DeviceInfo {
        DeviceInfo {
            cuda_count: count,
            devices: devices.to_vec(),
            maps: maps
                .iter()
                .map(|(t, m)| (t.to_string(), m.iter().copied().collect()))
                .collect(),
        }
    }

    fn check(all: Vec<(&str, DeviceInfo)>, static_group: bool) -> std::result::Result<(), String> {
        let all: Vec<(String, DeviceInfo)> =
            all.into_iter().map(|(n, i)| (n.to_owned(), i)).collect();
        validate(&all, static_group).map_err(|e| e.to_string())
    }

    #[test]
    fn parses_and_prints_devices() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda:3".parse::<Device>().unwrap(), cuda(3));
        assert_eq!("cuda".parse::<Device>().unwrap(), cuda(0));
        assert!("gpu:1".parse::<Device>().is_err());
        assert_eq!(cuda(2).to_string(), "cuda:2");
    }

    #[test]
    fn cuda_visible_devices_is_read_as_cuda_does() {
        assert_eq!(visible_count(4, None), 4);
        assert_eq!(visible_count(4, Some("")), 0);
        assert_eq!(visible_count(4, Some("1,3")), 2);
        assert_eq!(
            visible_count(4, Some("0,7,1")),
            1,
            "cut at the invalid index"
        );
        assert_eq!(visible_count(4, Some("2,2")), 1, "cut at the repeat");
        assert_eq!(visible_count(4, Some("-1")), 0);
        assert_eq!(visible_count(0, Some("0")), 0);
    }

    #[test]
    fn every_pytorch_rule_names_the_worker() {
        let ok = info(2, &[], &[("b", &[(cuda(0), cuda(1))])]);
        assert!(check(vec![("a", ok.clone()), ("b", info(2, &[], &[]))], true).is_ok());

        let e = check(vec![("a", info(2, &[cuda(0), cuda(0)], &[]))], true).unwrap_err();
        assert!(e.contains("Node a has duplicated devices"), "{e}");

        let e = check(vec![("a", info(1, &[cuda(1)], &[]))], true).unwrap_err();
        assert!(
            e.contains("Node a has devices with invalid indices") && e.contains("device count = 1"),
            "{e}"
        );

        let e = check(vec![("a", ok.clone())], true).unwrap_err();
        assert!(
            e.contains("Node a has invalid target node names") && e.contains("\"b\""),
            "{e}"
        );
        assert!(
            check(vec![("a", ok.clone())], false).is_ok(),
            "dynamic groups skip unknown targets"
        );

        let dup = info(2, &[], &[("b", &[(cuda(0), cuda(1)), (cuda(1), cuda(1))])]);
        let e = check(vec![("a", dup), ("b", info(2, &[], &[]))], true).unwrap_err();
        assert!(
            e.contains("Node a has duplicated target devices in its device map for b"),
            "{e}"
        );

        let src = info(2, &[cuda(1)], &[("b", &[(cuda(0), cuda(0))])]);
        let e = check(vec![("a", src), ("b", info(2, &[], &[]))], true).unwrap_err();
        assert!(
            e.contains("Node a has unexpected source devices in its device map for b"),
            "{e}"
        );

        let src = info(1, &[], &[("b", &[(cuda(1), cuda(0))])]);
        let e = check(vec![("a", src), ("b", info(2, &[], &[]))], true).unwrap_err();
        assert!(
            e.contains("Node a has source devices with invalid indices in its device map for b"),
            "{e}"
        );

        let e = check(
            vec![("a", ok.clone()), ("b", info(2, &[cuda(0)], &[]))],
            true,
        )
        .unwrap_err();
        assert!(
            e.contains("Node a has unexpected target devices in its device map for b")
                && e.contains("devices = [cuda:0]"),
            "{e}"
        );

        let e = check(vec![("a", ok.clone()), ("b", info(1, &[], &[]))], true).unwrap_err();
        assert!(
            e.contains("Node a has target devices with invalid indices in its device map for b")
                && e.contains("device count = 1"),
            "{e}"
        );

        // cpu is always valid, on both sides.
        let cpu = info(0, &[], &[("b", &[(Device::Cpu, Device::Cpu)])]);
        assert!(check(vec![("a", cpu), ("b", info(0, &[], &[]))], true).is_ok());
    }

    #[test]
    fn reverse_maps_and_default_device_list() {
        let all = vec![
            (
                "a".to_owned(),
                info(
                    2,
                    &[],
                    &[("b", &[(cuda(0), cuda(1)), (Device::Cpu, Device::Cpu)])],
                ),
            ),
            (
                "b".to_owned(),
                info(2, &[], &[("c", &[(cuda(0), cuda(0))])]),
            ),
        ];
        let rev = reverse_maps("b", &all);
        assert_eq!(rev.len(), 1);
        assert_eq!(rev["a"][&cuda(1)], cuda(0));
        assert_eq!(
            device_list(&[], &all[1].1.maps, &rev),
            vec![cuda(0), cuda(1)]
        );
        assert_eq!(device_list(&[cuda(1)], &all[1].1.maps, &rev), vec![cuda(1)]);
    }

    #[test]
    fn set_device_map_stays_one_to_one() {
        let mut maps = BTreeMap::new();
        add_map(&mut maps, "b", &[(cuda(0), cuda(1))].into()).unwrap();
        add_map(&mut maps, "b", &[(cuda(0), cuda(1))].into()).unwrap();
        let e = add_map(&mut maps, "b", &[(cuda(0), cuda(2))].into())
            .unwrap_err()
            .to_string();
        assert!(e.contains("already exists"), "{e}");
        let e = add_map(&mut maps, "b", &[(cuda(1), cuda(1))].into())
            .unwrap_err()
            .to_string();
        assert!(e.contains("only support 1-to-1"), "{e}");
        assert_eq!(maps["b"].len(), 1, "a refused map changes nothing");
    }
}
