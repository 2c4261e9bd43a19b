//! `http` (keyed) and `http.unkeyed`: an HTTP request to a host on the
//! plugin's allow-list.
//!
//! Request (JSON): `{"method": "POST", "url": "http://host:port/path",
//! "headers": {"name": "value"}, "body": <string or any JSON>}`; `method`
//! defaults to `GET`; a non-string `body` is sent as JSON. Result:
//! `{"status": 200, "body": "<text>"}`. A status of 400 or more is `failed`
//! with the status and the start of the body.
//!
//! Every request carries `Idempotency-Key: <database>:<run_id>:<seq>`
//! (stable across attempts) and `Leasehold-Fence: <fence>` (so the remote
//! side can reject a stale segment), and `traceparent` naming the call's
//! span (docs/operations.md, "Tracing") unless the guest sent its own.
//! `http` is *keyed*: when a segment dies
//! with the request in flight, the next segment re-issues it with the same
//! key; a re-issue answered `409` or `425` (the first request is still in
//! progress) is tried again, not recorded. `http.unkeyed` is for endpoints
//! that cannot deduplicate: it is never re-issued, and the turn receives
//! `in-doubt` instead. Redirects are not followed (they could leave the
//! allow-list). `https://` uses rustls with the system's roots.
//!
//! The allow-list (see [`check`]) is closed: an entry `host` allows that
//! host on its scheme's default port only, `host:port` that port, and
//! `scheme://host:port` that scheme too. A name that resolves to a
//! loopback, private or link-local address is refused (only an entry that
//! is that IP literal reaches it), and the service's own API is reachable
//! only through an entry that names its port. The guest cannot set `Host`,
//! framing or hop-by-hop headers, nor the two leasehold headers.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::OnceLock;
use std::time::Duration;

use serde::Deserialize;

use super::{RemoteCtx, RemoteFailure, in_progress};
use super::EffectError;

/// How long one request may take. Default: 30 s.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Headers the host sets or that frame the message: a guest may not.
const FORBIDDEN_HEADERS: [&str; 13] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "idempotency-key",
    "leasehold-fence",
];

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpRequest {
    #[serde(default)]
    method: Option<String>,
    url: String,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    body: Option<serde_json::Value>,
}

impl HttpRequest {
    /// The URL, as the guest wrote it (checked by [`check`]).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The method, upper case (default `GET`).
    pub fn method(&self) -> String {
        self.method.as_deref().unwrap_or("GET").to_ascii_uppercase()
    }
}

/// One allow-list entry: `host`, `host:port` or `scheme://host:port`.
#[derive(Debug, PartialEq)]
struct Entry {
    scheme: Option<String>,
    host: String,
    port: Option<u16>,
}

fn parse_entry(entry: &str) -> Option<Entry> {
    let (scheme, rest) = match entry.split_once("://") {
        Some((s, rest)) => (Some(s.to_ascii_lowercase()), rest),
        None => (None, entry),
    };
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p.parse().ok()?),
            None if after.is_empty() => None,
            None => return None,
        };
        (host.to_string(), port)
    } else {
        match rest.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p.parse().ok()?)),
            None => (rest.to_string(), None),
        }
    };
    (!host.is_empty()).then(|| Entry { scheme, host: host.to_ascii_lowercase(), port })
}

fn default_port(scheme: &str) -> u16 {
    if scheme == "https" { 443 } else { 80 }
}

/// Whether an entry's host names the URL's host: the same name, or the same
/// IP address however it is written.
fn same_host(entry: &str, host: &url::Host<&str>) -> bool {
    match (host, entry.parse::<IpAddr>()) {
        (url::Host::Domain(d), Err(_)) => d.eq_ignore_ascii_case(entry),
        (url::Host::Ipv4(ip), Ok(e)) => IpAddr::V4(*ip) == e,
        (url::Host::Ipv6(ip), Ok(e)) => IpAddr::V6(*ip) == e,
        _ => false,
    }
}

/// Parses and checks a request against the plugin's allow-list and the
/// addresses it must not reach unless listed with their port (`reserved`:
/// the service's own API). `Err` is a recorded refusal.
pub fn check(name: &str, request: &str, allow: &[String], reserved: &[SocketAddr]) -> Result<HttpRequest, EffectError> {
    let req: HttpRequest =
        serde_json::from_str(request).map_err(|e| EffectError::Failed(format!("{name}: bad request: {e}")))?;
    let url = reqwest::Url::parse(&req.url)
        .map_err(|e| EffectError::Failed(format!("{name}: bad url {:?}: {e}", req.url)))?;
    let scheme = url.scheme();
    if scheme != "http" && scheme != "https" {
        return Err(EffectError::Denied(format!("{name}: only http:// and https:// URLs are allowed, not {scheme:?}")));
    }
    if let Some(h) = req.headers.keys().find(|h| FORBIDDEN_HEADERS.contains(&h.to_ascii_lowercase().as_str())) {
        return Err(EffectError::Denied(format!("{name}: the guest may not set the {h:?} header")));
    }
    let host = url.host().ok_or_else(|| EffectError::Failed(format!("{name}: the url {:?} has no host", req.url)))?;
    let port = url.port_or_known_default().unwrap_or(default_port(scheme));
    let shown = match &host {
        url::Host::Ipv6(ip) => format!("[{ip}]:{port}"),
        other => format!("{other}:{port}"),
    };
    let matching: Vec<Entry> = allow
        .iter()
        .filter_map(|a| parse_entry(a))
        .filter(|e| {
            e.scheme.as_deref().is_none_or(|s| s == scheme)
                && same_host(&e.host, &host)
                && e.port.unwrap_or_else(|| default_port(e.scheme.as_deref().unwrap_or(scheme))) == port
        })
        .collect();
    if matching.is_empty() {
        return Err(EffectError::Denied(format!(
            "{name}: {scheme}://{shown} is not on this plugin's allow-list \
             (an entry `host` allows the scheme's default port only; list `host:port` for another)"
        )));
    }
    let ip = match host {
        url::Host::Ipv4(ip) => Some(IpAddr::V4(ip)),
        url::Host::Ipv6(ip) => Some(IpAddr::V6(ip)),
        url::Host::Domain(_) => None,
    };
    let own = ip.is_some_and(|ip| reserved.iter().any(|r| r.port() == port && (r.ip().is_unspecified() || r.ip() == ip)));
    if own && !matching.iter().any(|e| e.port.is_some()) {
        return Err(EffectError::Denied(format!(
            "{name}: {shown} is this service's own API; an allow-list entry must name it with its port"
        )));
    }
    Ok(req)
}

/// Whether `ip` is an address on the public internet: not loopback,
/// private, link-local, shared (CGNAT), unspecified, broadcast,
/// documentation or unique-local.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_documentation()
                || v4.is_multicast()
                || o[0] == 0
                || (o[0] == 100 && (o[1] & 0xc0) == 64))
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = v6.segments();
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80)
        }
    }
}

/// A name that resolved to no public address.
#[derive(Debug, thiserror::Error)]
#[error("{0} resolves only to loopback, private or link-local addresses; list the IP address itself to reach it")]
pub struct NotPublic(String);

/// Resolves names for guests' requests, keeping public addresses only: a
/// guest must not reach the host's own network through a name (or a name
/// rebound after the allow-list check). IP literals never come here.
struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        Box::pin(async move {
            let host = name.as_str().to_string();
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let public: Vec<SocketAddr> = addrs.into_iter().filter(|a| is_public(a.ip())).collect();
            if public.is_empty() {
                return Err(Box::new(NotPublic(host)) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(public.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Where guests' `http` requests go. Default ([`Egress::direct`]):
/// straight to the host they name, resolved to public addresses only.
/// `HTTP_PROXY`, `HTTPS_PROXY` and `ALL_PROXY` are ignored: a proxy
/// resolves the names itself, so the public-address rule would never run,
/// and a guest could reach the host's own network through it. A proxy is
/// the operator's explicit choice ([`Egress::through_proxy`], `serve
/// --guest-http-proxy`).
#[derive(Clone, Debug)]
pub struct Egress {
    client: reqwest::Client,
    /// The proxy's address without credentials, for logs; `None`: direct.
    proxy: Option<String>,
}

impl Default for Egress {
    fn default() -> Self {
        Egress::direct()
    }
}

impl Egress {
    /// Straight to the named host, public addresses only, no proxy.
    pub fn direct() -> Egress {
        Egress { client: client().clone(), proxy: None }
    }

    /// Every guest request through the HTTP proxy at `url` (`http://` or
    /// `https://`, credentials allowed in the URL). The allow-list still
    /// decides which hosts a plugin may name, but the proxy resolves the
    /// names and connects, so the public-address rule is the proxy's to
    /// enforce: a proxy that can reach the host's own network lets every
    /// allowed name reach it too. No redirects, as direct.
    pub fn through_proxy(url: &str) -> Result<Egress, String> {
        let parsed = reqwest::Url::parse(url).map_err(|e| format!("the guest HTTP proxy {url:?} is not a URL: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(format!("the guest HTTP proxy must be an http:// or https:// URL with a host, not {}", shown(&parsed)));
        }
        install_tls();
        let proxy = reqwest::Proxy::all(parsed.as_str()).map_err(|e| format!("the guest HTTP proxy {}: {e}", shown(&parsed)))?;
        let client = reqwest::Client::builder()
            .proxy(proxy)
            .redirect(reqwest::redirect::Policy::none())
            .timeout(TIMEOUT)
            .build()
            .map_err(|e| format!("building the guests' HTTP client: {e}"))?;
        Ok(Egress { client, proxy: Some(shown(&parsed)) })
    }

    /// The proxy guests' requests go through (without credentials), if any.
    pub fn proxy(&self) -> Option<&str> {
        self.proxy.as_deref()
    }
}

/// `url`'s scheme, host and port: never its credentials.
fn shown(url: &reqwest::Url) -> String {
    match (url.host_str(), url.port_or_known_default()) {
        (Some(host), Some(port)) => format!("{}://{host}:{port}", url.scheme()),
        _ => format!("{}://…", url.scheme()),
    }
}

/// The client of guests' direct `http` effects (names resolved to public
/// addresses only, no redirects, no proxy): see [`Egress`].
fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        install_tls();
        reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .dns_resolver(std::sync::Arc::new(PublicOnly))
            .timeout(TIMEOUT)
            .build()
            .expect("building the HTTP client")
    })
}

/// The client of endpoints the operator configured (the model), which may
/// well be on the host's own network. No redirects.
pub(crate) fn host_client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        install_tls();
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(TIMEOUT)
            .build()
            .expect("building the HTTP client")
    })
}

/// Installs the process's TLS crypto provider (ring), once. Every reqwest
/// client of the process needs it before it is built.
pub fn install_tls() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err means another provider is already installed: fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A request error that a policy, not the network, caused.
fn refused_by_policy(e: &reqwest::Error) -> Option<String> {
    let mut source: Option<&dyn std::error::Error> = Some(e);
    while let Some(err) = source {
        if let Some(not_public) = err.downcast_ref::<NotPublic>() {
            return Some(not_public.to_string());
        }
        source = err.source();
    }
    None
}

pub async fn perform(name: &str, req: HttpRequest, ctx: &RemoteCtx, egress: &Egress) -> Result<String, RemoteFailure> {
    let failed = |m: String| RemoteFailure::Effect(EffectError::Failed(format!("{name}: {m}")));
    let method = req.method.as_deref().unwrap_or("GET").to_ascii_uppercase();
    let method = reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| failed(format!("bad method: {e}")))?;
    let mut builder = egress
        .client
        .request(method, &req.url)
        .header("Idempotency-Key", ctx.idempotency_key())
        .header("Leasehold-Fence", ctx.fence.to_string());
    for (k, v) in &req.headers {
        builder = builder.header(k.as_str(), v.as_str());
    }
    if let Some(tp) = &ctx.traceparent
        && !req.headers.keys().any(|k| k.eq_ignore_ascii_case("traceparent"))
    {
        builder = builder.header("traceparent", tp.as_str());
    }
    builder = match req.body {
        None => builder,
        Some(serde_json::Value::String(s)) => builder.body(s),
        Some(json) => builder.header("Content-Type", "application/json").body(json.to_string()),
    };
    let mut response = match builder.send().await {
        Ok(r) => r,
        Err(e) => {
            if let Some(why) = refused_by_policy(&e) {
                return Err(RemoteFailure::Effect(EffectError::Denied(format!("{name}: {why}"))));
            }
            return Err(failed(format!("request failed: {e}")));
        }
    };
    let status = response.status().as_u16();
    if in_progress(status, ctx) {
        return Err(RemoteFailure::InProgress(format!("HTTP {status}")));
    }
    let retry_after = super::rate::retry_after(status, response.headers());
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| failed(format!("reading the response: {e}")))? {
        body.extend_from_slice(&chunk);
        if body.len() > ctx.max_result_bytes {
            return Err(failed(format!("response is over the {}-byte cap", ctx.max_result_bytes)));
        }
    }
    let body = String::from_utf8_lossy(&body).into_owned();
    if status >= 400 {
        let start: String = body.chars().take(200).collect();
        let error = EffectError::Failed(format!("{name}: HTTP {status}: {start}"));
        return Err(match retry_after {
            Some(retry_after) => RemoteFailure::Throttled { error, retry_after },
            None => RemoteFailure::Effect(error),
        });
    }
    Ok(serde_json::json!({ "status": status, "body": body }).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(url: &str, allow: &[&str]) -> bool {
        let allow: Vec<String> = allow.iter().map(|s| s.to_string()).collect();
        let reserved = [SocketAddr::from(([127, 0, 0, 1], 8080))];
        check("http", &serde_json::json!({ "url": url }).to_string(), &allow, &reserved).is_ok()
    }

    #[test]
    fn an_entry_without_a_port_means_the_schemes_default_port() {
        assert!(allowed("http://api.example/x", &["api.example"]));
        assert!(allowed("https://api.example/x", &["api.example"]));
        assert!(!allowed("http://api.example:9000/x", &["api.example"]));
        assert!(allowed("http://api.example:9000/x", &["api.example:9000"]));
        assert!(!allowed("https://api.example:9000/x", &["http://api.example:9000"]));
        assert!(allowed("https://api.example/x", &["https://api.example"]));
        assert!(!allowed("http://api.example/x", &["https://api.example"]));
        assert!(allowed("http://[::1]:9000/x", &["[::1]:9000"]));
        assert!(!allowed("http://other.example/x", &["api.example"]));
    }

    #[test]
    fn the_services_own_api_needs_an_entry_with_its_port() {
        let check_own = |url: &str, allow: &[&str]| {
            let allow: Vec<String> = allow.iter().map(|s| s.to_string()).collect();
            let reserved = [SocketAddr::from(([0, 0, 0, 0], 80))];
            check("http", &serde_json::json!({ "url": url }).to_string(), &allow, &reserved).is_ok()
        };
        assert!(!check_own("http://127.0.0.1/v1/plugins/x", &["127.0.0.1"]));
        assert!(!check_own("http://10.0.0.5/v1/plugins/x", &["10.0.0.5"]));
        assert!(check_own("http://127.0.0.1/v1/runs", &["127.0.0.1:80"]));
        assert!(check_own("http://example.com/", &["example.com"]), "names go through the public-only resolver instead");
    }

    #[test]
    fn public_addresses_are_told_from_the_hosts_own_networks() {
        for ip in ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0", "::1", "fd00::1", "fe80::1", "::ffff:127.0.0.1"] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["1.1.1.1", "8.8.8.8", "2606:4700::1111"] {
            assert!(is_public(ip.parse().unwrap()), "{ip}");
        }
    }
}
