//! Byte sizes, durations and counts as people write them on a command line.
//!
//! Sizes follow the convention of `nvidia-smi` and PyTorch's messages: the
//! binary suffixes (`KiB`, `MiB`, `GiB`) and the bare letters (`K`, `M`, `G`)
//! are powers of 1024, while `KB`, `MB` and `GB` are powers of 1000, because
//! that is what the spec sheets of GPUs and model cards mean by them.
//!
//! ```
//! use oomkit_units::{human_bytes, parse_bytes, parse_duration};
//! assert_eq!(parse_bytes("80GiB").unwrap(), 80 << 30);
//! assert_eq!(parse_bytes("80GB").unwrap(), 80_000_000_000);
//! assert_eq!(human_bytes(3 << 29), "1.50 GiB");
//! assert_eq!(parse_duration("10m").unwrap().as_secs(), 600);
//! ```

use std::time::Duration;

/// Why a size, duration or count could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UnitError {
    /// The text was not a number followed by a known suffix.
    #[error("{text:?} is not a {what} (examples: {examples})")]
    Unreadable {
        /// The text as given.
        text: String,
        /// What was expected: "size", "duration" or "count".
        what: &'static str,
        /// Examples of accepted forms.
        examples: &'static str,
    },
    /// The number does not fit in 64 bits.
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// "1 block", "3 blocks": a count with its noun in the right number.
pub fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Formats a byte count with a binary unit, to three significant digits.
pub fn human_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    match i {
        0 => format!("{b} B"),
        _ if v >= 100.0 => format!("{v:.0} {}", units[i]),
        _ if v >= 10.0 => format!("{v:.1} {}", units[i]),
        _ => format!("{v:.2} {}", units[i]),
    }
}

/// Formats a signed byte difference with its sign, as in "+1.50 GiB".
pub fn human_delta(d: i64) -> String {
    let sign = if d < 0 { "-" } else { "+" };
    format!("{sign}{}", human_bytes(d.unsigned_abs()))
}

/// Splits "12.5GiB" into (12.5, "GiB"), allowing spaces between them.
fn split_number(text: &str) -> Option<(f64, &str)> {
    let t = text.trim();
    let end = t
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_digit() || *c == '.' || *c == '_'))
        .map_or(t.len(), |(i, _)| i);
    let digits: String = t[..end].chars().filter(|c| *c != '_').collect();
    if digits.is_empty() || digits == "." {
        return None;
    }
    let value: f64 = digits.parse().ok()?;
    Some((value, t[end..].trim()))
}

fn scaled(text: &str, value: f64, scale: f64) -> Result<u64, UnitError> {
    let v = (value * scale).round();
    if !v.is_finite() || v >= u64::MAX as f64 {
        return Err(UnitError::TooLarge(text.to_string()));
    }
    Ok(v as u64)
}

/// Parses a byte size such as `80GiB`, `512M`, `1.5 GB` or `1048576`.
pub fn parse_bytes(text: &str) -> Result<u64, UnitError> {
    let bad = || UnitError::Unreadable {
        text: text.to_string(),
        what: "size",
        examples: "80GiB, 512MiB, 24GB, 1048576",
    };
    let (value, suffix) = split_number(text).ok_or_else(bad)?;
    let scale = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" | "ki" => 1024.0,
        "m" | "mib" | "mi" => 1024.0 * 1024.0,
        "g" | "gib" | "gi" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" | "ti" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    scaled(text, value, scale)
}

/// Parses a duration such as `2h`, `30s`, `1h30m`, `500ms` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let bad = || UnitError::Unreadable {
        text: text.to_string(),
        what: "duration",
        examples: "30s, 10m, 2h, 1h30m, 500ms",
    };
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let (value, after) = split_number(rest).ok_or_else(bad)?;
        let unit_len = after
            .char_indices()
            .find(|(_, c)| !c.is_ascii_alphabetic())
            .map_or(after.len(), |(i, _)| i);
        let seconds = match &after[..unit_len] {
            "" if after.is_empty() && total == 0.0 => 1.0,
            "ms" => 1e-3,
            "s" | "sec" => 1.0,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            "d" => 86400.0,
            _ => return Err(bad()),
        };
        total += value * seconds;
        rest = after[unit_len..].trim_start();
    }
    if !total.is_finite() || total > 1e12 {
        return Err(UnitError::TooLarge(text.to_string()));
    }
    Ok(Duration::from_secs_f64(total))
}

/// Parses a count written with a decimal suffix, as model sizes are: `7B`, `350M`, `1.3b`, `125000`.
pub fn parse_count(text: &str) -> Result<u64, UnitError> {
    let bad = || UnitError::Unreadable {
        text: text.to_string(),
        what: "count",
        examples: "7B, 350M, 1.3B, 125000",
    };
    let (value, suffix) = split_number(text).ok_or_else(bad)?;
    let scale = match suffix.to_ascii_lowercase().as_str() {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "b" | "g" => 1e9,
        "t" => 1e12,
        _ => return Err(bad()),
    };
    scaled(text, value, scale)
}

/// Formats a duration briefly, as in "1h05m", "3m20s" or "4.2s".
pub fn human_duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 60.0 {
        format!("{s:.1}s")
    } else if s < 3600.0 {
        format!("{}m{:02}s", (s / 60.0) as u64, (s % 60.0) as u64)
    } else {
        format!(
            "{}h{:02}m",
            (s / 3600.0) as u64,
            ((s % 3600.0) / 60.0) as u64
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("80 GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("24GB"), Ok(24_000_000_000));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("").is_err());
        assert!(matches!(
            parse_bytes("99999999999TiB"),
            Err(UnitError::TooLarge(_))
        ));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("1h30").is_err());
    }

    #[test]
    fn counts() {
        assert_eq!(parse_count("7B"), Ok(7_000_000_000));
        assert_eq!(parse_count("1.3b"), Ok(1_300_000_000));
        assert_eq!(parse_count("350M"), Ok(350_000_000));
        assert_eq!(parse_count("125000"), Ok(125_000));
        assert!(parse_count("7 GiB").is_err());
    }

    #[test]
    fn printing() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(80 << 30), "80.0 GiB");
        assert_eq!(human_delta(-(1 << 20)), "-1.00 MiB");
        assert_eq!(human_duration(Duration::from_secs(3900)), "1h05m");
    }

    proptest! {
        #[test]
        fn whole_mebibytes_round_trip(n in 0u64..1_000_000) {
            prop_assert_eq!(parse_bytes(&format!("{n}MiB")), Ok(n << 20));
        }

        #[test]
        fn never_panics(s in "\\PC{0,12}") {
            let _ = parse_bytes(&s);
            let _ = parse_duration(&s);
            let _ = parse_count(&s);
        }
    }
}
