#!/usr/bin/env bash
# Builds CPython 3.13 from Debian trixie's source package into $1 (default
# /opt/python3.13) and prints its interpreter's path on the last line.
# Debian's own sources list is left alone: trixie's deb-src stanza lives in a
# sources file of its own, with its own lists directory. Skips the build when
# $1/bin/python3.13 already runs.
set -euo pipefail
prefix=${1:-/opt/python3.13}
if "$prefix/bin/python3.13" -c 'import ssl, sqlite3, lzma, bz2, zlib, ctypes' 2>/dev/null; then
  echo "$prefix/bin/python3.13"; exit 0
fi
work=$(mktemp -d /tmp/py313.XXXXXX)
lists=$work/lists; mkdir -p "$lists/partial"
# The first stanza of the machine's own Debian sources, as a trixie deb-src one.
awk 'BEGIN{RS=""; ORS="\n\n"} NR==1' /etc/apt/sources.list.d/debian.sources \
  | sed -e 's/^Types:.*/Types: deb-src/' -e 's/^Suites:.*/Suites: trixie/' > "$work/trixie-src.sources"
apt_opts=(-o "Dir::State::Lists=$lists" -o "Dir::Etc::sourcelist=/dev/null"
          -o "Dir::Etc::sourceparts=$work" -o "APT::Get::List-Cleanup=0")
mkdir -p "$work/parts"; mv "$work/trixie-src.sources" "$work/parts/"
apt_opts[5]="Dir::Etc::sourceparts=$work/parts"
apt-get "${apt_opts[@]}" update -q >/dev/null
(cd "$work" && apt-get "${apt_opts[@]}" source --download-only -q python3.13 >/dev/null)
DEBIAN_FRONTEND=noninteractive apt-get install -y -q libssl-dev zlib1g-dev libffi-dev \
  libbz2-dev liblzma-dev libsqlite3-dev xz-utils >/dev/null
tar -xf "$work"/python3.13_*.orig.tar.xz -C "$work"
src=$(find "$work" -maxdepth 1 -type d -name 'Python-3.13*' | head -n 1)
(cd "$src" && ./configure -q --prefix="$prefix" --without-ensurepip >/dev/null \
  && make -s -j"$(nproc)" >/dev/null 2>&1 && make -s install >/dev/null 2>&1)
rm -rf "$work"
"$prefix/bin/python3.13" -c 'import ssl, sqlite3, lzma, bz2, zlib, ctypes'
echo "$prefix/bin/python3.13"
