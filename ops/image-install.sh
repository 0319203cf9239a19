#!/bin/sh
# The build stage of ops/Dockerfile: extra CA certificates, a virtual environment in $VENV
# (/opt/venv) with torch (CPU build) and kvserve from /src, and the default model in
# $KVSERVE_CACHE_DIR. OFFLINE=1 installs from $OFFLINE_DIR/wheels only and takes the model from
# $OFFLINE_DIR/models (ops/offline/README.md). Everything it was told to use is checked first:
# what is missing or does not parse fails the build with one line, before anything changes.
set -eu
OFFLINE_DIR=${OFFLINE_DIR:-/offline}
VENV=${VENV:-/opt/venv}
fail() { echo "kvserve image: $*" >&2; exit 1; }

# ---- checks ---------------------------------------------------------------------------------
for crt in "$OFFLINE_DIR"/certs/*.crt; do
  [ -e "$crt" ] || break
  python3 -c 'import ssl, sys; ssl.create_default_context(cafile=sys.argv[1])' "$crt" \
    2>/dev/null || fail "ops/offline/certs/$(basename "$crt") is not a PEM certificate"
done
model=""
if [ "$OFFLINE" = 1 ]; then
  ls "$OFFLINE_DIR"/wheels/torch-*.whl >/dev/null 2>&1 \
    || fail "OFFLINE=1 but ops/offline/wheels holds no torch wheel (ops/offline/README.md)"
  model=$(ls "$OFFLINE_DIR"/models/*.gguf 2>/dev/null | head -n 1)
  [ -n "$model" ] || fail "OFFLINE=1 but ops/offline/models holds no .gguf model file"
fi

# ---- certificates, environment, model -------------------------------------------------------
for crt in "$OFFLINE_DIR"/certs/*.crt; do
  [ -e "$crt" ] || break
  cp "$crt" /usr/local/share/ca-certificates/
  export PIP_CERT=/etc/ssl/certs/ca-certificates.crt  # pip trusts its own bundle otherwise
done
if [ -n "${PIP_CERT:-}" ]; then
  update-ca-certificates >/dev/null
fi

python3 -m venv "$VENV"
pip="$VENV/bin/pip"
if [ "$OFFLINE" = 1 ]; then
  $pip install -q --no-index --find-links "$OFFLINE_DIR/wheels" "torch==$TORCH_VERSION" /src
  mkdir -p "$KVSERVE_CACHE_DIR/models"
  cp "$model" "$KVSERVE_CACHE_DIR/models/"
else
  # torch first, from the CPU index, so that installing kvserve finds it satisfied and does not
  # pull a CUDA build (several GB).
  $pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
  $pip install -q /src
fi
# Verifies the model's sha256 (a file copied above is not downloaded again).
"$VENV/bin/kvserve" fetch-model >/dev/null \
  || fail "the default model is missing or does not match its sha256 (kvserve fetch-model)"
# Nothing that runs needs torch's C++ test programs or its protoc (about 140 MB).
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/torch/test" "$site"/torch/bin/test_* "$site"/torch/bin/protoc*
