#![no_main]
//! See `kvpool_fuzz::master_request`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvpool_fuzz::master_request(data));
