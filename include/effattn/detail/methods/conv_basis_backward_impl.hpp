/// \file conv_basis_backward_impl.hpp
/// \brief Implementation of `ConvBasisAttention::backward` (conv_basis.hpp): the gradient of the
/// Conv-Basis output with the basis starts held fixed, through FFT correlations.
#pragma once

#include <algorithm>
#include <complex>
#include <vector>

#include "../../conv_basis.hpp"
#include "../../conv_basis_recovery.hpp"
#include "../../core/checks.hpp"
#include "../../core/errors.hpp"
#include "../../core/parallel.hpp"
#include "../../core/types.hpp"
#include "../../gradients.hpp"
#include "../../numerics/fft.hpp"
#include "conv_basis_impl.hpp"

namespace effattn {
namespace conv_basis {
namespace detail {

/// The backward of one sequence (see `ConvBasisAttention::backward` for the formulas and the
/// cost), in double: basis `b` (its columns are the scaled logits at the starts), the unscaled Q
/// and K, V, the forward output Y and dO (all b.n rows). Writes dQ, dK (b.n x d) and dV
/// (b.n x dv). Bases run in parallel, each writing its own dV rows and its own dU_r: the result
/// does not depend on the thread count.
template <typename Backend, typename Real>
void backward_double(const Basis& b, const Matrix<double>& Qd, const Matrix<double>& Kd,
                     const Matrix<double>& Vd, const Matrix<double>& Yd, const Matrix<double>& dOd,
                     double scale, fft::Rigor rigor, Matrix<double>& dQ, Matrix<double>& dK,
                     Matrix<double>& dV) {
  using Complex = std::complex<Real>;
  using CArray = Eigen::Array<Complex, Eigen::Dynamic, 1>;
  using Engine = typename Backend::template Engine<Real>;
  const Index L = b.n, k = b.size(), dv = Vd.cols();
  const std::vector<fft::ConvTerm<double>> terms = basis_terms(b, basis_max(b));
  Vector<double> Dn, D_err;
  basis_denominators(terms, L, Dn, D_err);
  Index need = L;  // linear correlation without wrap-around (as the forward's size)
  for (const auto& t : terms) need = std::max(need, t.end + t.kernel.size() - 1);
  const Index N = Backend::fft_size(need), H = N / 2 + 1;
  const Engine engine(N, 1, rigor);

  const Matrix<double> X = (dOd.array().colwise() / Dn.array()).matrix();
  // Z = prefix sums of z_i = <dO_i, Y_i> / D_i.
  Vector<double> Z(L + 1);
  Z(0) = 0;
  for (Index i = 0; i < L; ++i) Z(i + 1) = Z(i) + dOd.row(i).dot(Yd.row(i)) / Dn(i);

  struct Workspace {
    fft::detail::AlignedBuffer<Real> in;
    fft::detail::AlignedBuffer<Complex> spec, acc, kern;
    typename Engine::Scratch scratch;
  };
  auto make_ws = [&] {
    return Workspace{fft::detail::AlignedBuffer<Real>(N), fft::detail::AlignedBuffer<Complex>(H),
                     fft::detail::AlignedBuffer<Complex>(H), fft::detail::AlignedBuffer<Complex>(H),
                     engine.make_scratch()};
  };
  // r2c of `x` placed at row `start` of a zero-padded length-N signal, into ws.spec.
  auto transform = [&](Workspace& ws, const auto& x, Index start) {
    Real* in = ws.in.data();
    std::fill(in, in + N, Real(0));
    Eigen::Map<Vector<Real>>(in + start, x.size()) = x.template cast<Real>();
    engine.forward(1, in, ws.spec.data(), ws.scratch);
  };
  // Inverse of ws.acc (destroyed) into ws.in.
  auto inverse = [&](Workspace& ws) { engine.inverse(1, ws.acc.data(), ws.in.data(), ws.scratch); };

  // Spectra of the columns of X, times 1/N so that every inverse below comes out scaled.
  Eigen::Matrix<Complex, Eigen::Dynamic, Eigen::Dynamic> Xh(H, dv);
  ::effattn::detail::parallel_for(dv, make_ws, [&](Index c, Workspace& ws) {
    transform(ws, X.col(c), 0);
    Xh.col(c) = Eigen::Map<const CArray>(ws.spec.data(), H).matrix() * (Real(1) / Real(N));
  });

  dV.resize(L, dv);
  std::vector<Vector<double>> dU(static_cast<std::size_t>(k));
  ::effattn::detail::parallel_for(k, make_ws, [&](Index r, Workspace& ws) {
    const auto& t = terms[static_cast<std::size_t>(r)];
    const Index s = t.offset, e = t.end, Kr = t.kernel.size();
    transform(ws, t.kernel, 0);
    Eigen::Map<CArray> C(ws.kern.data(), H), A(ws.acc.data(), H);
    C = Eigen::Map<const CArray>(ws.spec.data(), H).conjugate();
    // dV rows of segment r: dV[j, c] = sum_t c_r[t] X[j + t, c], the correlation of X_c with c_r.
    for (Index c = 0; c < dv; ++c) {
      A = Xh.col(c).array() * C;
      inverse(ws);
      dV.col(c).segment(s, e - s) =
          Eigen::Map<const Vector<Real>>(ws.in.data() + s, e - s).template cast<double>();
    }
    // a_r[t] = sum_c sum_{j in [s, e)} X[j + t, c] V[j, c]: the correlations of X_c with the
    // segment of V_c, summed in the frequency domain.
    A.setZero();
    for (Index c = 0; c < dv; ++c) {
      transform(ws, Vd.col(c).segment(s, e - s), s);
      A += Xh.col(c).array() * Eigen::Map<const CArray>(ws.spec.data(), H).conjugate();
    }
    inverse(ws);
    auto& g = dU[static_cast<std::size_t>(r)];
    g.resize(Kr);
    for (Index lag = 0; lag < Kr; ++lag) {
      const double a = static_cast<double>(ws.in.data()[lag]);
      const double bsum = Z(std::min(e + lag, L)) - Z(std::min(s + lag, L));
      g(lag) = t.kernel(lag) * (a - bsum);
    }
  });

  // U_r[t] = s <q_{s_r + t}, k_{s_r}>: O(k n d), bases in order.
  dQ.setZero(L, Qd.cols());
  dK.setZero(L, Kd.cols());
  for (Index r = 0; r < k; ++r) {
    const auto& g = dU[static_cast<std::size_t>(r)];
    const Index s = terms[static_cast<std::size_t>(r)].offset, Kr = g.size();
    dQ.middleRows(s, Kr).noalias() += (scale * g) * Kd.row(s);
    dK.row(s).noalias() += scale * (g.transpose() * Qd.middleRows(s, Kr));
  }
}

}  // namespace detail
}  // namespace conv_basis

template <typename Scalar_, typename FftBackend, typename Recovery, typename Real>
auto ConvBasisAttention<Scalar_, FftBackend, Recovery, Real>::backward(const Ref& Q, const Ref& K,
                                                                       const Ref& V,
                                                                       const Result& result,
                                                                       const Ref& dO) const
    -> Gradients {
  using detail::cat;
  check_inputs(Q, K, V);
  const Index n = Q.rows(), d = Q.cols(), dv = V.cols();
  detail::check_backward_args<Scalar>(name, n, dv, result.output, result.info, dO);
  const auto& offs = result.offsets;
  EFFATTN_CHECK(static_cast<Index>(offs.size()) == result.bases_used,
                cat(name, ": result.offsets must hold result.bases_used = ", result.bases_used,
                    " starts (the forward result of these Q, K, V); got ", offs.size()));
  const double scale = detail::resolve_scale(m_opts.scale, d);
  const MatrixType Qs = Q * static_cast<Scalar>(scale);
  const Index bs = m_opts.mask_block > 0 ? std::min(m_opts.mask_block, n) : n;
  Gradients g;
  g.dQ.resize(n, d);
  g.dK.resize(n, d);
  g.dV.resize(n, dv);
  std::size_t pos = 0;
  for (Index b0 = 0; b0 < n; b0 += bs) {
    const Index len = std::min(bs, n - b0);
    conv_basis::RecoveryParams p = params(m_opts.sliding_window);
    p.grid_starts.clear();
    for (; pos < offs.size() && offs[pos] < b0 + len; ++pos) {
      const Index s = offs[pos] - b0;
      EFFATTN_CHECK(
          s >= 0 && (p.grid_starts.empty() ? s == 0 : s > p.grid_starts.back()),
          cat(name, ": result.offsets must list, for every block of ", bs,
              " tokens, increasing starts beginning at the block start (the forward result "
              "of these Q, K, V with these options); got ",
              offs[pos], " at position ", pos));
      p.grid_starts.push_back(s);
    }
    EFFATTN_CHECK(!p.grid_starts.empty(),
                  cat(name, ": result.offsets has no start in the block at ", b0,
                      " (the forward result of these Q, K, V with these options?)"));
    const MatrixType Qb = Qs.middleRows(b0, len);
    const auto Kb = K.middleRows(b0, len);
    const Ref Kr(Kb);
    const conv_basis::Basis basis =
        conv_basis::recover<policy::Grid>(conv_basis::QKOracle<Scalar>(Qb, Kr), p);
    Matrix<double> dQb, dKb, dVb;
    conv_basis::detail::backward_double<FftBackend, Real>(
        basis, Q.middleRows(b0, len).template cast<double>(), Kb.template cast<double>(),
        V.middleRows(b0, len).template cast<double>(),
        result.output.middleRows(b0, len).template cast<double>(),
        dO.middleRows(b0, len).template cast<double>(), scale, m_opts.rigor, dQb, dKb, dVb);
    g.dQ.middleRows(b0, len) = dQb.template cast<Scalar>();
    g.dK.middleRows(b0, len) = dKb.template cast<Scalar>();
    g.dV.middleRows(b0, len) = dVb.template cast<Scalar>();
  }
  EFFATTN_CHECK(pos == offs.size(),
                cat(name, ": result.offsets holds starts beyond the sequence (n = ", n, ")"));
  return g;
}

}  // namespace effattn
