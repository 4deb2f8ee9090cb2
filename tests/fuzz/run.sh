#!/usr/bin/env bash
# Builds the libFuzzer executable with clang and runs each target (one per functor of
# effattn::MethodList, listed by the executable itself) for SECONDS (default 20) from a fixed
# seed, with the regression inputs in tests/fuzz/regressions/ as the starting corpus, as many
# targets at once as there are cores (EFFATTN_FUZZ_JOBS overrides). A crash, sanitizer report or
# contract violation fails the run (libFuzzer saves the input as build/fuzz/<target>-crash-*).
#   bash tests/fuzz/run.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .ci/deps.sh
effattn_ensure_packages "${EFFATTN_CLANG_PACKAGES[@]}" libeigen3-dev libfftw3-dev pkg-config cmake make
secs=${1:-20}
shift || true
build=build/fuzz
CXX=clang++ cmake -S tests/fuzz -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)" --target fuzz_attention
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
# EFFATTN_FUZZ_JOBS targets at a time (default: the number of cores), each on one core.
jobs=${EFFATTN_FUZZ_JOBS:-$(nproc)}
failed=0
for ((i = 0; i < ${#targets[@]}; i += jobs)); do
  batch=("${targets[@]:i:jobs}")
  echo "== ${batch[*]/#/fuzz_} for ${secs} s each"
  pids=()
  for t in "${batch[@]}"; do
    run_one "$t" &
    pids+=($!)
  done
  for k in "${!batch[@]}"; do
    t=${batch[k]}
    if wait "${pids[k]}"; then
      echo "fuzz_$t: $(grep -E "^Done" "$build/fuzz_$t.log")," \
        "$(grep -oE "new_units_added: +[0-9]+" "$build/fuzz_$t.log" | tr -s ' ')"
    else
      cat "$build/fuzz_$t.log"
      echo "fuzz_$t FAILED (input saved as $build/$t-crash-*)" >&2
      failed=1
    fi
  done
  [ "$failed" = 0 ] || exit 1
done
