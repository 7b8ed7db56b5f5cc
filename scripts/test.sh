#!/usr/bin/env bash
# The one command that runs every oomkit test, on a fresh machine too.
# It needs the Rust toolchain (cargo) and python3; cargo fetches the crates,
# and pip installs maturin, pytest (with pytest-xdist), mypy (its stubtest checks the stub), ruff, expecttest
# (which PyTorch's autocast test lists import), PyTorch (CPU use), transformers, accelerate,
# lightning, bitsandbytes, litgpt (without its pins), TRL, torchtune, torchtitan, diffusers, torchvision and timm into .venv, which
# sees packages already installed system-wide, so torch is fetched only once.
# The Rust tests check oomkit's figures against CPython's own pickle module;
# the Python tests run the installed package with real PyTorch, and load
# `oomkit report` pages in headless Chromium (installed from Debian if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null || { echo "test.sh: cargo not found: install Rust from https://rustup.rs" >&2; exit 2; }
command -v python3 >/dev/null || { echo "test.sh: python3 not found: install Python 3.9 or newer" >&2; exit 2; }

if [ ! -d ../shared/fixtures/snapshots ]; then
  echo "test.sh: ../shared/fixtures/snapshots is absent: the tests on real snapshots will be skipped" >&2
fi

cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The fuzz targets (run with cargo-fuzz, on nightly) still build against the crates.
cargo check --manifest-path fuzz/Cargo.toml --bins --locked --quiet
# Every declared dependency is used.
python3 scripts/check_deps.py
# Regenerating the demo snapshot must give the committed bytes.
check=$(mktemp)
trap 'rm -f "$check"' EXIT
python3 scripts/make_demo_snapshot.py "$check"
cmp -s "$check" crates/oomkit-cli/assets/demo_snapshot.pickle \
  || { echo "test.sh: crates/oomkit-cli/assets/demo_snapshot.pickle is stale: rerun scripts/make_demo_snapshot.py" >&2; exit 1; }
INSTA_UPDATE=no cargo test --workspace --locked

# The report tests load pages in headless Chromium: Debian's, installed here
# when missing (as root), and then required, so that CI cannot skip them.
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "test.sh: installing Debian's chromium for the browser tests" >&2
  apt-get install -y -q chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
fi
if command -v chromium >/dev/null; then
  export OOMKIT_REQUIRE_BROWSER=1
else
  echo "test.sh: chromium is absent and cannot be installed here: the browser tests will be skipped" >&2
fi

# The Python package, built with maturin and installed as a user would.
[ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
export PATH="$PWD/.venv/bin:$PATH"
python -c "import maturin, pytest, xdist, mypy, ruff, expecttest" 2>/dev/null || python -m pip install -q "maturin>=1.5,<2" pytest pytest-xdist mypy ruff expecttest
python -c "import torch" 2>/dev/null || python -m pip install -q torch
# The integration tests train tiny models with the real frameworks (built
# from configs; nothing is downloaded). transformers needs Python 3.10+;
# on older Pythons those tests are skipped with a message.
if python -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  python -c "import transformers, accelerate, lightning" 2>/dev/null \
    || python -m pip install -q transformers accelerate lightning
  # Lightning's demos (the corpus runs its transformer demo) need requests, its examples' extra.
  python -c "import requests" 2>/dev/null || python -m pip install -q requests
  # preflight runs bitsandbytes' 8-bit optimizer and 4-bit layers through
  # the fake kernels it registers; its wheel works without a GPU.
  python -c "import bitsandbytes" 2>/dev/null || python -m pip install -q bitsandbytes
  # VALIDATION.md's LitGPT rows run LitGPT's own model and loss. Its pins
  # (psutil, huggingface-hub) would change what the other tests run with,
  # and what the model code imports is installed above: no dependencies.
  python -c "import litgpt" 2>/dev/null || python -m pip install -q --no-deps "litgpt==0.5.13"
  # LitGPT's pretrain prepares and streams its text with litdata. Its other dependencies are above or
  # unused by that path (cloud storage, images; its torchvision has no wheel for every torch): none.
  python -c "import litdata" 2>/dev/null || python -m pip install -q --no-deps "litdata==0.2.76"
  # The corpus runs LitGPT's own commands (`python -m litgpt finetune_full`), whose
  # command line is jsonargparse's, reading the functions' signatures and docstrings.
  python -c "import jsonargparse, docstring_parser, typeshed_client" 2>/dev/null \
    || python -m pip install -q "jsonargparse==4.53.0" "docstring_parser==0.18.0" "typeshed_client==2.15.0"
  # The corpus of entry points that packages ship (python/tests/corpus.md): TRL's
  # trainers, through its own command, with the PEFT and datasets it runs on.
  python -c "import trl, peft, datasets" 2>/dev/null || python -m pip install -q "trl==1.16.0" "peft==0.21.2" "datasets==5.2.0"
  # torchtune's recipes, run through `tune run` (test_preflight_torchtune.py), with torchao and
  # what else they import, in a folder of their own that only those tests put on the path (the
  # other libraries would find torchao and change what they run). No dependencies: the rest is above.
  [ -d .venv/torchtune-site/torchtune ] || python -m pip install -q --no-deps --target .venv/torchtune-site \
    "torchtune==0.6.1" "torchao==0.15.0" "torchdata==0.11.0" "omegaconf==2.4.0" "antlr4-python3-runtime==4.13.2" \
    "tiktoken==0.14.0" "sentencepiece==0.2.3" "kagglehub==1.0.3" "kagglesdk==0.1.38" "protobuf==7.36.2"
  # torchtitan's trainer, run through torchrun (test_preflight_torchtitan.py), in a folder of its own
  # for the same reason; its metrics import tensorboard's writer. No dependencies: the rest is above.
  [ -d .venv/torchtitan-site/torchtitan ] || python -m pip install -q --no-deps --target .venv/torchtitan-site \
    "torchtitan==0.3.0" "tyro==1.0.17" "typeguard==4.6.1" "shtab==1.13.0" "einops==0.8.2" "spmd_types==0.2.3" \
    "torch_checkpointing==0.1.1" "torchdata==0.11.0" "tensorboard==2.21.0" "protobuf==7.36.2" "absl-py==2.5.1"
  # diffusers (test_preflight_diffusers.py), with Pillow and importlib_metadata, in a folder of its own
  # for the same reason: Pillow found by transformers would change what the other tests run.
  [ -d .venv/diffusers-site/diffusers ] || python -m pip install -q --no-deps --target .venv/diffusers-site \
    "diffusers==0.42.1" "pillow==13.0.0" "importlib_metadata==10.2.0" "zipp==4.1.2"
  # torchvision and timm (test_preflight_vision.py: weights by URL and from the hub), with Pillow, in a folder
  # of their own for the same reason. No dependencies: torch and huggingface_hub are above.
  [ -d .venv/vision-site/timm ] || python -m pip install -q --no-deps --target .venv/vision-site \
    "torchvision==0.29.2" "timm==1.0.31" "pillow==13.0.0"
  # Ultralytics' YOLO trainer (test_preflight_yolo.py), with OpenCV, matplotlib and polars, in a folder of
  # its own for the same reason. No dependencies: torch, numpy, PyYAML, requests and psutil are above.
  [ -d .venv/ultralytics-site/ultralytics ] || python -m pip install -q --no-deps --target .venv/ultralytics-site \
    "ultralytics==8.4.190" "ultralytics-thop==2.2.3" "opencv-python-headless==5.1.0.95" "matplotlib==3.11.2" \
    "contourpy==1.3.3" "cycler==0.12.1" "fonttools==4.68.0" "kiwisolver==1.5.1" "pyparsing==3.3.3" \
    "python-dateutil==2.9.0.post0" "six==1.17.0" "polars==2.1.0" "polars-runtime-32==2.1.0"
else
  echo "test.sh: Python older than 3.10: the Hugging Face and Lightning tests will be skipped" >&2
fi
# Built in the dev profile, from what `cargo test` compiled above: a release build took four
# and a half minutes of the suite's time, this one under one. The crates that read and replay
# snapshots are optimized there too (Cargo.toml's [profile.dev.package]), and overflow checks
# and debug assertions are on. A user's `pip install .` builds the release profile, as the
# README's `cargo install` does the command (the doc test runs that command unoptimized, in
# target/doc-test: test_doc_examples.py says why). test_install.py's `pip install` inherits
# this, and builds from the same target/.
export MATURIN_PEP517_ARGS="--profile dev"
python -m pip install -q --no-build-isolation --force-reinstall --no-deps .
# The Python side is linted and type-checked as a whole (pyproject.toml's
# [tool.ruff] and [tool.mypy]), against the installed package and torch.
python -m ruff check python scripts
python -m mypy
# Two workers: most tests wait on a subprocess (a script under preflight, a
# training run), so two of them keep two cores busy; the suite takes about
# a fifth less time than one after another. The slowest twenty are listed,
# to keep the suite well inside CI's time.
python -m pytest -q -n 2 --durations=20 python/tests
