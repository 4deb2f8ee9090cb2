#!/usr/bin/env bash
# Builds the libFuzzer targets with clang and runs each for SECONDS (default 20) from a fixed
# seed, with the regression inputs in tests/fuzz/regressions/ as the starting corpus. A crash,
# sanitizer report or contract violation fails the run (libFuzzer saves the input as crash-*).
#   bash tests/fuzz/run.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .ci/deps.sh
effattn_ensure_packages clang libclang-rt-dev libeigen3-dev libfftw3-dev pkg-config cmake make
secs=${1:-20}
shift || true
build=build/fuzz
CXX=clang++ cmake -S tests/fuzz -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=($(sed -n 's/^set(EFFATTN_FUZZ_TARGETS \(.*\)$/\1/p' tests/fuzz/CMakeLists.txt))
fi
cmake --build "$build" -j2 --target "${targets[@]/#/fuzz_}"
for t in "${targets[@]}"; do
  corpus="$build/corpus_$t"
  mkdir -p "$corpus"
  echo "== fuzz_$t for ${secs} s"
  log="$build/fuzz_$t.log"
  if (cd "$build" && ./fuzz_$t -seed=1 -max_total_time="$secs" -max_len=2048 -timeout=10 \
        -print_final_stats=1 "corpus_$t" ../../tests/fuzz/regressions) >"$log" 2>&1; then
    grep -E "^Done|stat::(number_of_executed_units|new_units_added)" "$log"
  else
    cat "$log"
    echo "fuzz_$t FAILED (input saved as $build/crash-*)" >&2
    exit 1
  fi
done
