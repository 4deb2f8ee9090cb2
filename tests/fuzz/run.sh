#!/usr/bin/env bash
# Builds the libFuzzer executable with clang and runs each target (one per functor of
# effattn::MethodList, listed by the executable itself) for SECONDS (default 20) from a fixed
# seed, with the regression inputs in tests/fuzz/regressions/ as the starting corpus, as many
# targets at once as there are cores (EFFATTN_FUZZ_JOBS overrides). A crash, sanitizer report or
# contract violation fails the run (libFuzzer saves the input as build/fuzz/<target>-crash-*).
#   bash tests/fuzz/run.sh [SECONDS] [TARGET...]
#   bash tests/fuzz/run.sh --build-only      configure and build only (.ci/lanes.mk: under
#                                            make's jobserver when MAKEFLAGS has one)
#   bash tests/fuzz/run.sh --no-build [SECONDS] [TARGET...]   run an existing build
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .ci/deps.sh
step=all
case "${1:-}" in
  --build-only) step=build; shift ;;
  --no-build) step=run; shift ;;
esac
build=build/fuzz
if [ "$step" != run ]; then
  effattn_ensure_packages "${EFFATTN_CLANG_PACKAGES[@]}" libeigen3-dev libfftw3-dev pkg-config cmake make
  CXX=clang++ cmake -S tests/fuzz -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
  if [[ "${MAKEFLAGS:-}" == *jobserver* ]]; then
    cmake --build "$build" --target fuzz_attention  # make's jobs come from the parent's jobserver
  else
    cmake --build "$build" -j"$(nproc)" --target fuzz_attention
  fi
fi
[ "$step" != build ] || exit 0
if [ ! -x "$build/fuzz_attention" ]; then
  echo "effattn: no $build/fuzz_attention (run tests/fuzz/run.sh without --no-build first)" >&2
  exit 1
fi
secs=${1:-20}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=($(EFFATTN_FUZZ_LIST=1 ASAN_OPTIONS=detect_leaks=0 "$build/fuzz_attention"))
fi
# Runs one target; its log goes to $build/fuzz_<target>.log.
run_one() {
  local t=$1
  mkdir -p "$build/corpus_$t"
  (cd "$build" && EFFATTN_FUZZ_METHOD=$t ./fuzz_attention -seed=1 -max_total_time="$secs" -max_len=2048 -timeout=10 \
     -artifact_prefix="./$t-" -print_final_stats=1 "corpus_$t" ../../tests/fuzz/regressions) \
    >"$build/fuzz_$t.log" 2>&1
}
# EFFATTN_FUZZ_JOBS targets at a time (default: the number of cores), each on one core: a pool,
# so a core that finishes its target starts the next one (9 targets on 2 cores: 5 rounds of
# SECONDS in lock-step left one core idle for the last round).
jobs=${EFFATTN_FUZZ_JOBS:-$(nproc)}
echo "== ${#targets[@]} targets, ${jobs} at a time, ${secs} s each"
# Reports target $1 (finished, exit status $2); returns 1 if it failed.
report_one() {
  local t=$1 rc=$2
  if [ "$rc" = 0 ]; then
    echo "fuzz_$t: $(grep -E "^Done" "$build/fuzz_$t.log")," \
      "$(grep -oE "new_units_added: +[0-9]+" "$build/fuzz_$t.log" | tr -s ' ')"
    return 0
  fi
  cat "$build/fuzz_$t.log"
  echo "fuzz_$t FAILED (input saved as $build/$t-crash-*)" >&2
  return 1
}
declare -A running=()  # pid -> target
failed=0
next=0
while [ "$next" -lt ${#targets[@]} ] || [ ${#running[@]} -gt 0 ]; do
  while [ "$failed" = 0 ] && [ "$next" -lt ${#targets[@]} ] && [ ${#running[@]} -lt "$jobs" ]; do
    run_one "${targets[next]}" &
    running[$!]=${targets[next]}
    next=$((next + 1))
  done
  [ ${#running[@]} -gt 0 ] || break
  rc=0
  wait -n -p done_pid "${!running[@]}" || rc=$?
  report_one "${running[$done_pid]}" "$rc" || failed=1
  unset "running[$done_pid]"
done
[ "$failed" = 0 ] || exit 1
