#!/usr/bin/env bash
# Sanitizer and fuzz runs, each stage in a build folder of its own (clang-14; CUDA left out):
#   asan  every test suite under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)
#   tsan  every test suite under ThreadSanitizer (build-tsan/; alloc_test is left out, see
#         tests/CMakeLists.txt)
#   fuzz  every libFuzzer target in tests/fuzz for DSYNC_FUZZ_SECONDS each, from its seeds in
#         tests/fuzz/corpus/<name>/ (build-fuzz/)
# Usage: scripts/sanitize.sh [asan] [tsan] [fuzz]   (no argument: all three)
# Any sanitizer report, failed test or fuzzer finding fails the run; every stage still runs.
# scripts/test.sh runs this after the other tests (DSYNC_SKIP_SANITIZE=1 skips it there).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh

fuzz_seconds="${DSYNC_FUZZ_SECONDS:-60}"
# clang for every stage: libFuzzer comes only with clang, and one compiler means one set of
# sanitizer runtimes and options (g++ 12 would do for the test stages too).
cxx=clang++-14
symbolizer=/usr/lib/llvm-14/bin/llvm-symbolizer
jobs="$(nproc)"

# halt_on_error: the first report ends the process with an error, so the test fails.
export ASAN_OPTIONS="detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:strict_string_checks=1:external_symbolizer_path=$symbolizer"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:external_symbolizer_path=$symbolizer"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:external_symbolizer_path=$symbolizer"
# OpenBLAS hands work to its own threads through flags ThreadSanitizer cannot see (the library
# is not instrumented), so every matrix they write would look racy. One thread: no pool.
export OPENBLAS_NUM_THREADS=1

# configure BUILD_DIR SANITIZERS [CMAKE_ARGS...]
configure() {
  local dir=$1 sanitizers=$2
  shift 2
  cmake -S . -B "$dir" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DDSYNC_SANITIZE="$sanitizers" -DDSYNC_BUILD_BENCH=OFF -DDSYNC_WERROR=ON "$@" >/dev/null
}

# Every suite, one at a time like scripts/test.sh: timing-based scenarios need a quiet machine.
run_tests() {
  local dir=$1 sanitizers=$2
  configure "$dir" "$sanitizers" && ninja -C "$dir" -j "$jobs" &&
    ctest --test-dir "$dir" --output-on-failure --timeout 300
}

# fuzz_one NAME: fuzzes for fuzz_seconds; the exit status goes to findings/NAME.rc.
fuzz_one() {
  local name=$1 dir=build-fuzz rc=0
  # New inputs go to the first folder (kept between local runs); the seeds stay as they are.
  mkdir -p "$dir/corpus/$name"
  "$dir/tests/fuzz/${name}_fuzz" -max_total_time="$fuzz_seconds" -timeout=10 \
    -artifact_prefix="$dir/findings/$name-" "$dir/corpus/$name" "tests/fuzz/corpus/$name" \
    >"$dir/findings/$name.log" 2>&1 || rc=$?
  echo $rc >"$dir/findings/$name.rc"
}

# One fuzzer per core at a time.
run_fuzzers() {
  local dir=build-fuzz failed=0 name input
  configure "$dir" address,undefined -DDSYNC_FUZZ=ON && ninja -C "$dir" -j "$jobs" fuzzers ||
    return 1
  rm -rf "$dir/findings"
  mkdir -p "$dir/findings"
  local names=()
  for input in tests/fuzz/corpus/*/; do names+=("$(basename "$input")"); done
  echo "sanitize.sh: fuzzing ${names[*]} for ${fuzz_seconds}s each, $jobs at a time"
  for name in "${names[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    fuzz_one "$name" &
  done
  wait
  for name in "${names[@]}"; do
    [ "$(cat "$dir/findings/$name.rc")" = 0 ] && continue
    failed=1
    tail -n 40 "$dir/findings/$name.log"
    echo "sanitize.sh: fuzzer $name FAILED (log: $dir/findings/$name.log)"
    for input in "$dir/findings/$name"-*; do
      [ -e "$input" ] && echo "sanitize.sh: reproduce with: $dir/tests/fuzz/${name}_fuzz $input"
    done
  done
  return $failed
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(asan tsan fuzz)
failed=()
for stage in "${stages[@]}"; do
  start=$SECONDS
  case $stage in
    asan) run_tests build-asan address,undefined || failed+=(asan) ;;
    tsan) run_tests build-tsan thread || failed+=(tsan) ;;
    fuzz) run_fuzzers || failed+=(fuzz) ;;
    *) echo "sanitize.sh: unknown stage '$stage' (asan, tsan, fuzz)" >&2; exit 2 ;;
  esac
  echo "sanitize.sh: $stage took $((SECONDS - start))s"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "sanitize.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "sanitize.sh: no findings"
