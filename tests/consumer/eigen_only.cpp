// The compile-cost yardstick: a translation unit with only <Eigen/Dense> and one GEMM.
#include <Eigen/Dense>

#include <cstdio>

int main() {
  const Eigen::MatrixXf A = Eigen::MatrixXf::Random(256, 256),
                        B = Eigen::MatrixXf::Random(256, 256);
  const Eigen::MatrixXf C = A * B;
  std::printf("eigen-only consumer: %g\n", static_cast<double>(C.sum()));
  return 0;
}
