//! The Redis connection each store thread keeps ([`Link`]), and the URL as messages show it
//! ([`redact`]: never with its password).

use std::collections::HashMap;
use std::time::Duration;

/// `url` with any password (and query string) replaced by `***`, for messages and logs.
pub fn redact(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let (rest, query) = match rest.find('?') {
        Some(i) => (&rest[..i], "?***"),
        None => (rest, ""),
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    let authority = match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            let host = &authority[at..];
            match userinfo.find(':') {
                Some(colon) => format!("{}:***{host}", &userinfo[..colon]),
                // A lone user-info part may be a password: hide all of it.
                None => format!("***{host}"),
            }
        }
        None => authority.to_owned(),
    };
    format!("{scheme}{authority}{path}{query}")
}

/// One connection to Redis, opened when first needed and dropped after any failure (after
/// a timeout a late reply could otherwise be read as the answer to the next command).
pub(super) struct Link {
    client: redis::Client,
    conn: Option<redis::Connection>,
    timeout: Duration,
    /// SHA1 of each script, as `SCRIPT LOAD` answered (fixed by the script's text).
    shas: HashMap<&'static str, String>,
}

impl Link {
    pub(super) fn new(client: redis::Client, timeout: Duration) -> Link {
        Link {
            client,
            conn: None,
            timeout,
            shas: HashMap::new(),
        }
    }

    fn conn(&mut self) -> redis::RedisResult<&mut redis::Connection> {
        if self.conn.is_none() {
            let conn = self.client.get_connection_with_timeout(self.timeout)?;
            conn.set_read_timeout(Some(self.timeout))?;
            conn.set_write_timeout(Some(self.timeout))?;
            self.conn = Some(conn);
        }
        match self.conn.as_mut() {
            Some(c) => Ok(c),
            None => Err(redis::RedisError::from((
                redis::ErrorKind::IoError,
                "no connection",
            ))),
        }
    }

    /// Run `cmd`; on any error drop the connection so the next call starts clean.
    pub(super) fn query<T: redis::FromRedisValue>(
        &mut self,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        let result = self.conn().and_then(|c| cmd.query(c));
        if result.is_err() {
            self.conn = None;
        }
        result
    }

    /// Run `pipe` as [`Link::query`] runs one command.
    pub(super) fn query_pipe<T: redis::FromRedisValue>(
        &mut self,
        pipe: &redis::Pipeline,
    ) -> redis::RedisResult<T> {
        let result = self.conn().and_then(|c| pipe.query(c));
        if result.is_err() {
            self.conn = None;
        }
        result
    }

    /// `EVALSHA` of `script`, loading it first if this store has not yet; `EVAL` when Redis
    /// no longer has it cached (which caches it again).
    pub(super) fn eval<T: redis::FromRedisValue>(
        &mut self,
        script: &'static str,
        keys: &[&str],
        args: &[&[u8]],
    ) -> redis::RedisResult<T> {
        let sha = match self.shas.get(script) {
            Some(sha) => sha.clone(),
            None => {
                let sha: String = self.query(redis::cmd("SCRIPT").arg("LOAD").arg(script))?;
                self.shas.insert(script, sha.clone());
                sha
            }
        };
        let call = |verb: &str, first: &[u8]| {
            let mut c = redis::cmd(verb);
            c.arg(first).arg(keys.len()).arg(keys);
            for a in args {
                c.arg(*a);
            }
            c
        };
        let conn = match self.conn() {
            Ok(c) => c,
            Err(e) => {
                self.conn = None;
                return Err(e);
            }
        };
        match call("EVALSHA", sha.as_bytes()).query(conn) {
            Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                self.query(&call("EVAL", script.as_bytes()))
            }
            Err(e) => {
                self.conn = None;
                Err(e)
            }
            ok => ok,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact("redis://:s3cret@10.0.0.1:6379/2"),
            "redis://:***@10.0.0.1:6379/2"
        );
        assert_eq!(
            redact("redis://admin:s3cret@host/0"),
            "redis://admin:***@host/0"
        );
        assert_eq!(redact("redis://s3cret@host"), "redis://***@host");
        assert_eq!(
            redact("redis://host:1/0?password=s3cret"),
            "redis://host:1/0?***"
        );
        assert_eq!(redact("redis://host:6379/0"), "redis://host:6379/0");
        // Hostile shapes: '@' in the password, no scheme, empty.
        assert!(!redact("redis://:p@ss@host/0").contains("p@ss"));
        assert!(!redact(":pw@host").contains("pw"));
        assert_eq!(redact(""), "");
    }
}
