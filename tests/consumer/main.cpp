// Consumer check: the installed headers compile, link and give exact attention that matches the
// materialised reference.
#include <effattn/effattn.hpp>
#include <effattn/workloads.hpp>

#include <cstdio>

int main() {
  const auto w = effattn::workloads::make<double>(effattn::workloads::Kind::Clustered, 300, 32, 7);
  const Eigen::MatrixXd a = effattn::ExactAttentiond()(w.Q, w.K, w.V);
  const Eigen::MatrixXd b = effattn::NaiveAttentiond()(w.Q, w.K, w.V);
  const double err = (a - b).norm() / b.norm();
  std::printf("effattn consumer: version 0x%06x, rel. error Tiled vs Naive = %.2e\n",
              EFFATTN_VERSION, err);
  return err < 1e-12 ? 0 : 1;
}
