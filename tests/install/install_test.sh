#!/usr/bin/env bash
# The installed dsyncps, used as a user would, from a prefix outside the build tree:
#   1. `cmake --install` of the build into a fresh prefix;
#   2. a CMake project of its own (consumer/) builds the example worker with
#      find_package(dsyncps CONFIG), and pkg-config builds it too;
#   3. the installed `dsyncps launch` runs both builds as a job's workers, which must train;
#   4. the installed Python package is imported from the prefix and trains exactly;
#   5. `cpack -G DEB` makes a package holding all of it in Debian's places.
# Usage: install_test.sh BUILD_DIR SOURCE_DIR PYTHON (PYTHON empty: no Python package built)
set -euo pipefail
build=$(cd "$1" && pwd) src=$(cd "$2" && pwd) python=${3:-}
work=$(mktemp -d /tmp/dsync-install.XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

step() { echo "install_test: $*"; }
fail() { echo "install_test: FAILED: $*" >&2; exit 1; }

step "cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" > "$work/install.log" || { cat "$work/install.log"; fail "cmake --install"; }
for f in bin/dsyncps include/dsync/worker.h lib/pkgconfig/dsyncps.pc lib/cmake/dsyncps/dsyncpsConfig.cmake; do
  [ -e "$prefix/$f" ] || fail "$f is not installed"
done
[ ! -e "$prefix/include/ps" ] || fail "private headers (src/ps) were installed"

step "find_package(dsyncps CONFIG) from a project of its own"
cmake -S "$src/tests/install/consumer" -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DWORKER_SOURCE="$src/examples/cpp/linear_worker.cc" > "$work/consumer.log" 2>&1 ||
  { cat "$work/consumer.log"; fail "configuring the consumer"; }
cmake --build "$work/consumer" > "$work/consumer-build.log" 2>&1 ||
  { cat "$work/consumer-build.log"; fail "building the consumer"; }

step "pkg-config --cflags --libs dsyncps"
flags=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs dsyncps) || fail "pkg-config dsyncps"
case "$flags" in *"$prefix"*) ;; *) fail "pkg-config does not point into the prefix: $flags" ;; esac
# shellcheck disable=SC2086  # the flags are words
c++ -std=c++20 -o "$work/linear_worker_pc" "$src/examples/cpp/linear_worker.cc" $flags ||
  fail "building with pkg-config's flags"

# Both builds train, as the workers of one job the installed launcher starts.
for worker in "$work/consumer/linear_worker" "$work/linear_worker_pc"; do
  step "$prefix/bin/dsyncps launch --workers 2 -- $worker 60"
  out=$(timeout 120 "$prefix/bin/dsyncps" launch --workers 2 --servers 1 --sync bsp -- "$worker" 60 2>&1) ||
    { echo "$out"; fail "the job of $worker"; }
  n=$(grep -c "linear_worker rank [01] .*: loss" <<<"$out" || true)
  [ "$n" = 2 ] || { echo "$out"; fail "expected 2 workers' losses, got $n"; }
  grep -q "workers joined 2, left 2, failed 0" <<<"$out" || { echo "$out"; fail "the job did not end cleanly"; }
done

if [ -n "$python" ]; then
  step "the Python package from the prefix"
  pydir=$(dirname "$(find "$prefix" -name __init__.py -path '*/dsyncps/*' | head -1)")
  [ -n "$pydir" ] && [ "$pydir" != . ] || fail "no Python package under $prefix"
  out=$(cd "$work" && PYTHONPATH=$(dirname "$pydir") timeout 120 "$prefix/bin/dsyncps" launch --workers 1 \
    --optimizer sgd --lr 0.5 -- "$python" "$src/tests/install/consumer/check_python.py" "$prefix" 2>&1) ||
    { echo "$out"; fail "the Python worker"; }
  grep -q "installed python package ok" <<<"$out" || { echo "$out"; fail "the Python check did not run"; }
fi
step "cpack -G DEB"
(cd "$build" && cpack --config CPackConfig.cmake -G DEB -B "$work/deb" > "$work/cpack.log" 2>&1) ||
  { cat "$work/cpack.log"; fail "cpack -G DEB"; }
deb=$(ls "$work"/deb/dsyncps_*.deb) || fail "no .deb made"
listing=$(dpkg-deb -c "$deb")
want=(./usr/bin/dsyncps ./usr/include/dsync/worker.h ./usr/lib/cmake/dsyncps/dsyncpsConfig.cmake ./usr/lib/pkgconfig/dsyncps.pc)
[ -z "$python" ] || want+=(./usr/lib/python3/dist-packages/dsyncps/__init__.py ./usr/lib/python3/dist-packages/dsyncps/torch.py)
for f in "${want[@]}"; do
  grep -q " $f\$" <<<"$listing" || { echo "$listing"; fail "$f is not in $deb"; }
done
[ -z "$python" ] || grep -q "/usr/lib/python3/dist-packages/dsyncps/_core\..*\.so$" <<<"$listing" ||
  fail "the Python module _core is not in $deb"
dpkg-deb -f "$deb" Depends | grep -q libsodium || fail "the package does not depend on libsodium: $(dpkg-deb -f "$deb" Depends)"
step "ok"
