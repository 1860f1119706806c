#![no_main]
//! See `kvpool_fuzz::reply`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvpool_fuzz::reply(data));
