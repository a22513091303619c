#!/usr/bin/env bash
# Builds llama.cpp's native `llama-server` (real parallel slots, continuous batching) from the
# llama.cpp tree vendored in the llama-cpp-python sdist on PyPI, and prints the binary's path
# on stdout (everything else goes to stderr).
#
#   scripts/llama-server.sh            # build once, then print the cached path in a second
#
# The whole build folder is cached outside the checkout, in
# ${SLACKGATE_CACHE:-$HOME/.cache/slackgate}/llama.cpp-<version>/, because the binary finds
# its shared libraries there by absolute path. A finished build is marked by a stamp file, so
# an interrupted one is resumed (cmake rebuilds only what is missing). Concurrent callers wait
# on a lock instead of building twice. Installs cmake and a compiler with apt when missing
# (root only). The first build takes about 6 minutes on 2 idle cores, up to 14 beside other work.
set -euo pipefail

version=0.3.36
cache="${SLACKGATE_CACHE:-$HOME/.cache/slackgate}"
dir="$cache/llama.cpp-$version"
build="$dir/build"
bin="$build/bin/llama-server"
stamp="$dir/.built"

if [ -x "$bin" ] && [ -f "$stamp" ]; then
    echo "$bin"
    exit 0
fi

mkdir -p "$dir"
exec 9>"$dir/.lock"
if ! flock -n 9; then
    echo "llama-server.sh: another build holds $dir/.lock; waiting" >&2
    flock 9
fi
# The build we waited on may have finished it.
if [ -x "$bin" ] && [ -f "$stamp" ]; then
    echo "$bin"
    exit 0
fi

# The compiler's warnings fill thousands of lines: they go to a log, shown only on failure.
fail() {
    echo "llama-server.sh: $1 failed; the end of $2:" >&2
    tail -n 40 "$2" >&2
    exit 1
}

started=$(date +%s)
{
    missing=()
    command -v cmake >/dev/null 2>&1 || missing+=(cmake)
    command -v g++ >/dev/null 2>&1 || missing+=(g++)
    command -v make >/dev/null 2>&1 || missing+=(make)
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" != 0 ]; then
            echo "llama-server.sh: missing ${missing[*]} and I am not root: apt-get install cmake build-essential" >&2
            exit 1
        fi
        echo "llama-server.sh: installing ${missing[*]} with apt"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ make >/dev/null
    fi

    src="$dir/src"
    if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
        echo "llama-server.sh: downloading the llama-cpp-python==$version sdist"
        rm -rf "$dir/download" "$src"
        mkdir -p "$dir/download" "$src"
        python3 -m pip download --quiet --disable-pip-version-check --no-deps \
            --no-binary=llama-cpp-python --dest "$dir/download" "llama-cpp-python==$version"
        sdist=$(ls "$dir"/download/llama_cpp_python-"$version".tar.gz "$dir"/download/llama-cpp-python-"$version".tar.gz 2>/dev/null | head -n1 || true)
        if [ -z "$sdist" ]; then
            echo "llama-server.sh: no sdist in $dir/download" >&2
            exit 1
        fi
        tar -xzf "$sdist" -C "$src" --strip-components=1
    fi

    # Only the server: no tests or examples, no libcurl or OpenSSL (no model downloads), and no
    # attempt to fetch the prebuilt web UI (it would wait on a download that cannot succeed
    # here); the API the tests use needs none of them.
    echo "llama-server.sh: cmake configure in $build"
    cmake -S "$src/vendor/llama.cpp" -B "$build" \
        -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON \
        -DGGML_BUILD_TESTS=OFF \
        -DGGML_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_OPENSSL=OFF \
        >"$dir/configure.log" 2>&1 || fail "cmake configure" "$dir/configure.log"
    echo "llama-server.sh: building llama-server with -j 2 (log: $dir/build.log)"
    cmake --build "$build" --target llama-server -j 2 >"$dir/build.log" 2>&1 \
        || fail "the build" "$dir/build.log"
} >&2

if [ ! -x "$bin" ]; then
    echo "llama-server.sh: the build finished but $bin is missing" >&2
    exit 1
fi
date -u +%FT%TZ > "$stamp"
echo "llama-server.sh: built in $(( $(date +%s) - started )) s: $bin" >&2
echo "$bin"
