// Torch-side helpers shared by the CPU kernels: the float32/bfloat16 dispatch and a dynamic work queue
// over torch's intra-op threads. The vector operations are in vec.h, one implementation per ISA.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "vec.h"

namespace {

template <typename F>
void dispatch(at::ScalarType t, const F& f) {
  if (t == at::kFloat) f(float{});
  else if (t == at::kBFloat16) f(bf16{});
  else TORCH_CHECK(false, "conveyor CPU kernels take float32 or bfloat16, got ", t);
}

// Runs work items 0..n-1 on torch's intra-op threads, each thread taking the next free item:
// prefill tiles and long decodes cost far more than short ones.
template <typename F>
void parallel_items(int64_t n, int64_t scratch, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> buf(scratch);
    for (int64_t i = next++; i < n; i = next++) f(i, buf.data());
  });
}

// f(std::integral_constant<int, N>{}) for N = min(n, Max), n >= 1.
template <int Max, typename F>
inline void upto(int64_t n, const F& f) {
  if constexpr (Max > 1) {
    if (n < Max) return upto<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}

}  // namespace
