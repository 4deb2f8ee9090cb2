/// \file expected_skips.hpp
/// \brief The checks a test skips on purpose, as data: a table of {functor type, case, reason}.
///
/// Where a method at its defaults cannot be held to any tolerance (it is measured no better than
/// uniform attention on a workload, or it has no form for a problem), the test lists the skip in a
/// table keyed by the functor type, with the reason:
/// \code{.cpp}
/// template <typename S>
/// constexpr ExpectedSkip<MyCase> my_skips[] = {
///     expected_skip<PerformerAttention<S>>(MyCase::Causal, "no causal form"),
/// };
/// \endcode
/// A `SkipLedger` over the table reports each skip through Catch2 (`WARN` with the reason), fails
/// the test on a skip the table does not list, and fails it on an entry that no skip used, so
/// the table stays exactly the set of skips. The test cases that skip carry the tag `[skips]`.
/// `Case` is the test's own description of where a check runs (a workload, a model head); it
/// needs `==` and `<<`.
#pragma once

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include <effattn/core/concept.hpp>

#include "test_utils.hpp"

namespace effattn {
namespace testing {

/// A value standing for a type: the address of a variable-template instance, one per type.
using TypeKey = const void*;

/// \cond
template <typename T>
inline constexpr char type_key_v = 0;
/// \endcond

/// The key of type `T`.
template <typename T>
constexpr TypeKey type_key() {
  return &type_key_v<T>;
}

/// One check skipped on purpose: the functor (by type), where, and why.
template <typename Case>
struct ExpectedSkip {
  TypeKey method = nullptr;
  const char* method_name = "";  ///< functor_traits<F>::name, for messages only
  Case where{};
  const char* reason = "";
};

/// The table entry for functor `F`.
template <typename F, typename Case>
constexpr ExpectedSkip<Case> expected_skip(Case where, const char* reason) {
  return {type_key<F>(), functor_traits<F>::name, where, reason};
}

/// Reports the skips of a test against its table of expected skips.
template <typename Case>
class SkipLedger {
 public:
  /// Every entry of `table`.
  template <typename Table>
  explicit SkipLedger(const Table& table) {
    for (const ExpectedSkip<Case>& e : table) m_entries.push_back({e, 0});
  }
  /// The entries of `table` for one functor (`method`).
  template <typename Table>
  SkipLedger(const Table& table, TypeKey method) {
    for (const ExpectedSkip<Case>& e : table)
      if (e.method == method) m_entries.push_back({e, 0});
  }

  /// Records a skip without asserting: the table's reason, or nullptr when the table does not
  /// list it.
  const char* record(TypeKey method, const Case& where) {
    for (Entry& e : m_entries)
      if (e.expected.method == method && e.expected.where == where) {
        ++e.uses;
        return e.expected.reason;
      }
    return nullptr;
  }

  /// The entries no skip used so far.
  std::vector<ExpectedSkip<Case>> unused() const {
    std::vector<ExpectedSkip<Case>> out;
    for (const Entry& e : m_entries)
      if (e.uses == 0) out.push_back(e.expected);
    return out;
  }

  /// Records a skip of `where` for the functor `method` (named `name` in messages): a Catch2
  /// warning with the table's reason and `detail` (what was measured), or a failed check when
  /// the table does not list the skip.
  void skip(TypeKey method, const std::string& name, const Case& where,
            const std::string& detail = {}) {
    std::ostringstream what;
    what << name << ": " << where;
    if (!detail.empty()) what << " (" << detail << ")";
    if (const char* reason = record(method, where)) {
      WARN("SKIP " << what.str() << ": " << reason);
    } else {
      FAIL_CHECK("skipped " << what.str()
                            << " without an entry in the table of expected skips: hold it to a "
                               "tolerance, or list the skip with its reason");
    }
  }

  /// `skip` for the functor type `F`.
  template <typename F>
  void skip(const Case& where, const std::string& detail = {}) {
    skip(type_key<F>(), functor_traits<F>::name, where, detail);
  }

  /// A failed check for every entry no skip used (the table must not go stale).
  void check_all_used() const {
    for (const ExpectedSkip<Case>& e : unused())
      FAIL_CHECK("expected skip never happened: " << e.method_name << ": " << e.where << " ("
                                                  << e.reason
                                                  << "): the check runs now; remove the entry");
  }

 private:
  struct Entry {
    ExpectedSkip<Case> expected;
    int uses;
  };
  std::vector<Entry> m_entries;
};

/// True when every entry of `table` names one of the types of the list (e.g. `MethodList<S>{}`),
/// so that no entry escapes the per-functor checks of `SkipLedger::check_all_used`.
template <template <typename...> class List, typename... T, typename Table>
bool all_entries_name(List<T...>, const Table& table) {
  const TypeKey keys[] = {type_key<T>()...};
  return std::all_of(std::begin(table), std::end(table), [&](const auto& e) {
    return std::find(std::begin(keys), std::end(keys), e.method) != std::end(keys);
  });
}

}  // namespace testing
}  // namespace effattn
