#![no_main]
//! See `kvpool_fuzz::config`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvpool_fuzz::config(data));
