# The jobs of .ci/run after the python phase, as one GNU make graph under one jobserver:
#   make -f .ci/lanes.mk -j2        (from the repository root; .ci/run does it)
# With -jN at most N processes run at any time, the compilers of the sub-builds (asan, tsan and
# fuzz trees) included: a sub-build started with `+` takes its make jobs from this jobserver, and
# each fuzz target is a job of its own. So a core that one job leaves idle (the consumer's timed
# compilations run one at a time; the last translation units of a build; a fuzz round with one
# target left) runs another job instead of waiting for the phase to end. Every job logs to
# build/ci-logs/<job>.log and appends its start and end to build/ci-logs/times.txt (.ci/job);
# .ci/run prints the table.
#   consumer   install build/ci, then the consumer project against the installed package (each
#              method alone header-only, the umbrella compiled and without FFTW), each
#              translation unit timed (bench/compile_cost.sh)
#   docs       doxygen, warnings as errors (docs/Doxyfile)
#   asan-*     every other test under AddressSanitizer + UBSan (preset asan, clang)
#   tsan-*     the thread-safety and FFT tests under ThreadSanitizer (preset tsan, clang)
#   noomp-*    every test built and run without OpenMP (preset noomp: -O1, -Werror)
#   fuzz-*     the libFuzzer build (tests/fuzz/run.sh) and one job per target, FUZZ_SECONDS each
FUZZ_SECONDS ?= 30
JOB := bash .ci/job
FUZZ_EXE := build/fuzz/fuzz_attention

.PHONY: all consumer docs asan-build asan-test tsan-build tsan-test noomp-build noomp-test \
        fuzz-build fuzz-run fuzz-targets
# Listed longest chain first: make starts the prerequisites of `all` in this order.
all: asan-test consumer docs tsan-test noomp-test fuzz-run

# Timed one compilation at a time (its own make -j1, outside the jobserver).
consumer:
	$(JOB) consumer bash -c 'rm -rf build/ci-install && cmake --install build/ci --prefix "$$PWD/build/ci-install" >/dev/null && bash bench/compile_cost.sh build/ci-install build/consumer'

docs:
	$(JOB) docs doxygen docs/Doxyfile

# Configure and build in one job: make starts a job only when its scan of `all` reaches it, so a
# separate configure job would let the jobs listed after it start before its build.
asan-build:
	+$(JOB) --make asan-build bash -c 'cmake --preset asan && cmake --build build/asan'
# One test at a time: the other slot runs other jobs (the tests that use threads start their own).
asan-test: asan-build
	$(JOB) asan-test ctest --preset asan --parallel 1

tsan-build:
	+$(JOB) --make tsan-build bash -c 'cmake --preset tsan && cmake --build build/tsan --target test_thread_safety test_fft'
tsan-test: tsan-build
	$(JOB) tsan-test ctest --preset tsan --parallel 1

# Without OpenMP: the one-thread paths of the headers and an effattn::compiled built without it.
noomp-build:
	+$(JOB) --make noomp-build bash -c 'cmake --preset noomp && cmake --build build/noomp'
noomp-test: noomp-build
	$(JOB) noomp-test ctest --preset noomp --parallel 1

fuzz-build:
	+$(JOB) --make fuzz-build bash tests/fuzz/run.sh --build-only
# The targets are listed by the executable itself (effattn::MethodList): a sub-make with one job
# per target, from the same jobserver. An empty or failed listing fails the job (it must not pass
# with no target run).
fuzz-run: fuzz-build
	+targets="$$(EFFATTN_FUZZ_LIST=1 ASAN_OPTIONS=detect_leaks=0 $(FUZZ_EXE))" && \
	  [ -n "$$targets" ] || { echo "effattn: $(FUZZ_EXE) listed no fuzz targets" >&2; exit 1; }; \
	  $(MAKE) -f .ci/lanes.mk --no-print-directory fuzz-targets FUZZ_TARGETS="$$targets"
fuzz-targets: $(addprefix fuzz-run-,$(FUZZ_TARGETS))
fuzz-run-%:
	$(JOB) fuzz-$* bash tests/fuzz/run.sh --no-build $(FUZZ_SECONDS) $*
