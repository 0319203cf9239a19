#!/bin/sh
# The build stage of ops/Dockerfile: extra CA certificates, a virtual environment in /opt/venv
# with torch (CPU build) and kvserve from /src, and the default model in $KVSERVE_CACHE_DIR.
# OFFLINE=1 installs from /offline/wheels only and takes the model from /offline/models
# (ops/offline/README.md); anything it was told to use and does not find fails the build with
# one line.
set -eu
fail() { echo "kvserve image: $*" >&2; exit 1; }

for crt in /offline/certs/*.crt; do
  [ -e "$crt" ] || break
  python3 -c 'import ssl, sys; ssl.create_default_context(cafile=sys.argv[1])' "$crt" \
    2>/dev/null || fail "ops/offline/certs/$(basename "$crt") is not a PEM certificate"
  cp "$crt" /usr/local/share/ca-certificates/
  export PIP_CERT=/etc/ssl/certs/ca-certificates.crt  # pip trusts its own bundle otherwise
done
if [ -n "${PIP_CERT:-}" ]; then
  update-ca-certificates >/dev/null
fi

python3 -m venv /opt/venv
pip=/opt/venv/bin/pip
if [ "$OFFLINE" = 1 ]; then
  ls /offline/wheels/torch-*.whl >/dev/null 2>&1 \
    || fail "OFFLINE=1 but ops/offline/wheels holds no torch wheel (ops/build-image.sh --offline fills it)"
  $pip install -q --no-index --find-links /offline/wheels "torch==$TORCH_VERSION" /src
  model=$(ls /offline/models/*.gguf 2>/dev/null | head -n 1)
  [ -n "$model" ] || fail "OFFLINE=1 but ops/offline/models holds no .gguf model file"
  mkdir -p "$KVSERVE_CACHE_DIR/models"
  cp "$model" "$KVSERVE_CACHE_DIR/models/"
else
  # torch first, from the CPU index, so that installing kvserve finds it satisfied and does not
  # pull a CUDA build (several GB).
  $pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
  $pip install -q /src
fi
# Verifies the model's sha256 (a file copied above is not downloaded again).
/opt/venv/bin/kvserve fetch-model >/dev/null \
  || fail "the default model is missing or does not match its sha256 (kvserve fetch-model)"
