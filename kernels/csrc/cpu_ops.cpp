// CPU kernels for the engine's hot path, compiled once per ISA (vec.h): paged attention that reads the
// block cache in place (paged_attention.h), the small-batch matmul (gemm.h), and the fused elementwise ops
// of a Llama layer. Elementwise ops round where torch's eager ops round, so float32 and bfloat16 results
// match kernels/reference.py and transformers up to summation order.
#include <sched.h>

#include "gemm.h"
#include "paged_attention.h"
#include "simd.h"

namespace {

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* w, int64_t n, int64_t h, float eps, bool add) {
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    std::vector<float> row(h);
    for (int64_t t = b; t < e; ++t) {
      T* xr = x + t * h;
      T* rr = residual + t * h;
      f32x16 ss = zero();
      for (int64_t i = 0; i < h; i += 16) {
        f32x16 v = load16(xr + i);
        if (add) {
          v = rnd<T>(v + load16(rr + i));
          store16(rr + i, v);
        }
        store16(row.data() + i, v);
        ss = fma(v, v, ss);
      }
      const f32x16 inv = set1(1.0f / std::sqrt(reduce_add(ss) / float(h) + eps));
      for (int64_t i = 0; i < h; i += 16) {
        const f32x16 normed = rnd<T>(load16(row.data() + i) * inv);
        store16(xr + i, load16(w + i) * normed);
      }
    }
  });
}

// In place: residual = x + residual (when given), x = weight * rmsnorm(residual or x).
void rms_norm_(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 16 == 0 && weight.scalar_type() == x.scalar_type(), "x");
  const int64_t h = x.size(-1), n = x.numel() / h;
  torch::Tensor r = residual.has_value() ? *residual : x;
  TORCH_CHECK(r.is_contiguous(), "residual must be contiguous");
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_rows<T>(x.data_ptr<T>(), r.data_ptr<T>(), weight.data_ptr<T>(), n, h, float(eps),
                         residual.has_value());
  });
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t n, int64_t h) {
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t i = 0; i < h; i += 16) {
        const f32x16 g = load16(gu + t * 2 * h + i);
        const f32x16 silu = rnd<T>(g / (set1(1.0f) + exp16(zero() - g)));
        store16(out + t * h + i, silu * load16(gu + t * 2 * h + h + i));
      }
  });
}

// gate_up [T, 2I] -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 32 == 0, "gate_up");
  const int64_t h = gate_up.size(-1) / 2, n = gate_up.numel() / (2 * h);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = h;
  auto out = torch::empty(sizes, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), n, h);
  });
  return out;
}

template <typename T>
void rope_rows(T* x, int64_t tok_stride, int64_t heads, int64_t d, const int64_t* pos, const float* cos,
               const float* sin, int64_t n) {
  const int64_t half = d / 2;
  for (int64_t t = 0; t < n; ++t) {
    const float* c = cos + pos[t] * d;
    const float* s = sin + pos[t] * d;
    for (int64_t hh = 0; hh < heads; ++hh) {
      T* xr = x + t * tok_stride + hh * d;
      for (int64_t i = 0; i < half; i += 16) {
        const f32x16 x1 = load16(xr + i), x2 = load16(xr + half + i);
        const f32x16 c1 = rnd<T>(load16(c + i)), s1 = rnd<T>(load16(s + i));
        const f32x16 c2 = rnd<T>(load16(c + half + i)), s2 = rnd<T>(load16(s + half + i));
        const f32x16 neg_x2 = zero() - x2;
        const f32x16 o1 = rnd<T>(x1 * c1) + rnd<T>(neg_x2 * s1);
        const f32x16 o2 = rnd<T>(x2 * c2) + rnd<T>(x1 * s2);
        store16(xr + i, o1);
        store16(xr + half + i, o2);
      }
    }
  }
}

// In place neox-style RoPE on q [T, H, D] and k [T, KVH, D] (token rows may be strided) with
// float32 tables cos/sin [P, D] as transformers builds them (already scaled).
void rotary_embedding_(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                       torch::Tensor sin) {
  TORCH_CHECK(q.size(2) % 32 == 0 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && cos.is_contiguous() && sin.is_contiguous(), "k rows");
  auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t n = q.size(0), d = q.size(2);
  at::parallel_for(0, n, 32, [&](int64_t b, int64_t e) {
    dispatch(q.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const int64_t* p = pos.data_ptr<int64_t>() + b;
      rope_rows<T>(q.data_ptr<T>() + b * q.stride(0), q.stride(0), q.size(1), d, p, cos.data_ptr<float>(),
                   sin.data_ptr<float>(), e - b);
      rope_rows<T>(k.data_ptr<T>() + b * k.stride(0), k.stride(0), k.size(1), d, p, cos.data_ptr<float>(),
                   sin.data_ptr<float>(), e - b);
    });
  });
}

// float32 -> bfloat16 with the kernels' own rounding (vec.h's store16), as torch's .to(torch.bfloat16)
// (the avx512bf16 build flushes subnormals to signed zero).
torch::Tensor to_bfloat16(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "to_bfloat16 takes float32");
  auto src = x.contiguous();
  auto out = torch::empty(src.sizes(), src.options().dtype(at::kBFloat16));
  const float* s = src.data_ptr<float>();
  bf16* d = out.data_ptr<bf16>();
  const int64_t n = src.numel();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(d + i, load16(s + i));
  if (i < n) {
    alignas(64) bf16 tail[16];
    store16(tail, load_n(s + i, n - i));
    std::copy(tail, tail + (n - i), d + i);
  }
  return out;
}

// Pins torch's intra-op thread i to cpus[i], as vLLM binds one OpenMP thread per core.
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus) {
  at::set_num_threads(int(cpus.size()));
  std::vector<int64_t> bound(cpus.size(), -1);
  at::parallel_for(0, int64_t(cpus.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(int(cpus[i]), &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) bound[at::get_thread_num()] = cpus[i];
    }
  });
  return bound;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention);
  m.def("store_kv_cache", &store_kv_cache);
  m.def("rms_norm_", &rms_norm_, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary_embedding_", &rotary_embedding_);
  m.def("bind_threads", &bind_threads);
  m.def("pack_gemm", &pack_gemm);
  m.def("gemm_packed", &gemm_packed, py::arg("x"), py::arg("wp"), py::arg("n"), py::arg("bias") = py::none());
  m.def("to_bfloat16", &to_bfloat16);
  m.attr("isa") = kIsa;  // the instruction set this module was compiled for
}
