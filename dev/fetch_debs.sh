#!/usr/bin/env bash
# Downloads the Debian packages a build of nabla needs beyond a compiler, CMake
# and the CUDA toolkit (Check, OpenBLAS, oneDNN, Gloo, pkg-config, OpenSSL's
# headers, and the libraries those load) into one folder, for a machine that
# has a GPU but not these packages and cannot install them itself. Run it on a
# Debian 12 (bookworm, amd64) machine whose apt can reach the archive, from the
# project's root:
#
#   dev/fetch_debs.sh [DIR]          DIR defaults to .deps (ignored by git)
#
# Copy DIR to the GPU machine with the source tree, then there:
#
#   source dev/unpack_debs.sh DIR    (unpacks into DIR/root, sets the paths)
#
# or let benchmarks/gpu_check.sh do it (it looks in .deps). Nothing is
# installed on either machine: the packages are only downloaded, and later
# only unpacked (docs/gpu_check.md). EXTRA_DEBS adds package names.
#
# It also puts NVIDIA's cudnn-frontend headers (PyPI nvidia-cudnn-frontend,
# the version cmake/NablaDependencies.cmake names; cuDNN's fused attention is
# written against them) in DIR/cudnn_frontend/include, where a build looks
# for them before fetching them itself (with DIR other than .deps, configure
# with -DNABLA_CUDNN_FRONTEND_ROOT=DIR/cudnn_frontend). This needs python3
# with pip and a reachable package index.
set -euo pipefail

dir=${1:-.deps}

# What CMake looks for, and what each of those loads at run time. Base
# libraries every Debian system has (libc6, libstdc++6, libgcc-s1, libssl3,
# zlib) are left out on purpose: unpacking a second C library next to the
# system's would break every program that loads it.
build_debs="check libsubunit0 libsubunit-dev
  libopenblas0-pthread libopenblas-dev libopenblas-pthread-dev libgfortran5
  libdnnl2 libdnnl-dev
  libgloo0 libgloo-dev libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200
  ocl-icd-libopencl1
  pkg-config pkgconf pkgconf-bin libpkgconf3
  libssl-dev"

if ! command -v apt-get >/dev/null; then
  echo "fetch_debs: apt-get not found: run this on Debian 12 (bookworm)" >&2
  exit 1
fi
mkdir -p "$dir"
# apt downloads as its unprivileged user when run as root: let it write there
chmod a+rwx "$dir"
if [ -z "$(find /var/lib/apt/lists -name '*Packages*' 2>/dev/null | head -1)" ]; then
  echo "fetch_debs: apt has no package lists; running apt-get update" >&2
  apt-get update -qq
fi
# shellcheck disable=SC2086
(cd "$dir" && apt-get download $build_debs ${EXTRA_DEBS:-})
fe_version=$(sed -n 's/^set(NABLA_CUDNN_FRONTEND_VERSION "\([^"]*\)".*/\1/p' \
  "$(dirname "$0")/../cmake/NablaDependencies.cmake")
wheels=$(mktemp -d)
python3 -m pip download --no-deps --only-binary=:all: --disable-pip-version-check -q -d "$wheels" \
  "nvidia-cudnn-frontend==$fe_version"
rm -rf "$dir/cudnn_frontend"
python3 - "$wheels" "$dir/cudnn_frontend" <<'EOF'
import glob, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0])
wheel.extractall(sys.argv[2], [n for n in wheel.namelist() if n.startswith("include/")])
EOF
rm -rf "$wheels"
n=$(find "$dir" -maxdepth 1 -name '*.deb' | wc -l)
echo "fetch_debs: cudnn-frontend $fe_version headers in $dir/cudnn_frontend/include"
echo "fetch_debs: $n packages in $dir ($(du -sh "$dir" | cut -f1)); on the GPU machine: source dev/unpack_debs.sh $dir"
