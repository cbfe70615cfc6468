//! Kubernetes quantities (`500m`, `2`, `1Gi`, `1e9`) as numbers, for validation and for the
//! per-tenant requests gauge.

/// CPU cores: `500m` → 0.5, `2` → 2.0.
pub fn cores(q: &str) -> Option<f64> {
    let q = q.trim();
    let v = match q.strip_suffix('m') {
        Some(milli) => number(milli)? / 1000.0,
        None => number(q)?,
    };
    Some(v)
}

/// Bytes: `1Gi` → 2^30, `10G` → 10^10, `128974848`, `129e6`.
pub fn bytes(q: &str) -> Option<f64> {
    let q = q.trim();
    const SUFFIXES: [(&str, f64); 13] = [
        ("Ki", 1024.0),
        ("Mi", 1_048_576.0),
        ("Gi", 1_073_741_824.0),
        ("Ti", 1_099_511_627_776.0),
        ("Pi", 1_125_899_906_842_624.0),
        ("Ei", 1_152_921_504_606_846_976.0),
        ("m", 0.001),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    for (suffix, factor) in SUFFIXES {
        if let Some(n) = q.strip_suffix(suffix) {
            return Some(number(n)? * factor);
        }
    }
    number(q)
}

/// A non-negative decimal number, optionally with an exponent (`1.5`, `129e6`).
fn number(s: &str) -> Option<f64> {
    let ok = !s.is_empty()
        && s.starts_with(|c: char| c.is_ascii_digit() || c == '.')
        && s.chars()
            .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'));
    let v: f64 = s.parse().ok().filter(|_| ok)?;
    (v.is_finite() && v >= 0.0).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_read_as_kubernetes_reads_them() {
        assert_eq!(cores("500m"), Some(0.5));
        assert_eq!(cores("2"), Some(2.0));
        assert_eq!(bytes("1Gi"), Some(1_073_741_824.0));
        assert_eq!(bytes("10G"), Some(1e10));
        assert_eq!(bytes("129e6"), Some(129e6));
        assert_eq!(bytes("4096"), Some(4096.0));
        for bad in ["", "lots", "-1", "1Xi", "Gi", "1 Gi"] {
            assert_eq!(bytes(bad), None, "{bad:?}");
        }
        assert_eq!(cores("m"), None);
        assert_eq!(cores("two"), None);
    }
}
