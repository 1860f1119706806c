//! A panic on a shard ends the whole process (SIGABRT), instead of leaving
//! a process whose other shards still serve while every call to the dead
//! one times out. The test runs itself as a child process to watch it die.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use kvpool_runtime::{ShardPool, ShardPoolConfig, Shutdown};

const CHILD: &str = "KVPOOL_TEST_PANIC_CHILD";

#[test]
fn a_panicking_shard_takes_the_process_down() {
    if std::env::var_os(CHILD).is_some() {
        let cfg = ShardPoolConfig {
            shards: 2,
            pin: false,
            ..Default::default()
        };
        let pool = ShardPool::start(&cfg, Shutdown::new()).expect("shards");
        pool.handle()
            .spawn_on_blocking(1, |_| async { panic!("a bug on shard 1") })
            .expect("job sent");
        // Shard 0 would serve on; the process must not.
        std::thread::sleep(Duration::from_secs(20));
        println!("STILL ALIVE");
        std::process::exit(0);
    }
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "a_panicking_shard_takes_the_process_down",
            "--exact",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stdout.contains("STILL ALIVE"), "{stdout}");
    assert_eq!(out.status.signal(), Some(6), "SIGABRT; stderr:\n{stderr}");
    assert!(stderr.contains("a bug on shard 1"), "{stderr}");
    assert!(stderr.contains("shard 1 panicked; aborting"), "{stderr}");
}
