#!/usr/bin/env bash
# Downloads vLLM 0.32.0's sdist from PyPI (sha256-checked) and extracts its
# tests/ (and pyproject.toml, for the pytest markers) into
# $RADIXKV_VLLM_TESTS_DIR (default ~/.cache/radixkv-engines/vllm-tests-0.32.0).
# Idempotent: does nothing once extracted. Prints the directory.
set -euo pipefail
VERSION=0.32.0
SHA256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
URL=https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-$VERSION.tar.gz
DIR=${RADIXKV_VLLM_TESTS_DIR:-$HOME/.cache/radixkv-engines/vllm-tests-$VERSION}
if [ ! -f "$DIR/.extracted" ]; then
  mkdir -p "$DIR"
  TGZ="$DIR/vllm-$VERSION.tar.gz"
  if ! echo "$SHA256  $TGZ" | sha256sum -c --status 2>/dev/null; then
    curl -fsSL -o "$TGZ.part" "$URL"
    echo "$SHA256  $TGZ.part" | sha256sum -c --quiet
    mv "$TGZ.part" "$TGZ"
  fi
  tar xzf "$TGZ" -C "$DIR" --strip-components=1 --wildcards \
      "vllm-$VERSION/tests/*" "vllm-$VERSION/pyproject.toml"
  rm -f "$TGZ"
  touch "$DIR/.extracted"
fi
echo "$DIR"
