// Real attention as a workload: the Q, K, V of one head of one layer of a trained model
// (examples/lm) on held-out text, computed by running the model with exact attention. The spec
// string is `lm:MODEL:LAYER:HEAD` (e.g. `lm:decoder:1:0`); MODEL is decoder or encoder, HEAD a
// query head (its key/value head under GQA). Used by effattn-compare (`--workload`), by the
// benchmarks (EFFATTN_BENCH_WORKLOAD) and by tests/test_lm.cpp.
#pragma once

#include <effattn/multi_head.hpp>

#include "lm_model.hpp"

#include <map>
#include <memory>
#include <sstream>

namespace effattn {
namespace lm {

struct WorkloadSpec {
  std::string model;  ///< decoder | encoder
  Index layer = 0, head = 0;
};

/// True if `s` starts with "lm:"; parses it into `out` (throws lm_error on a malformed spec).
inline bool parse_workload(const std::string& s, WorkloadSpec& out) {
  if (s.rfind("lm:", 0) != 0) return false;
  std::stringstream ss(s.substr(3));
  std::string model, layer, head;
  if (!std::getline(ss, model, ':') || !std::getline(ss, layer, ':') ||
      !std::getline(ss, head, ':') || (model != "decoder" && model != "encoder"))
    throw lm_error("effattn: a real-model workload is lm:decoder|encoder:LAYER:HEAD, got '" + s +
                   "'");
  char* e1 = nullptr;
  char* e2 = nullptr;
  out.model = model;
  out.layer = std::strtol(layer.c_str(), &e1, 10);
  out.head = std::strtol(head.c_str(), &e2, 10);
  if (layer.empty() || head.empty() || *e1 || *e2)
    throw lm_error("effattn: bad layer or head in '" + s + "'");
  return true;
}

/// The workload's matrices (n x head_dim each) and the model's mask.
template <typename Scalar>
struct RealHead {
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> Q, K, V;
  bool causal = false;  ///< the decoder's heads are causal
};

/// Runs `spec.model` on the first n bytes of held-out window `window` (the encoder with that
/// window's evaluation mask) and returns layer `spec.layer`'s rotated q, k, v of query head
/// `spec.head`. Models are loaded once per process.
template <typename Scalar>
RealHead<Scalar> real_head(const WorkloadSpec& spec, Index n, Index window = 0) {
  static std::map<std::string, std::shared_ptr<const Model>> models;
  auto& slot = models[spec.model];
  if (!slot) slot = std::make_shared<const Model>(load_model(weights_path(spec.model)));
  const Model& m = *slot;
  const Config& c = m.cfg;
  if (spec.layer < 0 || spec.layer >= c.layers || spec.head < 0 || spec.head >= c.heads)
    throw lm_error("effattn: the " + std::string(c.name()) + " has " + std::to_string(c.layers) +
                   " layers and " + std::to_string(c.heads) + " heads");
  static const std::vector<int> text = read_text(heldout_path());
  if (n < 1 || window < 0 || (window + 1) * n > static_cast<Index>(text.size()))
    throw lm_error("effattn: the held-out text has " + std::to_string(text.size()) +
                   " bytes, too few for window " + std::to_string(window) + " of " +
                   std::to_string(n));
  std::vector<int> tok(text.begin() + window * n, text.begin() + (window + 1) * n);
  if (c.kind == Kind::Encoder)
    for (const Index t : masked_positions(window, n))
      tok[static_cast<std::size_t>(t)] = c.mask_token;
  ExactOptions eo;
  eo.causal = c.causal();
  const MultiHead<ExactAttentionf> exact(eo, {c.heads, c.kv_heads});
  RealHead<Scalar> out;
  out.causal = c.causal();
  const Index hd = c.head_dim, g = spec.head / (c.heads / c.kv_heads);
  (void)forward(m, tok, [&](Index l, const Mat& q, const Mat& k, const Mat& v) {
    if (l == spec.layer) {
      out.Q = q.middleCols(spec.head * hd, hd).cast<Scalar>();
      out.K = k.middleCols(g * hd, hd).cast<Scalar>();
      out.V = v.middleCols(g * hd, hd).cast<Scalar>();
    }
    return Mat(exact.compute(q, k, v).output);
  });
  return out;
}

}  // namespace lm
}  // namespace effattn
