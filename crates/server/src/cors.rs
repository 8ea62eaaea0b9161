//! Cross-origin access: off unless `--cors-origin` names origins (browsers then may call the API
//! from those pages only). The preflight is answered before authentication, as browsers send it
//! without credentials.

use axum::http::{header, HeaderValue, Method};
use tower_http::cors::{AllowOrigin, CorsLayer};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("--cors-origin {0:?} is not a valid origin (want e.g. https://example.com, or *)")]
pub struct BadOrigin(pub String);

/// The layer for `origins` (`*` allows any), or `None` when the list is empty.
pub fn layer(origins: &[String]) -> Result<Option<CorsLayer>, BadOrigin> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let values = origins
            .iter()
            .map(|o| parse(o).ok_or_else(|| BadOrigin(o.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        AllowOrigin::list(values)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
    ))
}

/// An origin is a scheme and a host (and port), nothing after: `https://example.com:8443`.
fn parse(o: &str) -> Option<HeaderValue> {
    let rest = o
        .strip_prefix("http://")
        .or_else(|| o.strip_prefix("https://"))?;
    let ok = !rest.is_empty() && !rest.contains(['/', '?', '#', ' ']);
    ok.then(|| HeaderValue::from_str(o).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_checked() {
        assert!(layer(&[]).unwrap().is_none());
        assert!(layer(&["https://a.example:8443".into(), "*".into()]).is_ok());
        assert_eq!(
            layer(&["https://a.example/path".into()]).unwrap_err(),
            BadOrigin("https://a.example/path".into())
        );
        assert!(layer(&["a.example".into()]).is_err());
    }
}
