/// \file deprecated.hpp
/// \brief Renamed options: how the old spelling of a renamed `Options` field keeps working for one
/// release.
///
/// A renamed field keeps its old spelling as a second member, declared last in its struct and
/// marked `[[deprecated("use <new name>")]]`, so that user code naming it is warned at compile
/// time. The library folds it into the new field once, when the options enter a functor
/// (`merge_renamed`): the old value is used when it differs from its default, setting both
/// spellings to different non-default values throws `effattn::invalid_argument`, and the stored
/// options carry the value under the new name only (the old member is reset to its default).
///
/// The struct's implicitly defined constructors and assignments copy the deprecated member, which
/// GCC and Clang would report at the struct's declaration; the struct and the function that reads
/// the old member are therefore declared between `EFFATTN_DEPRECATED_FIELDS_BEGIN` and
/// `EFFATTN_DEPRECATED_FIELDS_END`, the one place where the library silences the warning. The
/// renamed fields are listed in CHANGELOG.md.
#pragma once

#include "errors.hpp"

#if defined(__GNUC__) || defined(__clang__)
/// Opens a region in which `[[deprecated]]` members may be named without a warning (the renamed
/// options' structs and their `resolve_renamed` functions; tests of the old spellings).
#define EFFATTN_DEPRECATED_FIELDS_BEGIN \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wdeprecated-declarations\"")
/// Closes the region opened by `EFFATTN_DEPRECATED_FIELDS_BEGIN`.
#define EFFATTN_DEPRECATED_FIELDS_END _Pragma("GCC diagnostic pop")
#else
/// Opens a region in which `[[deprecated]]` members may be named without a warning (no-op on
/// this compiler).
#define EFFATTN_DEPRECATED_FIELDS_BEGIN
/// Closes the region opened by `EFFATTN_DEPRECATED_FIELDS_BEGIN` (no-op on this compiler).
#define EFFATTN_DEPRECATED_FIELDS_END
#endif

namespace effattn {
namespace detail {

/// Folds the deprecated spelling `old_value` of a renamed option into its new field `value`
/// (both with the default `def`): `value` takes `old_value` when only the old spelling was set,
/// and `old_value` is reset to `def`. `who` and the two names are for the message.
/// \throws effattn::invalid_argument when both spellings are set to different non-default values.
template <typename T>
void merge_renamed(T& value, T& old_value, const T& def, const char* who, const char* name,
                   const char* old_name) {
  if (!(old_value == def) && !(old_value == value)) {
    EFFATTN_CHECK(value == def, cat(who, ": Options::", name, " = ", value,
                                    " and its deprecated spelling Options::", old_name, " = ",
                                    old_value, " are both set and differ; set only ", name));
    value = old_value;
  }
  old_value = def;
}

}  // namespace detail
}  // namespace effattn
