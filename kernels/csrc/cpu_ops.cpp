// CPU kernels for the engine's hot path (AVX-512): paged attention that reads the block cache in
// place (decode and prefill in one call, GQA without expanding K/V), the KV store, and the fused
// elementwise ops of a Llama layer. Elementwise ops round where torch's eager ops round, so float32
// and bfloat16 results match kernels/reference.py and transformers up to summation order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
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

struct WorkItem {
  int32_t seq, kv_head, q_begin, q_end;
};

// The CPU backend's own block layout, written only by store_kv_cache and read only by
// paged_attention, inside the [BS, KVH, D] block the engine allocates: a K block is [KVH, D, BS]
// (16 keys along the lanes, so 16 scores come out of one FMA chain with no horizontal sums) and a
// V block [KVH, BS, D]. Each head's slice of a block is contiguous, which the prefetcher streams.
inline __m512 load_n(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_n(const bf16* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Scores of NR query rows against one chunk of keys: s[i] lane j = q_i . k_j (two chains per row).
template <int NR, typename T>
inline void chunk_scores(const float* qs, int64_t d, const T* kt, int64_t bs, __mmask16 keys, __m512* s) {
  __m512 a[NR], b[NR];
  for (int i = 0; i < NR; ++i) a[i] = b[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < d; k += 2) {
    const __m512 k0 = load_n(kt + k * bs, keys), k1 = load_n(kt + (k + 1) * bs, keys);
    for (int i = 0; i < NR; ++i) {
      a[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i * d + k]), k0, a[i]);
      b[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i * d + k + 1]), k1, b[i]);
    }
  }
  for (int i = 0; i < NR; ++i) s[i] = _mm512_add_ps(a[i], b[i]);
}

// acc_i = acc_i * corr_i + sum_j p_i[j] v_j for NR rows over one chunk of n values.
template <int NR, typename T>
inline void chunk_values(float* acc, int64_t d, const T* v, int64_t n, const float* p, const float* corr) {
  for (int64_t c = 0; c < d; c += 16) {
    __m512 a[NR];
    for (int i = 0; i < NR; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * d + c), _mm512_set1_ps(corr[i]));
    for (int64_t j = 0; j < n; ++j) {
      const __m512 vj = load16(v + j * d + c);
      for (int i = 0; i < NR; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * 16 + j]), vj, a[i]);
    }
    for (int i = 0; i < NR; ++i) _mm512_storeu_ps(acc + i * d + c, a[i]);
  }
}

template <int NR, typename T>
void chunk_rows(float* qs, float* acc, float* m, float* l, float* p, int64_t d, const T* kt, const T* v,
                int64_t bs, int64_t chunk, int64_t key0, int64_t pos0, int64_t r0, int64_t g) {
  __m512 s[NR];
  chunk_scores<NR>(qs, d, kt, bs, __mmask16((1u << chunk) - 1u), s);
  float corr[NR];
  int64_t n = 0;
  for (int i = 0; i < NR; ++i) {
    const int64_t valid = std::min<int64_t>(chunk, pos0 + (r0 + i) / g - key0 + 1);  // row r0+i's causal keys
    n = std::max(n, valid);
    const __mmask16 mask = __mmask16((1u << valid) - 1u);
    const float m_new = std::max(m[i], _mm512_mask_reduce_max_ps(mask, s[i]));
    corr[i] = std::exp(m[i] - m_new);
    const __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(s[i], _mm512_set1_ps(m_new))));
    l[i] = l[i] * corr[i] + _mm512_reduce_add_ps(e);
    m[i] = m_new;
    _mm512_storeu_ps(p + i * 16, e);
  }
  chunk_values<NR>(acc, d, v, n, p, corr);
}

template <typename T>
void attention_item(const WorkItem& w, const T* q, T* out, const T* kc, const T* vc, const int32_t* tables,
                    const int32_t* seq_lens, const int32_t* qsl, int64_t table_width, int64_t heads,
                    int64_t kv_heads, int64_t d, int64_t bs, int64_t q_stride, float scale, float* scratch) {
  const int64_t g = heads / kv_heads, nv = d / 16;
  const int64_t q_len = qsl[w.seq + 1] - qsl[w.seq];
  const int64_t pos0 = seq_lens[w.seq] - q_len + (w.q_begin - qsl[w.seq]);  // position of row 0
  const int64_t rows = (w.q_end - w.q_begin) * g, last_pos = pos0 + (rows - 1) / g;
  float* qs = scratch;                  // [rows, d] scaled queries
  float* acc = qs + rows * d;           // [rows, d]
  float* m = acc + rows * d;            // [rows]
  float* l = m + rows;                  // [rows]
  float* p = l + rows;                  // [4, 16] one row group's probabilities
  const int64_t tok_stride = heads * d;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (w.q_begin + r / g) * q_stride + (w.kv_head * g + r % g) * d;
    for (int64_t v = 0; v < nv; ++v)
      _mm512_storeu_ps(qs + r * d + 16 * v, _mm512_mul_ps(load16(src + 16 * v), _mm512_set1_ps(scale)));
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  const int32_t* table = tables + w.seq * table_width;
  const int64_t head_elems = d * bs, block_elems = kv_heads * head_elems, chunk = std::min<int64_t>(16, bs);
  const int64_t num_blocks = last_pos / bs + 1;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const T* kb = kc + int64_t(table[b]) * block_elems + w.kv_head * head_elems;
    const T* vb = vc + int64_t(table[b]) * block_elems + w.kv_head * head_elems;
    if (b + 1 < num_blocks) {
      const int64_t next = int64_t(table[b + 1]) * block_elems + w.kv_head * head_elems;
      const char* nk = reinterpret_cast<const char*>(kc + next);
      const char* nv_ = reinterpret_cast<const char*>(vc + next);
      for (int64_t off = 0; off < head_elems * int64_t(sizeof(T)); off += 64) {
        _mm_prefetch(nk + off, _MM_HINT_T0);
        _mm_prefetch(nv_ + off, _MM_HINT_T0);
      }
    }
    for (int64_t c0 = 0; c0 < bs; c0 += chunk) {
      const int64_t key0 = b * bs + c0;
      if (key0 > last_pos) break;
      const int64_t first = key0 > pos0 ? (key0 - pos0) * g : 0;  // rows before it see none of these keys
      for (int64_t r = first; r < rows; r += 4) {
        const int64_t nr = std::min<int64_t>(4, rows - r);
        auto run = [&](auto nr_tag) {
          constexpr int NR = decltype(nr_tag)::value;
          chunk_rows<NR>(qs + r * d, acc + r * d, m + r, l + r, p, d, kb + c0, vb + c0 * d, bs, chunk, key0, pos0,
                         r, g);
        };
        switch (nr) {
          case 4: run(std::integral_constant<int, 4>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          default: run(std::integral_constant<int, 1>{}); break;
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (w.q_begin + r / g) * tok_stride + (w.kv_head * g + r % g) * d;
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t v = 0; v < nv; ++v) store16(dst + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + 16 * v), inv));
  }
}

// q [T, H, D] (token rows may be strided, as a slice of the fused qkv), out [T, H, D] contiguous; caches [num_blocks, block_size, KVH, D];
// block_tables [S, W]; seq_lens [S] context after this step; query_start_loc [S + 1].
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                     double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [T, H, D] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous tensors");
  const int64_t heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(d % 16 == 0 && heads % kv_heads == 0, "head_dim must be a multiple of 16");
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lens = seq_lens.to(torch::kInt32).contiguous();
  auto qsl = query_start_loc.to(torch::kInt32).contiguous();
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int64_t g = heads / kv_heads, tile = std::max<int64_t>(1, 64 / g), num_seqs = lens.size(0);
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int32_t t = qs[s]; t < qs[s + 1]; t += tile)
      for (int32_t h = 0; h < kv_heads; ++h)
        items.push_back({int32_t(s), h, t, int32_t(std::min<int64_t>(t + tile, qs[s + 1]))});
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.q_end - a.q_begin > b.q_end - b.q_begin; });
  const int64_t scratch = 2 * tile * g * d + 2 * tile * g + 64;
  dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    parallel_items(items.size(), scratch, [&](int64_t i, float* buf) {
      attention_item<T>(items[i], q.data_ptr<T>(), out.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), qs, tables.size(1), heads, kv_heads,
                        d, bs, q.stride(0), float(scale), buf);
    });
  });
}

// key/value [T, KVH, D] rows (token stride may differ) -> flat slots of the caches, in the layout
// paged_attention reads (K [KVH, D, BS], V [KVH, BS, D] per block); slot -1 skipped.
void store_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
              value.stride(1) == value.size(2), "key/value rows must be [T, KVH, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  auto slots = slot_mapping.to(torch::kInt64).contiguous();
  const int64_t bs = k_cache.size(1), kv_heads = k_cache.size(2), d = k_cache.size(3), n = key.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  dispatch(key.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* ks = key.data_ptr<T>();
    const T* vs = value.data_ptr<T>();
    T* kd = k_cache.data_ptr<T>();
    T* vd = v_cache.data_ptr<T>();
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (sp[t] < 0) continue;
        const int64_t block = sp[t] / bs, off = sp[t] % bs;
        for (int64_t h = 0; h < kv_heads; ++h) {
          const T* kr = ks + t * key.stride(0) + h * d;
          T* kt = kd + ((block * kv_heads + h) * d) * bs + off;
          for (int64_t i = 0; i < d; ++i) kt[i * bs] = kr[i];
          std::memcpy(vd + ((block * kv_heads + h) * bs + off) * d, vs + t * value.stride(0) + h * d, d * sizeof(T));
        }
      }
    });
  });
}

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* w, int64_t n, int64_t h, float eps, bool add) {
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    std::vector<float> row(h);
    for (int64_t t = b; t < e; ++t) {
      T* xr = x + t * h;
      T* rr = residual + t * h;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < h; i += 16) {
        __m512 v = load16(xr + i);
        if (add) {
          v = rnd<T>(_mm512_add_ps(v, load16(rr + i)));
          store16(rr + i, v);
        }
        _mm512_storeu_ps(row.data() + i, v);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / float(h) + eps));
      for (int64_t i = 0; i < h; i += 16) {
        __m512 normed = rnd<T>(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), inv));
        store16(xr + i, _mm512_mul_ps(load16(w + i), normed));
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
        __m512 g = load16(gu + t * 2 * h + i);
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        silu = rnd<T>(silu);
        store16(out + t * h + i, _mm512_mul_ps(silu, load16(gu + t * 2 * h + h + i)));
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
        __m512 x1 = load16(xr + i), x2 = load16(xr + half + i);
        __m512 c1 = rnd<T>(_mm512_loadu_ps(c + i)), s1 = rnd<T>(_mm512_loadu_ps(s + i));
        __m512 c2 = rnd<T>(_mm512_loadu_ps(c + half + i)), s2 = rnd<T>(_mm512_loadu_ps(s + half + i));
        __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
        __m512 o1 = _mm512_add_ps(rnd<T>(_mm512_mul_ps(x1, c1)), rnd<T>(_mm512_mul_ps(neg_x2, s1)));
        __m512 o2 = _mm512_add_ps(rnd<T>(_mm512_mul_ps(x2, c2)), rnd<T>(_mm512_mul_ps(x1, s2)));
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
}
