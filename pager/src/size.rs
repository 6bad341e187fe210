//! Byte sizes as users write them: `4096`, `64K`, `1.5G`, `48MiB`.

use thiserror::Error;

/// A size string that could not be understood.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("size is empty")]
    Empty,
    #[error("size `{0}` is not a number with an optional K/M/G/T suffix (e.g. 4096, 64K, 1.5G)")]
    Malformed(String),
    #[error("size `{0}` is too large")]
    Overflow(String),
}

/// Parses a size in bytes. Suffixes K, M, G, T (optionally followed by `iB` or `B`) are
/// binary multiples, as `dd` and `truncate` read them; fractions are allowed with a
/// suffix (`1.5G`) and rounded down to a whole byte.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(SizeError::Empty);
    }
    let malformed = || SizeError::Malformed(text.to_string());
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, suffix) = trimmed.split_at(split);
    let shift = match suffix.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(malformed()),
    };
    if number.is_empty() {
        return Err(malformed());
    }
    if let Some((whole, frac)) = number.split_once('.') {
        if shift == 0 || frac.contains('.') || (whole.is_empty() && frac.is_empty()) {
            return Err(malformed());
        }
        let value: f64 = number.parse().map_err(|_| malformed())?;
        let bytes = value * (1u64 << shift) as f64;
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(SizeError::Overflow(text.to_string()));
        }
        return Ok(bytes as u64);
    }
    let value: u64 = number.parse().map_err(|_| malformed())?;
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| SizeError::Overflow(text.to_string()))
}

/// Formats a byte count for people: `512 B`, `64.0 KiB`, `1.50 GiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{bytes} B"),
        _ if value < 10.0 => format!("{value:.2} {}", UNITS[unit]),
        _ => format!("{value:.1} {}", UNITS[unit]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_suffixed_sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("48M"), Ok(48 << 20));
        assert_eq!(parse_size("48MiB"), Ok(48 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size(" 1T "), Ok(1 << 40));
    }

    #[test]
    fn rejects_nonsense() {
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert!(matches!(parse_size("G"), Err(SizeError::Malformed(_))));
        assert!(matches!(parse_size("12X"), Err(SizeError::Malformed(_))));
        assert!(matches!(parse_size("1.5"), Err(SizeError::Malformed(_))));
        assert!(matches!(parse_size("1..5G"), Err(SizeError::Malformed(_))));
        assert!(matches!(parse_size("-1G"), Err(SizeError::Malformed(_))));
        assert!(matches!(
            parse_size("99999999999T"),
            Err(SizeError::Overflow(_))
        ));
    }

    #[test]
    fn formats_for_people() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(64 << 10), "64.0 KiB");
        assert_eq!(format_size(3 << 29), "1.50 GiB");
    }
}
