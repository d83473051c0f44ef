//! Secrets between services: random bytes from the OS, compared in constant time, carried as
//! hex (gRPC metadata, etcd values).

/// Bytes of a session secret or a leadership token.
pub const LEN: usize = 32;

/// The metadata key a session's stream and resets present its secret under (hex).
pub const SESSION_SECRET_HEADER: &str = "ferry-session-secret";

/// `LEN` random bytes from the operating system.
///
/// # Panics
/// If the OS has no random source to give (no service could run safely then).
#[must_use]
pub fn random() -> Vec<u8> {
    let mut bytes = vec![0u8; LEN];
    getrandom::fill(&mut bytes).expect("the operating system's random source");
    bytes
}

/// Whether `a` equals `b`, in a time that depends only on their lengths.
#[must_use]
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// `bytes` as lowercase hex.
#[must_use]
pub fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut hex, b| {
        let _ = write!(hex, "{b:02x}");
        hex
    })
}

/// Hex back into bytes; `None` if it is not hex.
#[must_use]
pub fn from_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect()
}

/// Shortest token a `--leadership-token-file` may hold, in bytes.
pub const MIN_TOKEN: usize = 16;

/// The token in `path`: hex (whitespace around it ignored), at least [`MIN_TOKEN`] bytes.
///
/// # Errors
/// What is wrong with the file, naming it.
pub fn read_token_file(path: &std::path::Path) -> Result<Vec<u8>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--leadership-token-file {}: {e}", path.display()))?;
    match from_hex(text.trim()) {
        Some(token) if token.len() >= MIN_TOKEN => Ok(token),
        _ => Err(format!(
            "--leadership-token-file {}: not a token: it must hold at least {MIN_TOKEN} bytes as \
             hex (for example `openssl rand -hex 32`)",
            path.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_random_and_round_trip_through_hex() {
        let (a, b) = (random(), random());
        assert_eq!(a.len(), LEN);
        assert_ne!(a, b, "two draws differ");
        assert_eq!(from_hex(&to_hex(&a)), Some(a.clone()));
        assert!(same(&a, &a) && !same(&a, &b) && !same(&a, &a[1..]));
        assert_eq!(from_hex("0g"), None);
        assert_eq!(from_hex("abc"), None);
    }
}
