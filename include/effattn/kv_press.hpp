/// \file kv_press.hpp
/// \brief KV-cache presses: compress a prompt's keys and values to a budget of rows, as a
/// `CompressedKV` that `weighted_attention` and the multi-head decoding path consume.
///
/// A press turns the m prompt rows of one key/value head (K m x d, V m x dv) into r <= budget
/// rows. Every press produces the same `CompressedKV<Scalar>` (rows with keys, values, weights and
/// log-scales, see wildcat.hpp), so the same decoding code runs each of them:
///
/// | name        | rows kept | scored by |
/// |---|---|---|
/// | `drop`      | none (the prompt removed) | nothing: the no-context baseline |
/// | `streaming` | the first `sinks` rows and the most recent rows (StreamingLLM, Xiao et al. 2024)
/// | position | | `uniform`   | a uniformly random subset (seeded) | nothing | | `knorm`     | the
/// keys of smallest L2 norm (Devoto et al. 2024; kvpress's KnormPress) | ||k|| | | `snapkv`    |
/// the keys most attended by the last `observation` queries, scores average-pooled over `pool`
/// positions; the observation rows always kept (Li et al. 2024) | attention of the window | |
/// `observed`  | the keys with the largest attention received, averaged over the queries that see
/// them (H2O's accumulated attention, Zhang et al. 2023, normalised as kvpress's
/// ObservedAttentionPress) | attention of every given query | | `wildcat`   | an RPNys coreset with
/// Nystrom weights (`compress_kv`, Schroeder & Mackey) | RP-Cholesky on the key kernel | | `vcc` |
/// a VIP-guided TwoLevel partition of the prompt, one mean key / value per segment with log-scale
/// log(count) (Zeng et al. 2023) | attention of the given queries |
///
/// The selection presses keep rows exactly (weight 1, log-scale 0), in prompt order; `wildcat` and
/// `vcc` rows stand for several keys. A budget at least the prompt length keeps every row as it
/// is, whatever the press (`drop` included): with nothing to save there is nothing to compress.
/// Below that, `drop` keeps no row, the selection presses exactly `budget` rows, `wildcat` at most
/// `budget` (RP-Cholesky stops early on round-off exhaustion) and `vcc` at most `budget` (the
/// TwoLevel partition fills the budget with whole fine blocks).
///
/// The error bound that `weighted_attention` reports for a pressed cache is certified only for
/// `wildcat`; the other presses' rows carry no certificate, so the bound is the clip bound (the
/// range of the values).
///
/// Cost: streaming / uniform O(r (d + dv)); knorm O(m d + m log m); snapkv O(w m d) for w
/// observation queries; observed O(n_q m d) (n_q given queries, in tiles of 128: nothing n_q x m);
/// wildcat O(m r^2 + m r (d + dv)); vcc O(m d + n_q (m / k) d).
///
/// \par Example
/// \code{.cpp}
/// effattn::KvPressOptions o;
/// o.press = effattn::kv_press::Kind::SnapKv;
/// o.keep = 0.1;                                   // 10% of the prompt's rows
/// auto cache = effattn::KvPress<float>(o).compress(K, V, Q_last);
/// auto out = effattn::weighted_attention(Q_new, cache);  // or append() while decoding
/// \endcode
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "vcc_tree.hpp"
#include "wildcat.hpp"

namespace effattn {

namespace kv_press {

/// The presses (see the file's table).
enum class Kind {
  Drop,       ///< "drop": the prompt removed
  Streaming,  ///< "streaming": attention sinks and the most recent rows
  Uniform,    ///< "uniform": a seeded uniform subset
  Knorm,      ///< "knorm": the keys of smallest norm
  SnapKv,     ///< "snapkv": the keys the observation window attends to most (pooled)
  Observed,   ///< "observed": the keys with the largest mean attention received (H2O)
  Wildcat,    ///< "wildcat": the RPNys coreset with Nystrom weights (`compress_kv`)
  Vcc         ///< "vcc": VIP-guided TwoLevel segments, one mean row each
};

/// Every press, in table order.
inline std::vector<Kind> all() {
  return {Kind::Drop,   Kind::Streaming, Kind::Uniform, Kind::Knorm,
          Kind::SnapKv, Kind::Observed,  Kind::Wildcat, Kind::Vcc};
}

/// The press's name: "drop", "streaming", "uniform", "knorm", "snapkv", "observed", "wildcat",
/// "vcc".
inline const char* name(Kind k);

/// The press called `name`.
/// \throws effattn::invalid_argument on an unknown name (the message lists the names).
inline Kind from_name(const std::string& name);

/// True for the presses that read the queries passed to `compress` (snapkv, observed, vcc; and
/// wildcat, which takes its query radius from them).
inline bool uses_queries(Kind k) {
  return k == Kind::SnapKv || k == Kind::Observed || k == Kind::Vcc || k == Kind::Wildcat;
}

}  // namespace kv_press

/// Options of `KvPress`.
struct KvPressOptions {
  /// The press.
  kv_press::Kind press = kv_press::Kind::Streaming;
  /// Budget as a keep ratio of the prompt, in (0, 1]: round(keep m) rows, at least 1. Used when
  /// `rows` is 0.
  double keep = 0;
  /// Budget in rows (>= 1); 0 = use `keep`. One of the two must be set.
  Index rows = 0;
  /// streaming: the first rows kept (attention sinks); the rest of the budget is the most recent
  /// rows. Capped at the budget.
  Index sinks = 4;
  /// snapkv: the observation window, the last queries of each head block of Q whose attention
  /// ranks the keys (and whose own key rows, the last `observation` rows of the prompt, are always
  /// kept). Capped at the queries given.
  Index observation = 64;
  /// snapkv: the window of the average pooling of the scores along positions (odd, >= 1; 1 = no
  /// pooling).
  Index pool = 5;
  /// snapkv, observed: query j of a head block of w queries sits at prompt position m - w + j and
  /// sees keys 0 .. m - w + j only (a causal prompt). false: every query sees every key.
  bool causal = true;
  /// Query heads stacked in Q (rows [h w, (h + 1) w) are head h's w queries): a key/value head
  /// shared by a group of query heads (GQA) is scored by all of them (scores summed).
  Index query_heads = 1;
  /// Logit scale of the scoring attention (snapkv, observed, vcc, wildcat); 0 = 1/sqrt(d). Must
  /// match the scale of the attention that reads the cache (wildcat).
  double scale = 0;
  /// uniform: the subset; wildcat: the pivots.
  std::uint64_t seed = 0x5eedULL;
  /// wildcat: R_Q of eq. (12); 0 = the largest norm of the given queries (the keys' radius R_K
  /// when none are given).
  double q_radius = 0;
  /// vcc: the TwoLevel block size k (a power of two); 0 = the k whose partition uses the most of
  /// the budget (ceil(m / k) blocks, the queries' favourite blocks refined to single rows).
  Index block_size = 0;
};

/// \ingroup Methods
/// \brief A KV-cache press: `compress(K, V, Q)` returns the prompt's cache at the budget.
///
/// Deterministic: the same inputs, options and seed give bit-identical caches, whatever the
/// thread count.
///
/// \tparam Scalar_ float or double.
template <typename Scalar_>
class KvPress {
  static_assert(detail::is_supported_scalar_v<Scalar_>, "effattn: Scalar must be float or double");

 public:
  using Scalar = Scalar_;              ///< float or double
  using Options = KvPressOptions;      ///< the options struct
  using Ref = ConstRef<Scalar>;        ///< the input type
  using Cache = CompressedKV<Scalar>;  ///< what a press returns

  /// \throws effattn::invalid_argument on keep outside (0, 1] with rows = 0, rows < 0, sinks < 0,
  ///         observation < 1, an even or non-positive pool, query_heads < 1, a negative or
  ///         non-finite scale / q_radius, a block_size that is not 0 or a power of two, or an
  ///         invalid press.
  explicit KvPress(Options opts = {});

  /// The budget in rows for a prompt of m rows (min(m, rows) or clamp(round(keep m), 1, m)).
  Index budget(Index m) const;

  /// The prompt queries per head this press reads from a prompt of m rows (the last ones): all
  /// m for observed and wildcat (its query radius), `observation` for snapkv and vcc, none for
  /// the others. What a caller passes as each head block of Q.
  Index queries_read(Index m) const {
    const kv_press::Kind k = m_opts.press;
    if (k == kv_press::Kind::Observed || k == kv_press::Kind::Wildcat) return m;
    return kv_press::uses_queries(k) ? std::min(m_opts.observation, m) : Index(0);
  }

  /// Compresses the prompt K (m x d), V (m x dv). Q (query_heads w x d, may be empty) holds the
  /// queries the query-guided presses read (see `KvPressOptions::query_heads`, `causal`):
  /// snapkv and observed need at least one query row per head; vcc without queries partitions
  /// the prompt uniformly; wildcat takes its query radius from them.
  /// \throws effattn::invalid_argument on empty, mismatched or non-finite inputs, Q with a column
  ///         count other than d or a row count not a multiple of query_heads (or more queries per
  ///         head than m with causal), or a query-guided press without the queries it needs.
  /// \throws effattn::numerical_error if wildcat's compression breaks down.
  [[nodiscard]] Cache compress(const Ref& K, const Ref& V, const Ref& Q) const;
  /// `compress(K, V, Q)` without queries.
  [[nodiscard]] Cache compress(const Ref& K, const Ref& V) const {
    return compress(K, V, Matrix<Scalar>(0, K.cols()));
  }

  /// The prompt rows (positions) a selection press keeps, ascending; the row positions behind a
  /// wildcat or vcc cache's rows are its `pivots`.
  /// \throws as `compress`.
  std::vector<Index> select(const Ref& K, const Ref& Q) const;

  /// The options this press was built with.
  const Options& options() const noexcept { return m_opts; }

 private:
  Options m_opts;
};

/// A press over float.
using KvPressf = KvPress<float>;
/// A press over double.
using KvPressd = KvPress<double>;

}  // namespace effattn

#include "detail/methods/kv_press_impl.hpp"
