//! `oomkit report` (the page's embedded data against `analyze`), `oomkit
//! diff` (its JSON contract, checked on real snapshots) and the multi-rank
//! view of `analyze`. The pages themselves are loaded in Chromium by
//! python/tests/test_report_browser.py.

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;

/// Writes a report and returns the page and the data embedded in it.
fn report(inputs: &[&Path], out: &Path, more: &[&str]) -> (String, Value) {
    let mut args = vec!["report"];
    args.extend(inputs.iter().map(|p| p.to_str().unwrap()));
    args.extend(["-o", out.to_str().unwrap()]);
    args.extend_from_slice(more);
    let r = oomkit(&args, None);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let page = std::fs::read_to_string(out).unwrap();
    let start = page
        .find(r#"<script id="oomkit-data" type="application/json">"#)
        .unwrap();
    let body = &page[start..];
    let body = &body[body.find('>').unwrap() + 1..body.find("</script>").unwrap()];
    assert!(
        !body.contains('<'),
        "the data must not be able to end its element"
    );
    (page.clone(), serde_json::from_str(body).unwrap())
}

fn undelta(v: &Value) -> Vec<i64> {
    let mut acc = 0;
    v.as_array()
        .unwrap()
        .iter()
        .map(|d| {
            acc += d.as_i64().unwrap();
            acc
        })
        .collect()
}

/// The page's series, peak and OOMs must be the analysis's.
fn check_snapshot_report(path: &Path, dir: &Path, max_points: usize) {
    let out = dir.join(format!(
        "{}-{max_points}.html",
        path.file_stem().unwrap().to_str().unwrap()
    ));
    let (page, data) = report(&[path], &out, &["--max-points", &max_points.to_string()]);
    assert!(
        page.contains("Copyright (c) 2022 Leon Sorokin"),
        "uPlot's licence travels with it"
    );
    // Nothing is loaded from the network: no element points there, and the
    // page's policy forbids it (the browser test watches the requests).
    assert!(page.contains("default-src 'none'"));
    for attr in ["src=\"http", "href=\"http", "src='http", "href='http"] {
        assert!(
            !page.contains(attr),
            "the page refers to the network: {attr}"
        );
    }
    let a = run_json(&["analyze", "--json", path.to_str().unwrap()]);
    let file = &data["files"][0];
    assert_eq!(file["kind"], "snapshot");
    let devs = file["devices"].as_array().unwrap();
    assert_eq!(devs.len(), a["devices"].as_array().unwrap().len());
    for (d, ad) in devs.iter().zip(a["devices"].as_array().unwrap()) {
        let name = format!("{}: cuda:{}", path.display(), d["device"]);
        let x = undelta(&d["x"]);
        let active = undelta(&d["active"]);
        let reserved = undelta(&d["reserved"]);
        let n = x.len();
        for col in ["t", "size", "action", "site"] {
            assert_eq!(d[col].as_array().unwrap().len(), n, "{name}: {col}");
        }
        assert_eq!(active.len(), n);
        assert!(x.windows(2).all(|w| w[0] < w[1]), "{name}: x must ascend");
        if max_points > 0 {
            assert!(n <= max_points + 2, "{name}: {n} points");
        }
        let events = ad["events"].as_u64().unwrap();
        assert_eq!(d["events"], events);
        if events > 0 {
            assert_eq!(
                *x.last().unwrap() as u64,
                events,
                "{name}: the last entry is kept"
            );
        }
        // The thinned series keeps the analysed peak, where the trace has it.
        if ad["top_sites_at"] == "peak" {
            let peak = ad["peak_active_bytes"].as_i64().unwrap();
            assert_eq!(active.iter().copied().max(), Some(peak), "{name}");
            let px = d["peak"]["x"].as_i64().unwrap();
            let at = x
                .iter()
                .position(|&v| v == px)
                .expect("the peak's entry is a point");
            assert_eq!(active[at], peak, "{name}");
        }
        if events > 0 {
            assert_eq!(
                reserved.iter().copied().max().unwrap_or(0) as u64,
                ad["peak_reserved_bytes"].as_u64().unwrap(),
                "{name}"
            );
        }
        let ooms: Vec<u64> = d["ooms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["x"].as_u64().unwrap() - 1)
            .collect();
        let want: Vec<u64> = ad["ooms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["event_index"].as_u64().unwrap())
            .collect();
        assert_eq!(ooms, want, "{name}");
        let sites = d["sites"].as_array().unwrap().len() as i64;
        assert!(d["site"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| (-1..sites).contains(&s.as_i64().unwrap())));
        assert!(d["segments"].as_array().unwrap().len() <= 200);
    }
}

#[test]
fn reports_of_real_snapshots_carry_the_analysed_series() {
    let dir = tempdir("report-real");
    for f in fixture_files() {
        check_snapshot_report(&f, &dir, 50_000);
        check_snapshot_report(&f, &dir, 30);
    }
    check_snapshot_report(&demo_file(), &dir, 50_000);
    check_snapshot_report(&demo_file(), &dir, 60);
}

#[test]
fn report_never_overwrites_and_refuses_bad_input() {
    let dir = tempdir("report-bad");
    let out = dir.join("r.html");
    std::fs::write(&out, "keep me").unwrap();
    let demo = demo_file();
    let r = oomkit(
        &[
            "report",
            demo.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ],
        None,
    );
    assert_refused(&r, &["already exists"]);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "keep me");

    let bad = dir.join("cut.pickle");
    let bytes = std::fs::read(&demo).unwrap();
    std::fs::write(&bad, &bytes[..bytes.len() / 3]).unwrap();
    let target = dir.join("new.html");
    let r = oomkit(
        &[
            "report",
            demo.to_str().unwrap(),
            bad.to_str().unwrap(),
            "-o",
            target.to_str().unwrap(),
        ],
        None,
    );
    assert_refused(&r, &["cut.pickle", "truncated"]);
    assert!(!target.exists(), "no page is written when an input is bad");

    let r = oomkit(&["report", demo.to_str().unwrap(), "-o", "-"], None);
    assert!(r.status.success());
    assert!(
        r.stdout.starts_with(b"<!DOCTYPE html>"),
        "-o - writes the page to stdout"
    );
}

#[test]
fn a_run_log_report_has_its_steps_stages_and_oom() {
    let dir = tempdir("report-run");
    let log = dir.join("run-rank3.jsonl");
    std::fs::write(&log, run_log_text(3, 1, Some(1_700_000_000.0))).unwrap();
    let (_, data) = report(&[&log], &dir.join("r.html"), &[]);
    let f = &data["files"][0];
    assert_eq!(f["kind"], "run");
    assert_eq!(f["steps"], serde_json::json!([0, 1, 2]));
    assert_eq!(f["series"]["peak"], serde_json::json!([700, 700, 700]));
    let names: Vec<&str> = f["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["forward", "backward", "optimizer"]);
    assert_eq!(f["phases"][0]["step"], 2);
    assert_eq!(f["ooms"][0]["step"], 3);
    assert_eq!(
        data["ranks"],
        serde_json::json!([]),
        "one file has no rank table"
    );
}

#[test]
fn diff_of_a_file_with_itself_changes_nothing_and_sites_sum_to_the_peak() {
    let mut files = fixture_files();
    files.push(demo_file());
    for f in &files {
        let p = f.to_str().unwrap();
        let d = run_json(&["diff", "--json", p, p]);
        let a = run_json(&["analyze", "--json", "--top", "100000", p]);
        let devs = d["devices"].as_array().unwrap();
        assert_eq!(devs.len(), a["devices"].as_array().unwrap().len(), "{p}");
        for (dd, ad) in devs.iter().zip(a["devices"].as_array().unwrap()) {
            assert_eq!(dd["device"], format!("cuda:{}", ad["device"]));
            assert_eq!(dd["peak_active_bytes_a"], ad["peak_active_bytes"]);
            assert_eq!(dd["peak_active_bytes_b"], ad["peak_active_bytes"]);
            assert_eq!(dd["peak_active_bytes_delta"], 0);
            let sites = dd["sites"].as_array().unwrap();
            assert!(sites
                .iter()
                .all(|s| s["delta_bytes"] == 0 && s["change"] == "same"));
            // The diff lists exactly the sites that analyze finds at the peak.
            let pairs = |v: &Value, name: &str, bytes: &str| -> Vec<(String, u64)> {
                let mut out: Vec<(String, u64)> = v
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| (s[name].as_str().unwrap().into(), s[bytes].as_u64().unwrap()))
                    .collect();
                out.sort();
                out
            };
            assert_eq!(
                pairs(&dd["sites"], "site", "bytes_a"),
                pairs(&ad["top_sites"], "label", "bytes"),
                "{p}"
            );
            // Every live block at the peak belongs to one site. The peak
            // counts the sizes the trace records, the sites of blocks still
            // live at the end count their sizes in the segments, which can be
            // larger: tiny allocations recorded unrounded (4 bytes in a
            // 512-byte block) and large ones whose unsplit remainder stays in
            // the block (2.5 MiB in 3 MiB). On the real fixtures the two agree
            // to within 0.3%.
            let sum: u64 = sites.iter().map(|s| s["bytes_a"].as_u64().unwrap()).sum();
            let live = if ad["top_sites_at"] == "snapshot" {
                ad["active_bytes"].as_u64().unwrap()
            } else {
                ad["peak_active_bytes"].as_u64().unwrap()
            };
            assert!(
                sum.abs_diff(live) as f64 <= live as f64 * 0.01 + 4096.0,
                "{p} cuda:{}: {sum} vs {live}",
                ad["device"]
            );
        }
    }
}

#[test]
fn diff_between_two_snapshots_follows_the_contract() {
    let files = fixture_files();
    let Some(other) = files
        .iter()
        .find(|f| f.to_str().unwrap().contains("lm_medium_ctx128_training"))
    else {
        return;
    };
    let (a, b) = (demo_file(), other.clone());
    let (pa, pb) = (a.to_str().unwrap(), b.to_str().unwrap());
    let d = run_json(&["diff", "--json", pa, pb]);
    let aa = run_json(&["analyze", "--json", "--top", "100000", pa]);
    let ab = run_json(&["analyze", "--json", "--top", "100000", pb]);
    let dev = &d["devices"][0];
    let peak_a = aa["devices"][0]["peak_active_bytes"].as_i64().unwrap();
    let peak_b = ab["devices"][0]["peak_active_bytes"].as_i64().unwrap();
    assert_eq!(
        dev["peak_active_bytes_delta"].as_i64().unwrap(),
        peak_b - peak_a
    );
    let site_bytes = |an: &Value, label: &str| -> u64 {
        an["devices"][0]["top_sites"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["label"] == label)
            .map(|s| s["bytes"].as_u64().unwrap())
            .sum()
    };
    let sites = dev["sites"].as_array().unwrap();
    assert!(!sites.is_empty());
    let mut last = u64::MAX;
    for s in sites {
        let label = s["site"].as_str().unwrap();
        let (x, y) = (
            s["bytes_a"].as_u64().unwrap(),
            s["bytes_b"].as_u64().unwrap(),
        );
        assert_eq!(x, site_bytes(&aa, label), "{label}");
        assert_eq!(y, site_bytes(&ab, label), "{label}");
        assert_eq!(s["delta_bytes"].as_i64().unwrap(), y as i64 - x as i64);
        let want = match (x, y) {
            (0, _) => "appeared",
            (_, 0) => "vanished",
            _ if y > x => "grew",
            _ if y < x => "shrank",
            _ => "same",
        };
        assert_eq!(s["change"], want, "{label}");
        let mag = s["delta_bytes"].as_i64().unwrap().unsigned_abs();
        assert!(mag <= last, "largest change first");
        last = mag;
    }
    let text = String::from_utf8(oomkit(&["diff", pa, pb], None).stdout).unwrap();
    assert!(text.contains("cuda:0: peak 23.4 GiB -> 6.53 GiB"), "{text}");
    assert!(
        text.contains("vanished") && text.contains("appeared"),
        "{text}"
    );
}

#[test]
fn diff_of_run_logs_compares_stage_peaks() {
    let dir = tempdir("diff-run");
    let (a, b) = (dir.join("before.jsonl"), dir.join("after.jsonl"));
    std::fs::write(&a, run_log_text(0, 2, Some(1.0))).unwrap();
    std::fs::write(&b, run_log_text(0, 1, None)).unwrap();
    let d = run_json(&["diff", "--json", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert_eq!(d["kind"], "run");
    let dev = &d["devices"][0];
    assert_eq!(dev["peak_active_bytes_a"], 1400);
    assert_eq!(dev["peak_active_bytes_b"], 700);
    assert_eq!(dev["peak_active_bytes_delta"], -700);
    assert_eq!(
        (dev["ooms_a"].as_u64(), dev["ooms_b"].as_u64()),
        (Some(1), Some(0))
    );
    let stage = |name: &str| {
        dev["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name)
            .cloned()
            .unwrap()
    };
    assert_eq!(stage("backward")["delta_bytes"], -700);
    assert_eq!(stage("eval")["kind"], "phase");
    assert_eq!(stage("eval")["max_peak_bytes_a"], 1600);
}

#[test]
fn diff_compares_a_snapshot_with_a_run_log_role_by_role() {
    let demo = demo_file();
    let log = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/ranks/run-20261125-053127-rank1.jsonl");
    let (s, l) = (demo.to_str().unwrap(), log.to_str().unwrap());
    let snap = run_json(&["analyze", "--json", s]);
    let run = run_json(&["analyze", "--json", l]);
    for (a, b, snap_is_a) in [(s, l, true), (l, s, false)] {
        let d = run_json(&["diff", "--json", a, b]);
        assert_eq!(d["kind"], "mixed");
        let dev = &d["devices"][0];
        // The run log is on the CPU: it goes against the snapshot's largest peak.
        assert_eq!(dev["device"], "cuda:0 / cpu");
        let (snap_side, run_side) = if snap_is_a { ("a", "b") } else { ("b", "a") };
        let roles = dev["roles"].as_array().unwrap();
        let side = |which: &str, role: &str| {
            roles
                .iter()
                .find(|r| r["role"] == role)
                .map_or(0, |r| r[format!("bytes_{which}")].as_u64().unwrap())
        };
        let peak = &snap["devices"][0]["roles"]["peak"];
        for role in ["parameters", "optimizer_state", "activations", "unknown"] {
            assert_eq!(
                side(snap_side, role),
                peak[role].as_u64().unwrap(),
                "{role}"
            );
        }
        // The run log's roles: its components, and the rest of its peak unknown.
        let c = &run["components"];
        assert_eq!(
            side(run_side, "parameters"),
            c["params_bytes"].as_u64().unwrap() + c["buffers_bytes"].as_u64().unwrap()
        );
        assert_eq!(
            side(run_side, "gradients"),
            c["grads_bytes"].as_u64().unwrap()
        );
        let total: u64 = roles
            .iter()
            .map(|r| r[format!("bytes_{run_side}")].as_u64().unwrap())
            .sum();
        assert_eq!(total, run["peak_bytes"].as_u64().unwrap());
        for r in roles {
            let (x, y) = (
                r["bytes_a"].as_i64().unwrap(),
                r["bytes_b"].as_i64().unwrap(),
            );
            assert_eq!(r["delta_bytes"].as_i64().unwrap(), y - x);
        }
    }
    let text = String::from_utf8(oomkit(&["diff", s, l], None).stdout).unwrap();
    assert!(
        text.contains("role") && text.contains("optimizer state"),
        "{text}"
    );
}

#[test]
fn several_run_logs_get_a_rank_table_with_imbalance_and_first_failure() {
    let dir = tempdir("ranks");
    let logs: Vec<_> = [
        (0u32, 1u64 << 20, None),
        (1, 3 << 20, Some(1_700_000_100.5)),
        (2, 1 << 20, Some(1_700_000_050.0)),
    ]
    .iter()
    .map(|&(rank, scale, oom)| {
        let p = dir.join(format!("run-rank{rank}.jsonl"));
        std::fs::write(&p, run_log_text(rank, scale, oom)).unwrap();
        p
    })
    .collect();
    let args: Vec<&str> = logs.iter().map(|p| p.to_str().unwrap()).collect();
    let mut json_args = vec!["analyze", "--json"];
    json_args.extend(&args);
    let v = run_json(&json_args);
    let rows: Vec<&Value> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|f| &f["multi_rank"][0])
        .collect();
    assert_eq!(
        rows.iter()
            .map(|r| r["rank"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 1, 2]
    );
    assert_eq!(rows[1]["imbalanced"], true, "rank 1 peaks 3x the others");
    assert_eq!(rows[1]["peak_bytes"], 2100u64 << 20);
    assert_eq!(rows[0]["imbalanced"], false);
    assert_eq!(rows[1]["above_smallest"], 2.0);
    // Rank 2's OOM came 50 s before rank 1's.
    assert_eq!(
        rows.iter()
            .map(|r| r["failed_first"] == true)
            .collect::<Vec<_>>(),
        [false, false, true]
    );
    let mut text_args = vec!["analyze"];
    text_args.extend(&args);
    let text = String::from_utf8(oomkit(&text_args, None).stdout).unwrap();
    assert!(text.contains("== ranks (3 files)"), "{text}");
    assert!(text.contains("[imbalance] rank 1 (cuda:0)"), "{text}");
    assert!(
        text.contains("[failed_first] rank 2 (cuda:0) ran out of memory first (step 3, forward)"),
        "{text}"
    );

    let (_, data) = report(&[&logs[0], &logs[1], &logs[2]], &dir.join("r.html"), &[]);
    assert_eq!(data["ranks"].as_array().unwrap().len(), 3);
    assert_eq!(data["ranks"][2]["failed_first"], true);

    // One file: no rank view.
    let one = run_json(&["analyze", "--json", args[0]]);
    assert!(one.get("multi_rank").is_none());
}
