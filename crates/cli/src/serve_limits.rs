//! `q4moe serve`'s flags for connection limits, `/metrics` access and CORS (issue 55 items 6, 9),
//! parsed into the server's typed config here, at the edge.

use std::time::Duration;

use clap::{Args, ValueEnum};
use q4moe_server::{ConnLimits, ServeConfig};

#[derive(Args, Debug)]
pub struct ServeLimitArgs {
    /// Time a client has to send a request's headers once it starts (e.g. 10s, 500ms).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    header_timeout: Duration,
    /// A connection silent this long between requests is closed.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    idle_timeout: Duration,
    /// Time a client has to send a request's body once its headers are in.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    body_timeout: Duration,
    /// Open connections at most; at it a new one takes the place of the one idle longest (or
    /// is closed at once where every open one has a request in flight).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Whether /metrics needs the API key (when one is set).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    metrics_auth: OnOff,
    /// An origin whose web pages may call the API (repeatable; `*` allows any). None: no CORS.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

impl ServeLimitArgs {
    pub fn apply(&self, cfg: &mut ServeConfig) {
        cfg.conn = ConnLimits {
            header_timeout: self.header_timeout,
            idle_timeout: self.idle_timeout,
            body_timeout: self.body_timeout,
            max_connections: self.max_connections as usize,
        };
        cfg.metrics_auth = self.metrics_auth == OnOff::On;
        cfg.cors_origins = self.cors_origins.clone();
    }
}

/// `10s`, `500ms`, `1.5s`, or a bare number of seconds; more than zero, at most a day.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, scale) = match t.strip_suffix("ms") {
        Some(n) => (n, 1e-3),
        None => (t.strip_suffix('s').unwrap_or(t), 1.0),
    };
    let secs = num
        .trim()
        .parse::<f64>()
        .map(|v| v * scale)
        .map_err(|_| format!("'{s}' is not a duration (want e.g. 10s or 500ms)"))?;
    if !(secs > 0.0 && secs <= 86_400.0) {
        return Err(format!("'{s}' must be more than 0 and at most a day"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::parse_duration;
    use std::time::Duration;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        for bad in ["0s", "-1", "abc", "1e9", "NaN", ""] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
