//! `host:port` to a socket address, waiting for DNS: a StatefulSet pod's name appears
//! in the cluster DNS a few seconds after the pod starts, so a lookup that fails is
//! tried again until a deadline instead of stopping the node at once.

use std::net::SocketAddr;
use std::time::Duration;

/// A `host:port` that did not resolve; the message names it and what was tried.
#[derive(Debug, thiserror::Error)]
#[error("{what} {text:?}: {problem}")]
pub struct LookupError {
    /// What the address is for (e.g. "the seed (node.seed)").
    pub what: String,
    /// The address as given.
    pub text: String,
    /// Why it did not resolve.
    pub problem: String,
}

/// Splits `host:port` (`[v6]:port` for IPv6 literals); `None` when it is not one.
pub fn split_host_port(text: &str) -> Option<(&str, u16)> {
    let (host, port) = text.rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let name_ok = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b':'));
    (name_ok).then_some(())?;
    Some((host, port.parse().ok()?))
}

/// Resolves `text` (`host:port` or a socket address), trying again every 500 ms until
/// `wait` has passed. An address literal returns at once. IPv4 answers are preferred.
pub async fn lookup(what: &str, text: &str, wait: Duration) -> Result<SocketAddr, LookupError> {
    let fail = |problem: String| LookupError {
        what: what.into(),
        text: text.into(),
        problem,
    };
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if split_host_port(text).is_none() {
        return Err(fail(
            "expected HOST:PORT, e.g. gpu01:7400 or yatt-0.yatt:7400".into(),
        ));
    }
    let deadline = tokio::time::Instant::now() + wait;
    let mut logged = false;
    loop {
        let problem = match tokio::net::lookup_host(text).await {
            Ok(addrs) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                if let Some(a) = addrs.iter().find(|a| a.is_ipv4()).or(addrs.first()) {
                    return Ok(*a);
                }
                "the name has no address".to_string()
            }
            Err(e) => e.to_string(),
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(fail(format!(
                "{problem} (tried for {} s; check the name, the DNS, or the headless Service)",
                wait.as_secs()
            )));
        }
        if !logged {
            tracing::info!(what, address = text, %problem, "waiting for the name to resolve");
            logged = true;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_host_and_port() {
        assert_eq!(split_host_port("gpu01:7400"), Some(("gpu01", 7400)));
        assert_eq!(split_host_port("a-0.svc.ns:1"), Some(("a-0.svc.ns", 1)));
        assert_eq!(split_host_port("[::1]:7400"), Some(("::1", 7400)));
        for bad in [
            "gpu01",
            "gpu01:",
            ":7400",
            "gpu01:99999",
            "a b:1",
            "gpu01:x",
        ] {
            assert_eq!(split_host_port(bad), None, "{bad}");
        }
    }

    #[tokio::test]
    async fn literals_resolve_at_once_and_junk_is_refused() {
        let w = Duration::from_secs(1);
        assert_eq!(
            lookup("seed", "127.0.0.2:7400", w).await.unwrap(),
            "127.0.0.2:7400".parse().unwrap()
        );
        assert_eq!(lookup("seed", "localhost:9", w).await.unwrap().port(), 9);
        let e = lookup("the seed", "no port", w)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("the seed") && e.contains("HOST:PORT"), "{e}");
    }
}
