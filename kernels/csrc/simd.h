// AVX-512 helpers shared by the CPU kernels: float32/bfloat16 loads and stores, rounding where torch's
// eager ops round, a vector exp, and a dynamic work queue over torch's intra-op threads.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {


using bf16 = at::BFloat16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {
  __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i&>(h));
}
// Round a float32 vector to T and back: where torch's eager bf16 ops round.
template <typename T> inline __m512 rnd(__m512 v) { return v; }
template <> inline __m512 rnd<bf16>(__m512 v) {
  __m256bh h = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(h)), 16));
}

template <typename F>
void dispatch(at::ScalarType t, const F& f) {
  if (t == at::kFloat) f(float{});
  else if (t == at::kBFloat16) f(bf16{});
  else TORCH_CHECK(false, "conveyor CPU kernels take float32 or bfloat16, got ", t);
}

// Cephes expf on 16 lanes (about 1 ulp).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365478515625f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
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

inline __m512 load_n(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_n(const bf16* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

}  // namespace
