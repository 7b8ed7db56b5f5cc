//! Feeds arbitrary text through the OOM message reader and its explanation,
//! as `oomkit explain`, `oomkit run` and the Python package use them: no
//! input may panic, whatever its line breaks, units or figures.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for m in oomkit_supervise::oom::find_messages(&text) {
        let _ = m.requested_bytes;
    }
    if let Some(e) = oomkit_supervise::explain::explain(&text, Some("expandable_segments:True")) {
        let _ = oomkit_report::text::explanation(&e);
    }
});
