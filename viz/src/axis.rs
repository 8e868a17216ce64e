//! Tick steps and labels shared by the charts.

/// The 1, 2 or 5 times a power of ten nearest above `raw` (at least 1e-9).
pub fn nice_step(raw: f64) -> f64 {
    let raw = if raw.is_finite() && raw > 1e-9 {
        raw
    } else {
        1e-9
    };
    let p = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * p >= raw * (1.0 - 1e-9) {
            return m * p;
        }
    }
    10.0 * p
}

/// A time in the unit its tick step calls for (`s`, `ms` or `us`), with as many
/// decimals as the step needs.
pub fn fmt_time(t: f64, step: f64) -> String {
    let (v, s, unit) = if step >= 0.1 {
        (t, step, "s")
    } else if step >= 1e-4 {
        (t * 1e3, step * 1e3, "ms")
    } else {
        (t * 1e6, step * 1e6, "us")
    };
    let decimals = if s >= 1.0 {
        0
    } else {
        (-s.log10().floor()) as usize
    };
    format!("{v:.decimals$} {unit}")
}

/// A duration to four significant figures or so: `6.667 s`, `263.79 ms`, `40.1 us`.
pub fn fmt_dur(t: f64) -> String {
    if t >= 1.0 {
        format!("{t:.3} s")
    } else if t >= 1e-3 {
        format!("{:.2} ms", t * 1e3)
    } else {
        format!("{:.1} us", t * 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_and_labels() {
        assert_eq!(nice_step(0.7), 1.0);
        assert_eq!(nice_step(1.2), 2.0);
        assert_eq!(nice_step(3.0), 5.0);
        assert!((nice_step(0.013) - 0.02).abs() < 1e-15);
        assert_eq!(fmt_time(2.0, 0.5), "2.0 s");
        assert_eq!(fmt_time(0.012, 0.002), "12 ms");
        assert_eq!(fmt_time(0.0125, 0.0005), "12.5 ms");
        assert_eq!(fmt_time(3e-5, 1e-5), "30 us");
        assert_eq!(fmt_dur(6.6670114), "6.667 s");
        assert_eq!(fmt_dur(0.26378), "263.78 ms");
        assert_eq!(fmt_dur(4.01e-5), "40.1 us");
    }
}
