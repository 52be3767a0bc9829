//! `host:port` to a socket address, waiting for DNS: a StatefulSet pod's name appears
//! in the cluster DNS a few seconds after the pod starts, so a lookup that fails is
//! tried again until a deadline instead of stopping the node at once.
//!
//! `YATT_HOSTS_FILE` names a file in `/etc/hosts` form consulted before the system's
//! resolver: for nodes whose names no DNS serves (a cluster network without one, or a
//! test playing pods on loopback addresses).

/// The variable naming a hosts file read before DNS.
pub const HOSTS_FILE_VAR: &str = "YATT_HOSTS_FILE";

/// The address `host` has in `text`, a file in `/etc/hosts` form (`ADDRESS NAME...` a
/// line, `#` comments), names compared without case.
pub fn from_hosts_file(text: &str, host: &str) -> Option<std::net::IpAddr> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .find_map(|line| {
            let mut words = line.split_whitespace();
            let addr = words.next()?.parse().ok()?;
            words.any(|w| w.eq_ignore_ascii_case(host)).then_some(addr)
        })
}

/// `host` in the file `YATT_HOSTS_FILE` names, when it is set.
fn hosts_file_entry(host: &str) -> Result<Option<std::net::IpAddr>, String> {
    let Some(path) = std::env::var_os(HOSTS_FILE_VAR) else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "{HOSTS_FILE_VAR}={:?} cannot be read ({e}); unset it or point it at a hosts file",
            path
        )
    })?;
    Ok(from_hosts_file(&text, host))
}

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
    let Some((host, port)) = split_host_port(text) else {
        return Err(fail(
            "expected HOST:PORT, e.g. gpu01:7400 or yatt-0.yatt:7400".into(),
        ));
    };
    if let Some(ip) = hosts_file_entry(host).map_err(fail)? {
        return Ok(SocketAddr::new(ip, port));
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

    #[test]
    fn a_hosts_file_names_addresses() {
        let text = "# pods\n127.0.0.2 yatt-node-1.yatt yatt-node-1 # pod 1\n\n::1 six\nbad line\n";
        let ip = |h| from_hosts_file(text, h).map(|a| a.to_string());
        assert_eq!(ip("yatt-node-1.yatt").as_deref(), Some("127.0.0.2"));
        assert_eq!(ip("YATT-NODE-1").as_deref(), Some("127.0.0.2"));
        assert_eq!(ip("six").as_deref(), Some("::1"));
        assert_eq!(ip("pods"), None);
        assert_eq!(ip("line"), None);
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
