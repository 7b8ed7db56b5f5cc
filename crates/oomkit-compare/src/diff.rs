//! Two runs compared, before and after a change: the peak per device, the
//! sites that grew, shrank, appeared or vanished, and each stage's peak.

use crate::{FileAnalysis, Report, RunFile};
use oomkit_advice::{Role, RoleBytes};
use oomkit_runlog::MeasureKind;
use oomkit_snapshot::{DeviceReport, SiteBytes};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// Bytes held by one site in each run.
#[derive(Clone, Debug, Serialize)]
pub struct SiteDelta {
    /// The site, in the words of the site tables (`file.py:LINE function`).
    pub site: String,
    /// Bytes live from it at A's peak.
    pub bytes_a: u64,
    /// Bytes live from it at B's peak.
    pub bytes_b: u64,
    /// `bytes_b - bytes_a`.
    pub delta_bytes: i64,
    /// `grew`, `shrank`, `appeared`, `vanished` or `same`.
    pub change: &'static str,
}

/// One stage's peak in each run log.
#[derive(Clone, Debug, Serialize)]
pub struct StageDelta {
    /// `stage`, `step` or `phase`.
    pub kind: MeasureKind,
    /// The stage's name.
    pub name: String,
    /// Its largest peak in A, or null when A has none.
    pub max_peak_bytes_a: Option<u64>,
    /// Its largest peak in B, or null when B has none.
    pub max_peak_bytes_b: Option<u64>,
    /// B minus A, counting a missing stage as 0.
    pub delta_bytes: i64,
    /// True where A's largest peak is a lower bound (a peak under an earlier high-water mark could be above it).
    pub at_least_a: bool,
    /// The same for B.
    pub at_least_b: bool,
}

/// Bytes of one role at each run's peak.
#[derive(Clone, Debug, Serialize)]
pub struct RoleDelta {
    /// The role.
    pub role: Role,
    /// Its bytes at A's peak.
    pub bytes_a: u64,
    /// Its bytes at B's peak.
    pub bytes_b: u64,
    /// `bytes_b - bytes_a`.
    pub delta_bytes: i64,
}

/// One device in both runs.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceDelta {
    /// `cuda:N`, or a run log's device.
    pub device: String,
    /// Peak bytes in A (0 when the device is absent there).
    pub peak_active_bytes_a: u64,
    /// Peak bytes in B (0 when the device is absent there).
    pub peak_active_bytes_b: u64,
    /// B minus A.
    pub peak_active_bytes_delta: i64,
    /// Peak reserved bytes in A.
    pub peak_reserved_bytes_a: u64,
    /// Peak reserved bytes in B.
    pub peak_reserved_bytes_b: u64,
    /// OOMs in A.
    pub ooms_a: usize,
    /// OOMs in B.
    pub ooms_b: usize,
    /// `a` or `b` when the device appears in one run only.
    pub only_in: Option<&'static str>,
    /// Sites whose bytes at the peak differ or not, largest change first.
    pub sites: Vec<SiteDelta>,
    /// For run logs: each stage's peak.
    pub stages: Vec<StageDelta>,
    /// Each role either run holds at its peak, in the order reports list
    /// roles; empty when neither file tells roles (a run log without a
    /// component count).
    pub roles: Vec<RoleDelta>,
}

/// A comparison of two runs.
#[derive(Clone, Debug, Serialize)]
pub struct Diff {
    /// `snapshot`, `run`, or `mixed` (a snapshot and a run log, compared by role).
    pub kind: &'static str,
    /// The first file, "before".
    pub file_a: String,
    /// The second file, "after".
    pub file_b: String,
    /// The attempt of `oomkit run` that wrote A, for a run log that says (null otherwise).
    pub attempt_a: Option<u64>,
    /// The same for B: two attempts of one job are two plans, not two ranks.
    pub attempt_b: Option<u64>,
    /// Per device.
    pub devices: Vec<DeviceDelta>,
}

fn delta(a: u64, b: u64) -> i64 {
    b as i64 - a as i64
}

/// What one file says of one device, for a comparison.
#[derive(Clone, Copy, Default)]
struct Side {
    peak: u64,
    reserved: u64,
    ooms: usize,
    /// At the peak, where the file tells roles.
    roles: Option<RoleBytes>,
}

impl Side {
    /// A snapshot's device, or nothing where the file lacks it.
    fn device(d: Option<&DeviceReport>) -> Side {
        d.map_or(Side::default(), |d| Side {
            peak: d.peak_active_bytes,
            reserved: d.peak_reserved_bytes.max(d.reserved_bytes),
            ooms: d.ooms.len(),
            roles: Some(d.roles.peak),
        })
    }

    /// A run log's device.
    fn run(r: &oomkit_runlog::Analysis) -> Side {
        Side {
            // A log that measured nothing compares as nothing held.
            peak: r.peak_bytes.unwrap_or(0),
            reserved: r.peak_reserved_bytes,
            ooms: r.ooms.len(),
            roles: r.roles_at_peak(),
        }
    }
}

impl DeviceDelta {
    /// One device in both files, with neither sites nor stages yet.
    fn between(device: String, a: Side, b: Side) -> DeviceDelta {
        DeviceDelta {
            device,
            peak_active_bytes_a: a.peak,
            peak_active_bytes_b: b.peak,
            peak_active_bytes_delta: delta(a.peak, b.peak),
            peak_reserved_bytes_a: a.reserved,
            peak_reserved_bytes_b: b.reserved,
            ooms_a: a.ooms,
            ooms_b: b.ooms,
            only_in: None,
            sites: Vec::new(),
            stages: Vec::new(),
            roles: role_deltas(a.roles.as_ref(), b.roles.as_ref()),
        }
    }
}

fn role_deltas(a: Option<&RoleBytes>, b: Option<&RoleBytes>) -> Vec<RoleDelta> {
    if a.is_none() && b.is_none() {
        return Vec::new();
    }
    let zero = RoleBytes::default();
    let (a, b) = (a.unwrap_or(&zero), b.unwrap_or(&zero));
    a.beside(b)
        .into_iter()
        .map(|(role, x, y)| RoleDelta {
            role,
            bytes_a: x,
            bytes_b: y,
            delta_bytes: delta(x, y),
        })
        .collect()
}

fn site_deltas(a: &[SiteBytes], b: &[SiteBytes]) -> Vec<SiteDelta> {
    let mut bytes: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for s in a {
        bytes.entry(&s.label).or_default().0 += s.bytes;
    }
    for s in b {
        bytes.entry(&s.label).or_default().1 += s.bytes;
    }
    let mut out: Vec<SiteDelta> = bytes
        .into_iter()
        .map(|(site, (x, y))| SiteDelta {
            site: site.to_string(),
            bytes_a: x,
            bytes_b: y,
            delta_bytes: delta(x, y),
            change: match (x, y) {
                (0, _) => "appeared",
                (_, 0) => "vanished",
                (x, y) if y > x => "grew",
                (x, y) if y < x => "shrank",
                _ => "same",
            },
        })
        .collect();
    out.sort_by(|p, q| {
        q.delta_bytes
            .unsigned_abs()
            .cmp(&p.delta_bytes.unsigned_abs())
            .then_with(|| p.site.cmp(&q.site))
    });
    out
}

/// Compares two snapshots' analyses, device by device. The analyses
/// should list every site (a large `top`), or sites below the cut look
/// as if they had vanished.
pub fn diff_snapshots(a: &FileAnalysis, b: &FileAnalysis) -> Diff {
    let ids: BTreeSet<i64> = a
        .analysis
        .devices
        .iter()
        .chain(&b.analysis.devices)
        .map(|d| d.device)
        .collect();
    let devices = ids
        .into_iter()
        .map(|id| {
            let da = a.analysis.devices.iter().find(|d| d.device == id);
            let db = b.analysis.devices.iter().find(|d| d.device == id);
            DeviceDelta {
                only_in: match (da, db) {
                    (Some(_), None) => Some("a"),
                    (None, Some(_)) => Some("b"),
                    _ => None,
                },
                sites: site_deltas(
                    da.map_or(&[][..], |d| &d.top_sites[..]),
                    db.map_or(&[][..], |d| &d.top_sites[..]),
                ),
                ..DeviceDelta::between(format!("cuda:{id}"), Side::device(da), Side::device(db))
            }
        })
        .collect();
    Diff {
        kind: "snapshot",
        file_a: a.path.clone(),
        file_b: b.path.clone(),
        attempt_a: None,
        attempt_b: None,
        devices,
    }
}

/// Compares two run logs: the step peak, and the largest peak of every
/// stage, step and phase.
pub fn diff_runs(a: &RunFile, b: &RunFile) -> Diff {
    let (ra, rb) = (&a.analysis, &b.analysis);
    let mut keys: Vec<(MeasureKind, String)> = Vec::new();
    for s in ra.stages.iter().chain(&rb.stages) {
        let k = (s.kind, s.name.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let find = |r: &oomkit_runlog::Analysis, k: &(MeasureKind, String)| {
        r.stages
            .iter()
            .find(|s| s.kind == k.0 && s.name == k.1)
            .map(|s| (s.max_peak_bytes, s.max_peak_at_most_bytes.is_some()))
    };
    let stages = keys
        .iter()
        .map(|k| {
            let (x, y) = (find(ra, k), find(rb, k));
            StageDelta {
                kind: k.0,
                name: k.1.clone(),
                max_peak_bytes_a: x.map(|v| v.0),
                max_peak_bytes_b: y.map(|v| v.0),
                delta_bytes: delta(x.map_or(0, |v| v.0), y.map_or(0, |v| v.0)),
                at_least_a: x.is_some_and(|v| v.1),
                at_least_b: y.is_some_and(|v| v.1),
            }
        })
        .collect();
    let device = if ra.device == rb.device {
        ra.device.clone()
    } else {
        format!("{} / {}", ra.device, rb.device)
    };
    Diff {
        kind: "run",
        file_a: a.path.clone(),
        file_b: b.path.clone(),
        attempt_a: ra.attempt,
        attempt_b: rb.attempt,
        devices: vec![DeviceDelta {
            stages,
            ..DeviceDelta::between(device, Side::run(ra), Side::run(rb))
        }],
    }
}

/// Compares a snapshot with a run log (in either order) role by role: the
/// run log's device against the snapshot's device of the same name, or
/// else its largest peak. `None` unless one file is each.
pub fn diff_mixed(a: &Report, b: &Report) -> Option<Diff> {
    let (snap, run, snap_first) = match (a, b) {
        (Report::Snapshot(s), Report::Run(r)) => (s, r, true),
        (Report::Run(r), Report::Snapshot(s)) => (s, r, false),
        _ => return None,
    };
    let ra = &run.analysis;
    let devices = &snap.analysis.devices;
    let d = devices
        .iter()
        .find(|d| format!("cuda:{}", d.device) == ra.device)
        .or_else(|| devices.iter().max_by_key(|d| d.peak_active_bytes));
    let name = match d {
        Some(d) if format!("cuda:{}", d.device) == ra.device => ra.device.clone(),
        Some(d) => format!("cuda:{} / {}", d.device, ra.device),
        None => ra.device.clone(),
    };
    let (x, y) = if snap_first {
        (Side::device(d), Side::run(ra))
    } else {
        (Side::run(ra), Side::device(d))
    };
    Some(Diff {
        kind: "mixed",
        file_a: a.path().to_string(),
        file_b: b.path().to_string(),
        attempt_a: if snap_first { None } else { ra.attempt },
        attempt_b: if snap_first { ra.attempt } else { None },
        devices: vec![DeviceDelta::between(name, x, y)],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(label: &str, bytes: u64) -> SiteBytes {
        SiteBytes {
            site: None,
            label: label.into(),
            bytes,
            count: 1,
            stack: Vec::new(),
        }
    }

    #[test]
    fn sites_are_matched_by_label_and_ordered_by_change() {
        let a = [
            site("a.py:1 f", 100),
            site("b.py:2 g", 50),
            site("c.py:3 h", 10),
        ];
        let b = [
            site("a.py:1 f", 40),
            site("c.py:3 h", 10),
            site("d.py:4 k", 500),
        ];
        let d = site_deltas(&a, &b);
        let got: Vec<(&str, i64, &str)> = d
            .iter()
            .map(|s| (s.site.as_str(), s.delta_bytes, s.change))
            .collect();
        assert_eq!(
            got,
            [
                ("d.py:4 k", 500, "appeared"),
                ("a.py:1 f", -60, "shrank"),
                ("b.py:2 g", -50, "vanished"),
                ("c.py:3 h", 0, "same"),
            ]
        );
        let grew = site_deltas(&[site("x", 1)], &[site("x", 3)]);
        assert_eq!(
            (grew[0].change, grew[0].bytes_a, grew[0].bytes_b),
            ("grew", 1, 3)
        );
    }
}
