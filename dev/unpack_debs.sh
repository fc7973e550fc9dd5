# Unpacks the Debian packages of a folder made by dev/fetch_debs.sh into a
# prefix (never into /: nothing on the system changes) and points the
# compilers, CMake, pkg-config and the loader at it. Sourced, not run:
#
#   source dev/unpack_debs.sh [DIR [PREFIX]]   DIR: .deps; PREFIX: DIR/root
#
# Exports DEPS_PREFIX, CMAKE_PREFIX_PATH, PKG_CONFIG_PATH, CPATH, LIBRARY_PATH,
# LD_LIBRARY_PATH and PATH (the unpacked programs, such as pkg-config, after
# the system's own). Returns non-zero when DIR holds no package.
nb_deps_dir=${1:-.deps}
if ! ls "$nb_deps_dir"/*.deb >/dev/null 2>&1; then
  echo "unpack_debs: no .deb files in $nb_deps_dir (make them with dev/fetch_debs.sh)" >&2
  return 1 2>/dev/null || exit 1
fi
nb_deps_dir=$(cd "$nb_deps_dir" && pwd)
DEPS_PREFIX=${2:-$nb_deps_dir/root}
mkdir -p "$DEPS_PREFIX"
DEPS_PREFIX=$(cd "$DEPS_PREFIX" && pwd)
export DEPS_PREFIX
for nb_deb in "$nb_deps_dir"/*.deb; do
  dpkg-deb -x "$nb_deb" "$DEPS_PREFIX" || { echo "unpack_debs: cannot unpack $nb_deb" >&2; return 1 2>/dev/null || exit 1; }
done
# The packages' pkg-config files say prefix=/usr: point them at the unpacked tree.
find "$DEPS_PREFIX" -name '*.pc' -exec sed -i -e "s|=/usr\b|=$DEPS_PREFIX/usr|" \
  -e "s| -I/usr/| -I$DEPS_PREFIX/usr/|g" -e "s| -L/usr/| -L$DEPS_PREFIX/usr/|g" {} +
nb_ma=$DEPS_PREFIX/usr/lib/$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
nb_blas=$nb_ma/openblas-pthread
# Debian's OpenBLAS is chosen through alternatives, which an unpacked package
# does not get: the linker and the loader need the plain names.
[ -e "$nb_blas/libopenblas.so" ] || ln -sf libopenblas.so.0 "$nb_blas/libopenblas.so"
[ -e "$nb_blas/libblas.so" ] || ln -sf libblas.so.3 "$nb_blas/libblas.so"
[ -e "$nb_ma/libgfortran.so" ] || ln -sf libgfortran.so.5 "$nb_ma/libgfortran.so"
nb_prepend() { # VAR DIR...: prepends each DIR to the colon-separated VAR
  local var=$1 d v; shift
  for d in "$@"; do v=${!var:-}; export "$var=$d${v:+:$v}"; done
}
nb_prepend CMAKE_PREFIX_PATH "$DEPS_PREFIX/usr"
nb_prepend PKG_CONFIG_PATH "$DEPS_PREFIX/usr/share/pkgconfig" "$DEPS_PREFIX/usr/lib/pkgconfig" "$nb_ma/pkgconfig" "$nb_blas/pkgconfig"
nb_prepend CPATH "$DEPS_PREFIX/usr/include" "$DEPS_PREFIX/usr/include/${nb_ma##*/}/openblas-pthread"
# Gloo installs into usr/lib, not the multiarch folder
nb_prepend LIBRARY_PATH "$DEPS_PREFIX/usr/lib" "$nb_ma" "$nb_blas"
nb_prepend LD_LIBRARY_PATH "$DEPS_PREFIX/usr/lib" "$nb_ma" "$nb_blas"
export PATH=${PATH:+$PATH:}$DEPS_PREFIX/usr/bin
unset -f nb_prepend
unset nb_deb nb_ma nb_blas
echo "unpack_debs: $(ls "$nb_deps_dir"/*.deb | wc -l) packages unpacked in $DEPS_PREFIX"
unset nb_deps_dir
