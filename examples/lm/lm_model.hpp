// effattn-lm's model: the weight loader and the float forward pass of the two byte-level
// transformers of examples/lm/FORMAT.md (a causal decoder and a bidirectional encoder), with the
// attention of every layer delegated to a caller-supplied function (exact, or any effattn
// method). Used by effattn-lm, by the `lm:` workloads of effattn-compare and the benchmarks, and
// by tests/test_lm.cpp. Independent of the trainer: both follow FORMAT.md.
#pragma once

#include <Eigen/Dense>
#include <unsupported/Eigen/SpecialFunctions>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace effattn {
namespace lm {

using Index = Eigen::Index;
using Mat = Eigen::MatrixXf;  ///< activations: tokens in rows, column-major
using Vec = Eigen::VectorXf;

/// A model error: bad file, bad tokens, bad options. The message says what and where.
struct lm_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Kind { Decoder = 0, Encoder = 1 };

/// The header of a weight file (FORMAT.md).
struct Config {
  Kind kind = Kind::Decoder;
  Index vocab = 0, d_model = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, d_ff = 0;
  Index context = 0;    ///< training context length
  int mask_token = -1;  ///< MASK (encoder), -1 for none
  float rope_base = 10000, norm_eps = 1e-5f;
  bool causal() const { return kind == Kind::Decoder; }
  const char* name() const { return kind == Kind::Decoder ? "decoder" : "encoder"; }
};

/// One layer; projection matrices stored transposed (in x out), so y = x W.
struct Layer {
  Vec attn_norm, mlp_norm;
  Mat wq, wk, wv;  ///< D x H hd, D x G hd, D x G hd
  Mat wo;          ///< H hd x D
  Mat w1, w2;      ///< D x F, F x D
};

struct Model {
  Config cfg;
  Mat embed_t;  ///< D x vocab: column t is the embedding of token t (and the output head)
  std::vector<Layer> layers;
  Vec final_norm;
};

namespace detail {

/// IEEE binary16 -> float (subnormals, infinities and NaN included).
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: man * 2^-24
      const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline std::uint64_t fnv1a(const unsigned char* p, std::size_t n,
                           std::uint64_t h = 0xcbf29ce484222325ull) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

/// Bounds-checked little-endian reader over a file's bytes.
struct Reader {
  const std::vector<unsigned char>& buf;
  std::size_t pos = 0;
  std::string file;
  void need(std::size_t n, const char* what) {
    if (pos > buf.size() || buf.size() - pos < n)
      throw lm_error("effattn-lm: " + file + " is truncated (" + std::to_string(buf.size()) +
                     " bytes; reading " + what + " at byte " + std::to_string(pos) + ")");
  }
  std::uint32_t u32(const char* what) {
    need(4, what);
    std::uint32_t v = 0;
    for (std::size_t i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(buf[pos + i]) << (8 * i);
    pos += 4;
    return v;
  }
  float f32(const char* what) {
    const std::uint32_t b = u32(what);
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
};

inline std::vector<unsigned char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw lm_error("effattn-lm: cannot open " + path);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(in), {});
}

/// The bytes of `path`, whose first 8 bytes must be `magic` (else "is not <what>").
inline std::vector<unsigned char> read_with_magic(const std::string& path, const char* magic,
                                                  const std::string& what) {
  std::vector<unsigned char> buf = read_file(path);
  Reader{buf, 0, path}.need(8, "the magic");
  if (std::memcmp(buf.data(), magic, 8) != 0)
    throw lm_error("effattn-lm: " + path + " is not " + what);
  return buf;
}

}  // namespace detail

/// Loads a FORMAT.md weight file. Checks the magic, version, header values, every tensor's name
/// and shape, the FNV-1a checksum and the end marker.
/// \throws lm_error naming the file and the problem (truncated, corrupted, wrong tensor, ...).
inline Model load_model(const std::string& path) {
  const std::vector<unsigned char> buf =
      detail::read_with_magic(path, "EFLMWTS1", "an effattn-lm weight file (bad magic)");
  detail::Reader r{buf, 8, path};
  // The checksum first: a corrupted file should say so, not fail on a garbled header.
  if (buf.size() < 8 + 16) throw lm_error("effattn-lm: " + path + " is truncated");
  if (std::memcmp(buf.data() + buf.size() - 8, "EFLMEND\0", 8) != 0)
    throw lm_error("effattn-lm: " + path + " is truncated (no end marker)");
  std::uint64_t stored = 0;
  for (int i = 0; i < 8; ++i)
    stored |= static_cast<std::uint64_t>(buf[buf.size() - 16 + static_cast<std::size_t>(i)])
              << (8 * i);
  if (detail::fnv1a(buf.data(), buf.size() - 16) != stored)
    throw lm_error("effattn-lm: " + path + " is corrupted (checksum mismatch)");

  Model m;
  Config& c = m.cfg;
  if (r.u32("version") != 1) throw lm_error("effattn-lm: " + path + ": unsupported version");
  const std::uint32_t kind = r.u32("kind");
  if (kind > 1) throw lm_error("effattn-lm: " + path + ": unknown model kind");
  c.kind = static_cast<Kind>(kind);
  c.vocab = r.u32("vocab");
  c.d_model = r.u32("d_model");
  c.layers = r.u32("layers");
  c.heads = r.u32("heads");
  c.kv_heads = r.u32("kv_heads");
  c.head_dim = r.u32("head_dim");
  c.d_ff = r.u32("d_ff");
  c.context = r.u32("context");
  const std::uint32_t mask = r.u32("mask_token");
  c.mask_token = mask == 0xFFFFFFFFu ? -1 : static_cast<int>(mask);
  c.rope_base = r.f32("rope_base");
  c.norm_eps = r.f32("norm_eps");
  if (r.u32("dtype") != 1) throw lm_error("effattn-lm: " + path + ": unsupported dtype");
  const auto bad = [&](const std::string& what) {
    return lm_error("effattn-lm: " + path + ": " + what);
  };
  if (c.vocab < 256 || c.vocab > 512 || c.d_model < 1 || c.layers < 1 || c.heads < 1 ||
      c.kv_heads < 1 || c.heads % c.kv_heads != 0 || c.head_dim < 2 || c.head_dim % 2 != 0 ||
      c.d_ff < 1 || c.context < 1 || c.d_model > 65536 || c.d_ff > 1 << 20 || c.layers > 1024)
    throw bad("implausible header values");
  if ((c.kind == Kind::Encoder) != (c.mask_token >= 0) ||
      (c.mask_token >= 0 && c.mask_token >= c.vocab))
    throw bad("mask token does not fit the model kind");
  const std::uint32_t n_tensors = r.u32("n_tensors");
  if (n_tensors != static_cast<std::uint32_t>(2 + 8 * c.layers))
    throw bad("expected " + std::to_string(2 + 8 * c.layers) + " tensors, the header says " +
              std::to_string(n_tensors));

  // Reads the next tensor, checks its name and shape, returns it transposed (cols x rows,
  // column-major): torch's row-major (out x in) becomes (in x out).
  const auto tensor = [&](const std::string& name, Index rows, Index cols) {
    const std::uint32_t len = r.u32("a tensor name length");
    if (len > 256) throw bad("bad tensor name length before '" + name + "'");
    r.need(len, "a tensor name");
    const std::string got(reinterpret_cast<const char*>(buf.data() + r.pos), len);
    r.pos += len;
    if (got != name) throw bad("expected tensor '" + name + "', found '" + got + "'");
    const Index gr = r.u32("a tensor shape"), gc = r.u32("a tensor shape");
    if (gr != rows || gc != cols)
      throw bad("tensor '" + name + "' is " + std::to_string(gr) + " x " + std::to_string(gc) +
                ", expected " + std::to_string(rows) + " x " + std::to_string(cols));
    const std::size_t n = static_cast<std::size_t>(rows * cols);
    r.need(2 * n, name.c_str());
    Mat t(cols, rows);
    float* out = t.data();
    const unsigned char* p = buf.data() + r.pos;
    for (std::size_t i = 0; i < n; ++i)
      out[i] = detail::half_to_float(static_cast<std::uint16_t>(p[2 * i] | (p[2 * i + 1] << 8)));
    r.pos += 2 * n;
    if (!t.allFinite()) throw bad("tensor '" + name + "' has non-finite values");
    return t;
  };
  const Index D = c.d_model, H = c.heads, G = c.kv_heads, hd = c.head_dim, F = c.d_ff;
  m.embed_t = tensor("embed", c.vocab, D);
  m.layers.resize(static_cast<std::size_t>(c.layers));
  for (Index l = 0; l < c.layers; ++l) {
    Layer& L = m.layers[static_cast<std::size_t>(l)];
    const std::string p = "layers." + std::to_string(l) + ".";
    L.attn_norm = tensor(p + "attn_norm", 1, D);
    L.wq = tensor(p + "wq", H * hd, D);
    L.wk = tensor(p + "wk", G * hd, D);
    L.wv = tensor(p + "wv", G * hd, D);
    L.wo = tensor(p + "wo", D, H * hd);
    L.mlp_norm = tensor(p + "mlp_norm", 1, D);
    L.w1 = tensor(p + "w1", F, D);
    L.w2 = tensor(p + "w2", D, F);
  }
  m.final_norm = tensor("final_norm", 1, D);
  if (r.pos != buf.size() - 16) throw bad("trailing bytes after the last tensor");
  return m;
}

/// Loads a logit fixture (FORMAT.md): tokens and the torch logits (T x vocab).
struct Fixture {
  std::vector<int> tokens;
  Mat logits;
};
inline Fixture load_fixture(const std::string& path) {
  const std::vector<unsigned char> buf =
      detail::read_with_magic(path, "EFLMFIX1", "a logit fixture");
  detail::Reader r{buf, 8, path};
  const Index T = r.u32("n_tokens"), V = r.u32("vocab");
  if (T < 1 || T > 1 << 20 || V < 1 || V > 1024) throw lm_error("effattn-lm: bad fixture header");
  Fixture f;
  for (Index t = 0; t < T; ++t) f.tokens.push_back(static_cast<int>(r.u32("tokens")));
  f.logits.resize(T, V);
  for (Index t = 0; t < T; ++t)
    for (Index v = 0; v < V; ++v) f.logits(t, v) = r.f32("logits");
  return f;
}

/// The packed projections of one layer and the attention output a method must produce.
/// q: T x (H hd), k and v: T x (G hd), rotary applied to q and k; head layout as MultiHead's.
using AttentionFn = std::function<Mat(Index layer, const Mat& q, const Mat& k, const Mat& v)>;

/// Rotary tables: cos / sin of t * base^(-2i/hd), T x hd/2, angles in double (FORMAT.md).
struct Rope {
  Mat cos, sin;
  void build(Index T, Index hd, double base) {
    if (cos.rows() >= T && cos.cols() == hd / 2) return;
    cos.resize(T, hd / 2);
    sin.resize(T, hd / 2);
    for (Index i = 0; i < hd / 2; ++i) {
      const double inv = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
      for (Index t = 0; t < T; ++t) {
        const double a = static_cast<double>(t) * inv;
        cos(t, i) = static_cast<float>(std::cos(a));
        sin(t, i) = static_cast<float>(std::sin(a));
      }
    }
  }
  /// Rotates every head of x (rows = positions first..first+rows) in place.
  void apply(Mat& x, Index heads, Index hd, Index first = 0) const {
    const Index T = x.rows();
    rotate(x, heads, hd, [&](Index i) {
      return std::make_pair(cos.col(i).segment(first, T).array(),
                            sin.col(i).segment(first, T).array());
    });
  }
  /// Rotates every head of every row of x, all at position `pos` (decoding: one new token per
  /// sequence), in place.
  void apply_at(Mat& x, Index heads, Index hd, Index pos) const {
    rotate(x, heads, hd, [&](Index i) { return std::make_pair(cos(pos, i), sin(pos, i)); });
  }

 private:
  /// The pair rotation of every head; cs(i) gives pair i's cosine and sine (per row or one value).
  template <typename CosSin>
  static void rotate(Mat& x, Index heads, Index hd, CosSin&& cs) {
    const Index h2 = hd / 2;
    for (Index h = 0; h < heads; ++h)
      for (Index i = 0; i < h2; ++i) {
        auto a = x.col(h * hd + i).array();
        auto b = x.col(h * hd + i + h2).array();
        const auto [c, s] = cs(i);
        const Eigen::ArrayXf a0 = a;
        a = a0 * c - b * s;
        b = a0 * s + b * c;
      }
  }
};

/// x / sqrt(mean(x^2) + eps) * g, row-wise.
inline Mat rmsnorm(const Mat& x, const Vec& g, float eps) {
  const Eigen::ArrayXf inv =
      ((x.array().square().rowwise().sum() / static_cast<float>(x.cols())) + eps).rsqrt();
  return ((x.array().colwise() * inv).rowwise() * g.transpose().array()).matrix();
}

/// gelu(u) = u/2 (1 + erf(u / sqrt 2)), in place (Eigen's vectorised erf).
inline void gelu_inplace(Mat& u) {
  u.array() = 0.5f * u.array() * (1.0f + (u.array() * 0.70710678118654752f).erf());
}

/// Timings of a forward pass.
struct ForwardTimes {
  double attention = 0;  ///< seconds inside the attention function
  double total = 0;      ///< seconds of the whole forward pass
};

/// Forward pass of one window of tokens (positions first..first+T-1): logits T x vocab. `attn`
/// computes every layer's attention (see AttentionFn; with first > 0 it supplies the earlier
/// positions' keys and values itself, as a KV cache does).
inline Mat forward(const Model& m, const std::vector<int>& tokens, const AttentionFn& attn,
                   ForwardTimes* times = nullptr, Index first = 0) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const Config& c = m.cfg;
  const Index T = static_cast<Index>(tokens.size());
  if (T < 1) throw lm_error("effattn-lm: empty token sequence");
  Mat x(T, c.d_model);
  for (Index t = 0; t < T; ++t) {
    const int tok = tokens[static_cast<std::size_t>(t)];
    if (tok < 0 || tok >= c.vocab)
      throw lm_error("effattn-lm: token " + std::to_string(tok) + " outside the vocabulary");
    x.row(t) = m.embed_t.col(tok).transpose();
  }
  Rope rope;
  rope.build(first + T, c.head_dim, c.rope_base);
  double attn_s = 0;
  for (Index l = 0; l < c.layers; ++l) {
    const Layer& L = m.layers[static_cast<std::size_t>(l)];
    Mat h = rmsnorm(x, L.attn_norm, c.norm_eps);
    Mat q = h * L.wq, k = h * L.wk, v = h * L.wv;
    rope.apply(q, c.heads, c.head_dim, first);
    rope.apply(k, c.kv_heads, c.head_dim, first);
    const auto a0 = clock::now();
    const Mat a = attn(l, q, k, v);
    attn_s += std::chrono::duration<double>(clock::now() - a0).count();
    if (a.rows() != T || a.cols() != c.heads * c.head_dim)
      throw lm_error("effattn-lm: the attention function returned a wrongly shaped output");
    x.noalias() += a * L.wo;
    h = rmsnorm(x, L.mlp_norm, c.norm_eps);
    Mat u = h * L.w1;
    gelu_inplace(u);
    x.noalias() += u * L.w2;
  }
  Mat logits = rmsnorm(x, m.final_norm, c.norm_eps) * m.embed_t;
  if (times) {
    times->attention += attn_s;
    times->total += std::chrono::duration<double>(clock::now() - t0).count();
  }
  return logits;
}

/// -log2 softmax(logits_row)[target], in double.
inline double bits_of(const Eigen::Ref<const Eigen::RowVectorXf>& logits, int target) {
  const double mx = static_cast<double>(logits.maxCoeff());
  double s = 0;
  for (Index j = 0; j < logits.size(); ++j) s += std::exp(static_cast<double>(logits(j)) - mx);
  return (std::log(s) + mx - static_cast<double>(logits(target))) / std::log(2.0);
}

/// splitmix64 (FORMAT.md's mask hash).
inline std::uint64_t splitmix64(std::uint64_t x) {
  std::uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Encoder evaluation mask of window w (FORMAT.md): position t is masked iff
/// splitmix64(w 2^32 + t) % 1000 < 150.
inline std::vector<Index> masked_positions(Index window, Index T) {
  std::vector<Index> p;
  for (Index t = 0; t < T; ++t)
    if (splitmix64((static_cast<std::uint64_t>(window) << 32) + static_cast<std::uint64_t>(t)) %
            1000 <
        150)
      p.push_back(t);
  return p;
}

/// The held-out text as tokens (bytes).
inline std::vector<int> read_text(const std::string& path) {
  const std::vector<unsigned char> b = detail::read_file(path);
  return std::vector<int>(b.begin(), b.end());
}

/// Default locations, relative to the source tree (EFFATTN_LM_DIR set by CMake) or overridden by
/// the environment variable EFFATTN_LM_DIR.
inline std::string lm_dir() {
  if (const char* e = std::getenv("EFFATTN_LM_DIR")) return e;
#ifdef EFFATTN_LM_DIR
  return EFFATTN_LM_DIR;
#else
  return "examples/lm";
#endif
}
inline std::string weights_path(const std::string& model) {
  return lm_dir() + "/weights/" + model + ".eflm";
}
inline std::string heldout_path() {
  return lm_dir() + "/data/heldout.txt";
}

}  // namespace lm
}  // namespace effattn
