/// \file conformance.hpp
/// \brief The generic property suite every attention method runs against exact attention.
///
/// Usage (one TEMPLATE_TEST_CASE over float and double per method):
/// \code{.cpp}
/// TEMPLATE_TEST_CASE("MyMethod conforms", "[conformance][mymethod]", float, double) {
///   effattn::testing::ConformanceConfig cfg;
///   cfg.name = "MyMethod";
///   cfg.tolerance = [](workloads::Kind k) { return k == workloads::Kind::Gaussian ? 0.3 : 0.1; };
///   effattn::testing::check_conformance<TestType>(
///       cfg, [](const auto& Q, const auto& K, const auto& V) {
///         MyMethod<TestType>::Options o; o.seed = 7;
///         return MyMethod<TestType>(o).compute(Q, K, V);
///       });
/// }
/// \endcode
///
/// For every workload kind and every shape in the config it checks:
///  1. `info == Success`, output shape n x dv, all entries finite;
///  2. determinism: two calls give bit-identical output, and so do 1 and 2 OpenMP threads;
///  3. accuracy: relative Frobenius error against `ExactAttention<double, policy::Naive>` (on the
///     same inputs, promoted to double; causal when `cfg.causal`) is <= `cfg.tolerance(kind)`
///     (a negative tolerance skips the check for that kind);
///  4. the measured errors are printed when the environment variable EFFATTN_TEST_VERBOSE is set.
///
/// Every skipped check (an accuracy check without a tolerance; the cross-attention shapes of a
/// self-attention-only method) must be listed in `cfg.expected_skips` (expected_skips.hpp): it is
/// then reported as a Catch2 warning with the listed reason; an unlisted skip, or a listed one
/// that did not happen, fails the test.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <effattn/exact.hpp>
#include <effattn/workloads.hpp>

#include "expected_skips.hpp"
#include "test_utils.hpp"

namespace effattn {
namespace testing {

/// One problem shape of the conformance suite.
struct ConformanceShape {
  Index n, m, d, dv;
};

/// A check of the suite that a config may skip on purpose (`ConformanceConfig::expected_skips`).
struct ConformanceCheck {
  enum class Part {
    Accuracy,        ///< the accuracy check on one workload kind, on every shape
    CrossAttention,  ///< the shapes with n != m (run as m x m by a self-attention-only method)
  };
  Part part = Part::Accuracy;
  workloads::Kind kind = workloads::Kind::Gaussian;  ///< Part::Accuracy only

  /// The accuracy check on workload `k`.
  static constexpr ConformanceCheck accuracy(workloads::Kind k) { return {Part::Accuracy, k}; }
  /// The cross-attention shapes.
  static constexpr ConformanceCheck cross_attention() {
    return {Part::CrossAttention, workloads::Kind::Gaussian};
  }
  friend constexpr bool operator==(const ConformanceCheck& a, const ConformanceCheck& b) {
    return a.part == b.part && (a.part == Part::CrossAttention || a.kind == b.kind);
  }
  friend std::ostream& operator<<(std::ostream& os, const ConformanceCheck& c) {
    if (c.part == Part::CrossAttention) return os << "the cross-attention shapes (n != m)";
    return os << "accuracy on " << workloads::name(c.kind);
  }
};

/// What to run and how strictly.
struct ConformanceConfig {
  std::string name = "method";
  /// Shapes to test; the default covers self-attention, cross-attention (n != m, dv != d) and
  /// sizes that are not multiples of any block size.
  std::vector<ConformanceShape> shapes = {{256, 256, 32, 32}, {97, 300, 16, 24}};
  /// The method needs Q and K of the same rows: a shape with n != m runs with n = m instead (a
  /// skip of `ConformanceCheck::cross_attention()`).
  bool self_attention_only = false;
  /// Compare against causal exact attention.
  bool causal = false;
  /// Maximum relative Frobenius error per workload kind (< 0 skips the accuracy check).
  std::function<double(workloads::Kind)> tolerance = [](workloads::Kind) { return 1e-5; };
  /// When set, the tolerance is instead this fraction (< 1) of the error of the uniform-attention
  /// baseline (every query returns the mean of the values it may see) on the same problem, so an
  /// all-zero or mean-of-V output fails by construction.
  /// A negative fraction skips the accuracy check on that workload (an expected skip): the
  /// method is measured to be no better than the baseline there, so no honest tolerance exists.
  std::function<double(workloads::Kind)> baseline_fraction;
  /// With `baseline_fraction`: an absolute cap on top of it (the tolerance an older version of a
  /// test had), so that moving a test to baseline fractions never loosens it.
  std::function<double(workloads::Kind)> tolerance_cap;
  /// Seed of the generated workloads.
  std::uint64_t workload_seed = 2024;
  /// Check bit-identical output for 1 vs 2 OpenMP threads.
  bool check_thread_determinism = true;
  /// The functor under test (`type_key<F>()`) and the checks it skips on purpose, with the
  /// reasons; entries for other functors are ignored, so a table of several may be passed.
  TypeKey method = nullptr;
  std::vector<ExpectedSkip<ConformanceCheck>> expected_skips;
};

/// The shapes `cfg` runs: its shapes, with n = m for a self-attention-only method.
inline std::vector<ConformanceShape> run_shapes(const ConformanceConfig& cfg) {
  std::vector<ConformanceShape> shapes = cfg.shapes;
  if (cfg.self_attention_only)
    for (ConformanceShape& s : shapes) s.n = s.m;
  return shapes;
}

/// Measurements of one (shape, workload) case.
struct ConformanceEntry {
  ConformanceShape shape{};
  workloads::Kind kind = workloads::Kind::Gaussian;
  Info info = Info::NotComputed;
  bool shape_ok = false;         ///< output is n x dv
  bool finite = false;           ///< every output entry is finite
  bool repeatable = false;       ///< two calls are bit-identical
  bool thread_invariant = true;  ///< 1 and 2 threads are bit-identical (true when not checked)
  bool threads_checked = false;  ///< the 1 vs 2 threads comparison ran (OpenMP builds)
  double rel_fro_error = -1;     ///< vs exact attention; -1 when not measured
  double baseline_error = -1;    ///< error of the uniform-attention (mean-of-V) output
  double tolerance = -1;         ///< the bound it is held to; < 0 when not checked
};

/// The uniform-attention baseline: row i is the mean of the values query i may see (all m rows;
/// causal, bottom-right aligned: rows 0..i + m - n).
inline Matrix<double> uniform_attention(const Matrix<double>& V, Index n, bool causal) {
  const Index m = V.rows();
  Matrix<double> out(n, V.cols());
  if (!causal) {
    out = V.colwise().mean().replicate(n, 1);
    return out;
  }
  Matrix<double> prefix = Matrix<double>::Zero(m + 1, V.cols());
  for (Index j = 0; j < m; ++j) prefix.row(j + 1) = prefix.row(j) + V.row(j);
  for (Index i = 0; i < n; ++i) {
    const Index seen = i + (m - n) + 1;
    out.row(i) = prefix.row(seen) / static_cast<double>(seen);
  }
  return out;
}

/// Runs every case and returns the measurements without asserting anything (so the suite itself
/// can be tested). `run(Q, K, V)` must return a Result deriving from `AttentionResult<Scalar>`.
template <typename Scalar, typename Run>
std::vector<ConformanceEntry> conformance_report(const ConformanceConfig& cfg, Run&& run) {
  std::vector<ConformanceEntry> report;
  for (const auto& shape : run_shapes(cfg)) {
    for (const workloads::Kind kind : workloads::all_kinds()) {
      const auto w = workloads::make<Scalar>(
          kind, workloads::Params::shape(shape.n, shape.m, shape.d, shape.dv, cfg.workload_seed));
      ConformanceEntry e;
      e.shape = shape;
      e.kind = kind;
      const auto r1 = run(w.Q, w.K, w.V);
      e.info = r1.info;
      e.shape_ok = r1.output.rows() == shape.n && r1.output.cols() == shape.dv;
      e.finite = r1.output.allFinite();
      e.repeatable = bitwise_equal(r1.output, run(w.Q, w.K, w.V).output);
      if (cfg.check_thread_determinism && has_openmp()) {
        e.threads_checked = true;
        const auto t1 = with_threads(1, [&] { return run(w.Q, w.K, w.V); });
        const auto t2 = with_threads(2, [&] { return run(w.Q, w.K, w.V); });
        e.thread_invariant =
            bitwise_equal(t1.output, t2.output) && bitwise_equal(t1.output, r1.output);
      }
      ExactOptions eo;
      eo.causal = cfg.causal;
      const Matrix<double> Qd = w.Q.template cast<double>(), Kd = w.K.template cast<double>(),
                           Vd = w.V.template cast<double>();
      const Matrix<double> ref = ExactAttention<double, policy::Naive>(eo)(Qd, Kd, Vd);
      e.baseline_error = rel_fro_error(uniform_attention(Vd, shape.n, cfg.causal), ref);
      if (cfg.baseline_fraction) {
        const double f = cfg.baseline_fraction(kind);
        e.tolerance = f < 0 ? -1.0 : f * e.baseline_error;
        if (f >= 0 && cfg.tolerance_cap)
          e.tolerance = std::min(e.tolerance, cfg.tolerance_cap(kind));
      } else {
        e.tolerance = cfg.tolerance(kind);
      }
      if (e.shape_ok) e.rel_fro_error = rel_fro_error(r1.output, ref);
      report.push_back(e);
    }
  }
  return report;
}

/// Runs the suite and asserts every property with Catch2; reports the skips (see the file
/// documentation).
template <typename Scalar, typename Run>
void check_conformance(const ConformanceConfig& cfg, Run&& run) {
  const bool verbose = testing::verbose();
  const char* scalar = sizeof(Scalar) == 4 ? "float" : "double";
  SkipLedger<ConformanceCheck> skips(cfg.expected_skips, cfg.method);
  for (const ConformanceShape& s : cfg.shapes)
    if (cfg.self_attention_only && s.n != s.m) {
      std::ostringstream detail;
      detail << "n=" << s.n << " m=" << s.m << " runs as n=m=" << s.m << ", " << scalar;
      skips.skip(cfg.method, cfg.name, ConformanceCheck::cross_attention(), detail.str());
    }
  bool threads_unchecked = false;
  for (const ConformanceEntry& e : conformance_report<Scalar>(cfg, run)) {
    INFO(cfg.name << " on " << workloads::name(e.kind) << ", n=" << e.shape.n << " m=" << e.shape.m
                  << " d=" << e.shape.d << " dv=" << e.shape.dv << " causal=" << cfg.causal
                  << " scalar=" << scalar << " rel_fro_error=" << e.rel_fro_error
                  << " tol=" << e.tolerance << " baseline_error=" << e.baseline_error);
    if (verbose)
      std::cout << "[conformance] " << cfg.name << " " << workloads::name(e.kind)
                << " n=" << e.shape.n << " m=" << e.shape.m << " "
                << (sizeof(Scalar) == 4 ? "f" : "d") << " rel_fro_err=" << e.rel_fro_error
                << " tol=" << e.tolerance << " baseline=" << e.baseline_error
                << " fraction=" << e.rel_fro_error / e.baseline_error << "\n";
    CHECK(e.info == Info::Success);
    CHECK(e.shape_ok);
    CHECK(e.finite);
    CHECK(e.repeatable);
    CHECK(e.thread_invariant);
    if (e.tolerance >= 0) CHECK(e.rel_fro_error <= e.tolerance);
    // Every tolerance must reject the uniform-attention baseline (and so an all-zero output,
    // whose error is 1 >= the baseline's here).
    if (e.tolerance >= 0) CHECK(e.tolerance < std::min(1.0, e.baseline_error));
    if (e.tolerance < 0) {
      std::ostringstream detail;
      detail << "n=" << e.shape.n << " m=" << e.shape.m << " " << scalar << ": "
             << e.rel_fro_error / e.baseline_error << " of the uniform baseline's error";
      skips.skip(cfg.method, cfg.name, ConformanceCheck::accuracy(e.kind), detail.str());
    }
    threads_unchecked = threads_unchecked || (cfg.check_thread_determinism && !e.threads_checked);
  }
  skips.check_all_used();
  // Not a skip of the method: the build has one thread only.
  if (threads_unchecked)
    WARN("SKIP 1 vs 2 threads determinism of " << cfg.name << ": built without OpenMP");
}

}  // namespace testing
}  // namespace effattn
