//! Device discovery and the per-process RDMA context.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use ibverbs_sys as ffi;

use kvpool_wire::error::{ErrorCode, KvError};
use kvpool_wire::rdma_wire::{RdmaCaps, RdmaLinkLayer, RdmaPortInfo, MAX_ADVERTISED_DEVICES};

use super::error::{NoDeviceReason, RdmaError};
use super::memory::{LocalSlice, MrCacheStats, MrCounters, RangeCache, RdmaMemory, Registration};
use super::verbs::{DeviceHandle, DeviceList, GidEntry};
use kvpool_transport::nic::{RdmaConfig, MAX_RD_ATOMIC};

/// One opened device: its context, its protection domain, the port we use.
pub(crate) struct RdmaDevice {
    pub(crate) handle: Arc<DeviceHandle>,
    pub(crate) info: RdmaPortInfo,
    /// Work requests one QP may hold (device limit).
    pub(crate) max_qp_wr: u32,
    /// Completion queue entries (device limit).
    pub(crate) max_cqe: u32,
    /// RDMA READs in flight per QP as initiator (capped at `MAX_RD_ATOMIC`).
    pub(crate) max_rd_atomic: u8,
    /// RDMA READs in flight per QP as responder (capped at `MAX_RD_ATOMIC`).
    pub(crate) max_dest_rd_atomic: u8,
}

/// Which listed devices to open: all (when none is named) or the named
/// ones, all of which must exist.
pub(crate) fn select_devices(
    listed: Result<Vec<String>, (i32, String)>,
    wanted: &[String],
) -> Result<Vec<usize>, NoDeviceReason> {
    let names = listed.map_err(|(errno, message)| NoDeviceReason::ListFailed { errno, message })?;
    if names.is_empty() {
        return Err(NoDeviceReason::EmptyList);
    }
    if wanted.is_empty() {
        return Ok((0..names.len()).collect());
    }
    let missing: Vec<String> = wanted
        .iter()
        .filter(|w| !names.contains(w))
        .cloned()
        .collect();
    if !missing.is_empty() {
        return Err(NoDeviceReason::NamedMissing {
            missing,
            present: names,
        });
    }
    Ok(wanted
        .iter()
        .map(|w| names.iter().position(|n| n == w).expect("checked above"))
        .collect())
}

fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|b| *b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// The source GID: the configured index, or on RoCE the first RoCE v2 GID
/// with an IPv4-mapped address (routable, what RoCE deployments use), else
/// the first RoCE v2 GID, else the first entry; on InfiniBand index 0.
pub(crate) fn choose_gid(
    link: RdmaLinkLayer,
    table: &[GidEntry],
    wanted: Option<u8>,
) -> Result<(u8, [u8; 16]), String> {
    const ROCE_V2: u32 = ffi::IBV_GID_TYPE_ROCE_V2;
    let valid = |e: &&GidEntry| e.gid != [0; 16];
    if let Some(i) = wanted {
        return table
            .iter()
            .find(|e| e.index == i as u32)
            .map(|e| (i, e.gid))
            .ok_or_else(|| format!("configured gid_index {i} is not in the port's GID table"));
    }
    let pick = match link {
        RdmaLinkLayer::Infiniband => table.iter().filter(valid).min_by_key(|e| e.index),
        RdmaLinkLayer::Ethernet => table
            .iter()
            .filter(valid)
            .find(|e| e.gid_type == ROCE_V2 && is_ipv4_mapped(&e.gid))
            .or_else(|| table.iter().filter(valid).find(|e| e.gid_type == ROCE_V2))
            .or_else(|| table.iter().filter(valid).min_by_key(|e| e.index)),
    };
    pick.map(|e| (e.index as u8, e.gid))
        .ok_or_else(|| "the port's GID table has no valid entry".to_string())
}

fn port_state_name(state: u32) -> &'static str {
    match state {
        ffi::ibv_port_state::IBV_PORT_NOP => "NOP",
        ffi::ibv_port_state::IBV_PORT_DOWN => "DOWN",
        ffi::ibv_port_state::IBV_PORT_INIT => "INIT",
        ffi::ibv_port_state::IBV_PORT_ARMED => "ARMED",
        ffi::ibv_port_state::IBV_PORT_ACTIVE => "ACTIVE",
        _ => "ACTIVE_DEFER",
    }
}

/// Opens one device and describes its port; `Err` is why it is unusable.
fn open_device(
    list: &DeviceList,
    index: usize,
    name: &str,
    cfg: &RdmaConfig,
) -> Result<RdmaDevice, String> {
    let handle = Arc::new(list.open(index).map_err(|e| e.to_string())?);
    let attr = handle.query_device().map_err(|e| e.to_string())?;
    let port = handle.query_port(cfg.port).map_err(|e| e.to_string())?;
    if port.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
        return Err(format!(
            "port {} is {}, not ACTIVE",
            cfg.port,
            port_state_name(port.state)
        ));
    }
    let link = if port.link_layer == ffi::IBV_LINK_LAYER_ETHERNET as u8 {
        RdmaLinkLayer::Ethernet
    } else {
        RdmaLinkLayer::Infiniband
    };
    let table = handle
        .gid_table(cfg.port, port.gid_tbl_len.max(1) as usize)
        .map_err(|e| e.to_string())?;
    let (gid_index, gid) = choose_gid(link, &table, cfg.gid_index)?;
    let clamp = |v: i32| v.clamp(1, MAX_RD_ATOMIC as i32) as u8;
    Ok(RdmaDevice {
        handle,
        info: RdmaPortInfo {
            device: name.to_string(),
            port: cfg.port,
            link_layer: link,
            lid: port.lid,
            gid,
            gid_index,
            active_mtu: port.active_mtu.clamp(1, 5) as u8,
        },
        max_qp_wr: attr.max_qp_wr.max(1) as u32,
        max_cqe: attr.max_cqe.max(1) as u32,
        max_rd_atomic: clamp(attr.max_qp_init_rd_atom),
        max_dest_rd_atomic: clamp(attr.max_qp_rd_atom),
    })
}

/// The RDMA transport of one process: the opened devices (one protection
/// domain each) and the memory-region cache. Share it (`Arc`) between every
/// shard and task of the process; connections and registrations keep what
/// they use alive.
pub struct RdmaContext {
    pub(crate) cfg: RdmaConfig,
    pub(crate) devices: Vec<RdmaDevice>,
    cache: Mutex<RangeCache<Registration>>,
    counters: Arc<MrCounters>,
}

impl std::fmt::Debug for RdmaContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaContext")
            .field("devices", &self.device_names())
            .finish()
    }
}

impl RdmaContext {
    /// Opens the configured devices (all with an active port when none is
    /// named). No usable device is [`RdmaError::NoDevice`] with the reason;
    /// a named device that cannot be used is also `NoDevice`.
    pub fn open(cfg: RdmaConfig) -> Result<Arc<Self>, RdmaError> {
        cfg.validate()?;
        let list = DeviceList::get();
        let names = list.as_ref().map(|l| l.names()).map_err(|e| e.clone());
        let picked = select_devices(names.clone(), &cfg.devices).map_err(RdmaError::NoDevice)?;
        let (list, names) = (
            list.expect("listing succeeded"),
            names.expect("listing succeeded"),
        );
        let mut devices = Vec::new();
        let mut unusable = Vec::new();
        for i in picked.into_iter().take(MAX_ADVERTISED_DEVICES) {
            match open_device(&list, i, &names[i], &cfg) {
                Ok(d) => devices.push(d),
                Err(why) => {
                    if !cfg.devices.is_empty() {
                        // A device the operator named must work.
                        return Err(RdmaError::NoDevice(NoDeviceReason::NoActivePort {
                            devices: vec![(names[i].clone(), why)],
                        }));
                    }
                    tracing::warn!("rdma: skipping device {}: {why}", names[i]);
                    unusable.push((names[i].clone(), why));
                }
            }
        }
        if devices.is_empty() {
            return Err(RdmaError::NoDevice(NoDeviceReason::NoActivePort {
                devices: unusable,
            }));
        }
        let cache = RangeCache::new(cfg.mr_cache_max_entries, cfg.mr_cache_max_bytes);
        Ok(Arc::new(Self {
            cfg,
            devices,
            cache: Mutex::new(cache),
            counters: Arc::new(MrCounters::default()),
        }))
    }

    pub fn config(&self) -> &RdmaConfig {
        &self.cfg
    }

    pub fn device_names(&self) -> Vec<String> {
        self.devices.iter().map(|d| d.info.device.clone()).collect()
    }

    /// What this process advertises to peers.
    pub fn caps(&self) -> RdmaCaps {
        RdmaCaps {
            devices: self.devices.iter().map(|d| d.info.clone()).collect(),
            unavailable_reason: String::new(),
        }
    }

    pub(crate) fn handles(&self) -> Vec<Arc<DeviceHandle>> {
        self.devices.iter().map(|d| d.handle.clone()).collect()
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, RangeCache<Registration>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `mem` on every device, through the cache: a cached
    /// registration that already covers its range is returned instead (and
    /// `mem` is dropped; the covering registration keeps its own owner).
    /// When the cache is full, the least recently used registration nobody
    /// holds is released; if all are held, `ResourceExhausted`.
    ///
    /// Registration pins the pages (no on-demand paging): a large segment is
    /// committed here.
    pub fn register(&self, mem: Arc<dyn RdmaMemory>) -> Result<Arc<Registration>, RdmaError> {
        let (addr, len) = (mem.as_ptr() as usize, mem.len());
        if len == 0 {
            return Err(KvError::new(ErrorCode::InvalidParams, "cannot register 0 bytes").into());
        }
        let mut cache = self.lock_cache();
        if let Some(hit) = cache.lookup(addr, len) {
            self.counters.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(hit);
        }
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        let evicted = match cache.make_room(len as u64) {
            Ok(ev) => ev,
            Err((ev, e)) => {
                drop(cache);
                self.count_evictions(ev);
                return Err(e.into());
            }
        };
        let reg = Registration::new(&self.handles(), mem, self.counters.clone()).map(Arc::new);
        if let Ok(reg) = &reg {
            cache.insert(reg.clone());
        }
        drop(cache);
        // Deregistration (a syscall) happens outside the lock.
        self.count_evictions(evicted);
        reg
    }

    fn count_evictions(&self, evicted: Vec<Arc<Registration>>) {
        self.counters
            .evictions
            .fetch_add(evicted.len() as u64, Ordering::Relaxed);
    }

    /// The registered memory covering `addr..addr+len`, as a slice ready for
    /// a transfer; `None` if no cached registration covers it.
    pub fn lookup(&self, addr: usize, len: usize) -> Option<LocalSlice> {
        let reg = self.lock_cache().lookup(addr, len);
        match reg {
            Some(reg) => {
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                let offset = addr - reg.addr();
                Some(
                    reg.slice(offset, len)
                        .expect("the cache returned a covering range"),
                )
            }
            None => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Drops the cache's hold on the registration of exactly
    /// `addr..addr+len`. It is deregistered when the last holder (a caller,
    /// a work request in flight) lets go. Returns whether it was cached.
    pub fn unregister(&self, addr: usize, len: usize) -> bool {
        let removed = self.lock_cache().remove(addr, len);
        removed.is_some()
    }

    pub fn mr_cache_stats(&self) -> MrCacheStats {
        let cache = self.lock_cache();
        MrCacheStats {
            registrations: self.counters.registrations.load(Ordering::Relaxed),
            deregistrations: self.counters.deregistrations.load(Ordering::Relaxed),
            hits: self.counters.hits.load(Ordering::Relaxed),
            misses: self.counters.misses.load(Ordering::Relaxed),
            evictions: self.counters.evictions.load(Ordering::Relaxed),
            entries: cache.len(),
            bytes: cache.bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Result<Vec<String>, (i32, String)> {
        Ok(v.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn each_no_device_reason_is_told_apart() {
        let e = select_devices(Err((38, "Function not implemented".into())), &[]).unwrap_err();
        assert!(e.is_enosys(), "{e}");
        assert_eq!(
            select_devices(names(&[]), &[]).unwrap_err(),
            NoDeviceReason::EmptyList
        );
        let e = select_devices(names(&["rxe0"]), &["mlx5_0".into()]).unwrap_err();
        assert_eq!(
            e,
            NoDeviceReason::NamedMissing {
                missing: vec!["mlx5_0".into()],
                present: vec!["rxe0".into()]
            }
        );
    }

    #[test]
    fn all_devices_or_the_named_ones_in_their_order() {
        assert_eq!(select_devices(names(&["a", "b"]), &[]).unwrap(), vec![0, 1]);
        assert_eq!(
            select_devices(names(&["a", "b", "c"]), &["c".into(), "a".into()]).unwrap(),
            vec![2, 0]
        );
    }

    fn gid(last: [u8; 4], mapped: bool) -> [u8; 16] {
        let mut g = [0u8; 16];
        if mapped {
            g[10] = 0xff;
            g[11] = 0xff;
        } else {
            g[0] = 0xfe;
            g[1] = 0x80;
        }
        g[12..].copy_from_slice(&last);
        g
    }

    #[test]
    fn roce_prefers_a_v2_ipv4_mapped_gid() {
        let table = [
            GidEntry {
                index: 0,
                gid: gid([1, 2, 3, 4], false),
                gid_type: ffi::IBV_GID_TYPE_ROCE_V2,
            },
            GidEntry {
                index: 1,
                gid: gid([10, 0, 2, 15], true),
                gid_type: ffi::IBV_GID_TYPE_ROCE_V1,
            },
            GidEntry {
                index: 2,
                gid: gid([10, 0, 2, 15], true),
                gid_type: ffi::IBV_GID_TYPE_ROCE_V2,
            },
        ];
        assert_eq!(
            choose_gid(RdmaLinkLayer::Ethernet, &table, None).unwrap().0,
            2
        );
        assert_eq!(
            choose_gid(RdmaLinkLayer::Ethernet, &table[..2], None)
                .unwrap()
                .0,
            0
        );
        assert_eq!(
            choose_gid(RdmaLinkLayer::Infiniband, &table, None)
                .unwrap()
                .0,
            0
        );
        assert_eq!(
            choose_gid(RdmaLinkLayer::Ethernet, &table, Some(1))
                .unwrap()
                .0,
            1
        );
        assert!(choose_gid(RdmaLinkLayer::Ethernet, &table, Some(7)).is_err());
        assert!(choose_gid(RdmaLinkLayer::Ethernet, &[], None).is_err());
    }
}
