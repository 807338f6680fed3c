// The machine's practical ceiling: Eigen's single-threaded GEMM, square and in the
// 64×64-tile shapes the attention kernels use. Eigen is built without OpenMP here,
// so these run on one core.
#include "bench_common.hpp"

namespace {

void BM_EigenGemm(benchmark::State& state) {
    const auto n = static_cast<memattn::Index>(state.range(0));
    memattn::bench::eigen_gemm<float>(state, n, n, n);
}
BENCHMARK(BM_EigenGemm)->ArgName("n")->Arg(64)->Arg(128)->Arg(256)->Arg(512)->Arg(1024);

// QKᵀ of one 64-query tile against 64 keys of dim d, and P·V back.
void BM_EigenTileProducts(benchmark::State& state) {
    const auto d = static_cast<memattn::Index>(state.range(0));
    memattn::bench::eigen_gemm<float>(state, 64, 64, d);
}
BENCHMARK(BM_EigenTileProducts)->ArgName("d")->Arg(64)->Arg(128);

}  // namespace

BENCHMARK_MAIN();
