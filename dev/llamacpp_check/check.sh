#!/usr/bin/env bash
# Cross-check with llama.cpp: synthetic GGUFs written by `q4moe synth` must load in llama.cpp as a
# real Qwen3-MoE file does, and greedy text should match q4moe's. Not run in CI (it builds
# llama.cpp from the llama-cpp-python sdist, whose vendor/ folder holds llama.cpp's source).
#   dev/llamacpp_check/check.sh [WORKDIR]        (needs cmake, a C++ compiler, network to PyPI)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-/tmp/q4moe-llamacpp}
mkdir -p "$work" && cd "$work"
if [ ! -x llama.cpp/build/bin/llama-simple ]; then
  url=$(curl -s https://pypi.org/pypi/llama-cpp-python/json | python3 -c \
    "import json,sys,urllib.parse as u; d=json.load(sys.stdin); print(u.urljoin('https://pypi.org/pypi/llama-cpp-python/json', [x['url'] for x in d['urls'] if x['packagetype']=='sdist'][0]))")
  curl -sL -o sdist.tgz "$url"
  tar xzf sdist.tgz && rm -rf llama.cpp && mv llama_cpp_python-*/vendor/llama.cpp llama.cpp
  cmake -S llama.cpp -B llama.cpp/build -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build llama.cpp/build --target llama-simple -j"$(nproc)" >/dev/null
fi
(cd "$root" && cargo build --release -q -p q4moe)
q4moe="$root/target/release/q4moe"
for q in q4_0 q4_k_m q8_0; do
  "$q4moe" synth --geometry tiny --quant "$q" --seed 2 --out "$work/tiny-$q.gguf" 2>/dev/null
  ours=$("$q4moe" run -m "$work/tiny-$q.gguf" -p "Hello world" -n 16 --device cpu --ignore-eos 2>/dev/null)
  theirs=$(llama.cpp/build/bin/llama-simple -m "$work/tiny-$q.gguf" -n 16 "Hello world" 2>/dev/null | head -1)
  theirs=${theirs#Hello world}
  [ "$ours" = "$theirs" ] && verdict="identical" || verdict="differs"
  printf '%-7s llama.cpp loads it; greedy text %s\n  q4moe:     %q\n  llama.cpp: %q\n' "$q" "$verdict" "$ours" "$theirs"
done
