// The reference of MultiHead<F>::backward shared by the test suites: F's own forward and backward
// called per (sequence, head) on column-major copies.
#pragma once

#include <effattn/multi_head.hpp>

#include <array>
#include <cstddef>

namespace effattn {
namespace testing {

/// Per-(sequence, head) forward and backward calls of F on column-major copies, dK and dV summed
/// over each group's query heads in head order: the reference of MultiHead<F>::backward.
/// Q, K, V, dO are packed (rows x heads width); `cu` the sequence offsets.
template <typename F, typename MQ, typename MK, typename MV, typename MG>
std::array<Matrix<typename F::Scalar>, 3> per_head_backward(const F& f, const HeadLayout& L,
                                                            const MQ& Q, const MK& K, const MV& V,
                                                            const MG& dO, const SeqOffsets& cu) {
  using S = typename F::Scalar;
  const Index H = L.heads, G = L.kv_heads, d = Q.cols() / H, dv = V.cols() / G;
  std::array<Matrix<S>, 3> g = {Matrix<S>::Zero(Q.rows(), H * d), Matrix<S>::Zero(K.rows(), G * d),
                                Matrix<S>::Zero(V.rows(), G * dv)};
  detail::run_serial([&] {
    for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
      const Index r0 = cu[b], n = cu[b + 1] - r0;
      if (n == 0) continue;
      for (Index h = 0; h < H; ++h) {
        const Index kv = h / (H / G);
        const Matrix<S> q = Q.block(r0, h * d, n, d), k = K.block(r0, kv * d, n, d),
                        v = V.block(r0, kv * dv, n, dv), go = dO.block(r0, h * dv, n, dv);
        const auto res = f.compute(q, k, v);
        const auto gr = f.backward(q, k, v, res, go);
        g[0].block(r0, h * d, n, d) = gr.dQ;
        g[1].block(r0, kv * d, n, d) += gr.dK;
        g[2].block(r0, kv * dv, n, dv) += gr.dV;
      }
    }
  });
  return g;
}

}  // namespace testing
}  // namespace effattn
