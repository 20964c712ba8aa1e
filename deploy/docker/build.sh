#!/usr/bin/env bash
# deploy/docker/build.sh [sim|torch] [DOCKER_BUILD_OPTION...]: build one target of deploy/docker/Dockerfile and tag
# it twice:
#   REPO:TARGET          the variant's latest build (what docker-compose.yml runs: EI_TARGET=sim|torch)
#   REPO:VERSION-TARGET  the package version of this checkout (pyproject.toml's), e.g. evolving-infra:0.1.0-torch:
#                        a deployment pins it (compose: EI_TARGET=0.1.0-torch docker compose up)
# `docker compose build` gives the image one tag only (compose v1 has one per service; no version): this
# script gives both. REPO is $EI_IMAGE_REPO (default evolving-infra); BASE_IMAGE, when set, is the base image's
# build argument; DOCKER the client (default docker). Extra options go to docker build (e.g. -q, --network none).
# A target other than sim or torch, or EI_IMAGE set (renamed EI_IMAGE_REPO; not read), is refused with status 2.
set -euo pipefail
cd "$(dirname "$0")/../.."
target=${1:-sim}
[ $# -gt 0 ] && shift
case $target in
  sim|torch) ;;
  *) echo "build.sh: target $target: sim or torch (the Dockerfile's targets; a version is added as a second tag)" >&2; exit 2 ;;
esac
if [ -n "${EI_IMAGE:-}" ]; then
    echo "build.sh: EI_IMAGE=$EI_IMAGE is no longer read (renamed EI_IMAGE_REPO: the repository, without a tag; the" \
        "tag is the target): unset it and set EI_IMAGE_REPO" >&2
    exit 2
fi
# [project]'s version (not another table's version key)
version=$(awk '/^\[/ { p = ($0 == "[project]") } p && /^version *=/ { gsub(/^version *= *"|".*$/, ""); print; exit }' pyproject.toml)
[ -n "$version" ] || { echo "build.sh: no version in pyproject.toml's [project] table" >&2; exit 1; }
repo=${EI_IMAGE_REPO:-evolving-infra}
${DOCKER:-docker} build --target "$target" ${BASE_IMAGE:+--build-arg "BASE_IMAGE=$BASE_IMAGE"} -f deploy/docker/Dockerfile \
    -t "$repo:$target" -t "$repo:$version-$target" "$@" .
echo "build.sh: tagged $repo:$target and $repo:$version-$target" >&2
