// VccStack: a stack of simplified Transformer layers run with VCC (Zeng et al., NeurIPS 2023),
// keeping the hidden states of the non-VIP tokens in a VccTree across layers (the paper's Alg. 2):
// per layer only the compressed sequence [P; S_c C] (r rows) goes through the layer, and the tree
// update touches O(r) nodes; C itself is materialised only once, after the last layer.
//
// Layer (row-wise gamma, as eq. (7)-(9) of the paper with a tanh FFN):
//   A = softmax(tau (X' Wq)(X' Wk)^T + [0; log s]) (X' Wv),   U = A Wo,
//   gamma(X')_row = U_row + tanh((X'_row + U_row) W1) W2,     X'_new = X' + gamma(X'),
// with X' = [P; S_c C]. Then P <- first n_p rows, and the tree gets Y = S_c C_new (update).
//
// Sanity checks (exit code 1 on failure):
//  1. the tree-held run equals an explicit run that keeps C as a dense matrix and decompresses
//     every layer (C += S_c^dagger (Y - S_c C)), same J: max relative difference <= 1e-10;
//  2. every update touches <= 2|J| + depth nodes, i.e. O(r), not O(n);
//  3. J chosen from the tree equals J chosen from a tree rebuilt from the explicit C;
//  4. outputs are finite. The VIP-row difference to the uncompressed stack is printed.
//
// Usage: vcc_stack [n = 4096] [layers = 6]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <effattn/exact.hpp>
#include <effattn/vcc.hpp>
#include <effattn/workloads.hpp>

using namespace effattn;
using Mat = Matrix<double>;
using Clock = std::chrono::steady_clock;

namespace {

struct Layer {
  Mat Wq, Wk, Wv, Wo, W1, W2;
};

std::vector<Layer> make_layers(Index layers, Index d, std::uint64_t seed) {
  std::vector<Layer> L;
  Rng rng = make_rng(seed);
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  auto w = [&](double scale) {
    Mat m(d, d);
    fill_normal(m, rng, 0.0, scale);
    return m;
  };
  for (Index l = 0; l < layers; ++l) L.push_back({w(s), w(s), w(s), w(0.3 * s), w(s), w(0.3 * s)});
  return L;
}

// gamma of the rows of X (r x d) attending to themselves with the per-key bias b.
Mat gamma(const Layer& W, const Mat& X, const Vector<double>& bias, double tau) {
  ExactOptions o;
  o.scale = tau;
  const Mat A = ExactAttention<double>(o).compute(X * W.Wq, X * W.Wk, X * W.Wv, bias).output;
  const Mat U = A * W.Wo;
  const Mat H = ((X + U) * W.W1).array().tanh().matrix();
  return U + H * W.W2;
}

double rel(const Mat& a, const Mat& b) {
  return (a - b).norm() / std::max(1e-300, b.norm());
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const Index n = argc > 1 ? std::atol(argv[1]) : 4096;
  const Index layers = argc > 2 ? std::atol(argv[2]) : 6;
  const Index d = 32, n_p = 16;
  workloads::SmoothVipParams wp;
  wp.n = n;
  wp.d = d;
  wp.vip = n_p;
  const auto w = workloads::make_smooth_vip<double>(wp);
  const Mat X0 = w.K;  // smooth initial hidden states
  const std::vector<Index>& vip = w.vip;
  const std::vector<Index> crow = vcc::nonvip_rows(n, vip);
  const Index n_c = n - n_p;
  const double tau = 1.0 / std::sqrt(static_cast<double>(d));
  const std::vector<Layer> L = make_layers(layers, d, 7);

  VccSelectOptions so;  // the paper's two-level scheme with k = 16, h = 20
  so.select = vcc::SelectKind::TwoLevel;
  so.block_size = 16;
  so.fine_blocks = 20;
  so.scale = tau;

  Mat P(n_p, d), C(n_c, d);
  for (Index i = 0; i < n_p; ++i) P.row(i) = X0.row(vip[static_cast<std::size_t>(i)]);
  for (Index t = 0; t < n_c; ++t) C.row(t) = X0.row(crow[static_cast<std::size_t>(t)]);

  bool ok = true;
  // --- Tree-held run (Alg. 2) and, alongside, the explicit run with the same J.
  VccTreed T(C);
  Mat P_tree = P, P_ref = P, C_ref = C;
  double t_update = 0, t_explicit = 0;
  std::printf("VccStack: n = %ld, d = %ld, n_p = %ld, %ld layers, TwoLevel k = 16, h = 20\n",
              static_cast<long>(n), static_cast<long>(d), static_cast<long>(n_p),
              static_cast<long>(layers));
  std::printf("%5s %6s %6s %8s %8s %12s %12s\n", "layer", "|J|", "r", "touched", "bound",
              "update ms", "decomp ms");
  for (Index l = 0; l < layers; ++l) {
    const Layer& W = L[static_cast<std::size_t>(l)];
    // Select with the VIP queries mapped into the hidden space: tau <P Wq, c Wk> = tau <P Wq Wk^T,
    // c>.
    const Mat Psel = P_tree * W.Wq * W.Wk.transpose();
    const std::vector<VccSegment> J = T.select(Psel, so);
    const std::vector<VccSegment> J_ref =
        VccTreed(C_ref).select(P_ref * W.Wq * W.Wk.transpose(), so);
    if (!(J == J_ref)) {
      std::printf("FAIL: layer %ld: the tree-held selection differs from the explicit one\n",
                  static_cast<long>(l));
      ok = false;
    }
    const Index m = static_cast<Index>(J.size()), r = n_p + m;
    Vector<double> bias = Vector<double>::Zero(r);
    for (Index j = 0; j < m; ++j)
      bias(n_p + j) = std::log(static_cast<double>(J[static_cast<std::size_t>(j)].count));

    // Tree-held layer.
    const VccCompressed<double> Sc = T.compress(J);
    Mat Xs(r, d);
    Xs << P_tree, Sc.means;
    const Mat G = gamma(W, Xs, bias, tau);
    P_tree += G.topRows(n_p);
    const Mat Y = Sc.means + G.bottomRows(m);
    auto t0 = Clock::now();
    const VccUpdateStats st = T.update(J, Y);
    const double t_up = ms_since(t0);
    t_update += t_up;

    // Explicit layer: direct segment means of C_ref, then C_ref += S_c^dagger G.
    Mat Xr(r, d);
    Xr.topRows(n_p) = P_ref;
    for (Index j = 0; j < m; ++j) {
      const VccSegment& s = J[static_cast<std::size_t>(j)];
      Xr.row(n_p + j) = C_ref.middleRows(s.begin, s.count).colwise().mean();
    }
    const Mat Gr = gamma(W, Xr, bias, tau);
    P_ref += Gr.topRows(n_p);
    t0 = Clock::now();
    for (Index j = 0; j < m; ++j) {
      const VccSegment& s = J[static_cast<std::size_t>(j)];
      C_ref.middleRows(s.begin, s.count).rowwise() += Gr.row(n_p + j);
    }
    const double t_dec = ms_since(t0);
    t_explicit += t_dec;

    const Index bound = 2 * m + T.depth();
    std::printf("%5ld %6ld %6ld %8zu %8ld %12.3f %12.3f\n", static_cast<long>(l),
                static_cast<long>(m), static_cast<long>(r), st.touched.size(),
                static_cast<long>(bound), t_up, t_dec);
    if (static_cast<Index>(st.touched.size()) > bound) {
      std::printf("FAIL: layer %ld touched %zu nodes > 2|J| + depth = %ld\n", static_cast<long>(l),
                  st.touched.size(), static_cast<long>(bound));
      ok = false;
    }
  }
  std::printf("total: tree updates %.3f ms, explicit decompressions %.3f ms\n", t_update,
              t_explicit);
  const Mat C_tree = T.materialize();
  const double diff = std::max(rel(C_tree, C_ref), rel(P_tree, P_ref));
  std::printf(
      "tree-held vs explicit decompression: max relative difference %.2e (n_c = %ld rows "
      "never materialised between layers)\n",
      diff, static_cast<long>(n_c));
  if (!(diff <= 1e-10) || !C_tree.allFinite() || !P_tree.allFinite()) {
    std::printf("FAIL: tree-held and explicit runs differ (or are not finite)\n");
    ok = false;
  }

  // --- The uncompressed stack, for reference (informational).
  Mat X = X0;
  for (Index l = 0; l < layers; ++l)
    X += gamma(L[static_cast<std::size_t>(l)], X, Vector<double>::Zero(n), tau);
  Mat P_full(n_p, d);
  for (Index i = 0; i < n_p; ++i) P_full.row(i) = X.row(vip[static_cast<std::size_t>(i)]);
  std::printf("VIP hidden states vs the uncompressed %ld-layer stack: relative difference %.3e\n",
              static_cast<long>(layers), rel(P_tree, P_full));
  std::printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
