//! A `redis-server` for the drill's cluster runs and the cluster benchmark: started on a free
//! 127.0.0.1 port with no persistence and killed, by its own PID only, when dropped; or an
//! existing one named by `--redis`. Also the two commands the drill needs of it (`PING`,
//! `INFO`), over a plain socket: the drill only reads, so a RESP client is not worth a
//! dependency.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a fresh server may take to answer `PING`.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// Largest `INFO` answer read (the `commandstats` section is a few KiB).
const MAX_INFO: usize = 1 << 20;

/// A Redis the drill uses: one it started (killed on drop) or one it was given.
#[derive(Debug)]
pub struct Redis {
    addr: SocketAddr,
    db: u32,
    child: Option<Child>,
}

/// Something wrong with the Redis the drill was given or started.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// `redis-server` could not be run or did not answer.
    #[error("cannot start redis-server: {0}")]
    Start(String),
    /// `--redis` is not a `redis://127.0.0.1:PORT[/DB]` URL.
    #[error("--redis {0:?}: expected redis://127.0.0.1:PORT[/DB] (a drill's load stays on loopback; no password)")]
    Url(String),
    /// The server did not answer a command.
    #[error("redis at {addr}: {why}")]
    Io {
        /// Where.
        addr: SocketAddr,
        /// Why.
        why: String,
    },
}

impl Redis {
    /// Start `redis-server` (`$SLACKGATE_REDIS_SERVER`, else the one on `PATH`) on a free
    /// loopback port, in memory only, and wait until it answers `PING`.
    pub fn start() -> Result<Redis, RedisError> {
        let binary = std::env::var_os("SLACKGATE_REDIS_SERVER")
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| "redis-server".into());
        let mut last = String::from("no attempt");
        // A port found free can be taken before the server binds it: try a few.
        for _ in 0..3 {
            let port = free_port().map_err(|e| RedisError::Start(e.to_string()))?;
            let mut child = Command::new(&binary)
                .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
                .arg("--port")
                .arg(port.to_string())
                .arg("--dir")
                .arg(std::env::temp_dir())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| {
                    RedisError::Start(format!(
                        "{}: {e} (install the redis-server package, or pass --redis)",
                        std::path::Path::new(&binary).display()
                    ))
                })?;
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let deadline = Instant::now() + READY_WITHIN;
            loop {
                if ping(addr) {
                    return Ok(Redis {
                        addr,
                        db: 0,
                        child: Some(child),
                    });
                }
                if let Ok(Some(status)) = child.try_wait() {
                    last = format!("exited at start on port {port} ({status})");
                    break;
                }
                if Instant::now() >= deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    last = format!("no PONG on port {port} within {READY_WITHIN:?}");
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Err(RedisError::Start(last))
    }

    /// An existing server at `redis://127.0.0.1:PORT[/DB]` (or `localhost`), checked with
    /// `PING`. It is not stopped on drop.
    pub fn existing(url: &str) -> Result<Redis, RedisError> {
        let bad = || RedisError::Url(url.to_owned());
        let rest = url.strip_prefix("redis://").ok_or_else(bad)?;
        let (authority, db) = match rest.split_once('/') {
            Some((a, "")) => (a, 0),
            Some((a, d)) => (a, d.parse::<u32>().map_err(|_| bad())?),
            None => (rest, 0),
        };
        let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
        if !matches!(host, "127.0.0.1" | "localhost") {
            return Err(bad());
        }
        let port: u16 = port.parse().map_err(|_| bad())?;
        if port == 0 {
            return Err(bad());
        }
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        if !ping(addr) {
            return Err(RedisError::Io {
                addr,
                why: "no answer to PING".into(),
            });
        }
        Ok(Redis {
            addr,
            db,
            child: None,
        })
    }

    /// `redis://127.0.0.1:PORT/DB`.
    pub fn url(&self) -> String {
        format!("redis://{}/{}", self.addr, self.db)
    }

    /// Whether the drill started it (and kills it on drop).
    pub fn owned(&self) -> bool {
        self.child.is_some()
    }

    /// The server's `INFO <section>` text.
    pub fn info(&self, section: &str) -> Result<String, RedisError> {
        let io = |e: std::io::Error| RedisError::Io {
            addr: self.addr,
            why: e.to_string(),
        };
        let mut s = TcpStream::connect_timeout(&self.addr, Duration::from_secs(2)).map_err(io)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(io)?;
        let cmd = format!("*2\r\n$4\r\nINFO\r\n${}\r\n{section}\r\n", section.len());
        s.write_all(cmd.as_bytes()).map_err(io)?;
        let mut got = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            if let Some(body) = bulk_string(&got).map_err(|why| RedisError::Io {
                addr: self.addr,
                why,
            })? {
                return Ok(body);
            }
            if got.len() > MAX_INFO {
                return Err(RedisError::Io {
                    addr: self.addr,
                    why: format!("INFO answer longer than {MAX_INFO} bytes"),
                });
            }
            match s.read(&mut buf).map_err(io)? {
                0 => {
                    return Err(RedisError::Io {
                        addr: self.addr,
                        why: "connection closed mid-answer".into(),
                    })
                }
                n => got.extend_from_slice(&buf[..n]),
            }
        }
    }

    /// Commands served so far, summed over `INFO commandstats`, leaving out `info` itself.
    pub fn commands_served(&self) -> Result<u64, RedisError> {
        Ok(command_calls(&self.info("commandstats")?)
            .into_iter()
            .filter(|(c, _)| c != "info")
            .map(|(_, n)| n)
            .sum())
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A RESP bulk string (`$LEN\r\nBODY\r\n`) from the start of `got`: `Ok(None)` while
/// incomplete, an error for anything else (an error reply, a bad length).
fn bulk_string(got: &[u8]) -> Result<Option<String>, String> {
    let Some(eol) = got.windows(2).position(|w| w == b"\r\n") else {
        if got.len() > 32 {
            return Err("no length line in the answer".into());
        }
        return Ok(None);
    };
    let head = std::str::from_utf8(&got[..eol]).map_err(|_| "answer is not text".to_string())?;
    let Some(len) = head.strip_prefix('$') else {
        return Err(format!(
            "unexpected answer {:?}",
            head.chars().take(80).collect::<String>()
        ));
    };
    let len: usize = len
        .parse()
        .map_err(|_| format!("bad bulk length {len:?}"))?;
    if len > MAX_INFO {
        return Err(format!("bulk length {len} over {MAX_INFO}"));
    }
    let start = eol + 2;
    if got.len() < start + len + 2 {
        return Ok(None);
    }
    String::from_utf8(got[start..start + len].to_vec())
        .map(Some)
        .map_err(|_| "answer is not UTF-8".into())
}

/// `(command, calls)` from an `INFO commandstats` text (`cmdstat_get:calls=3,usec=...`).
/// Lines that do not parse are skipped.
pub fn command_calls(info: &str) -> Vec<(String, u64)> {
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// A port nothing listens on right now.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Whether the server at `addr` answers `PING` with `+PONG`.
fn ping(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"*1\r\n$4\r\nPING\r\n").is_err() {
        return false;
    }
    let mut got = [0u8; 64];
    let mut n = 0;
    while n < got.len() {
        match s.read(&mut got[n..]) {
            Ok(0) | Err(_) => return false,
            Ok(k) => n += k,
        }
        if got[..n].starts_with(b"+PONG\r\n") {
            return true;
        }
        if got[..n].contains(&b'\n') {
            return false;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_are_summed_and_junk_is_skipped() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=12,usec=3,usec_per_call=0.25\r\n\
                    cmdstat_info:calls=2,usec=1\r\ncmdstat_broken\r\ncmdstat_x:calls=abc\r\n\
                    cmdstat_ping:usec=1,calls=5\r\n";
        let got = command_calls(info);
        assert_eq!(
            got,
            vec![
                ("evalsha".to_owned(), 12),
                ("info".to_owned(), 2),
                ("ping".to_owned(), 5)
            ]
        );
        assert!(command_calls("").is_empty());
        assert!(command_calls(&"cmdstat_".repeat(10_000)).is_empty());
    }

    #[test]
    fn bulk_strings_parse_wait_or_fail() {
        assert_eq!(bulk_string(b"$3\r\nabc\r\n"), Ok(Some("abc".into())));
        assert_eq!(bulk_string(b"$3\r\nab"), Ok(None));
        assert_eq!(bulk_string(b"$3"), Ok(None));
        assert!(bulk_string(b"-ERR unknown\r\n").is_err());
        assert!(bulk_string(b"$-1\r\n").is_err());
        assert!(bulk_string(b"$99999999999\r\n").is_err());
        assert!(bulk_string(&[b'x'; 100]).is_err());
        assert!(bulk_string(b"$2\r\n\xff\xfe\r\n").is_err());
    }

    #[test]
    fn only_loopback_urls_are_accepted() {
        for bad in [
            "http://127.0.0.1:6379",
            "redis://10.0.0.1:6379",
            "redis://:pw@127.0.0.1:6379",
            "redis://127.0.0.1",
            "redis://127.0.0.1:0",
            "redis://127.0.0.1:99999",
            "redis://127.0.0.1:6379/x",
            "",
        ] {
            assert!(
                matches!(Redis::existing(bad), Err(RedisError::Url(_))),
                "{bad}"
            );
        }
    }
}
