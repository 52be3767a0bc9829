//! Checks of the `python` and `http` reward keys: the function file, the interpreter,
//! the pool, the endpoint URL and the deadlines.

use std::path::Path;

use crate::config::checks::{invalid, only_with_kind, positive};
use crate::config::modes::RewardKind;
use crate::config::sections::JobConfig;
use crate::error::JobError;

impl JobConfig {
    /// The `python` and `http` reward keys.
    pub(crate) fn validate_reward_code(&self, kinds: &[RewardKind]) -> Result<(), JobError> {
        let r = &self.reward;
        let python = kinds.contains(&RewardKind::Python);
        let http = kinds.contains(&RewardKind::Http);
        for (used, kind, key, value) in [
            (python, RewardKind::Python, "reward.function", &r.function),
            (python, RewardKind::Python, "reward.python", &r.python),
            (http, RewardKind::Http, "reward.url", &r.url),
        ] {
            only_with_kind(used, kind, key, value)?;
        }
        if python || http {
            positive(
                "reward.timeout_s",
                r.timeout_s,
                "e.g. timeout_s = 60 (seconds per call)",
            )?;
        }
        if python {
            self.validate_python()?;
        }
        if http {
            validate_url(&r.url)?;
            if r.max_retries > 10 {
                return Err(invalid(
                    "reward.max_retries",
                    "at most 10",
                    &r.max_retries.to_string(),
                    "e.g. max_retries = 3",
                ));
            }
        }
        Ok(())
    }

    fn validate_python(&self) -> Result<(), JobError> {
        let r = &self.reward;
        let (file, _) = yatt_roles::parse_function(&r.function).map_err(|e| {
            invalid(
                "reward.function",
                "\"path/to/file.py:function\"",
                &format!("{:?}", r.function),
                &e,
            )
        })?;
        if !file.is_file() {
            // Name the directory a relative path was taken from: a job started from
            // elsewhere (a test, a service) finds nothing at the README's path.
            let from = match std::env::current_dir() {
                Ok(dir) if file.is_relative() => format!(" (looked in {})", dir.display()),
                _ => String::new(),
            };
            return Err(invalid(
                "reward.function",
                "an existing .py file",
                &format!("{:?}, and {} is not a file{from}", r.function, file.display()),
                "point reward.function at your file by a path from the working directory or an absolute one, e.g. \"examples/python_reward/numeric_reward.py:compute_score\" from the repository root",
            ));
        }
        if r.python.contains('/') && !Path::new(&r.python).is_file() {
            return Err(invalid(
                "reward.python",
                "a Python 3 interpreter (a path, or a name on PATH)",
                &format!("{:?}", r.python),
                "e.g. python = \".venv/bin/python\", or leave it empty for the active venv's",
            ));
        }
        if !(1..=64).contains(&r.python_workers) {
            return Err(invalid(
                "reward.python_workers",
                "1 to 64 worker processes",
                &r.python_workers.to_string(),
                "e.g. python_workers = 2",
            ));
        }
        if let Some(f) = r.fallback_score {
            if !f.is_finite() {
                return Err(invalid(
                    "reward.fallback_score",
                    "a finite number",
                    &f.to_string(),
                    "e.g. fallback_score = 0.0, or remove it to fail the step when the function raises",
                ));
            }
        }
        Ok(())
    }
}

/// `reward.url` must be `http://host:port/path`.
fn validate_url(url: &str) -> Result<(), JobError> {
    let bad = |why: &str| {
        invalid(
            "reward.url",
            "http://host:port/path",
            &format!("{url:?}"),
            &format!("{why}; e.g. url = \"http://127.0.0.1:8000/score\""),
        )
    };
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        bad("it must start with http:// (https: put a local TLS-terminating proxy in front)")
    })?;
    let (authority, path) = rest
        .split_once('/')
        .ok_or_else(|| bad("it has no /path after host:port"))?;
    let (host, port) = authority
        .rsplit_once(':')
        .ok_or_else(|| bad("it has no :port after the host"))?;
    if host.is_empty() {
        return Err(bad("it has no host"));
    }
    if !port.parse::<u16>().is_ok_and(|p| p > 0) {
        return Err(bad("the port is not a number in 1..65535"));
    }
    if path.is_empty() {
        return Err(bad("the path after host:port/ is empty"));
    }
    yatt_roles::HttpRewardClient::new(yatt_roles::HttpRewardConfig::new(url))
        .map_err(|e| bad(&e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::validate_url;

    #[test]
    fn reward_urls_need_host_port_and_path() {
        assert!(validate_url("http://127.0.0.1:8000/score").is_ok());
        for (url, why) in [
            ("https://h:1/p", "http://"),
            ("http://h:1", "no /path"),
            ("http://h/p", "no :port"),
            ("http://h:x/p", "port"),
            ("http://:80/p", "no host"),
            ("http://h:80/", "path"),
        ] {
            let e = validate_url(url).unwrap_err().to_string();
            assert!(e.contains("reward.url") && e.contains(why), "{url}: {e}");
        }
    }
}
