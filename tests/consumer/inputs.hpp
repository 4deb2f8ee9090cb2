// The consumer programs' inputs: Q, K, V (n x d, float) filled with smooth deterministic values,
// so every build of the consumer sees the same problem.
#pragma once

#include <Eigen/Core>
#include <cmath>

struct ConsumerInputs {
  Eigen::MatrixXf Q, K, V;
};

inline ConsumerInputs consumer_inputs(Eigen::Index n, Eigen::Index d) {
  ConsumerInputs in{Eigen::MatrixXf(n, d), Eigen::MatrixXf(n, d), Eigen::MatrixXf(n, d)};
  for (Eigen::Index j = 0; j < d; ++j)
    for (Eigen::Index i = 0; i < n; ++i) {
      const float t = static_cast<float>(i) / static_cast<float>(n);
      in.Q(i, j) = std::sin(3.0f * t * static_cast<float>(j + 1));
      in.K(i, j) = std::cos(2.0f * t * static_cast<float>(j + 2));
      in.V(i, j) = std::sin(5.0f * t + static_cast<float>(j));
    }
  return in;
}
