#!/usr/bin/env bash
# Stages the files of the slackgate image (deploy/Containerfile's final stage, FROM scratch) in
# DIR/rootfs: the release binary (debug info stripped), every shared library it
# links as ldd lists them, at the same paths (glibc's loader included), the CA bundle (for
# HTTPS upstreams), passwd/group files naming the non-root user 65532 (slackgate) and /tmp;
# and DIR/state, empty, which the Containerfile copies to /var/lib/slackgate owned by that
# user (the gate's working directory, where its default SQLite ledger goes). A separate tree
# so that only that directory is chowned, not /var and /var/lib above it.
#
#   scripts/image-rootfs.sh BINARY DIR
#
# Used by scripts/image.sh on the host and by the Containerfile's builder stage, so both
# images hold the same files.
set -euo pipefail
bin="${1:?usage: image-rootfs.sh BINARY DIR}"
out="${2:?usage: image-rootfs.sh BINARY DIR}"
root="$out/rootfs"
[ -x "$bin" ] || { echo "image-rootfs.sh: $bin is not an executable" >&2; exit 1; }
ca=/etc/ssl/certs/ca-certificates.crt
[ -f "$ca" ] || { echo "image-rootfs.sh: no CA bundle at $ca (apt-get install ca-certificates)" >&2; exit 1; }

rm -rf "$root" "$out/state"
mkdir -p "$root/usr/local/bin" "$root/etc/ssl/certs" "$root/var/lib" "$root/tmp" "$out/state"
# The binary without its debug info: about 100 MB with it (profile.release debug = 1), a
# fifth of that without; backtraces keep function names (the symbol table stays).
objcopy --strip-debug "$bin" "$root/usr/local/bin/slackgate"

# Every library ldd resolves, copied to the path it resolved to ("name => /path (addr)", or
# "/lib64/ld-linux-x86-64.so.2 (addr)" for the loader); linux-vdso has no file.
ldd "$bin" | while read -r first second third _; do
  lib=""
  if [ "$second" = "=>" ]; then
    lib="$third"
  elif [ "${first#/}" != "$first" ]; then
    lib="$first"
  fi
  [ -n "$lib" ] || continue
  if [ "$lib" = "not" ] || [ ! -e "$lib" ]; then
    echo "image-rootfs.sh: ldd cannot resolve $first for $bin" >&2
    exit 1
  fi
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done

cp -L "$ca" "$root/etc/ssl/certs/ca-certificates.crt"
cat >"$root/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/sbin/nologin
slackgate:x:65532:65532:slackgate:/var/lib/slackgate:/sbin/nologin
PASSWD
cat >"$root/etc/group" <<'GROUP'
root:x:0:
slackgate:x:65532:
GROUP
chmod 1777 "$root/tmp"
chmod 0755 "$out/state"
# Host names: /etc/hosts first, then DNS (Kubernetes mounts /etc/hosts and /etc/resolv.conf).
echo 'hosts: files dns' >"$root/etc/nsswitch.conf"
