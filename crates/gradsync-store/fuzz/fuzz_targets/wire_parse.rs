//! `cargo fuzz run wire_parse`: any bytes either fail to parse or round-trip exactly.
#![no_main]

use gradsync_store::wire::{Frame, Repr};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(frame) = Frame::new_checked(data) else {
        return;
    };
    let _ = frame.check_header();
    if let Ok(repr) = Repr::parse(&frame) {
        repr.validate().expect("a parsed frame is within the limits");
        assert_eq!(repr.to_bytes(), &data[..frame.frame_len()]);
    }
});
