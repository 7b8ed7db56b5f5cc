//! The terminal form of the rank table: one row per rank and device, with
//! the imbalance and the first failure called out.

use oomkit_compare::RankRow;
use oomkit_units::human_bytes;
use std::fmt::Write;

/// Renders the rank table and its flags for a terminal.
pub fn ranks(rows: &[RankRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "== ranks ({} files)", rows.len());
    // Logs of several attempts hold each rank more than once: say which attempt.
    let attempts = rows.iter().any(|r| r.attempt.is_some());
    let _ = writeln!(
        out,
        "  {:<5} {}{:<8} {:>10} {:>10} {:>5}  {:<22}  file",
        "rank",
        if attempts { "attempt " } else { "" },
        "device",
        "peak",
        "reserved",
        "OOMs",
        "first OOM"
    );
    for r in rows {
        let mut flags = String::new();
        if r.imbalanced {
            flags.push_str("  <- largest peak");
        }
        if r.failed_first {
            flags.push_str("  <- failed first");
        }
        let attempt = if attempts {
            format!("{:<8}", r.attempt.map_or("?".into(), |a| a.to_string()))
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "  {:<5} {}{:<8} {:>10} {:>10} {:>5}  {:<22}  {}{}",
            r.rank.map_or("?".into(), |r| r.to_string()),
            attempt,
            r.device,
            human_bytes(r.peak_bytes),
            human_bytes(r.reserved_bytes),
            r.ooms,
            r.first_oom.as_deref().unwrap_or("-"),
            r.file,
            flags
        );
    }
    let min = rows.iter().min_by_key(|r| r.peak_bytes);
    if let (Some(top), Some(min)) = (rows.iter().find(|r| r.imbalanced), min) {
        let _ = writeln!(
            out,
            "  * [imbalance] {} peaks at {}, {:.0}% above {} ({}): uneven sequence lengths, \
             a rank that does extra work (logging, eval, checkpoints on rank 0) or an uneven \
             model split; the largest rank sets the memory every rank needs",
            who(top),
            human_bytes(top.peak_bytes),
            100.0 * top.above_smallest,
            who(min),
            human_bytes(min.peak_bytes)
        );
    }
    if let Some(r) = rows.iter().find(|r| r.failed_first) {
        let _ = writeln!(
            out,
            "  * [failed_first] {} ran out of memory first ({}); the other ranks' errors are \
             likely its consequence, so analyze this one",
            who(r),
            r.first_oom.as_deref().unwrap_or("-")
        );
    } else if rows.iter().filter(|r| r.ooms > 0).count() > 1 {
        let _ = writeln!(
            out,
            "  * several ranks ran out of memory and the files do not tell which was first"
        );
    }
    out
}

fn who(r: &RankRow) -> String {
    match r.rank {
        Some(n) => format!("rank {n} ({})", r.device),
        None => format!("{} ({})", r.file, r.device),
    }
}
