#!/usr/bin/env bash
# The one command that runs every oomkit test, on a fresh machine too.
# It needs the Rust toolchain (cargo) and python3; cargo fetches the crates,
# and pip installs maturin, pytest and PyTorch (CPU use) into .venv, which
# sees packages already installed system-wide, so torch is fetched only once.
# The Rust tests check oomkit's figures against CPython's own pickle module;
# the Python tests run the installed package with real PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null || { echo "test.sh: cargo not found: install Rust from https://rustup.rs" >&2; exit 2; }
command -v python3 >/dev/null || { echo "test.sh: python3 not found: install Python 3.9 or newer" >&2; exit 2; }

if [ ! -d ../shared/fixtures/snapshots ]; then
  echo "test.sh: ../shared/fixtures/snapshots is absent: the tests on real snapshots will be skipped" >&2
fi

cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# Regenerating the demo snapshot must give the committed bytes.
check=$(mktemp)
trap 'rm -f "$check"' EXIT
python3 scripts/make_demo_snapshot.py "$check"
cmp -s "$check" crates/oomkit-cli/assets/demo_snapshot.pickle \
  || { echo "test.sh: crates/oomkit-cli/assets/demo_snapshot.pickle is stale: rerun scripts/make_demo_snapshot.py" >&2; exit 1; }
INSTA_UPDATE=no cargo test --workspace --locked

# The Python package, built with maturin and installed as a user would.
[ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
export PATH="$PWD/.venv/bin:$PATH"
python -c "import maturin, pytest" 2>/dev/null || python -m pip install -q "maturin>=1.5,<2" pytest
python -c "import torch" 2>/dev/null || python -m pip install -q torch
python -m pip install -q --no-build-isolation --force-reinstall --no-deps .
python -m pytest -q python/tests
