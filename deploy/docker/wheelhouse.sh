#!/usr/bin/env bash
# Fill deploy/docker/wheelhouse/ with the project's wheel and the wheels of every dependency,
# for a `docker build` that cannot reach a package index (the Dockerfile then installs with
# --no-index). Uses the Python given as $PYTHON (default python3); its version must match the
# image's (3.11 for python:3.11-slim and Debian bookworm). Extras: EXTRAS=torch.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
OUT=deploy/docker/wheelhouse
spec="."
[ -n "${EXTRAS:-}" ] && spec=".[${EXTRAS}]"
"$PYTHON" -m pip wheel --quiet --wheel-dir "$OUT" "$spec"
echo "wheelhouse: $(ls "$OUT"/*.whl | wc -l) wheels in $OUT"
