//! Memory by role, in the terminal: one line per role with its bytes, its
//! share and how it was told.

use oomkit_advice::{Role, RoleBytes, RoleEvidence};
use oomkit_snapshot::UnknownReason;
use oomkit_units::human_bytes;
use std::fmt::Write;

/// One line per role that holds any bytes, largest first, indented by
/// `indent`: bytes, share of the moment's total, and the evidence.
pub(crate) fn role_lines(
    bytes: &RoleBytes,
    evidence: &RoleEvidence,
    unknown: Option<UnknownReason>,
    indent: &str,
) -> String {
    let total = bytes.total();
    let mut out = String::new();
    if total == 0 {
        return out;
    }
    let mut roles: Vec<Role> = Role::ALL
        .into_iter()
        .filter(|&r| *bytes.get(r) > 0)
        .collect();
    // Unknown last, whatever its size: it is what the others leave.
    roles.sort_by_key(|&r| (r == Role::Unknown, std::cmp::Reverse(*bytes.get(r))));
    for r in roles {
        let b = *bytes.get(r);
        let _ = writeln!(
            out,
            "{indent}{:<16} {:>10}  {:>4.0}%  {}",
            r.words(),
            human_bytes(b),
            100.0 * b as f64 / total as f64,
            told(r, b, evidence, unknown)
        );
    }
    out
}

/// How a role's bytes were told: "from frames", or with the split when
/// several kinds of evidence told them ("from sizes 98%, frames 2%").
fn told(role: Role, bytes: u64, evidence: &RoleEvidence, unknown: Option<UnknownReason>) -> String {
    if role == Role::Unknown {
        return unknown.map_or("", |u| u.brief()).into();
    }
    let t = evidence.get(role);
    let mut kinds: Vec<(&str, u64)> = [
        ("frames", t.frames),
        ("lifetimes", t.lifetimes),
        ("sizes", t.sizes),
    ]
    .into_iter()
    .filter(|(_, b)| *b > 0)
    .collect();
    kinds.sort_by_key(|&(_, b)| std::cmp::Reverse(b));
    match kinds.as_slice() {
        [] => String::new(),
        [(k, _)] => format!("from {k}"),
        _ => {
            let parts: Vec<String> = kinds
                .iter()
                .map(|(k, b)| format!("{k} {:.0}%", 100.0 * *b as f64 / bytes.max(1) as f64))
                .collect();
            format!("from {}", parts.join(", "))
        }
    }
}
