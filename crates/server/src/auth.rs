//! Who may call what: the API key (compared in fixed time), and the startup checks that refuse
//! an empty key and warn about an open server on a public address.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::errors::ApiError;

/// The configured key, if any; an empty key is refused by [`check_key`] before it gets here.
#[derive(Clone)]
pub struct ApiKey(pub Option<String>);

/// With a key configured, the routes under this layer need `Authorization: Bearer <key>` or
/// `x-api-key: <key>`.
pub async fn require_key(
    State(key): State<ApiKey>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    let Some(key) = &key.0 else {
        return next.run(req).await;
    };
    // OpenAI's clients send a Bearer token, Anthropic's an `x-api-key` header.
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim);
    match given {
        Some(g) if fixed_time_eq(g.as_bytes(), key.as_bytes()) => next.run(req).await,
        _ => ApiError::unauthorized().into_response(),
    }
}

/// Equality whose time depends only on the lengths, not on where the inputs first differ, so
/// response times do not reveal the key a byte at a time.
pub fn fixed_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // Keeps the optimiser from turning the fold into an early-exit comparison.
    std::hint::black_box(diff) == 0
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthConfigError {
    #[error("the API key is empty (an empty Q4MOE_API_KEY or --api-key would turn authentication off); set a key or unset it")]
    EmptyKey,
}

/// An empty (or blank) key is an error, never "no authentication".
pub fn check_key(key: Option<&str>) -> Result<(), AuthConfigError> {
    match key {
        Some(k) if k.trim().is_empty() => Err(AuthConfigError::EmptyKey),
        _ => Ok(()),
    }
}

/// Whether `host` (a name or an address) is reachable only from this machine.
pub fn is_loopback(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The warning for a server any machine can reach and anyone can use, if it is one.
pub fn open_server_warning(host: &str, key: Option<&str>) -> Option<String> {
    (key.is_none() && !is_loopback(host)).then(|| {
        format!(
            "listening on {host} without an API key: anyone who can reach this address can use \
             the model; set --api-key (or Q4MOE_API_KEY), or bind 127.0.0.1"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_time_eq_is_equality() {
        assert!(fixed_time_eq(b"secret", b"secret"));
        assert!(!fixed_time_eq(b"secret", b"secreT"));
        assert!(!fixed_time_eq(b"secret", b"secret2"));
        assert!(fixed_time_eq(b"", b""));
    }

    #[test]
    fn empty_keys_are_refused_and_open_public_servers_warned_about() {
        assert_eq!(check_key(Some("")), Err(AuthConfigError::EmptyKey));
        assert_eq!(check_key(Some("  ")), Err(AuthConfigError::EmptyKey));
        assert_eq!(check_key(Some("k")), Ok(()));
        assert_eq!(check_key(None), Ok(()));
        assert!(open_server_warning("0.0.0.0", None).is_some());
        assert!(open_server_warning("192.168.1.5", None).is_some());
        assert!(open_server_warning("0.0.0.0", Some("k")).is_none());
        for local in ["127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"] {
            assert!(open_server_warning(local, None).is_none(), "{local}");
        }
    }
}
