//! A real `redis-server` for integration tests: started on a free 127.0.0.1 port, by default
//! with no persistence (or, through [`RedisOptions`], with an append-only file synced at every
//! write, and extra environment such as libfaketime's), killed (by its own PID only) when the
//! test ends.
//!
//! The binary is `$SLACKGATE_REDIS_SERVER` when set, else `redis-server` on `PATH`. A missing
//! binary is an error, not a skip: the cluster tests are the only proof that replicas share
//! one gate, so CI must run them (`scripts/test.sh` installs the Debian package).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Environment variable naming the `redis-server` binary to use instead of the one on `PATH`.
pub const REDIS_SERVER_VAR: &str = "SLACKGATE_REDIS_SERVER";

/// How long a fresh server may take to answer `PING`.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// How to run a [`RedisServer`] beyond the defaults (no password, no persistence).
#[derive(Clone, Debug, Default)]
pub struct RedisOptions {
    /// `requirepass`: clients must give it.
    pub password: Option<String>,
    /// Keep the data in this directory as an append-only file synced at every write
    /// (`appendonly yes`, `appendfsync always`): a kill -9 and [`RedisServer::restart`] come
    /// back with every write Redis acknowledged. `None`: memory only.
    pub persist_in: Option<PathBuf>,
    /// Extra environment of the server process (libfaketime's `LD_PRELOAD`, `FAKETIME_*`).
    pub env: Vec<(String, String)>,
}

/// A `redis-server` child process on 127.0.0.1. Without persistence (`--save ""
/// --appendonly no`) data lives in memory only, so a [`RedisServer::restart`] starts empty,
/// like a crashed cache node.
#[derive(Debug)]
pub struct RedisServer {
    binary: PathBuf,
    port: u16,
    options: RedisOptions,
    child: Option<Child>,
}

impl RedisServer {
    /// Start a server on a free loopback port and wait until it answers `PING`.
    pub fn start() -> std::io::Result<RedisServer> {
        RedisServer::start_with(RedisOptions::default())
    }

    /// [`RedisServer::start`] with `requirepass`: clients must give `password`.
    pub fn start_with_password(password: &str) -> std::io::Result<RedisServer> {
        RedisServer::start_with(RedisOptions {
            password: Some(password.to_owned()),
            ..RedisOptions::default()
        })
    }

    /// [`RedisServer::start`] with `options`.
    pub fn start_with(options: RedisOptions) -> std::io::Result<RedisServer> {
        let binary = binary()?;
        if let Some(dir) = &options.persist_in {
            std::fs::create_dir_all(dir)?;
        }
        let mut last = None;
        // A port found free can be taken by someone else before the server binds it: retry
        // with another one a few times.
        for _ in 0..3 {
            let port = free_port()?;
            let mut server = RedisServer {
                binary: binary.clone(),
                port,
                options: options.clone(),
                child: None,
            };
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("redis-server did not start")))
    }

    /// `redis://[:password@]127.0.0.1:PORT/0`.
    pub fn url(&self) -> String {
        match &self.options.password {
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}/0", self.port),
            None => format!("redis://127.0.0.1:{}/0", self.port),
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kill the server (SIGKILL to its PID, like a crash) and reap it. Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The process id of the running server, if it runs (to signal it: SIGSTOP, SIGCONT).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stop (if running) and start again on the same port, waits for `PING`: empty without
    /// persistence, with every acknowledged write with it.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.stop();
        self.spawn_again()
    }

    /// Stop (if running), delete the persisted data (if any) and start again on the same port,
    /// empty: a server that lost its disk, or one that never had persistence.
    pub fn restart_empty(&mut self) -> std::io::Result<()> {
        self.stop();
        if let Some(dir) = &self.options.persist_in {
            for entry in std::fs::read_dir(dir)? {
                let path = entry?.path();
                if path.is_dir() {
                    std::fs::remove_dir_all(&path)?;
                } else {
                    std::fs::remove_file(&path)?;
                }
            }
        }
        self.spawn_again()
    }

    fn spawn_again(&mut self) -> std::io::Result<()> {
        // The port was just released; another process taking it in between is unlikely, and
        // then the start fails with a clear error rather than silently moving.
        let mut last = None;
        for _ in 0..20 {
            match self.spawn() {
                Ok(()) => return Ok(()),
                Err(e) => {
                    last = Some(e);
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("redis-server did not restart")))
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let mut cmd = Command::new(&self.binary);
        cmd.args(["--save", "", "--bind", "127.0.0.1"]);
        let dir = match &self.options.persist_in {
            Some(dir) => {
                cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
                dir.clone()
            }
            None => {
                cmd.args(["--appendonly", "no"]);
                std::env::temp_dir()
            }
        };
        cmd.envs(self.options.env.iter().map(|(k, v)| (k, v)))
            .arg("--port")
            .arg(self.port.to_string())
            .arg("--dir")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(pw) = &self.options.password {
            cmd.arg("--requirepass").arg(pw);
        }
        let mut child = cmd.spawn().map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot run {}: {e}", self.binary.display()),
            )
        })?;
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if ping(self.port, self.options.password.as_deref()) {
                self.child = Some(child);
                return Ok(());
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(std::io::Error::other(format!(
                    "redis-server on port {} exited at start ({status}); port taken?",
                    self.port
                )));
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "redis-server on port {} did not answer PING within {READY_WITHIN:?}",
                        self.port
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The `redis-server` to run, or an error saying how to get one.
fn binary() -> std::io::Result<PathBuf> {
    if let Some(p) = std::env::var_os(REDIS_SERVER_VAR).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{REDIS_SERVER_VAR}={} is not a file", p.display()),
        ));
    }
    std::env::var_os("PATH")
        .and_then(|p| crate::find_in(&p, "redis-server"))
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "no `redis-server` on PATH: install it with `apt-get install -y \
                     redis-server` (scripts/test.sh does) or set {REDIS_SERVER_VAR}=PATH"
                ),
            )
        })
}

/// A port nothing listens on right now.
fn free_port() -> std::io::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Whether a server on `port` answers `PING` with `+PONG` (after `AUTH` when it has a
/// password).
fn ping(port: u16, password: Option<&str>) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut req = String::new();
    if let Some(pw) = password {
        req.push_str(&format!("*2\r\n$4\r\nAUTH\r\n${}\r\n{pw}\r\n", pw.len()));
    }
    req.push_str("*1\r\n$4\r\nPING\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    while !got.windows(5).any(|w| w == b"+PONG") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return false,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
        if got.len() > 4096 {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_starts_answers_restarts_and_dies_with_its_handle() -> std::io::Result<()> {
        let mut server = RedisServer::start()?;
        let port = server.port();
        assert!(ping(port, None));
        server.stop();
        assert!(!ping(port, None));
        server.restart()?;
        assert_eq!(server.port(), port);
        assert!(ping(port, None));
        drop(server);
        assert!(!ping(port, None));
        Ok(())
    }

    /// Writes `SET k v` and reads `GET k` back: the value, or `None` for a nil reply.
    fn set_then_get(port: u16, set: bool) -> std::io::Result<Option<String>> {
        let mut s = TcpStream::connect(SocketAddr::from(([127, 0, 0, 1], port)))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        if set {
            s.write_all(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n")?;
            let mut ok = [0u8; 5];
            s.read_exact(&mut ok)?;
        }
        s.write_all(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n")?;
        let mut got = [0u8; 7];
        let n = s.read(&mut got)?;
        Ok(match &got[..n] {
            b"$1\r\nv\r\n" => Some("v".to_owned()),
            _ => None,
        })
    }

    #[test]
    fn a_persistent_server_keeps_its_data_across_a_kill_unless_restarted_empty(
    ) -> std::io::Result<()> {
        let dir = std::env::temp_dir().join(format!("slackgate-redis-aof-{}", std::process::id()));
        let mut server = RedisServer::start_with(RedisOptions {
            persist_in: Some(dir.clone()),
            ..RedisOptions::default()
        })?;
        assert!(server.pid().is_some());
        assert_eq!(set_then_get(server.port(), true)?, Some("v".to_owned()));
        server.restart()?;
        assert_eq!(
            set_then_get(server.port(), false)?,
            Some("v".to_owned()),
            "kept"
        );
        server.restart_empty()?;
        assert_eq!(set_then_get(server.port(), false)?, None, "wiped");
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn a_password_is_required_and_in_the_url() -> std::io::Result<()> {
        let server = RedisServer::start_with_password("pw-1")?;
        assert!(ping(server.port(), Some("pw-1")));
        assert!(!ping(server.port(), None));
        assert!(server.url().contains(":pw-1@127.0.0.1:"));
        Ok(())
    }
}
