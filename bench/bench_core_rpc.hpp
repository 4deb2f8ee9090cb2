// RP-Cholesky benchmarks of bench_core (filled by the utility-layer issue).
#pragma once
#include "common.hpp"

inline void register_rpc_benchmarks() {}
