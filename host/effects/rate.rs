//! Rate limits on effects, the provider's side (docs/flow-control.md):
//! which rate key a call counts against, what a chat call reserves, what
//! it used, and a provider's `Retry-After`. Admission and the clocks are
//! in `store::rates`; the segment's waiting in `runtime::rates`.

use std::time::Duration;

use super::Remote;

/// The rate key a call counts against: `http:HOST:PORT` (the URL's host
/// in lower case, its port or the scheme's) or `model:NAME`.
pub fn key_of(remote: &Remote) -> String {
    match remote {
        Remote::Http { request, .. } => match reqwest::Url::parse(request.url()) {
            Ok(url) => {
                let port = url.port_or_known_default().unwrap_or(0);
                match url.host() {
                    Some(url::Host::Ipv6(ip)) => format!("http:[{ip}]:{port}"),
                    Some(host) => format!("http:{}:{port}", host.to_string().to_ascii_lowercase()),
                    None => format!("http::{port}"),
                }
            }
            Err(_) => "http:".to_string(),
        },
        Remote::Chat { request } => format!("model:{}", request.model()),
    }
}

/// The key a provider's `Retry-After` holds: for `http`, the plugin's
/// own calls to that host (`http:HOST:PORT@PLUGIN`), since one plugin's
/// answer says nothing of another's standing (each may send its own
/// credentials); for `model:`, every call to it, since the credential is
/// the operator's.
pub fn hold_key(key: &str, plugin: &str) -> String {
    if key.starts_with("http:") { format!("{key}@{plugin}") } else { key.to_string() }
}

/// The tokens a call reserves before it goes out: for a chat, its prompt
/// (a byte count over four, a common rough measure) and the most its
/// answer may cost (`max_tokens`); settled from the usage the answer
/// reports. Other calls cost no tokens.
pub fn reserve(remote: &Remote) -> i64 {
    match remote {
        Remote::Chat { request } => {
            let (prompt, answer) = request.estimate();
            prompt + answer
        }
        Remote::Http { .. } => 0,
    }
}


/// The tokens a recorded chat result says its call used
/// (`usage.total_tokens`), if the provider reported them.
pub fn used_tokens(result: &str) -> Option<i64> {
    let v: serde_json::Value = serde_json::from_str(result).ok()?;
    v["usage"]["total_tokens"].as_i64()
}

/// How long a `429` or `503` answer asks callers to stay away: its
/// `Retry-After`, in seconds or as an HTTP date. `None` for other
/// statuses, or without the header, or with one that does not parse.
pub fn retry_after(status: u16, headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    if status != 429 && status != 503 {
        return None;
    }
    let value = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(when.duration_since(std::time::SystemTime::now()).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(v: &str) -> reqwest::header::HeaderMap {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(reqwest::header::RETRY_AFTER, v.parse().unwrap());
        h
    }

    #[test]
    fn retry_after_is_read_from_429_and_503_only() {
        assert_eq!(retry_after(429, &headers("2")), Some(Duration::from_secs(2)));
        assert_eq!(retry_after(503, &headers(" 7 ")), Some(Duration::from_secs(7)));
        assert_eq!(retry_after(500, &headers("2")), None);
        assert_eq!(retry_after(429, &headers("soon")), None);
        assert_eq!(retry_after(429, &reqwest::header::HeaderMap::new()), None);
        let past = httpdate::fmt_http_date(std::time::SystemTime::UNIX_EPOCH);
        assert_eq!(retry_after(429, &headers(&past)), Some(Duration::ZERO));
    }
}
