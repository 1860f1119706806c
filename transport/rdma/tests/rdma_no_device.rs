//! "No RDMA device" is an answer with a reason, never a crash or a silent
//! fallback. On a machine without a device (listing fails with ENOSYS) this
//! checks that exact report; inside the soft-RoCE guest, where listing works,
//! it checks the other reasons (a named device that is missing or unusable).
#![cfg(feature = "rdma")]

use kvpool_rdma::{NoDeviceReason, RdmaConfig, RdmaContext, RdmaError};
use kvpool_wire::{ErrorCode, KvError, RdmaCaps};

fn no_device(cfg: RdmaConfig) -> NoDeviceReason {
    match RdmaContext::open(cfg) {
        Err(RdmaError::NoDevice(r)) => r,
        Err(e) => panic!("expected NoDevice, got another error: {e}"),
        Ok(ctx) => panic!("expected NoDevice, opened {:?}", ctx.device_names()),
    }
}

#[test]
fn no_device_is_reported_with_its_reason() {
    match RdmaContext::open(RdmaConfig::default()) {
        Err(RdmaError::NoDevice(reason)) => {
            if std::env::var("RDMA_TESTS_REQUIRE_DEVICE").as_deref() == Ok("1") {
                panic!("RDMA_TESTS_REQUIRE_DEVICE=1 but no RDMA device: {reason}");
            }
            println!("skip: no RDMA device ({reason}) -- checking that report");
            let text = reason.to_string();
            // Without the kernel's verbs class, listing fails with ENOSYS.
            if !std::path::Path::new("/sys/class/infiniband_verbs").exists() {
                assert!(reason.is_enosys(), "{reason:?}");
                assert!(text.contains("ENOSYS"), "{text}");
            }
            match &reason {
                NoDeviceReason::ListFailed { errno, message } => {
                    assert!(*errno > 0 && !message.is_empty(), "{reason:?}");
                }
                NoDeviceReason::EmptyList | NoDeviceReason::NoActivePort { .. } => {}
                NoDeviceReason::NamedMissing { .. } => panic!("no device was named: {reason:?}"),
            }
            // Naming a device does not hide why listing failed.
            let named = no_device(RdmaConfig {
                devices: vec!["mlx5_0".into()],
                ..Default::default()
            });
            assert_eq!(named, reason);
            // What the node logs and advertises.
            let e = KvError::from(RdmaError::NoDevice(reason.clone()));
            assert_eq!(e.code, ErrorCode::Unavailable);
            assert_eq!(e.message, format!("no RDMA device: {text}"));
            let caps = RdmaCaps::unavailable(e.message.clone());
            assert!(!caps.is_available());
        }
        Ok(ctx) => {
            let present = ctx.device_names();
            println!("devices: {present:?}; checking the other no-device reasons");
            match no_device(RdmaConfig {
                devices: vec!["no-such-dev9".into()],
                ..Default::default()
            }) {
                NoDeviceReason::NamedMissing {
                    missing,
                    present: p,
                } => {
                    assert_eq!(missing, vec!["no-such-dev9".to_string()]);
                    assert_eq!(p, present);
                }
                other => panic!("{other:?}"),
            }
            // A named device that cannot be used is NoDevice too, with why.
            match no_device(RdmaConfig {
                devices: vec![present[0].clone()],
                gid_index: Some(250),
                ..Default::default()
            }) {
                NoDeviceReason::NoActivePort { devices } => {
                    assert_eq!(devices[0].0, present[0]);
                    assert!(devices[0].1.contains("gid_index 250"), "{devices:?}");
                }
                other => panic!("{other:?}"),
            }
            match no_device(RdmaConfig {
                devices: vec![present[0].clone()],
                port: 9,
                ..Default::default()
            }) {
                NoDeviceReason::NoActivePort { devices } => {
                    assert_eq!(devices[0].0, present[0]);
                }
                other => panic!("{other:?}"),
            }
            let caps = ctx.caps();
            assert!(caps.is_available());
            assert_eq!(caps.devices[0].device, present[0]);
        }
        Err(e) => panic!("opening RDMA failed with something other than NoDevice: {e}"),
    }
}

#[test]
fn a_bad_config_is_refused_before_touching_devices() {
    let e = RdmaContext::open(RdmaConfig {
        lanes_per_peer: 0,
        ..Default::default()
    })
    .unwrap_err();
    assert!(!e.is_no_device());
    assert_eq!(e.code(), ErrorCode::InvalidParams);
    assert!(e.to_string().contains("rdma.lanes_per_peer"), "{e}");
}
