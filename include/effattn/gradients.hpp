/// \file gradients.hpp
/// \brief The result type of every `backward` (exact attention, Conv-Basis, Performer, EVA) and the
/// argument checks they share.
///
/// A `backward(Q, K, V, result, dO)` returns the gradients of a scalar loss L with respect to the
/// inputs of the forward call that produced `result`, given dO = dL/dO (n x dv, the gradient
/// with respect to the output): dQ (n x d), dK (m x d), dV (m x dv), and, for the overloads that
/// take a key bias b, dbias = dL/db (m values). For softmax attention O = P V,
/// P = row_softmax(s Q K^T + 1 b^T) (masked), with D_i = sum_c dO_ic O_ic:
/// \f[ dV = P^T dO,\quad dS = P \circ (dO\,V^T - D\,1^T),\quad dQ = s\, dS\, K,\quad
///     dK = s\, dS^T Q,\quad db = dS^T 1. \f]
#pragma once

#include "core/checks.hpp"
#include "core/errors.hpp"
#include "core/types.hpp"

namespace effattn {

/// Gradients returned by `backward` (see the file documentation).
template <typename Scalar>
struct AttentionGradients {
  Matrix<Scalar> dQ;     ///< n x d, dL/dQ
  Matrix<Scalar> dK;     ///< m x d, dL/dK
  Matrix<Scalar> dV;     ///< m x dv, dL/dV
  Vector<Scalar> dbias;  ///< m values dL/db when a key bias was passed; empty otherwise
};

namespace detail {

/// Checks the arguments a `backward` shares with every method: the forward result must be a
/// successful result of inputs with n rows and dv value columns (`output` n x dv), and dO must be
/// n x dv and finite. `method` names the caller in the message. O(n dv).
/// \throws effattn::invalid_argument naming `result` or `dO`.
template <typename Scalar>
void check_backward_args(const char* method, Index n, Index dv, const Matrix<Scalar>& output,
                         Info info, const ConstRef<Scalar>& dO) {
  EFFATTN_CHECK(info == Info::Success,
                cat(method, ": backward needs the result of a successful forward call; got info ",
                    static_cast<int>(info)));
  EFFATTN_CHECK(output.rows() == n && output.cols() == dv,
                cat(method, ": result.output must be n x dv = ", n, " x ", dv,
                    " (the forward result of these Q, K, V); got ", shape(output)));
  EFFATTN_CHECK(dO.rows() == n && dO.cols() == dv,
                cat(method, ": dO must be n x dv = ", n, " x ", dv,
                    " (the shape of the output); got ", shape(dO)));
  check_finite(dO, "dO");
}

}  // namespace detail
}  // namespace effattn
