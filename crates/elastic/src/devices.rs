//! The GPUs a process may use, counted as `torch.cuda.device_count()` counts them.
//!
//! The NVIDIA driver lists the physical GPUs under `/proc/driver/nvidia/gpus/`,
//! one directory per PCI bus id, each with an `information` file holding the
//! `GPU UUID`. `CUDA_VISIBLE_DEVICES` then narrows them, with CUDA's rules as
//! PyTorch applies them (`torch.cuda._parse_visible_devices`):
//!
//! - unset: every GPU; set but empty: none;
//! - ordinals are read like `strtoul` (`1gpu` is 1); the first negative or
//!   unparsable entry (`-1`) ends the list, as does the first ordinal past the
//!   last GPU;
//! - `GPU-<uuid>` entries match a GPU whose UUID starts with them; an unknown or
//!   ambiguous one ends the list; `MIG-` entries are counted as listed;
//! - a repeated entry makes the whole list empty.
//!
//! Everything reads from a root directory, so tests use a fake `/proc`.

use std::path::Path;

/// The physical GPUs under `root` (normally `/`), in PCI bus order: their UUIDs,
/// or an empty string where the driver's `information` file has none.
pub fn physical_gpus(root: &Path) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(root.join("proc/driver/nvidia/gpus")) else {
        return Vec::new();
    };
    let mut buses: Vec<String> = dir
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    buses.sort();
    buses.iter().map(|b| uuid_of(root, b)).collect()
}

/// The UUID the NVIDIA driver gives the GPU at PCI address `bus` (empty
/// when it has none, or the GPU is not NVIDIA's).
pub fn uuid_of(root: &Path, bus: &str) -> String {
    let info = root
        .join("proc/driver/nvidia/gpus")
        .join(bus)
        .join("information");
    std::fs::read_to_string(info)
        .ok()
        .and_then(|info| {
            info.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "GPU UUID").then(|| v.trim().to_owned())
            })
        })
        .unwrap_or_default()
}

/// Which GPUs `CUDA_VISIBLE_DEVICES` lets a process see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Visible {
    /// Indices into the physical GPUs, in the order the process numbers them.
    Gpus(Vec<usize>),
    /// This many MIG instances (not matched to physical GPUs here).
    Mig(usize),
}

/// How many of `gpus` (UUIDs, from [`physical_gpus`]) a process with
/// `CUDA_VISIBLE_DEVICES=visible` sees.
pub fn visible_count(visible: Option<&str>, gpus: &[String]) -> usize {
    match visible_set(visible, gpus) {
        Visible::Gpus(v) => v.len(),
        Visible::Mig(n) => n,
    }
}

/// Which of `gpus` (UUIDs, in PCI order) a process with
/// `CUDA_VISIBLE_DEVICES=visible` sees, and in which order.
pub fn visible_set(visible: Option<&str>, gpus: &[String]) -> Visible {
    let Some(var) = visible else {
        return Visible::Gpus((0..gpus.len()).collect());
    };
    for prefix in ["GPU-", "MIG-"] {
        if !var.starts_with(prefix) {
            continue;
        }
        let mut seen: Vec<&str> = Vec::new();
        for elem in var.split(',') {
            if seen.contains(&elem) {
                return Visible::Gpus(Vec::new());
            }
            if !elem.starts_with(prefix) {
                break;
            }
            seen.push(elem);
        }
        if prefix == "MIG-" {
            return Visible::Mig(seen.len());
        }
        let mut ordinals: Vec<usize> = Vec::new();
        for uuid in seen {
            let mut hits = gpus.iter().enumerate().filter(|(_, g)| g.starts_with(uuid));
            let (Some((i, _)), None) = (hits.next(), hits.next()) else {
                break;
            };
            if ordinals.contains(&i) {
                return Visible::Gpus(Vec::new());
            }
            ordinals.push(i);
        }
        return Visible::Gpus(ordinals);
    }
    let mut ordinals: Vec<u64> = Vec::new();
    for elem in var.split(',') {
        let Some(x) = strtoul(elem.trim()) else {
            break;
        };
        if ordinals.contains(&x) {
            return Visible::Gpus(Vec::new());
        }
        ordinals.push(x);
    }
    Visible::Gpus(
        ordinals
            .iter()
            .take_while(|&&x| x < gpus.len() as u64)
            .map(|&x| x as usize)
            .collect(),
    )
}

/// The GPUs this process sees: under `/`, with its `CUDA_VISIBLE_DEVICES`.
pub fn visible_gpus() -> usize {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    visible_count(visible.as_deref(), &physical_gpus(Path::new("/")))
}

/// The number a string starts with (an optional sign, then digits), or `None`
/// when there is none or it is negative.
fn strtoul(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    let sign = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let digits = b[sign..].iter().take_while(|c| c.is_ascii_digit()).count();
    if digits == 0 || b.first() == Some(&b'-') {
        return None;
    }
    s[sign..sign + digits].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("GPU-{i}a{i}b-0000")).collect()
    }

    #[test]
    fn ordinals_as_cuda_reads_them() {
        let g = gpus(4);
        assert_eq!(visible_count(None, &g), 4);
        assert_eq!(visible_count(Some(""), &g), 0);
        assert_eq!(visible_count(Some("-1"), &g), 0);
        assert_eq!(visible_count(Some("0,2"), &g), 2);
        assert_eq!(visible_count(Some("1, 3"), &g), 2);
        assert_eq!(visible_count(Some("0,-1,1"), &g), 1, "-1 ends the list");
        assert_eq!(visible_count(Some("1gpu,2ampere"), &g), 2, "strtoul");
        assert_eq!(visible_count(Some("x,1"), &g), 0);
        assert_eq!(visible_count(Some("0,7,1"), &g), 1, "past the last GPU");
        assert_eq!(visible_count(Some("1,1"), &g), 0, "a repeat empties it");
        assert_eq!(visible_count(Some("0"), &[]), 0);
    }

    #[test]
    fn uuids_match_by_prefix() {
        let g = gpus(3);
        assert_eq!(visible_count(Some("GPU-1a1b-0000,GPU-0"), &g), 2);
        assert_eq!(visible_count(Some("GPU-2a2b"), &g), 1);
        assert_eq!(visible_count(Some("GPU-2,GPU-9"), &g), 1, "unknown ends it");
        assert_eq!(visible_count(Some("GPU-"), &g), 0, "ambiguous ends it");
        assert_eq!(visible_count(Some("GPU-1,GPU-1a"), &g), 0, "same GPU twice");
        assert_eq!(visible_count(Some("GPU-1,GPU-1"), &g), 0);
        assert_eq!(visible_count(Some("GPU-0,1"), &g), 1, "others are ignored");
        assert_eq!(visible_count(Some("MIG-a,MIG-b"), &g), 2);
    }

    #[test]
    fn the_driver_listing_is_read_in_bus_order() {
        let root = tempfile::tempdir().unwrap();
        let base = root.path().join("proc/driver/nvidia/gpus");
        for (bus, uuid) in [("0000:81:00.0", "GPU-bbb"), ("0000:01:00.0", "GPU-aaa")] {
            std::fs::create_dir_all(base.join(bus)).unwrap();
            std::fs::write(
                base.join(bus).join("information"),
                format!("Model: \t\t Fake\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\n"),
            )
            .unwrap();
        }
        std::fs::create_dir_all(base.join("0000:c1:00.0")).unwrap();
        let g = physical_gpus(root.path());
        assert_eq!(g, ["GPU-aaa", "GPU-bbb", ""]);
        assert_eq!(visible_count(Some("GPU-b"), &g), 1);
        assert_eq!(
            physical_gpus(&root.path().join("none")),
            Vec::<String>::new()
        );
    }
}
