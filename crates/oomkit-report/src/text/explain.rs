//! The terminal form of an explained OOM message: the verdict, the figures
//! the message gave, the cause and the advice.

use oomkit_supervise::explain::Explanation;
use oomkit_units::human_bytes;
use std::fmt::Write;

/// The explanation for the terminal: the numbers, the cause, the advice.
pub fn explanation(ex: &Explanation) -> String {
    let m = &ex.message;
    let mut out = super::verdict(&ex.verdict);
    out.push('\n');
    let row = |out: &mut String, label: &str, v: Option<u64>| {
        if let Some(v) = v {
            let _ = writeln!(out, "  {label:<34} {}", human_bytes(v));
        }
    };
    let _ = writeln!(
        out,
        "cause: {}",
        serde_json::to_value(ex.cause)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default()
    );
    let _ = writeln!(out, "{}", ex.summary);
    let _ = writeln!(out);
    let before_figures = out.len();
    row(&mut out, "requested", m.requested_bytes);
    row(&mut out, "device capacity", m.capacity_bytes);
    row(&mut out, "free on the device", m.free_bytes);
    row(&mut out, "held by this process", m.process_bytes);
    row(&mut out, "allocated by PyTorch", m.allocated_bytes);
    row(
        &mut out,
        "reserved but unallocated",
        m.reserved_unallocated_bytes,
    );
    row(
        &mut out,
        "in private pools (CUDA graphs)",
        m.private_pool_bytes,
    );
    row(&mut out, "allowed to this process", m.allowed_bytes);
    for p in &m.other_processes {
        let _ = writeln!(
            out,
            "  {:<34} {}",
            format!("other process {}", p.pid),
            human_bytes(p.bytes)
        );
    }
    row(&mut out, "shortfall", ex.shortfall_bytes.filter(|s| *s > 0));
    if ex.messages > 1 {
        let _ = writeln!(
            out,
            "  ({} out-of-memory messages in the input; this is the first)",
            ex.messages
        );
    }
    // A message without figures has no table to close.
    if out.len() > before_figures {
        let _ = writeln!(out);
    }
    for a in &ex.advice {
        let _ = writeln!(out, "- {a}");
    }
    out
}
