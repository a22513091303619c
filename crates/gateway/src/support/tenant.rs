//! Tenant ids: the bearer key (or a trusted `X-Tenant` header) reduced to a short id for the
//! decision log, the ledger and token grants, without revealing the key.
//!
//! The id is a keyed hash, SipHash-2-4 under a 128-bit secret, not a public one: with a
//! public hash (the FNV-1a of earlier versions) anyone could search offline for an API key of
//! their own whose id equals another tenant's (read off a shared log or dashboard) and spend
//! that tenant's grant, or exhaust it. Without the secret no such search can be run. The
//! secret comes from `server.tenant_hash_key`, or else is generated once and kept in the
//! ledger file, so ids stay the same across restarts. `slackgate tenant-id` prints a key's id
//! for writing grants.

use std::fmt::Write;

/// Hashes tenant keys under a secret.
#[derive(Clone)]
pub struct TenantHasher {
    k0: u64,
    k1: u64,
}

impl std::fmt::Debug for TenantHasher {
    // The secret never reaches a log or a panic message.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TenantHasher(..)")
    }
}

/// Bytes in a tenant hash key.
pub const KEY_BYTES: usize = 16;

impl TenantHasher {
    /// A hasher under `key`.
    pub fn new(key: [u8; KEY_BYTES]) -> TenantHasher {
        let mut lo = [0u8; 8];
        let mut hi = [0u8; 8];
        lo.copy_from_slice(&key[..8]);
        hi.copy_from_slice(&key[8..]);
        TenantHasher {
            k0: u64::from_le_bytes(lo),
            k1: u64::from_le_bytes(hi),
        }
    }

    /// The tenant id of `secret` (an API key, an `X-Tenant` value) as `kind:<16 hex>`,
    /// `kind` being `k` (bearer key) or `t` (header, reservation API tenant).
    pub fn id(&self, kind: &str, secret: &[u8]) -> String {
        let mut s = String::with_capacity(kind.len() + 17);
        s.push_str(kind);
        s.push(':');
        let _ = write!(s, "{:016x}", siphash24(self.k0, self.k1, secret));
        s
    }
}

/// A tenant hash key that is not 32 hexadecimal digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("must be {} hexadecimal digits (e.g. from `openssl rand -hex {KEY_BYTES}`)", 2 * KEY_BYTES)]
pub struct BadKey;

/// Parse a key written as 32 hexadecimal digits.
pub fn parse_key(hex: &str) -> Result<[u8; KEY_BYTES], BadKey> {
    let hex = hex.trim();
    if hex.len() != 2 * KEY_BYTES || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(BadKey);
    }
    let mut key = [0u8; KEY_BYTES];
    for (i, b) in key.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| BadKey)?;
    }
    Ok(key)
}

/// A key as 32 hexadecimal digits.
pub fn key_hex(key: &[u8; KEY_BYTES]) -> String {
    let mut s = String::with_capacity(2 * KEY_BYTES);
    for b in key {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// A fresh random key: from the operating system's generator (`/dev/urandom`), or, where
/// that cannot be read, from the standard library's randomly seeded hasher state.
pub fn random_key() -> [u8; KEY_BYTES] {
    use std::io::Read;
    let mut key = [0u8; KEY_BYTES];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .is_ok()
    {
        return key;
    }
    use std::hash::{BuildHasher, Hasher};
    for (i, chunk) in key.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_usize(i);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    key
}

/// SipHash-2-4 (Aumasson and Bernstein, 2012) of `msg` under the key (`k0`, `k1`).
pub fn siphash24(k0: u64, k1: u64, msg: &[u8]) -> u64 {
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    let chunks = msg.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        let m = u64::from_le_bytes(w);
        v[3] ^= m;
        sip_round(&mut v);
        sip_round(&mut v);
        v[0] ^= m;
    }
    // The last word: the remaining bytes, and the message length (mod 256) in the top byte.
    let mut last = (msg.len() as u64 & 0xff) << 56;
    for (i, b) in tail.iter().enumerate() {
        last |= u64::from(*b) << (8 * i);
    }
    v[3] ^= last;
    sip_round(&mut v);
    sip_round(&mut v);
    v[0] ^= last;
    v[2] ^= 0xff;
    for _ in 0..4 {
        sip_round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

fn sip_round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13);
    v[1] ^= v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16);
    v[3] ^= v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21);
    v[3] ^= v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17);
    v[1] ^= v[2];
    v[2] = v[2].rotate_left(32);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paper's key: bytes 00..0f.
    fn paper_key() -> TenantHasher {
        let mut k = [0u8; 16];
        for (i, b) in k.iter_mut().enumerate() {
            *b = i as u8;
        }
        TenantHasher::new(k)
    }

    #[test]
    fn siphash_matches_the_reference_vectors() {
        let h = paper_key();
        // Appendix A of the SipHash paper: message 00..0e under key 00..0f.
        let msg: Vec<u8> = (0u8..15).collect();
        assert_eq!(siphash24(h.k0, h.k1, &msg), 0xa129_ca61_49be_45e5);
        // The reference implementation's first vector: the empty message.
        assert_eq!(siphash24(h.k0, h.k1, b""), 0x726f_db47_dd0e_0e31);
    }

    #[test]
    #[allow(deprecated)]
    fn siphash_agrees_with_the_standard_library_on_every_length() {
        use std::hash::Hasher;
        let h = TenantHasher::new(random_key());
        let msg: Vec<u8> = (0u8..=80).map(|i| i.wrapping_mul(37)).collect();
        for n in 0..msg.len() {
            let mut s = std::hash::SipHasher::new_with_keys(h.k0, h.k1);
            s.write(&msg[..n]);
            assert_eq!(siphash24(h.k0, h.k1, &msg[..n]), s.finish(), "length {n}");
        }
    }

    #[test]
    fn ids_depend_on_the_secret_and_never_show_the_key() {
        let a = TenantHasher::new([1; 16]);
        let b = TenantHasher::new([2; 16]);
        let id = a.id("k", b"sk-secret");
        assert!(
            id.starts_with("k:") && id.len() == 18 && !id.contains("secret"),
            "{id}"
        );
        assert_eq!(id, a.id("k", b"sk-secret"), "stable");
        assert_ne!(id, b.id("k", b"sk-secret"), "keyed");
        assert_ne!(a.id("k", b"x"), a.id("t", b"x"));
        assert_eq!(format!("{a:?}"), "TenantHasher(..)");
    }

    #[test]
    fn keys_round_trip_through_hex_and_bad_ones_are_refused() {
        let k = random_key();
        assert_eq!(parse_key(&key_hex(&k)), Ok(k));
        assert_ne!(random_key(), random_key());
        for bad in ["", "00", &"g".repeat(32), &"0".repeat(33)] {
            assert!(parse_key(bad).is_err(), "{bad:?}");
        }
    }
}
