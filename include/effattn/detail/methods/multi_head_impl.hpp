/// \file multi_head_impl.hpp
/// \brief Implementation of `MultiHead<F>`: the per-(sequence, head) driver every functor uses,
/// the forward pass (which hands `ExactAttention<Scalar, policy::Tiled>` to the multi-head exact
/// kernel of `multi_head_exact.hpp`), the backward pass and the KV-cache members. The packed
/// views of the inputs and the offset validation are in `multi_head_views.hpp`.
#pragma once

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/parallel.hpp"
#include "../../multi_head.hpp"
#include "multi_head_exact.hpp"
#include "multi_head_views.hpp"

namespace effattn {
namespace detail {

/// Rethrows an `invalid_argument` from one (sequence, head) call with its position.
[[noreturn]] EFFATTN_COLD inline void rethrow_for_head(const char* method, const char* what_,
                                                       Index b, Index h, const char* head_kind) {
  std::string what(what_);
  const std::string prefix = "effattn: ";
  if (what.compare(0, prefix.size(), prefix) == 0) what.erase(0, prefix.size());
  throw_invalid_argument(
      cat("MultiHead<", method, ">: sequence ", b, ", ", head_kind, " ", h, ": ", what));
}

/// Runs `head_call(b, h, q)` (returning F::Result) for every (sequence b, query head h) with q
/// the head's query rows as a ConstRef, in parallel over (b, h), each call serial inside its
/// task; writes each Result's output into `out`, keeps the Result without it, and sets `info`
/// (the first failure in (b, h) order).
template <typename F, typename HeadCall>
void run_per_head(const PackedView<typename F::Scalar>& Q, const SeqOffsets& oq, Index heads,
                  Index d, Index dv, const PackedView<typename F::Scalar, typename F::Scalar*>& out,
                  std::vector<typename F::Result>& results, Info& info, HeadCall&& head_call) {
  using Scalar = typename F::Scalar;
  const Index batch = static_cast<Index>(oq.size()) - 1;
  results.assign(static_cast<std::size_t>(batch * heads), typename F::Result{});
  parallel_for(
      batch * heads, [] { return 0; },
      [&](Index t, int&) {
        const Index b = t / heads, h = t % heads;
        const Index q0 = oq[static_cast<std::size_t>(b)];
        const Index nq = oq[static_cast<std::size_t>(b + 1)] - q0;
        typename F::Result& res = results[static_cast<std::size_t>(t)];
        if (nq == 0) {
          res.info = Info::Success;
          return;
        }
        try {
          with_slice_ref(Q, q0, nq, h * d, d,
                         [&](const ConstRef<Scalar>& q) { res = head_call(b, h, q); });
        } catch (const ::effattn::invalid_argument& e) {
          rethrow_for_head(F::name, e.what(), b, h, "head");
        }
        EFFATTN_ASSERT(res.output.rows() == nq && res.output.cols() == dv);
        write_slice(out, q0, h * dv, res.output);
        res.output.resize(0, 0);
      });
  info = Info::Success;
  for (const auto& r : results)
    if (r.info != Info::Success) {
      info = r.info;
      break;
    }
}

}  // namespace detail

template <typename F>
MultiHead<F>::MultiHead(Options opts, HeadLayout layout) : m_functor(opts), m_layout(layout) {
  EFFATTN_CHECK(m_layout.heads >= 1,
                detail::cat("MultiHead: HeadLayout::heads must be >= 1; got ", m_layout.heads));
  EFFATTN_CHECK(m_layout.kv_heads >= 0,
                detail::cat("MultiHead: HeadLayout::kv_heads must be >= 0 (0 = heads); got ",
                            m_layout.kv_heads));
  if (m_layout.kv_heads == 0) m_layout.kv_heads = m_layout.heads;
  EFFATTN_CHECK(m_layout.heads % m_layout.kv_heads == 0,
                detail::cat("MultiHead: HeadLayout::heads (", m_layout.heads,
                            ") must be a multiple of kv_heads (", m_layout.kv_heads, ")"));
}

namespace detail {

/// The packed views of Q, K and V (each evaluated once into the buffers here when it is an
/// expression or has an inner stride) and the checked batch, as the forward calls read them.
template <typename Scalar>
struct MhInputs {
  Matrix<Scalar> tq, tk, tv;
  RowMatrix<Scalar> rq, rk, rv;
  PackedView<Scalar> q, k, v;
  MultiHeadBatch mb;
  template <typename DQ, typename DK, typename DV>
  MhInputs(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
           const Eigen::MatrixBase<DV>& V, const HeadLayout& layout, const SeqOffsets& cu_q,
           const SeqOffsets& cu_k, const std::vector<Index>& seqused_k, bool check_q)
      : q(packed_view(Q, tq, rq)),
        k(packed_view(K, tk, rk)),
        v(packed_view(V, tv, rv)),
        mb(check_multi_head(q, k, v, layout, cu_q, cu_k, seqused_k, check_q)) {}
  MhInputs(const MhInputs&) = delete;  // the views may point into the buffers
  MhInputs& operator=(const MhInputs&) = delete;
};

/// The forward pass of `MultiHead<F>::compute` and `compute_into` on packed views of checked
/// inputs (`mb`): writes the output into `ov` (T_q x heads dv) and fills r's status and
/// per-head Results (not `r.output`).
template <typename F, int Order>
void multi_head_forward(const F& functor, const HeadLayout& layout,
                        const PackedView<typename F::Scalar>& qv,
                        const PackedView<typename F::Scalar>& kv,
                        const PackedView<typename F::Scalar>& vv, const MultiHeadBatch& mb,
                        const PackedView<typename F::Scalar, typename F::Scalar*>& ov,
                        MultiHeadResult<F, Order>& r) {
  using Scalar = typename F::Scalar;
  constexpr bool kExactTiled = std::is_same_v<F, ExactAttention<Scalar, policy::Tiled>>;
  const Index H = layout.heads, group = layout.heads / layout.kv_heads;
  r.batch = mb.batch();
  r.heads = H;
  r.kv_heads = layout.kv_heads;
  if constexpr (kExactTiled) {
    const ExactOptions& o = functor.options();
    for (Index b = 0; b < mb.batch(); ++b) {
      const std::size_t i = static_cast<std::size_t>(b);
      EFFATTN_CHECK(!o.causal || mb.k_len[i] >= mb.q[i + 1] - mb.q[i],
                    cat("MultiHead<", F::name,
                        ">: causal attention needs as many keys "
                        "as queries in every sequence; sequence ",
                        b, " has ", mb.q[i + 1] - mb.q[i], " queries and ", mb.k_len[i], " keys"));
    }
    bool scores_finite = true;
    multi_head_exact<Scalar>(o, layout, qv, kv, vv, ov, mb, r.head_results, r.tasks, scores_finite);
    // Each block's rows were checked for finiteness in cache by the kernel.
    r.info = Info::Success;
    for (const auto& hr : r.head_results)
      if (hr.info != Info::Success) r.info = Info::NumericalIssue;
    // Non-finite queries, scores or output: a non-finite query, key or value throws
    // invalid_argument here (the inputs are scanned only then); otherwise it was an overflow
    // (info says so).
    if (!scores_finite || r.info != Info::Success) {
      check_finite_view(qv, "Q");
      check_finite_view(kv, "K");
      check_finite_view(vv, "V");
    }
  } else {
    check_finite_view(kv, "K");
    check_finite_view(vv, "V");
    r.tasks = mb.batch() * H;
    run_per_head<F>(qv, mb.q, H, mb.d, mb.dv, ov, r.head_results, r.info,
                    [&](Index b, Index h, const ConstRef<Scalar>& q) {
                      const std::size_t i = static_cast<std::size_t>(b);
                      const Index k0 = mb.k[i], nk = mb.k_len[i], g = h / group;
                      typename F::Result res;
                      with_slice_ref(kv, k0, nk, g * mb.d, mb.d, [&](const ConstRef<Scalar>& k) {
                        with_slice_ref(
                            vv, k0, nk, g * mb.dv, mb.dv,
                            [&](const ConstRef<Scalar>& v) { res = functor.compute(q, k, v); });
                      });
                      return res;
                    });
  }
}

}  // namespace detail

template <typename F>
template <typename DQ, typename DK, typename DV>
MultiHeadResult<F, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)> MultiHead<F>::compute(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const SeqOffsets& cu_seqlens_q, const SeqOffsets& cu_seqlens_k,
    const std::vector<Index>& seqused_k) const {
  static_assert(std::is_same_v<typename DQ::Scalar, Scalar> &&
                    std::is_same_v<typename DK::Scalar, Scalar> &&
                    std::is_same_v<typename DV::Scalar, Scalar>,
                "effattn: MultiHead<F>::compute takes Q, K, V of F's scalar type");
  constexpr int order = DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor;
  // The exact kernel checks each query block as it loads it (Q is not scanned beforehand).
  constexpr bool kExactTiled = std::is_same_v<F, ExactAttention<Scalar, policy::Tiled>>;
  const detail::MhInputs<Scalar> in(Q, K, V, m_layout, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                    /*check_q=*/!kExactTiled);
  const detail::PackedView<Scalar>&qv = in.q, &kv = in.k, &vv = in.v;
  const detail::MultiHeadBatch& mb = in.mb;
  MultiHeadResult<F, order> r;
  r.output.resize(qv.rows, m_layout.heads * mb.dv);
  // A prefill output is large (64 MiB at B = 8, L = 512, 32 heads of 128) and written once:
  // its page faults were 6% of the exact kernel's time with 4 KiB pages. Its pages are then
  // mapped in one call before the kernel (see populate_pages).
  detail::advise_huge_pages(r.output);
  detail::populate_pages(r.output);
  const detail::PackedView<Scalar, Scalar*> ov{
      r.output.data(), r.output.rows(), r.output.cols(),
      order == Eigen::RowMajor ? r.output.cols() : r.output.rows(), order == Eigen::RowMajor};
  detail::multi_head_forward(m_functor, m_layout, qv, kv, vv, mb, ov, r);
  return r;
}

template <typename F>
template <typename DQ, typename DK, typename DV, typename DOut>
MultiHeadResult<F, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)> MultiHead<F>::compute_into(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DOut>& out, const SeqOffsets& cu_seqlens_q,
    const SeqOffsets& cu_seqlens_k, const std::vector<Index>& seqused_k) const {
  static_assert(std::is_same_v<typename DQ::Scalar, Scalar> &&
                    std::is_same_v<typename DK::Scalar, Scalar> &&
                    std::is_same_v<typename DV::Scalar, Scalar> &&
                    std::is_same_v<typename DOut::Scalar, Scalar>,
                "effattn: MultiHead<F>::compute_into takes Q, K, V and out of F's scalar type");
  static_assert(
      (DOut::Flags & Eigen::DirectAccessBit) != 0 && (DOut::Flags & Eigen::LvalueBit) != 0,
      "effattn: MultiHead<F>::compute_into writes into a Matrix, a Map or a block of "
      "one (a writable expression with direct access)");
  constexpr int order = DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor;
  constexpr bool kExactTiled = std::is_same_v<F, ExactAttention<Scalar, policy::Tiled>>;
  const detail::MhInputs<Scalar> in(Q, K, V, m_layout, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                    /*check_q=*/!kExactTiled);
  const detail::PackedView<Scalar>&qv = in.q, &kv = in.k, &vv = in.v;
  const detail::MultiHeadBatch& mb = in.mb;
  // Eigen's idiom for an output argument that may be a temporary Block or Map.
  DOut& o = const_cast<DOut&>(out.derived());
  const Index T = qv.rows, width = m_layout.heads * mb.dv;
  EFFATTN_CHECK(o.rows() == T && o.cols() == width,
                detail::cat("MultiHead<", F::name, ">::compute_into: out must be ", T, " x ", width,
                            " (T_q x heads dv); got ", o.rows(), " x ", o.cols()));
  EFFATTN_CHECK(
      o.innerStride() == 1,
      detail::cat("MultiHead<", F::name, ">::compute_into: out must have inner stride 1; got ",
                  o.innerStride()));
  const detail::PackedView<Scalar, Scalar*> ov{o.data(), T, width, o.outerStride(),
                                               static_cast<bool>(DOut::IsRowMajor)};
  for (const auto* view : {&qv, &kv, &vv})
    EFFATTN_CHECK(!detail::views_overlap(ov, *view),
                  detail::cat("MultiHead<", F::name, ">::compute_into: out overlaps ",
                              view == &qv   ? "Q"
                              : view == &kv ? "K"
                                            : "V"));
  MultiHeadResult<F, order> r;
  detail::multi_head_forward(m_functor, m_layout, qv, kv, vv, mb, ov, r);
  return r;
}

namespace detail {
/// Whether F has `backward(Q, K, V, result, dO)`.
template <typename F, typename = void>
struct has_backward : std::false_type {};
template <typename F>
struct has_backward<F, std::void_t<decltype(std::declval<const F&>().backward(
                           std::declval<const ConstRef<typename F::Scalar>&>(),
                           std::declval<const ConstRef<typename F::Scalar>&>(),
                           std::declval<const ConstRef<typename F::Scalar>&>(),
                           std::declval<const typename F::Result&>(),
                           std::declval<const ConstRef<typename F::Scalar>&>()))>>
    : std::true_type {};
}  // namespace detail

template <typename F>
template <typename DQ, typename DK, typename DV, int ResultOrder, typename DO>
MultiHeadGradients<typename F::Scalar, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)>
MultiHead<F>::backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                       const Eigen::MatrixBase<DV>& V,
                       const MultiHeadResult<F, ResultOrder>& result,
                       const Eigen::MatrixBase<DO>& dO, const SeqOffsets& cu_seqlens_q,
                       const SeqOffsets& cu_seqlens_k, const std::vector<Index>& seqused_k) const {
  static_assert(detail::has_backward<F>::value,
                "effattn: MultiHead<F>::backward needs a functor with backward (exact attention, "
                "Conv-Basis, Performer, EVA)");
  constexpr int order = DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor;
  Matrix<Scalar> tq, tk, tv, to, tdo;
  detail::RowMatrix<Scalar> rq, rk, rv, ro, rdo;
  const detail::PackedView<Scalar> qv = detail::packed_view(Q, tq, rq);
  const detail::PackedView<Scalar> kv = detail::packed_view(K, tk, rk);
  const detail::PackedView<Scalar> vv = detail::packed_view(V, tv, rv);
  const detail::MultiHeadBatch mb =
      detail::check_multi_head(qv, kv, vv, m_layout, cu_seqlens_q, cu_seqlens_k, seqused_k);
  const Index H = m_layout.heads, G = m_layout.kv_heads, group = H / G, B = mb.batch();
  const Index d = mb.d, dv = mb.dv;
  EFFATTN_CHECK(result.info == Info::Success,
                detail::cat("MultiHead<", F::name,
                            ">: backward needs the result of a successful forward call; got info ",
                            static_cast<int>(result.info)));
  EFFATTN_CHECK(
      result.heads == H && result.kv_heads == G && result.batch == B &&
          result.head_results.size() == static_cast<std::size_t>(B * H) &&
          result.output.rows() == qv.rows && result.output.cols() == H * dv,
      detail::cat("MultiHead<", F::name, ">: result must be the forward result of these inputs (",
                  B, " sequences, ", H, " heads, ", G, " kv heads, output ", qv.rows, " x ", H * dv,
                  "); got ", result.batch, " sequences, ", result.heads, " heads, ",
                  result.kv_heads, " kv heads, output ", detail::shape(result.output)));
  const detail::PackedView<Scalar> ov = detail::packed_view(result.output, to, ro);
  const detail::PackedView<Scalar> dov = detail::packed_view(dO, tdo, rdo);
  EFFATTN_CHECK(
      dov.rows == qv.rows && dov.cols == H * dv,
      detail::cat("MultiHead<", F::name, ">: dO must be T_q x heads dv = ", qv.rows, " x ", H * dv,
                  " (the output's shape); got ", dov.rows, " x ", dov.cols));
  detail::check_finite_view(dov, "dO");

  MultiHeadGradients<Scalar, order> g;
  g.dQ.setZero(qv.rows, H * d);
  g.dK.setZero(kv.rows, G * d);
  g.dV.setZero(vv.rows, G * dv);
  auto view = [](auto& x) {
    return detail::PackedView<Scalar, Scalar*>{x.data(), x.rows(), x.cols(),
                                               order == Eigen::RowMajor ? x.cols() : x.rows(),
                                               order == Eigen::RowMajor};
  };
  const auto dqv = view(g.dQ), dkv = view(g.dK), dvv = view(g.dV);
  // Tasks (sequence, kv head): each owns its dK, dV slice and its query heads' dQ slices.
  detail::parallel_for(
      B * G, [] { return 0; },
      [&](Index t, int&) {
        const Index b = t / G, kvh = t % G;
        const std::size_t i = static_cast<std::size_t>(b);
        const Index q0 = mb.q[i], nq = mb.q[i + 1] - q0, k0 = mb.k[i], nk = mb.k_len[i];
        if (nq == 0) return;
        Matrix<Scalar> dk = Matrix<Scalar>::Zero(nk, d), dvs = Matrix<Scalar>::Zero(nk, dv);
        for (Index h = kvh * group; h < (kvh + 1) * group; ++h) {
          typename F::Result hr = result.head(b, h);
          detail::with_slice_ref(ov, q0, nq, h * dv, dv,
                                 [&](const ConstRef<Scalar>& o) { hr.output = o; });
          try {
            detail::with_slice_ref(qv, q0, nq, h * d, d, [&](const ConstRef<Scalar>& q) {
              detail::with_slice_ref(kv, k0, nk, kvh * d, d, [&](const ConstRef<Scalar>& k) {
                detail::with_slice_ref(vv, k0, nk, kvh * dv, dv, [&](const ConstRef<Scalar>& v) {
                  detail::with_slice_ref(dov, q0, nq, h * dv, dv, [&](const ConstRef<Scalar>& go) {
                    const auto gr = m_functor.backward(q, k, v, hr, go);
                    detail::write_slice(dqv, q0, h * d, gr.dQ);
                    dk += gr.dK;
                    dvs += gr.dV;
                  });
                });
              });
            });
          } catch (const ::effattn::invalid_argument& e) {
            detail::rethrow_for_head(F::name, e.what(), b, h, "head");
          }
        }
        detail::write_slice(dkv, k0, kvh * d, dk);
        detail::write_slice(dvv, k0, kvh * dv, dvs);
      });
  return g;
}

template <typename F>
template <typename DK, typename DV>
auto MultiHead<F>::compress_kv(const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                               const SeqOffsets& cu_seqlens_k, double q_radius) const {
  using Cache = std::decay_t<decltype(m_functor.compress_kv(
      std::declval<const ConstRef<Scalar>&>(), std::declval<const ConstRef<Scalar>&>(), 0.0))>;
  Matrix<Scalar> tk, tv;
  detail::RowMatrix<Scalar> rk, rv;
  const detail::PackedView<Scalar> kv = detail::packed_view(K, tk, rk);
  const detail::PackedView<Scalar> vv = detail::packed_view(V, tv, rv);
  const Index G = m_layout.kv_heads;
  const Index d = detail::head_width(kv.cols, G, "K", "kv_heads");
  const Index dv = detail::head_width(vv.cols, G, "V", "kv_heads");
  EFFATTN_CHECK(vv.rows == kv.rows,
                detail::cat("MultiHead: V must have the rows of K (", kv.rows, "); got ", vv.rows));
  const SeqOffsets ok = detail::resolve_offsets(cu_seqlens_k, kv.rows, "cu_seqlens_k");
  MultiHeadCache<Cache> cache;
  cache.batch = static_cast<Index>(ok.size()) - 1;
  cache.kv_heads = G;
  cache.caches.resize(static_cast<std::size_t>(cache.batch * G));
  detail::parallel_for(
      cache.batch * G, [] { return 0; },
      [&](Index t, int&) {
        const Index b = t / G, g = t % G;
        const Index k0 = ok[static_cast<std::size_t>(b)];
        const Index nk = ok[static_cast<std::size_t>(b + 1)] - k0;
        try {
          detail::with_slice_ref(kv, k0, nk, g * d, d, [&](const ConstRef<Scalar>& k) {
            detail::with_slice_ref(vv, k0, nk, g * dv, dv, [&](const ConstRef<Scalar>& v) {
              cache.caches[static_cast<std::size_t>(t)] = m_functor.compress_kv(k, v, q_radius);
            });
          });
        } catch (const ::effattn::invalid_argument& e) {
          detail::rethrow_for_head(F::name, e.what(), b, g, "kv head");
        }
      });
  return cache;
}

template <typename F>
template <typename Cache, typename DK, typename DV>
void MultiHead<F>::append(MultiHeadCache<Cache>& cache, const Eigen::MatrixBase<DK>& K_new,
                          const Eigen::MatrixBase<DV>& V_new,
                          const SeqOffsets& cu_seqlens_new) const {
  Matrix<Scalar> tk, tv;
  detail::RowMatrix<Scalar> rk, rv;
  const detail::PackedView<Scalar> kv = detail::packed_view(K_new, tk, rk);
  const detail::PackedView<Scalar> vv = detail::packed_view(V_new, tv, rv);
  const Index G = m_layout.kv_heads;
  EFFATTN_CHECK(cache.kv_heads == G, detail::cat("MultiHead: the cache has ", cache.kv_heads,
                                                 " kv heads, the layout ", G));
  const Index d = detail::head_width(kv.cols, G, "K_new", "kv_heads");
  const Index dv = detail::head_width(vv.cols, G, "V_new", "kv_heads");
  EFFATTN_CHECK(vv.rows == kv.rows, detail::cat("MultiHead: V_new must have the rows of K_new (",
                                                kv.rows, "); got ", vv.rows));
  const SeqOffsets on = detail::resolve_offsets(cu_seqlens_new, kv.rows, "cu_seqlens_new");
  EFFATTN_CHECK(
      static_cast<Index>(on.size()) - 1 == cache.batch,
      detail::cat("MultiHead: cu_seqlens_new describes ", static_cast<Index>(on.size()) - 1,
                  " sequences, the cache ", cache.batch));
  for (Index b = 0; b < cache.batch; ++b) {
    const Index k0 = on[static_cast<std::size_t>(b)];
    const Index nk = on[static_cast<std::size_t>(b + 1)] - k0;
    if (nk == 0) continue;
    for (Index g = 0; g < G; ++g) {
      try {
        detail::with_slice_ref(kv, k0, nk, g * d, d, [&](const ConstRef<Scalar>& k) {
          detail::with_slice_ref(vv, k0, nk, g * dv, dv,
                                 [&](const ConstRef<Scalar>& v) { cache.at(b, g).append(k, v); });
        });
      } catch (const ::effattn::invalid_argument& e) {
        detail::rethrow_for_head(F::name, e.what(), b, g, "kv head");
      }
    }
  }
}

template <typename F>
template <typename Cache, typename DQ>
MultiHeadResult<F, (DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor)>
MultiHead<F>::weighted_attention(const Eigen::MatrixBase<DQ>& Q, const MultiHeadCache<Cache>& cache,
                                 const SeqOffsets& cu_seqlens_q) const {
  constexpr int order = DQ::IsRowMajor ? Eigen::RowMajor : Eigen::ColMajor;
  Matrix<Scalar> tq;
  detail::RowMatrix<Scalar> rq;
  const detail::PackedView<Scalar> qv = detail::packed_view(Q, tq, rq);
  const Index H = m_layout.heads, G = m_layout.kv_heads, group = H / G;
  EFFATTN_CHECK(cache.kv_heads == G, detail::cat("MultiHead: the cache has ", cache.kv_heads,
                                                 " kv heads, the layout ", G));
  const Index d = detail::head_width(qv.cols, H, "Q", "heads");
  const SeqOffsets oq = detail::resolve_offsets(cu_seqlens_q, qv.rows, "cu_seqlens_q");
  EFFATTN_CHECK(static_cast<Index>(oq.size()) - 1 == cache.batch,
                detail::cat("MultiHead: cu_seqlens_q describes ", static_cast<Index>(oq.size()) - 1,
                            " sequences, the cache ", cache.batch));
  EFFATTN_CHECK(!cache.caches.empty(), "MultiHead: the cache is empty");
  const Index dv = cache.caches.front().values.cols();
  MultiHeadResult<F, order> r;
  r.batch = cache.batch;
  r.heads = H;
  r.kv_heads = G;
  r.tasks = cache.batch * H;
  r.output.resize(qv.rows, H * dv);
  const detail::PackedView<Scalar, Scalar*> ov{
      r.output.data(), r.output.rows(), r.output.cols(),
      order == Eigen::RowMajor ? r.output.cols() : r.output.rows(), order == Eigen::RowMajor};
  detail::run_per_head<F>(qv, oq, H, d, dv, ov, r.head_results, r.info,
                          [&](Index b, Index h, const ConstRef<Scalar>& q) {
                            return m_functor.weighted_attention(q, cache.at(b, h / group));
                          });
  return r;
}

}  // namespace effattn
