use super::*;

#[test]
fn loopback_addresses_are_told_from_wider_ones() {
    assert!(is_loopback("127.0.0.1:7070"));
    assert!(is_loopback("[::1]:7070"));
    assert!(is_loopback("localhost:7070"));
    assert!(!is_loopback("0.0.0.0:7070"));
    assert!(!is_loopback("[::]:7070"));
    assert!(!is_loopback("10.1.2.3:7070"));
}

#[test]
fn a_short_secret_is_an_error_naming_the_key() {
    let e = NodeConfig::from_toml("[security]\nsecret = \"short\"\n", "t").unwrap_err();
    assert!(e.to_string().contains("security.secret"), "{e}");
    let c = NodeConfig::from_toml("[security]\nsecret = \"0123456789abcdef\"\n", "t").unwrap();
    assert!(c.cluster_key().unwrap().is_some());
    assert_eq!(c.client_config().secret.expose(), "0123456789abcdef");
    assert!(!format!("{:?}", c.client_config()).contains("0123456789abcdef"));
    assert!(
        !format!("{c:?}").contains("0123456789abcdef"),
        "Debug hides the secret"
    );
}

#[test]
fn empty_file_gives_the_defaults() {
    let c = NodeConfig::from_toml("", "t").unwrap();
    assert_eq!(c.master.listen, "127.0.0.1:7070");
    assert_eq!(c.storage.segment_size, Bytes::gib(1));
}

#[test]
fn a_master_on_etcd_refuses_frames_too_small_to_ship_its_log() {
    let ha = "[master]\nha = \"etcd://127.0.0.1:2379\"\n";
    let e = NodeConfig::from_toml(&format!("{ha}max_frame_bytes = \"1 MiB\"\n"), "t").unwrap_err();
    assert!(e.to_string().contains("master.max_frame_bytes"), "{e}");
    NodeConfig::from_toml(&format!("{ha}max_frame_bytes = \"2 MiB\"\n"), "t").unwrap();
    NodeConfig::from_toml("[master]\nmax_frame_bytes = \"1 MiB\"\n", "t").unwrap();
}

#[test]
fn an_http_connection_cap_past_the_bound_is_an_error_not_a_panic_at_start() {
    let e = NodeConfig::from_toml(
        "[runtime]\nhttp_max_connections = 4611686018427387904\n",
        "t",
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("runtime.http_max_connections"),
        "{e}"
    );
    NodeConfig::from_toml("[runtime]\nhttp_max_connections = 1048576\n", "t").unwrap();
}

#[test]
fn a_typo_is_an_error_naming_the_key() {
    let e = NodeConfig::from_toml("[storage]\nsegment_sise = \"1 GiB\"\n", "t").unwrap_err();
    assert!(e.to_string().contains("segment_sise"), "{e}");
    let e = NodeConfig::from_toml("[stroage]\n", "t").unwrap_err();
    assert!(e.to_string().contains("stroage"), "{e}");
}

#[test]
fn resp_limits_that_cannot_work_are_errors_naming_the_key() {
    let c = NodeConfig::from_toml("[resp]\nlisten = \"127.0.0.1:6379\"\n", "t").unwrap();
    assert_eq!(c.resp.listen_addr(false).as_deref(), Some("127.0.0.1:6379"));
    assert_eq!(NodeConfig::default().resp.listen_addr(false), None);
    assert_eq!(
        NodeConfig::default().resp.listen_addr(true).as_deref(),
        Some(RESP_GATEWAY_DEFAULT_LISTEN)
    );
    let e = NodeConfig::from_toml("[resp]\nmax_query_buffer = \"1 MiB\"\n", "t").unwrap_err();
    assert!(e.to_string().contains("resp.max_query_buffer"), "{e}");
    let e = NodeConfig::from_toml("[resp]\nmax_clients = 0\n", "t").unwrap_err();
    assert!(e.to_string().contains("resp.max_clients"), "{e}");
    let e = NodeConfig::from_toml("[resp]\nmax_client = 5\n", "t").unwrap_err();
    assert!(e.to_string().contains("max_client"), "{e}");
    let c = NodeConfig::from_toml("[resp]\nrequirepass = \"hunter2hunter2\"\n", "t").unwrap();
    assert!(
        !format!("{c:?}").contains("hunter2"),
        "Debug hides the password"
    );
}

#[test]
fn an_open_resp_listener_beyond_loopback_is_refused_unless_asked_for() {
    let mut r = RespConfig::default();
    assert!(r.check_exposure("127.0.0.1:6379", false).is_ok());
    let e = r.check_exposure("0.0.0.0:6379", false).unwrap_err();
    assert!(e.contains("resp.requirepass"), "{e}");
    r.requirepass = "a password".into();
    assert!(r.check_exposure("0.0.0.0:6379", false).is_ok());
    r.requirepass.clear();
    r.protected_mode = false;
    assert!(r.check_exposure("0.0.0.0:6379", false).is_ok());
}

/// Issue 29 (3): with a cluster secret the front needs a password, on
/// loopback and with protected_mode off too.
#[test]
fn a_resp_front_without_a_password_is_refused_in_a_cluster_with_a_secret() {
    let mut r = RespConfig::default();
    for listen in ["127.0.0.1:6379", "0.0.0.0:6379"] {
        for protected in [true, false] {
            r.protected_mode = protected;
            let e = r.check_exposure(listen, true).unwrap_err();
            assert!(
                e.contains("resp.requirepass") && e.contains("secret"),
                "{e}"
            );
        }
    }
    r.requirepass = "a password".into();
    assert!(r.check_exposure("0.0.0.0:6379", true).is_ok());
}

#[test]
fn a_bad_value_is_an_error_naming_the_key() {
    let e = NodeConfig::from_toml("[storage]\nsegment_size = \"lots\"\n", "t").unwrap_err();
    assert!(e.to_string().contains("storage.segment_size"), "{e}");
    let e = NodeConfig::from_toml("[master]\nmax_keys = 0\n", "t").unwrap_err();
    assert!(e.to_string().contains("master.max_keys"), "{e}");
    let e = NodeConfig::from_toml("[storage]\nsegment_size = 5000\n", "t").unwrap_err();
    assert!(e.to_string().contains("storage.segment_size"), "{e}");
}
