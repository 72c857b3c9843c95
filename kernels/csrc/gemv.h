// Skinny matmul for decode steps with few sequences: y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for up to
// 8 rows of x, w in nn.Linear's [N, K] layout. Bound by reading w once: each thread streams a contiguous
// range of w's rows, C of them at a time against every row of x held in registers; float32 accumulation,
// one rounding to T at the end, as torch's linear does.
#pragma once
#include "simd.h"

namespace {

constexpr int64_t GEMV_MAX_ROWS = 8;

template <typename T, int M, int C>
inline void gemv_cols(const T* x, int64_t K, const T* w, const T* bias, T* y, int64_t N, int64_t n, int cols) {
  __m512 acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  const T* wr[C];
  for (int c = 0; c < C; ++c) wr[c] = w + (n + std::min(c, cols - 1)) * K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[C];
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[c] + k + C * K), _MM_HINT_T0);  // the next tile's rows
      wv[c] = load16(wr[c] + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xv = load16(x + m * K + k);
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_fmadd_ps(xv, wv[c], acc[m][c]);
    }
  }
  if (k < K) {
    const __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_n(wr[c] + k, tail);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = load_n(x + m * K + k, tail);
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_fmadd_ps(xv, wv[c], acc[m][c]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < cols; ++c) {
      float v = _mm512_reduce_add_ps(acc[m][c]);
      if (bias) v += static_cast<float>(bias[n + c]);
      y[m * N + n + c] = static_cast<T>(v);
    }
}

template <typename T, int M>
void gemv_rows(const T* x, int64_t K, const T* w, const T* bias, T* y, int64_t N) {
  constexpr int C = M <= 4 ? 4 : 2;  // M x C accumulators + C weight vectors within the 32 zmm registers
  const int64_t tiles = (N + C - 1) / C;
  at::parallel_for(0, tiles, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t n = t * C;
      gemv_cols<T, M, C>(x, K, w, bias, y, N, n, static_cast<int>(std::min<int64_t>(C, N - n)));
    }
  });
}

template <typename T, int M = 1>
void gemv_dispatch(int64_t rows, const T* x, int64_t K, const T* w, const T* bias, T* y, int64_t N) {
  if constexpr (M < GEMV_MAX_ROWS) {
    if (rows != M) return gemv_dispatch<T, M + 1>(rows, x, K, w, bias, y, N);
  }
  gemv_rows<T, M>(x, K, w, bias, y, N);
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= GEMV_MAX_ROWS,
              "gemv: x must be contiguous [rows <= ", GEMV_MAX_ROWS, ", K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "gemv: w must be contiguous [N, K] of x's dtype");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == w.size(0) && bias->scalar_type() == x.scalar_type()),
              "gemv: bias must be [N] of x's dtype");
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  dispatch(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    gemv_dispatch<T>(x.size(0), x.data_ptr<T>(), x.size(1), w.data_ptr<T>(),
                     bias ? bias->data_ptr<T>() : nullptr, y.data_ptr<T>(), w.size(0));
  });
  return y;
}

}  // namespace
