//! Wire types of the RDMA transport's connection set-up.
//!
//! They are compiled with or without the `rdma` feature, so that the protocol
//! is the same on every build: a node built without the feature still answers
//! a client's [`RdmaRequest::Caps`] with "no RDMA here, and why", and the
//! client falls back to tcp with that reason in its log line.
//!
//! The exchange rides on our rkyv control channel (no metadata server):
//!
//! ```text
//!  client                                          storage node
//!    | RdmaRequest::Caps                       ->    |
//!    |    <- RdmaResponse::Caps(RdmaCaps)            |   devices, ports, GIDs (or the reason there are none)
//!    | create QPs (INIT)                              |
//!    | RdmaRequest::Connect(RdmaConnectRequest) ->   |   per lane: QPN, PSN, LID, GID, MTU, rd-atomic depth
//!    |                                                |   create QPs, INIT -> RTR -> RTS
//!    |    <- RdmaResponse::Connected(RdmaConnectReply)|   per lane: the same; per device: segment addr, len, rkey
//!    | QPs RTR -> RTS; one-sided READ/WRITE from now  |
//! ```
//!
//! The node keeps its side of the queue pairs for as long as the control
//! connection that set them up stays open; closing it tears them down.
//!
//! Every field comes from the network: receivers validate counts, indices and
//! ranges before use ([`RdmaConnectRequest::validate`],
//! [`RdmaConnectReply::validate`]). A change to any type here is a protocol
//! version bump (`frame::VERSION`), as for `proto`.

use rkyv::{Archive, Deserialize, Serialize};

use crate::error::{ErrorCode, KvError};

pub use crate::limits::{MAX_ADVERTISED_DEVICES, MAX_LANES_PER_CONNECTION};

/// The link layer of a port: it decides how a queue pair addresses its peer
/// (LID on InfiniBand, GID in a GRH on RoCE).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RdmaLinkLayer {
    Infiniband,
    Ethernet,
}

/// One usable port of one RDMA device.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RdmaPortInfo {
    /// The device name (`mlx5_0`, `rxe0`), unique on its host only.
    pub device: String,
    pub port: u8,
    pub link_layer: RdmaLinkLayer,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The GID used as source address (RoCE: the one at `gid_index`).
    pub gid: [u8; 16],
    pub gid_index: u8,
    /// Active MTU as the verbs enum: 1 = 256 B .. 5 = 4096 B.
    pub active_mtu: u8,
}

/// What a peer's RDMA transport can do. No devices means no RDMA, and
/// `unavailable_reason` says why (shown in the fallback log line).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct RdmaCaps {
    pub devices: Vec<RdmaPortInfo>,
    pub unavailable_reason: String,
}

impl RdmaCaps {
    /// The caps of a peer that cannot do RDMA, with the reason.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self {
            devices: Vec::new(),
            unavailable_reason: reason.into(),
        }
    }

    pub fn is_available(&self) -> bool {
        !self.devices.is_empty()
    }
}

/// One side of one queue pair, as its peer needs it to connect (RTR).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RdmaQpEndpoint {
    /// Index of the device in the sender's [`RdmaCaps::devices`].
    pub device: u16,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number the sender will use (24 bits).
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// Active MTU of the sender's port (verbs enum, 1..=5).
    pub mtu: u8,
    /// RDMA READs the sender's QP accepts in flight as responder
    /// (`max_dest_rd_atomic`); the peer's initiator depth must not exceed it.
    pub max_dest_rd_atomic: u8,
}

/// One lane the client wants: its own endpoint and which of the node's
/// devices (index into the node's caps) should serve it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RdmaLaneRequest {
    pub local: RdmaQpEndpoint,
    pub remote_device: u16,
}

/// Client -> node: connect these lanes to the segment `segment_id`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RdmaConnectRequest {
    pub segment_id: u64,
    pub lanes: Vec<RdmaLaneRequest>,
}

/// The node's segment as seen through one of its devices: one-sided
/// operations target `addr + offset` with `rkey`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RdmaRegion {
    /// Index of the device in the node's caps.
    pub device: u16,
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

/// Node -> client: the node's endpoint for every requested lane (same order)
/// and the segment's address and key on every device those lanes use.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RdmaConnectReply {
    pub lanes: Vec<RdmaQpEndpoint>,
    pub regions: Vec<RdmaRegion>,
}

/// Requests of the RDMA set-up exchange.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum RdmaRequest {
    Caps,
    Connect(RdmaConnectRequest),
}

/// Answers of the RDMA set-up exchange (errors travel as error frames).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum RdmaResponse {
    Caps(RdmaCaps),
    Connected(RdmaConnectReply),
}

const PSN_MASK: u32 = 0x00ff_ffff;

fn invalid(msg: String) -> KvError {
    KvError::new(ErrorCode::InvalidParams, msg)
}

impl RdmaQpEndpoint {
    fn validate(&self, what: &str, devices: usize) -> Result<(), KvError> {
        if self.device as usize >= devices {
            return Err(invalid(format!(
                "{what}: device index {} but the peer has {devices} device(s)",
                self.device
            )));
        }
        if self.qpn & !PSN_MASK != 0 || self.qpn == 0 {
            return Err(invalid(format!("{what}: bad QPN {:#x}", self.qpn)));
        }
        if self.psn & !PSN_MASK != 0 {
            return Err(invalid(format!("{what}: PSN {:#x} over 24 bits", self.psn)));
        }
        if !(1..=5).contains(&self.mtu) {
            return Err(invalid(format!(
                "{what}: MTU code {} not in 1..=5",
                self.mtu
            )));
        }
        Ok(())
    }
}

impl RdmaConnectRequest {
    /// Checks a request from the network against the caps this node
    /// advertises (`local_devices` of them).
    pub fn validate(&self, local_devices: usize) -> Result<(), KvError> {
        if self.lanes.is_empty() || self.lanes.len() > MAX_LANES_PER_CONNECTION {
            return Err(invalid(format!(
                "connect asks for {} lanes (1..={MAX_LANES_PER_CONNECTION})",
                self.lanes.len()
            )));
        }
        for (i, lane) in self.lanes.iter().enumerate() {
            // The client's device index refers to the client's caps, which
            // the node does not know; bound it by the protocol limit only.
            lane.local
                .validate(&format!("lane {i}"), MAX_ADVERTISED_DEVICES)?;
            if lane.remote_device as usize >= local_devices {
                return Err(invalid(format!(
                    "lane {i} asks for device {} but this node has {local_devices}",
                    lane.remote_device
                )));
            }
        }
        Ok(())
    }
}

impl RdmaConnectReply {
    /// Checks a reply from the network against the request it answers.
    pub fn validate(&self, req: &RdmaConnectRequest) -> Result<(), KvError> {
        if self.lanes.len() != req.lanes.len() {
            return Err(invalid(format!(
                "reply has {} lanes for a request of {}",
                self.lanes.len(),
                req.lanes.len()
            )));
        }
        for (i, (lane, asked)) in self.lanes.iter().zip(&req.lanes).enumerate() {
            lane.validate(&format!("reply lane {i}"), MAX_ADVERTISED_DEVICES)?;
            if lane.device != asked.remote_device {
                return Err(invalid(format!(
                    "reply lane {i} is on device {} but device {} was asked for",
                    lane.device, asked.remote_device
                )));
            }
            if self.region(lane.device).is_none() {
                return Err(invalid(format!(
                    "reply has no region for device {} (lane {i})",
                    lane.device
                )));
            }
        }
        for r in &self.regions {
            if r.len == 0 || r.addr.checked_add(r.len).is_none() {
                return Err(invalid(format!(
                    "region on device {}: bad range {:#x}+{}",
                    r.device, r.addr, r.len
                )));
            }
        }
        Ok(())
    }

    /// The segment as seen through the node's device `device`.
    pub fn region(&self, device: u16) -> Option<&RdmaRegion> {
        self.regions.iter().find(|r| r.device == device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{self, FrameKind};

    fn endpoint(device: u16) -> RdmaQpEndpoint {
        RdmaQpEndpoint {
            device,
            qpn: 0x11,
            psn: 0x123456,
            lid: 0,
            gid: [0xfe; 16],
            mtu: 3,
            max_dest_rd_atomic: 16,
        }
    }

    fn request() -> RdmaConnectRequest {
        RdmaConnectRequest {
            segment_id: 7,
            lanes: vec![
                RdmaLaneRequest {
                    local: endpoint(0),
                    remote_device: 0,
                },
                RdmaLaneRequest {
                    local: endpoint(0),
                    remote_device: 0,
                },
            ],
        }
    }

    fn reply() -> RdmaConnectReply {
        RdmaConnectReply {
            lanes: vec![endpoint(0), endpoint(0)],
            regions: vec![RdmaRegion {
                device: 0,
                addr: 0x7f00_0000_0000,
                len: 1 << 20,
                rkey: 0x42,
            }],
        }
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        futures_lite::future::block_on(f)
    }

    #[test]
    fn set_up_messages_round_trip_through_frames() {
        let caps = RdmaCaps {
            devices: vec![RdmaPortInfo {
                device: "rxe0".into(),
                port: 1,
                link_layer: RdmaLinkLayer::Ethernet,
                lid: 0,
                gid: [1; 16],
                gid_index: 1,
                active_mtu: 3,
            }],
            unavailable_reason: String::new(),
        };
        for msg in [
            RdmaResponse::Caps(caps),
            RdmaResponse::Caps(RdmaCaps::unavailable("no RDMA device (ENOSYS)")),
            RdmaResponse::Connected(reply()),
        ] {
            let bytes = frame::encode(FrameKind::DataResponse, 3, &msg);
            let mut r = futures_lite::io::Cursor::new(bytes);
            let (id, got): (u64, RdmaResponse) = block_on(frame::read_message(
                &mut r,
                FrameKind::DataResponse,
                1 << 16,
            ))
            .unwrap();
            assert_eq!(id, 3);
            assert_eq!(got, msg);
        }
        let req = RdmaRequest::Connect(request());
        let bytes = frame::encode(FrameKind::DataRequest, 4, &req);
        let mut r = futures_lite::io::Cursor::new(bytes);
        let (_, got): (u64, RdmaRequest) =
            block_on(frame::read_message(&mut r, FrameKind::DataRequest, 1 << 16)).unwrap();
        assert_eq!(got, req);
    }

    #[test]
    fn a_good_request_and_reply_validate() {
        request().validate(1).unwrap();
        reply().validate(&request()).unwrap();
        assert!(!RdmaCaps::unavailable("x").is_available());
    }

    #[test]
    fn bad_requests_are_refused() {
        let mut r = request();
        r.lanes.clear();
        assert_eq!(r.validate(1).unwrap_err().code, ErrorCode::InvalidParams);

        let mut r = request();
        r.lanes[1].remote_device = 1;
        assert!(r.validate(1).unwrap_err().message.contains("device 1"));

        let mut r = request();
        r.lanes[0].local.qpn = 1 << 24;
        assert!(r.validate(1).is_err());

        let mut r = request();
        r.lanes[0].local.psn = 1 << 24;
        assert!(r.validate(1).is_err());

        let mut r = request();
        r.lanes[0].local.mtu = 6;
        assert!(r.validate(1).is_err());

        let mut r = request();
        let lane = r.lanes[0].clone();
        r.lanes = vec![lane; MAX_LANES_PER_CONNECTION + 1];
        assert!(r.validate(1).is_err());
    }

    #[test]
    fn bad_replies_are_refused() {
        let req = request();
        let mut r = reply();
        r.lanes.pop();
        assert!(r.validate(&req).is_err());

        let mut r = reply();
        r.regions.clear();
        assert!(r.validate(&req).unwrap_err().message.contains("no region"));

        let mut r = reply();
        r.regions[0].len = 0;
        assert!(r.validate(&req).is_err());

        let mut r = reply();
        r.regions[0].addr = u64::MAX;
        assert!(r.validate(&req).is_err());

        let mut r = reply();
        r.lanes[1].device = 3;
        assert!(r.validate(&req).is_err());
    }
}
