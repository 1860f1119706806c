//! Thin owners of verbs objects: every raw pointer from libibverbs lives in
//! exactly one of these types, and is released in its `Drop`.
//!
//! Lifetimes follow the verbs rules through `Arc`s: a memory region, a
//! completion queue and a queue pair each hold their device (context + PD), and
//! a queue pair holds its completion queue, so nothing is destroyed while
//! something created from it lives. Whether the *memory* behind a work request
//! stays valid is the caller's business (see `memory` and `connection`).
//!
//! All `unsafe` of the transport's verbs calls is in this file.

use std::ffi::CStr;
use std::io;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use ibverbs_sys as ffi;

use super::error::RdmaError;

/// The kernel's device list, freed on drop. Devices are opened from it and
/// stay usable after it is freed.
pub(crate) struct DeviceList {
    list: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

impl DeviceList {
    /// Lists the devices, or the errno and message of the failure (`ENOSYS`
    /// when the kernel has no RDMA support).
    pub(crate) fn get() -> Result<Self, (i32, String)> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the call returns a NULL-terminated
        // array that we own until `ibv_free_device_list`, or NULL with errno.
        let p = unsafe { ffi::ibv_get_device_list(&mut n) };
        match NonNull::new(p) {
            Some(list) => Ok(Self {
                list,
                len: n.max(0) as usize,
            }),
            None => {
                let e = io::Error::last_os_error();
                Err((e.raw_os_error().unwrap_or(0), e.to_string()))
            }
        }
    }

    fn raw(&self) -> &[*mut ffi::ibv_device] {
        // SAFETY: the array holds `len` device pointers and lives until drop.
        unsafe { std::slice::from_raw_parts(self.list.as_ptr(), self.len) }
    }

    pub(crate) fn names(&self) -> Vec<String> {
        self.raw()
            .iter()
            .map(|d| {
                // SAFETY: `d` is a device of this live list; the name is a
                // NUL-terminated string owned by the device.
                let name = unsafe { ffi::ibv_get_device_name(*d) };
                if name.is_null() {
                    String::from("?")
                } else {
                    // SAFETY: non-null, NUL-terminated (see above).
                    unsafe { CStr::from_ptr(name) }
                        .to_string_lossy()
                        .into_owned()
                }
            })
            .collect()
    }

    /// Opens the device at `index` (of `names()`).
    pub(crate) fn open(&self, index: usize) -> Result<DeviceHandle, RdmaError> {
        let dev = self.raw()[index];
        // SAFETY: `dev` is a device of this live list.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        let ctx = NonNull::new(ctx).ok_or_else(|| RdmaError::verbs_last("ibv_open_device"))?;
        // SAFETY: `ctx` was just opened.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.as_ptr()) };
        let Some(pd) = NonNull::new(pd) else {
            let e = RdmaError::verbs_last("ibv_alloc_pd");
            // SAFETY: nothing was created from `ctx`.
            unsafe { ffi::ibv_close_device(ctx.as_ptr()) };
            return Err(e);
        };
        Ok(DeviceHandle { ctx, pd })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from `ibv_get_device_list`; opened contexts
        // stay valid after it is freed.
        unsafe { ffi::ibv_free_device_list(self.list.as_ptr()) };
    }
}

/// An opened device context and its one protection domain.
pub(crate) struct DeviceHandle {
    ctx: NonNull<ffi::ibv_context>,
    pd: NonNull<ffi::ibv_pd>,
}

// SAFETY: libibverbs contexts and PDs may be used from any thread (the
// library serialises what needs it); the handle only hands out the pointers
// to the owners below.
unsafe impl Send for DeviceHandle {}
// SAFETY: as above; no method mutates the handle itself.
unsafe impl Sync for DeviceHandle {}

/// One GID table entry of a port.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GidEntry {
    pub index: u32,
    pub gid: [u8; 16],
    pub gid_type: u32,
}

impl DeviceHandle {
    pub(crate) fn query_device(&self) -> Result<ffi::ibv_device_attr, RdmaError> {
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: `attr` is a valid out-struct of the type the call fills.
        let rc = unsafe { ffi::ibv_query_device(self.ctx.as_ptr(), &mut attr) };
        if rc != 0 {
            return Err(RdmaError::verbs("ibv_query_device", rc));
        }
        Ok(attr)
    }

    pub(crate) fn query_port(&self, port: u8) -> Result<ffi::ibv_port_attr, RdmaError> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: the exported `ibv_query_port` fills the compat layout, a
        // prefix of `ibv_port_attr` (state .. link_layer, flags); the rest
        // stays zero. `attr` outlives the call.
        let rc = unsafe {
            ffi::ibv_query_port(
                self.ctx.as_ptr(),
                port,
                (&mut attr as *mut ffi::ibv_port_attr).cast(),
            )
        };
        if rc != 0 {
            return Err(RdmaError::verbs("ibv_query_port", rc));
        }
        Ok(attr)
    }

    /// The valid GID entries of `port` (at most `max` looked at).
    pub(crate) fn gid_table(&self, port: u8, max: usize) -> Result<Vec<GidEntry>, RdmaError> {
        let mut entries = vec![ffi::ibv_gid_entry::default(); max.max(1)];
        // SAFETY: `entries` has room for `entries.len()` entries of the size
        // passed; the call writes at most that many.
        let n = unsafe {
            ffi::_ibv_query_gid_table(
                self.ctx.as_ptr(),
                entries.as_mut_ptr(),
                entries.len(),
                0,
                std::mem::size_of::<ffi::ibv_gid_entry>(),
            )
        };
        if n < 0 {
            return Err(RdmaError::verbs("ibv_query_gid_table", -n as i32));
        }
        entries.truncate(n as usize);
        Ok(entries
            .iter()
            .filter(|e| e.port_num == port as u32)
            .map(|e| GidEntry {
                index: e.gid_index,
                // SAFETY: `raw` is the 16-byte view of the GID union; every
                // bit pattern is a valid byte array.
                gid: unsafe { e.gid.raw },
                gid_type: e.gid_type,
            })
            .collect())
    }
}

impl Drop for DeviceHandle {
    fn drop(&mut self) {
        // SAFETY: every object created from the PD or context holds an Arc of
        // this handle, so they are all gone; PD first, then the context.
        unsafe {
            let rc = ffi::ibv_dealloc_pd(self.pd.as_ptr());
            if rc != 0 {
                tracing::error!(
                    "ibv_dealloc_pd failed: {}",
                    io::Error::from_raw_os_error(rc)
                );
            }
            let rc = ffi::ibv_close_device(self.ctx.as_ptr());
            if rc != 0 {
                tracing::error!("ibv_close_device failed: {}", io::Error::last_os_error());
            }
        }
    }
}

/// A registered memory region. Deregistered on drop.
pub(crate) struct Mr {
    mr: NonNull<ffi::ibv_mr>,
    _dev: Arc<DeviceHandle>,
}

// SAFETY: an MR is an immutable handle after registration (keys, address);
// deregistration happens once, in drop.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `len` bytes at `addr` for local write and remote read/write.
    ///
    /// # Safety
    /// `addr..addr+len` must be mapped memory that stays valid (not unmapped
    /// or freed) until this `Mr` is dropped; the NIC may read and write it
    /// for as long as work requests or peers use the keys.
    pub(crate) unsafe fn register(
        dev: &Arc<DeviceHandle>,
        addr: *mut u8,
        len: usize,
    ) -> Result<Self, RdmaError> {
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        // SAFETY: the PD is live (held by `dev`); the range is valid per the
        // caller's contract.
        let mr = unsafe { ffi::ibv_reg_mr(dev.pd.as_ptr(), addr.cast(), len, access as c_int) };
        let mr = NonNull::new(mr).ok_or_else(|| RdmaError::verbs_last("ibv_reg_mr"))?;
        Ok(Self {
            mr,
            _dev: dev.clone(),
        })
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the MR is live until drop; keys never change.
        unsafe { self.mr.as_ref().lkey }
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: as for `lkey`.
        unsafe { self.mr.as_ref().rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once here. Owners
        // drop an `Mr` only when no work request uses it (see `memory`).
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            tracing::error!("ibv_dereg_mr failed: {}", io::Error::from_raw_os_error(rc));
        }
    }
}

/// A completion queue. Destroyed on drop (after every QP using it).
pub(crate) struct Cq {
    cq: NonNull<ffi::ibv_cq>,
    entries: usize,
    _dev: Arc<DeviceHandle>,
}

// SAFETY: polling a CQ is thread-safe in libibverbs providers; we poll it
// under the owning connection's lock anyway.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub(crate) fn new(dev: &Arc<DeviceHandle>, entries: usize) -> Result<Self, RdmaError> {
        let cqe = c_int::try_from(entries.max(1)).map_err(|_| RdmaError::Verbs {
            op: "ibv_create_cq",
            source: io::Error::from_raw_os_error(22),
        })?;
        // SAFETY: the context is live (held by `dev`); no channel, no context
        // pointer.
        let cq = unsafe {
            ffi::ibv_create_cq(dev.ctx.as_ptr(), cqe, ptr::null_mut(), ptr::null_mut(), 0)
        };
        let cq = NonNull::new(cq).ok_or_else(|| RdmaError::verbs_last("ibv_create_cq"))?;
        Ok(Self {
            cq,
            entries: entries.max(1),
            _dev: dev.clone(),
        })
    }

    /// Capacity asked for at creation (the device may round it up).
    pub(crate) fn entries(&self) -> usize {
        self.entries
    }

    /// Pops up to `wcs.len()` completions; returns how many.
    pub(crate) fn poll(&self, wcs: &mut [ffi::ibv_wc]) -> Result<usize, RdmaError> {
        // SAFETY: the CQ and its context are live; `poll_cq` is the
        // provider's entry point that the inline `ibv_poll_cq` calls, and it
        // writes at most `wcs.len()` entries.
        let n = unsafe {
            let ctx = (*self.cq.as_ptr()).context;
            let poll = (*ctx)
                .ops
                .poll_cq
                .expect("every verbs provider implements poll_cq");
            poll(self.cq.as_ptr(), wcs.len() as c_int, wcs.as_mut_ptr())
        };
        if n < 0 {
            return Err(RdmaError::verbs("ibv_poll_cq", -n));
        }
        Ok(n as usize)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every QP on this CQ holds an Arc of it, so none is left.
        let rc = unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
        if rc != 0 {
            tracing::error!(
                "ibv_destroy_cq failed: {}",
                io::Error::from_raw_os_error(rc)
            );
        }
    }
}

/// Parameters of the RTR transition: where the peer is.
#[derive(Debug, Clone)]
pub(crate) struct RtrParams {
    pub port: u8,
    pub path_mtu: u32,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub dlid: u16,
    pub dgid: [u8; 16],
    /// Use a GRH (RoCE always; InfiniBand across subnets).
    pub global: bool,
    pub sgid_index: u8,
}

/// Parameters of the RTS transition.
#[derive(Debug, Clone)]
pub(crate) struct RtsParams {
    pub sq_psn: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub max_rd_atomic: u8,
}

/// A reliable-connected queue pair. Destroyed on drop.
pub(crate) struct Qp {
    qp: NonNull<ffi::ibv_qp>,
    _cq: Arc<Cq>,
    _dev: Arc<DeviceHandle>,
}

// SAFETY: posting and modifying a QP is thread-safe in libibverbs; the
// connection serialises its own use under a lock.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    /// Creates an RC QP whose send and receive completions go to `cq`. Only
    /// the send queue is used (one-sided operations).
    pub(crate) fn new_rc(
        dev: &Arc<DeviceHandle>,
        cq: &Arc<Cq>,
        max_send_wr: u32,
    ) -> Result<Self, RdmaError> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq.cq.as_ptr(),
            recv_cq: cq.cq.as_ptr(),
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the PD and CQ are live (held below); `init` outlives the call.
        let qp = unsafe { ffi::ibv_create_qp(dev.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| RdmaError::verbs_last("ibv_create_qp"))?;
        Ok(Self {
            qp,
            _cq: cq.clone(),
            _dev: dev.clone(),
        })
    }

    pub(crate) fn qpn(&self) -> u32 {
        // SAFETY: the QP is live; its number never changes.
        unsafe { self.qp.as_ref().qp_num }
    }

    fn modify(
        &self,
        op: &'static str,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
    ) -> Result<(), RdmaError> {
        // SAFETY: the QP is live; `attr` is a valid attribute struct whose
        // fields named by `mask` are set.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as c_int) };
        if rc != 0 {
            return Err(RdmaError::verbs(op, rc));
        }
        Ok(())
    }

    /// RESET -> INIT, allowing remote READ and WRITE into this side's MRs.
    pub(crate) fn to_init(&self, port: u8) -> Result<(), RdmaError> {
        use ffi::ibv_qp_attr_mask as m;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(INIT)",
            &mut attr,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
        )
    }

    /// INIT -> RTR: connect to the peer's QP.
    pub(crate) fn to_rtr(&self, p: &RtrParams) -> Result<(), RdmaError> {
        use ffi::ibv_qp_attr_mask as m;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: p.path_mtu,
            dest_qp_num: p.dest_qpn,
            rq_psn: p.rq_psn,
            max_dest_rd_atomic: p.max_dest_rd_atomic,
            min_rnr_timer: 12,
            ..Default::default()
        };
        attr.ah_attr.dlid = p.dlid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = p.port;
        if p.global {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = p.dgid;
            attr.ah_attr.grh.sgid_index = p.sgid_index;
            attr.ah_attr.grh.hop_limit = 64;
            attr.ah_attr.grh.traffic_class = 0;
            attr.ah_attr.grh.flow_label = 0;
        }
        self.modify(
            "ibv_modify_qp(RTR)",
            &mut attr,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
        )
    }

    /// RTR -> RTS: ready to post.
    pub(crate) fn to_rts(&self, p: &RtsParams) -> Result<(), RdmaError> {
        use ffi::ibv_qp_attr_mask as m;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: p.sq_psn,
            timeout: p.timeout,
            retry_cnt: p.retry_cnt,
            rnr_retry: 7,
            max_rd_atomic: p.max_rd_atomic,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(RTS)",
            &mut attr,
            m::IBV_QP_STATE
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Any state -> ERR: outstanding work requests complete with
    /// `IBV_WC_WR_FLUSH_ERR`, after which the NIC no longer touches their
    /// buffers.
    pub(crate) fn to_error(&self) -> Result<(), RdmaError> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(ERR)",
            &mut attr,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE,
        )
    }

    /// Posts a chain of send work requests.
    ///
    /// On failure returns the errno and how many of the chain's WRs were
    /// posted before the one refused (those will complete; the rest will not).
    ///
    /// # Safety
    /// `head` must start a valid `next`-linked chain whose SGEs name memory
    /// registered on this QP's PD, and that memory must stay valid until each
    /// posted WR's completion has been polled (or the QP is destroyed).
    pub(crate) unsafe fn post_send(&self, head: *mut ffi::ibv_send_wr) -> Result<(), (i32, usize)> {
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: the QP and context are live; `post_send` is the provider's
        // entry point that the inline `ibv_post_send` calls. The chain is
        // valid per the caller's contract; the provider copies the WRs.
        let rc = unsafe {
            let ctx = (*self.qp.as_ptr()).context;
            let post = (*ctx)
                .ops
                .post_send
                .expect("every verbs provider implements post_send");
            post(self.qp.as_ptr(), head, &mut bad)
        };
        if rc == 0 {
            return Ok(());
        }
        // A provider that refuses without naming a WR posted none of them.
        let mut posted = 0;
        if !bad.is_null() {
            let mut wr = head;
            while !wr.is_null() && wr != bad {
                posted += 1;
                // SAFETY: walking the caller's valid chain.
                wr = unsafe { (*wr).next };
            }
        }
        Err((rc, posted))
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created in `new_rc`, destroyed once. Owners move the QP to
        // ERR and drain it before dropping it while WRs are outstanding.
        let rc = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            tracing::error!(
                "ibv_destroy_qp failed: {}",
                io::Error::from_raw_os_error(rc)
            );
        }
    }
}

/// Builds a one-SGE RDMA READ or WRITE work request (signaled).
pub(crate) fn rdma_wr(
    wr_id: u64,
    sge: *mut ffi::ibv_sge,
    write: bool,
    remote_addr: u64,
    rkey: u32,
) -> ffi::ibv_send_wr {
    let mut wr = ffi::ibv_send_wr {
        wr_id,
        next: ptr::null_mut(),
        sg_list: sge,
        num_sge: 1,
        opcode: if write {
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE
        } else {
            ffi::ibv_wr_opcode::IBV_WR_RDMA_READ
        },
        send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
        ..Default::default()
    };
    wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
    wr
}

/// A zeroed work completion, for poll buffers.
pub(crate) fn empty_wc() -> ffi::ibv_wc {
    ffi::ibv_wc::default()
}
