//! The Python code tool: runs a model's code in a subprocess with a wall-time limit, an
//! address-space limit (`ulimit -v` in the `sh` that execs Python), an output limit, a
//! fresh temporary working directory, an empty environment and, where the system
//! allows, no network (a new network namespace through `unshare -n`, or `unshare -rn`
//! for an unprivileged user). The process runs in its own process group, and the whole
//! group is killed at the deadline or when the output overflows. Nothing it does can
//! take the trainer down: every failure is a [`ToolError`] the model reads.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::env::api::{Tool, ToolError};

/// Limits of the Python tool.
#[derive(Debug, Clone, PartialEq)]
pub struct PythonToolConfig {
    /// The interpreter.
    pub python: PathBuf,
    /// Wall time of one call.
    pub timeout: Duration,
    /// Address-space limit of the interpreter, bytes.
    pub memory_bytes: u64,
    /// Most bytes of output kept (stdout and stderr each); more kills the process.
    pub output_bytes: usize,
}

impl Default for PythonToolConfig {
    fn default() -> Self {
        PythonToolConfig {
            // The trainer passes the job's interpreter; `python3` on the PATH otherwise.
            python: PathBuf::from("python3"),
            timeout: Duration::from_secs(5),
            memory_bytes: 512 << 20,
            output_bytes: 4096,
        }
    }
}

/// How the tool keeps code off the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetIsolation {
    /// `unshare -n`: a new, empty network namespace (root or CAP_SYS_ADMIN).
    Unshare,
    /// `unshare -rn`: the same inside a new user namespace (unprivileged users, where
    /// the kernel allows user namespaces).
    UnshareUser,
    /// Neither works here: code runs with the host's network. Logged once at start.
    None,
}

impl NetIsolation {
    /// The strongest isolation that works on this machine.
    pub fn detect() -> Self {
        let works = |args: &[&str]| {
            Command::new("unshare")
                .args(args)
                .arg("true")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if works(&["-n"]) {
            NetIsolation::Unshare
        } else if works(&["-rn"]) {
            NetIsolation::UnshareUser
        } else {
            tracing::warn!("the python tool cannot isolate the network here (`unshare -n` and `unshare -rn` both fail): tool code runs with the host's network");
            NetIsolation::None
        }
    }

    fn prefix(self) -> &'static [&'static str] {
        match self {
            NetIsolation::Unshare => &["unshare", "-n"],
            NetIsolation::UnshareUser => &["unshare", "-rn"],
            NetIsolation::None => &[],
        }
    }
}

/// The sandboxed Python tool: `{"code": "print(2**10)"}` → `1024`.
#[derive(Debug, Clone)]
pub struct PythonTool {
    config: PythonToolConfig,
    isolation: NetIsolation,
}

impl PythonTool {
    /// A tool running under `config`, isolated by `isolation`.
    pub fn new(config: PythonToolConfig, isolation: NetIsolation) -> Self {
        PythonTool { config, isolation }
    }

    /// Runs `code`; its stdout on success.
    pub fn run(&self, code: &str) -> Result<String, ToolError> {
        let fail = |what: &str, e: std::io::Error| ToolError::Failed(format!("{what}: {e}"));
        let dir = tempfile::Builder::new()
            .prefix("yatt-python-tool-")
            .tempdir()
            .map_err(|e| fail("cannot make its temporary directory", e))?;
        let script = dir.path().join("main.py");
        std::fs::write(&script, code).map_err(|e| fail("cannot write the code", e))?;
        let kib = (self.config.memory_bytes / 1024).max(1);
        let mut cmd = Command::new("sh");
        // `ulimit -v` applies to the shell, which then becomes the interpreter.
        cmd.arg("-c")
            .arg(r#"ulimit -v "$1" || exit 97; shift; exec "$@""#)
            .arg("sh")
            .arg(kib.to_string())
            .args(self.isolation.prefix())
            .arg(&self.config.python)
            .args(["-I", "-B", "main.py"])
            .current_dir(dir.path())
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", dir.path())
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd.spawn().map_err(|e| fail("cannot start python", e))?;
        let pgid = child.id() as i32;
        let cap = self.config.output_bytes;
        let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) else {
            kill_group(pgid);
            let _ = child.wait();
            return Err(ToolError::Failed("no pipes to the interpreter".into()));
        };
        let out = std::thread::spawn(move || read_capped(out, cap, pgid));
        let err = std::thread::spawn(move || read_capped(err, cap, pgid));
        let (tx, rx) = mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        let status = match rx.recv_timeout(self.config.timeout) {
            Ok(s) => s.map_err(|e| fail("waiting for python", e))?,
            Err(_) => {
                kill_group(pgid);
                let _ = waiter.join();
                let _ = (out.join(), err.join());
                return Err(ToolError::Timeout(self.config.timeout.as_secs_f64()));
            }
        };
        let _ = waiter.join();
        let (stdout, out_over) = out.join().unwrap_or_default();
        let (stderr, err_over) = err.join().unwrap_or_default();
        if out_over || err_over {
            return Err(ToolError::Failed(format!(
                "the output passed the {cap}-byte limit; print less"
            )));
        }
        let stdout = String::from_utf8_lossy(&stdout).trim_end().to_string();
        let stderr = String::from_utf8_lossy(&stderr).trim_end().to_string();
        match status.code() {
            Some(0) => Ok(stdout),
            Some(97) => Err(ToolError::Failed("cannot set the memory limit".into())),
            Some(c) => Err(ToolError::Failed(format!(
                "exit status {c}: {}",
                last_line(&stderr)
            ))),
            None => Err(ToolError::Failed(
                "the interpreter was killed by a signal".into(),
            )),
        }
    }
}

/// The last non-empty line (a Python traceback's error line).
fn last_line(s: &str) -> &str {
    s.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("")
}

/// Reads up to `cap` bytes; past that, kills the group and reports the overflow.
fn read_capped(mut r: impl Read, cap: usize, pgid: i32) -> (Vec<u8>, bool) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match r.read(&mut chunk) {
            Ok(0) | Err(_) => return (buf, false),
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                if buf.len() > cap {
                    kill_group(pgid);
                    buf.truncate(cap);
                    return (buf, true);
                }
            }
        }
    }
}

fn kill_group(pgid: i32) {
    // SAFETY: kill(2) with a negative pid signals that process group; no memory is
    // touched. The group is the tool's own (process_group(0) at spawn).
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

impl Tool for PythonTool {
    fn name(&self) -> &str {
        "python"
    }

    fn description(&self) -> &str {
        "python: runs Python code and returns what it prints"
    }

    fn example_question(&self) -> &str {
        "What is 12 * 34?"
    }

    fn example_arguments(&self) -> &str {
        r#"{"code": "print(12*34)"}"#
    }

    fn example_result(&self) -> &str {
        "408"
    }

    fn call(&mut self, arguments: &Map<String, Value>) -> Result<String, ToolError> {
        match arguments.get("code") {
            Some(Value::String(code)) => self.run(code),
            _ => Err(ToolError::BadArguments(
                r#"the python tool takes {"code": "<python source>"}"#.into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn tool(timeout_ms: u64) -> PythonTool {
        let config = PythonToolConfig {
            timeout: Duration::from_millis(timeout_ms),
            memory_bytes: 256 << 20,
            output_bytes: 1000,
            ..Default::default()
        };
        PythonTool::new(config, NetIsolation::detect())
    }

    #[test]
    fn runs_code_and_enforces_every_limit() {
        let t = tool(10_000);
        assert_eq!(t.run("print(12 * 34)").unwrap(), "408");
        // Its own temporary directory, empty at the start.
        let cwd = t
            .run("import os; print(os.getcwd()); print(sorted(os.listdir('.')))")
            .unwrap();
        assert!(
            cwd.contains("yatt-python-tool-") && cwd.ends_with("['main.py']"),
            "{cwd}"
        );
        let e = t.run("raise ValueError('bad input')").unwrap_err();
        assert!(e.to_string().contains("ValueError: bad input"), "{e}");
        // Memory: a 1 GB allocation under a 256 MB limit.
        let e = t.run("x = bytearray(1 << 30)").unwrap_err();
        assert!(e.to_string().contains("MemoryError"), "{e}");
        // Output: a flood is cut off and the process killed.
        let e = t.run("while True: print('x' * 100)").unwrap_err();
        assert!(e.to_string().contains("1000-byte limit"), "{e}");
        // Network: in its own namespace no interface can reach anything (this needs
        // `unshare -n` or user namespaces; without them the tool warns and this fails).
        assert_ne!(NetIsolation::detect(), NetIsolation::None);
        let out = t
            .run("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('connected')\nexcept OSError as e:\n    print('no network')")
            .unwrap();
        assert_eq!(out, "no network");
        // Time: an endless loop (and the child it forked) is killed at the deadline.
        let t = tool(700);
        let t0 = Instant::now();
        let e = t
            .run("import os, time\nif os.fork() == 0:\n    time.sleep(60)\nwhile True: pass")
            .unwrap_err();
        assert_eq!(e, ToolError::Timeout(0.7));
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
}
