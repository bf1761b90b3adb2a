#!/usr/bin/env bash
# Builds CPython 3.13 from Debian trixie's source package into $1 (default
# /opt/python3.13) and prints the interpreter's path on its last line; a
# build already there that imports its extension modules is reused.
#
# The machine's own apt sources stay as they are: trixie's deb-src stanza
# (the first stanza of /etc/apt/sources.list.d/debian.sources, retyped) goes
# in a sources directory of its own, with a lists directory of its own.
set -euo pipefail
prefix=${1:-/opt/python3.13}
check='import ssl, sqlite3, lzma, bz2, zlib, ctypes, venv'
if "$prefix/bin/python3.13" -c "$check" 2>/dev/null; then
  echo "$prefix/bin/python3.13"; exit 0
fi
work=$(mktemp -d /tmp/python3.13.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/sources" "$work/lists/partial"
awk 'BEGIN { RS = ""; ORS = "\n\n" } NR == 1' /etc/apt/sources.list.d/debian.sources \
  | sed -e 's/^Types:.*/Types: deb-src/' -e 's/^Suites:.*/Suites: trixie/' \
  > "$work/sources/trixie-src.sources"
apt=(-o "Dir::State::Lists=$work/lists" -o "Dir::Etc::sourcelist=/dev/null"
     -o "Dir::Etc::sourceparts=$work/sources")
apt-get "${apt[@]}" update -q >/dev/null 2>&1
(cd "$work" && apt-get "${apt[@]}" source --download-only -q python3.13 >/dev/null 2>&1)
DEBIAN_FRONTEND=noninteractive apt-get install -y -q libssl-dev zlib1g-dev \
  libffi-dev libbz2-dev liblzma-dev libsqlite3-dev xz-utils >/dev/null 2>&1
tar -xf "$work"/python3.13_*.orig.tar.xz -C "$work"
src=$(find "$work" -maxdepth 1 -type d -name 'Python-3.13*' | head -n 1)
(cd "$src" && ./configure -q --prefix="$prefix" --without-ensurepip >/dev/null \
   && make -s -j"$(nproc)" >/dev/null 2>&1 && make -s install >/dev/null 2>&1)
"$prefix/bin/python3.13" -c "$check"
echo "$prefix/bin/python3.13"
