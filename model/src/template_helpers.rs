//! The two helpers Hugging Face's `transformers` gives chat templates beyond Jinja's own, as it
//! defines them: `strftime_now(format)` (Python's `datetime.now().strftime`, here in UTC — a
//! server's clock — for the C locale's directives) and `tojson` (Python's `json.dumps` with
//! `ensure_ascii=False`: no HTML escaping, `", "` and `": "` between items, or an indent).

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

const WEEKDAYS: [&str; 7] =
    ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// The civil date of `days` since 1970-01-01: (year, month 1-12, day 1-31) (Howard Hinnant's
/// `civil_from_days`).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `format` with Python's `strftime` directives for the time `at` (UTC): `%Y %y %m %d %e %j
/// %B %b %h %A %a %u %w %H %I %M %S %p %F %T %D %R %%`; another directive is an error naming it.
pub fn strftime(format: &str, at: SystemTime) -> Result<String, String> {
    let secs = match at.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    };
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = civil(days);
    let (hour, minute, second) = (rest / 3600, rest % 3600 / 60, rest % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - january_first(year) + 1;
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let directive = chars.next().ok_or("strftime_now: the format ends with a lone %")?;
        let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
        let month_name = MONTHS[month as usize - 1];
        let piece = match directive {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:2}"),
            'j' => format!("{day_of_year:03}"),
            'B' => month_name.to_string(),
            'b' | 'h' => month_name[..3].to_string(),
            'A' => WEEKDAYS[weekday].to_string(),
            'a' => WEEKDAYS[weekday][..3].to_string(),
            'u' => (weekday + 1).to_string(),
            'w' => ((weekday + 1) % 7).to_string(),
            'H' => format!("{hour:02}"),
            'I' => format!("{hour12:02}"),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'D' => format!("{month:02}/{day:02}/{:02}", year.rem_euclid(100)),
            'R' => format!("{hour:02}:{minute:02}"),
            '%' => "%".to_string(),
            other => {
                return Err(format!("strftime_now: %{other} is not a directive Ferry formats"))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Days from 1970-01-01 to January 1st of `year`.
fn january_first(year: i64) -> i64 {
    // Inverse of `civil` for January 1st (Hinnant's `days_from_civil`).
    let y = year - 1;
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let doy = (153 * 10 + 2) / 5; // January is month 11 of the March-based year before
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`: strings escaped as Python
/// escapes them (quotes, backslashes, control characters; nothing else), items joined by `", "`
/// and keys by `": "`, or with an indent one item per line joined by `","`; keys in the
/// value's order.
pub fn tojson(value: &serde_json::Value, indent: Option<usize>) -> String {
    let mut out = String::new();
    write_json(value, indent, 0, &mut out);
    out
}

fn write_json(value: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match value {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_string(k, out);
                out.push_str(": ");
                write_json(v, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        Value::Array(_) => out.push_str("[]"),
        Value::Object(_) => out.push_str("{}"),
        Value::String(s) => write_string(s, out),
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            // Python writes a float with a fraction or an exponent (`1.0`, `1e+20`).
            Some(f) => out.push_str(&python_float(f)),
            None => out.push_str(&n.to_string()),
        },
    }
}

/// A float as Python's `repr` writes it (the shortest round-trip digits; `1.0`, `1e+16`,
/// `1.5e-07`; `NaN` and `Infinity` as `json.dumps` writes them).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the shortest digits: d.ddde±x.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    if (-4..16).contains(&exp) {
        let plain = format!("{f}");
        if plain.contains('.') {
            plain
        } else {
            format!("{plain}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates_are_pythons() {
        // 2026-12-05 13:45:07 UTC, a Saturday, day 339.
        let at = UNIX_EPOCH + Duration::from_secs(1_796_478_307);
        let got = strftime("%d %b %Y|%A %a %B %j %H:%M:%S %I%p %y %F %u %w %%", at).unwrap();
        assert_eq!(got, "05 Dec 2026|Saturday Sat December 339 13:45:07 01PM 26 2026-12-05 6 6 %");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(strftime("%F %j %a", leap).unwrap(), "2000-02-29 060 Tue");
        assert!(strftime("%Q", at).unwrap_err().contains("%Q"));
    }

    #[test]
    fn json_is_pythons() {
        let v = serde_json::json!({"b": [1, 2.5, 1e20, "<a & 'b'>\n\u{1}é"], "a": {}, "c": null});
        assert_eq!(
            tojson(&v, None),
            "{\"b\": [1, 2.5, 1e+20, \"<a & 'b'>\\n\\u0001é\"], \"a\": {}, \"c\": null}"
        );
        assert_eq!(tojson(&serde_json::json!({"k": [1]}), Some(2)), "{\n  \"k\": [\n    1\n  ]\n}");
    }
}
