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
            r.peak_bytes.map_or("-".into(), human_bytes),
            human_bytes(r.reserved_bytes),
            r.ooms,
            r.first_oom.as_deref().unwrap_or("-"),
            r.file,
            flags
        );
    }
    if let Some(top) = rows.iter().find(|r| r.imbalanced) {
        // The smallest peak of the same attempt: the spread is told within one.
        let min = rows
            .iter()
            .filter(|r| r.attempt == top.attempt && r.peak_bytes.is_some())
            .min_by_key(|r| r.peak_bytes);
        if let Some(min) = min {
            let _ = writeln!(
                out,
                "  * [imbalance] {} peaks at {}, {:.0}% above {} ({}): uneven sequence lengths, \
                 a rank that does extra work (logging, eval, checkpoints on rank 0) or an uneven \
                 model split; the largest rank sets the memory every rank needs",
                who(top),
                top.peak_bytes.map_or("-".into(), human_bytes),
                100.0 * top.above_smallest,
                who(min),
                min.peak_bytes.map_or("-".into(), human_bytes)
            );
        }
    }
    let firsts: Vec<&RankRow> = rows.iter().filter(|r| r.failed_first).collect();
    for r in &firsts {
        // One per attempt: each attempt's ranks are compared apart.
        let attempt = match (firsts.len() > 1, r.attempt) {
            (true, Some(a)) => format!(" in attempt {a}"),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "  * [failed_first] {} ran out of memory first{attempt} ({}); the other ranks' errors are \
             likely its consequence, so analyze this one",
            who(r),
            r.first_oom.as_deref().unwrap_or("-")
        );
    }
    if firsts.is_empty() && several_ranks_failed_in_one_attempt(rows) {
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

/// Whether two different ranks of one attempt ran out of memory (attempts of one rank are not ranks).
fn several_ranks_failed_in_one_attempt(rows: &[RankRow]) -> bool {
    rows.iter().filter(|r| r.ooms > 0).any(|a| {
        rows.iter()
            .filter(|b| b.ooms > 0 && b.attempt == a.attempt && !std::ptr::eq(a, *b))
            .any(|b| b.rank != a.rank || a.rank.is_none())
    })
}
