// Attention as a decoder model calls it (docs/multi_head.md): a batch of two prompts
// of different lengths, 32 query heads sharing 8 key/value heads (GQA), a causal prefill, then
// token-by-token decoding against a KV cache preallocated per sequence. Checks every output
// against the per-head reference and prints the largest difference.
#include <effattn/multi_head.hpp>

#include <cstdio>
#include <vector>

int main() {
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Index H = 32, G = 8, d = 128, capacity = 1024;  // cache rows per sequence
  const std::vector<Eigen::Index> prompt = {300, 517};         // two sequences
  const Eigen::Index B = 2, T = prompt[0] + prompt[1];

  // Projections of the prompts, packed: tokens in rows, heads side by side (as x W_q, x W_k,
  // x W_v produce them). cu_seqlens: sequence b is rows [cu[b], cu[b + 1]).
  const effattn::SeqOffsets cu = {0, prompt[0], T};
  RowMat Q = RowMat::Random(T, H * d), K = RowMat::Random(T, G * d), V = RowMat::Random(T, G * d);

  effattn::ExactAttentionf::Options opts;
  opts.causal = true;  // bottom-right aligned per sequence
  const effattn::MultiHead<effattn::ExactAttentionf> attn(opts, {H, G});
  const auto prefill = attn.compute(Q, K, V, cu, cu);  // T x (H d), row-major like Q

  // The KV cache: `capacity` rows per sequence, filled with the prompt's keys and values.
  RowMat Kc = RowMat::Zero(B * capacity, G * d), Vc = RowMat::Zero(B * capacity, G * d);
  const effattn::SeqOffsets regions = {0, capacity, 2 * capacity};
  std::vector<Eigen::Index> used = prompt;
  for (Eigen::Index b = 0; b < B; ++b) {
    Kc.middleRows(regions[b], used[b]) = K.middleRows(cu[b], used[b]);
    Vc.middleRows(regions[b], used[b]) = V.middleRows(cu[b], used[b]);
  }

  // Decoding: each step projects one new token per sequence, appends its key and value to the
  // cache (a row write) and attends with seqused_k = the filled lengths.
  float worst = 0;
  for (int step = 0; step < 4; ++step) {
    const RowMat q = RowMat::Random(B, H * d), k = RowMat::Random(B, G * d),
                 v = RowMat::Random(B, G * d);
    for (Eigen::Index b = 0; b < B; ++b) {
      Kc.row(regions[b] + used[b]) = k.row(b);
      Vc.row(regions[b] + used[b]) = v.row(b);
      ++used[b];
    }
    const auto out = attn.compute(q, Kc, Vc, {0, 1, 2}, regions, used);
    if (out.info != effattn::Info::Success) return 1;
    // Check against one head at a time (what MultiHead saves you from writing).
    for (Eigen::Index b = 0; b < B; ++b)
      for (Eigen::Index h = 0; h < H; ++h) {
        const Eigen::Index g = h / (H / G);
        const Eigen::MatrixXf ref = effattn::ExactAttentionf(opts)(
            q.block(b, h * d, 1, d), Kc.block(regions[b], g * d, used[b], d),
            Vc.block(regions[b], g * d, used[b], d));
        worst = std::max(worst, (out.output.block(b, h * d, 1, d) - ref).cwiseAbs().maxCoeff());
      }
  }
  std::printf("prefill: %ld x %ld output, lse of head 5 of sequence 1 at its last token %.4f\n",
              static_cast<long>(prefill.output.rows()), static_cast<long>(prefill.output.cols()),
              static_cast<double>(prefill.head(1, 5).lse(prompt[1] - 1)));
  std::printf("decoding: 4 steps, largest difference from the per-head reference %.3g\n",
              static_cast<double>(worst));
  return worst < 1e-5f ? 0 : 1;
}
