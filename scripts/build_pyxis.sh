#!/usr/bin/env bash
# Build NVIDIA's enroot and pyxis (the SLURM SPANK plugin behind `srun --container-image`)
# into .pyxis/ of this checkout, for tests/test_pyxis.py. Neither is packaged by Debian, and
# where the tests run GitHub may not be reachable, so the sources are yours to give: two git
# repositories as arguments, or TORCHRUNX_PYXIS_SOURCES naming a folder that holds
# NVIDIA+pyxis/repo and NVIDIA+enroot/repo. Without them it builds nothing and says how to
# enable it; the pyxis tests then skip with that reason.
#
#   scripts/build_pyxis.sh [PYXIS_GIT ENROOT_GIT]
#
# Needs: gcc, make, libslurm-dev (spank.h of the installed SLURM), libbsd-dev, squashfs-tools
# (scripts/test.sh installs them). enroot's helpers are linked against glibc (FORCE_GLIBC=1)
# rather than its vendored musl, and its bundling tool (makeself) is left out: only `enroot
# create`, `start` and `remove`, which pyxis uses, are needed.
set -euo pipefail
cd "$(dirname "$0")/.."
sources=${TORCHRUNX_PYXIS_SOURCES:-}
if [ $# -eq 0 ] && [ -z "$sources" ]; then
    echo "build_pyxis: pyxis is not built: give the git repositories of pyxis and enroot" \
        "(scripts/build_pyxis.sh PYXIS_GIT ENROOT_GIT, or TORCHRUNX_PYXIS_SOURCES=DIR holding" \
        "NVIDIA+pyxis/repo and NVIDIA+enroot/repo); tests/test_pyxis.py skips without them" >&2
    exit 0
fi
pyxis_git=${1:-$sources/NVIDIA+pyxis/repo}
enroot_git=${2:-$sources/NVIDIA+enroot/repo}
if [ ! -d "$pyxis_git" ] || [ ! -d "$enroot_git" ]; then
    echo "build_pyxis: no sources ($pyxis_git, $enroot_git): pyxis is not built" >&2
    exit 0
fi
dest=$PWD/.pyxis
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$pyxis_git" "$work/pyxis"
git clone -q "$enroot_git" "$work/enroot"
rm -rf "$dest"
make -s -C "$work/pyxis" >/dev/null
utils="bin/enroot-aufs2ovlfs bin/enroot-mksquashovlfs bin/enroot-mount bin/enroot-switchroot bin/enroot-nsenter"
# -o deps: the vendored submodules (musl, headers, makeself) are not fetched.
# shellcheck disable=SC2086
make -s -C "$work/enroot" -o deps FORCE_GLIBC=1 CPPFLAGS= LDFLAGS= prefix="$dest" \
    enroot conf/enroot.conf $utils >/dev/null 2>&1
make -s -C "$work/enroot" -o all -o deps prefix="$dest" DEPS= install >/dev/null
install -D -m 644 "$work/pyxis/spank_pyxis.so" "$dest/lib/spank_pyxis.so"
echo "build_pyxis: pyxis $(git -C "$work/pyxis" describe --tags --always) and enroot" \
    "$(git -C "$work/enroot" describe --tags --always) in $dest"
