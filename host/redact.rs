//! Secrets kept out of logs and `Debug` output: API tokens, model keys and
//! the password in a database URL.

use std::fmt;

/// A string that prints as `[redacted]` in `Debug` and `Display`, so a
/// `Debug` derive or a log line of a settings struct cannot show it.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The secret itself, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Secret, Self::Err> {
        Ok(Secret(s.to_string()))
    }
}

impl<'de> serde::Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Secret, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Secret {
        Secret(s)
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Secret {
        Secret(s.to_string())
    }
}

/// `url` with the password of its user part (`scheme://user:PASSWORD@…`)
/// replaced by `***`, and a `password=` query parameter likewise.
pub fn url(url: &str) -> String {
    let mut out = url.to_string();
    if let Some(scheme_end) = out.find("://") {
        let rest = scheme_end + 3;
        let authority_end = out[rest..].find(['/', '?', '#']).map_or(out.len(), |i| rest + i);
        if let Some(at) = out[rest..authority_end].rfind('@') {
            let userinfo = &out[rest..rest + at];
            if let Some(colon) = userinfo.find(':') {
                out.replace_range(rest + colon + 1..rest + at, "***");
            }
        }
    }
    if let Some(q) = out.find("password=") {
        let start = q + "password=".len();
        let end = out[start..].find('&').map_or(out.len(), |i| start + i);
        out.replace_range(start..end, "***");
    }
    out
}

/// `u` as it may be shown: `scheme://host[:port]/path`, with no user
/// part, query or fragment (where credentials and tokens go).
pub fn url_shown(u: &str) -> String {
    match url::Url::parse(u) {
        Ok(parsed) if parsed.has_host() => {
            let port = parsed.port().map(|p| format!(":{p}")).unwrap_or_default();
            format!("{}://{}{port}{}", parsed.scheme(), parsed.host_str().unwrap_or_default(), parsed.path())
        }
        _ => {
            let cut = u.find(['?', '#']).map_or(u, |i| &u[..i]);
            match (cut.find("://"), cut.rfind('@')) {
                (Some(scheme), Some(at)) if at > scheme => format!("{}{}", &cut[..scheme + 3], &cut[at + 1..]),
                _ => cut.to_string(),
            }
        }
    }
}

/// `text` with every `http://` or `https://` URL in it shown as
/// [`url_shown`] shows one: an error message that quotes a URL keeps its
/// host and path, not its query's tokens.
pub fn urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("http://").into_iter().chain(rest.find("https://")).min() {
        out.push_str(&rest[..i]);
        let end = rest[i..].find(|c: char| c.is_whitespace() || matches!(c, ')' | '"' | '\'' | '<' | '>' | ',')).map_or(rest.len(), |e| i + e);
        out.push_str(&url_shown(&rest[i..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_shown_url_keeps_its_host_and_path_and_no_credentials() {
        assert_eq!(super::url_shown("https://u:pw9@c.example:8443/v1/traces?key=k3y#f"), "https://c.example:8443/v1/traces");
        assert_eq!(super::url_shown("http://127.0.0.1:9/x?token=s3cret"), "http://127.0.0.1:9/x");
        let said = super::urls("error sending request for url (http://127.0.0.1:9/x?token=s3cret): refused, see https://a:b@h/p?q=1");
        assert_eq!(said, "error sending request for url (http://127.0.0.1:9/x): refused, see https://h/p");
    }

    #[test]
    fn url_hides_the_password_and_keeps_the_rest() {
        assert_eq!(super::url("postgres://u:hunter2@db:5432/x"), "postgres://u:***@db:5432/x");
        assert_eq!(super::url("postgres://u@db/x"), "postgres://u@db/x");
        assert_eq!(super::url("postgres://db/x?user=u&password=p&sslmode=require"), "postgres://db/x?user=u&password=***&sslmode=require");
        assert_eq!(super::url("sqlite://leasehold.db"), "sqlite://leasehold.db");
        assert_eq!(super::url("postgres://u:p@ss@db/x"), "postgres://u:***@db/x");
    }

    #[test]
    fn secrets_do_not_print() {
        let s = super::Secret::new("s3cret");
        assert_eq!(format!("{s:?} {s}"), "[redacted] [redacted]");
        assert_eq!(s.expose(), "s3cret");
    }
}
