// Paged attention over the block cache in place (decodes and prefills of a step in one call, GQA
// without expanding K/V) and the KV store that writes the cache in the layout it reads.
//
// The CPU backend's own block layout, written only by store_kv_cache and read only by
// paged_attention, inside the [BS, KVH, D] block the engine allocates: a K block is [KVH, D, BS]
// (16 keys along the lanes, so 16 scores come out of one FMA chain with no horizontal sums) and a
// V block [KVH, BS, D]. Each head's slice of a block is contiguous, which the prefetcher streams.
#pragma once
#include <cstring>
#include <limits>

#include "simd.h"

namespace {

struct WorkItem {
  int32_t seq, kv_head, q_begin, q_end;
};

// Keys go a tile of up to 8 chunks at a time and rows 4 at a time: a row group's scores over the
// tile, one softmax pass per row (one max and one sum reduction per 128 keys, not per 16), then P.V
// with the accumulators in registers (in sub-tiles of vec.h's kTiles); the group's probabilities stay in L1.
constexpr int64_t kTileChunks = 8;
constexpr int64_t kTileLanes = 16 * kTileChunks;
constexpr int64_t kGroupRows = 4;
template <typename T> constexpr int kScoreRows = kTiles.score_rows_bf16;
template <> constexpr int kScoreRows<float> = kTiles.score_rows_f32;
template <typename T> constexpr int kScoreChunks = kTiles.score_chunks_bf16;
template <> constexpr int kScoreChunks<float> = kTiles.score_chunks_f32;
template <typename T> constexpr int kValueRows = kTiles.value_rows_bf16;
template <> constexpr int kValueRows<float> = kTiles.value_rows_f32;
template <typename T> constexpr int kValueVecs = kTiles.value_vecs_bf16;
template <> constexpr int kValueVecs<float> = kTiles.value_vecs_f32;
static_assert(kScoreRows<float> <= kGroupRows && kScoreRows<bf16> <= kGroupRows && kValueRows<float> <= kGroupRows &&
                  kValueRows<bf16> <= kGroupRows,
              "sub-tiles of a row group");

// Up to 16 consecutive keys of one block: dim i of key j at k[i * bs + j], its value row at v + j * d.
template <typename T>
struct Chunk {
  const T* k;
  const T* v;
  int64_t key0, n;  // position of the first key, keys in the chunk
};

// s[i * lds + 16 j + lane] = q_i . key (lane) of chunk j, for NR query rows and NC chunks.
template <int NR, int NC, typename T>
inline void tile_scores(const float* q, int64_t d, const Chunk<T>* c, int64_t bs, float* s, int64_t lds) {
  f32x16 acc[NR][NC];
  int64_t n[NC];
  for (int j = 0; j < NC; ++j) n[j] = c[j].n;
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = zero();
  for (int64_t k = 0; k < d; ++k) {
    f32x16 kv[NC];
    for (int j = 0; j < NC; ++j) kv[j] = load_n(c[j].k + k * bs, n[j]);
    for (int i = 0; i < NR; ++i) {
      const f32x16 qb = set1(q[i * d + k]);
      for (int j = 0; j < NC; ++j) acc[i][j] = fma(qb, kv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NC; ++j) store16(s + i * lds + 16 * j, acc[i][j]);
}

// One row's online-softmax step over a tile, for a row that sees the keys at positions <= pos (at
// least the tile's first): scores become probabilities in place (0 where unseen), m and l move on,
// and the factor for the row's accumulator is returned.
template <typename T>
inline float tile_softmax(float* s, const Chunk<T>* c, int64_t nc, int64_t pos, float& m, float& l) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  f32x16 mx = set1(kNegInf);
  int64_t seen = 0;
  for (; seen < nc && c[seen].key0 <= pos; ++seen) {
    const int64_t valid = std::min(c[seen].n, pos - c[seen].key0 + 1);
    mx = max(mx, keep_first(load16(s + 16 * seen), valid, kNegInf));
  }
  const float m_new = std::max(m, reduce_max(mx));
  const float corr = std::exp(m - m_new);
  const f32x16 mn = set1(m_new);
  f32x16 sum = zero();
  for (int64_t x = 0; x < seen; ++x) {
    const int64_t valid = std::min(c[x].n, pos - c[x].key0 + 1);
    const f32x16 e = keep_first(exp16(load16(s + 16 * x) - mn), valid, 0.0f);
    store16(s + 16 * x, e);
    sum = sum + e;
  }
  for (int64_t x = seen; x < nc; ++x) store16(s + 16 * x, zero());
  l = l * corr + reduce_add(sum);
  m = m_new;
  return corr;
}

// acc_i[col, col + 16 NV) = acc_i * corr_i + sum_j p_i[j] v_j over the tile's keys before limit
// (no row of the group sees a later one; those may not be written yet), for NR rows.
template <int NR, int NV, typename T>
inline void tile_values(float* acc, int64_t d, int64_t col, const float* corr, const float* p, int64_t ldp,
                        const Chunk<T>* c, int64_t nc, int64_t limit) {
  f32x16 a[NR][NV];
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < NV; ++v) a[i][v] = load16(acc + i * d + col + 16 * v) * set1(corr[i]);
  for (int64_t x = 0; x < nc && c[x].key0 < limit; ++x) {
    const int64_t n = std::min(c[x].n, limit - c[x].key0);
    const T* vr = c[x].v + col;
    const float* px = p + 16 * x;
    for (int64_t j = 0; j < n; ++j) {
      f32x16 vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = load16(vr + j * d + 16 * v);
      for (int i = 0; i < NR; ++i) {
        const f32x16 pb = set1(px[i * ldp + j]);
        for (int v = 0; v < NV; ++v) a[i][v] = fma(pb, vv[v], a[i][v]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < NV; ++v) store16(acc + i * d + col + 16 * v, a[i][v]);
}

inline int64_t scratch_floats(int64_t rows, int64_t d) {
  return rows * (2 * d + 2) + kGroupRows * (1 + kTileLanes) + 64;
}

// Asks for one kv head's K and V of the blocks holding chunks [c0, c1) into L2. The blocks are scattered, and
// the hardware prefetcher stops at every block boundary: in a step, whose weights and other layers' caches
// evict the last one's, decode attention read its cache at 14 GB/s (bfloat16) without this.
template <typename T>
inline void prefetch_chunks(const T* kc, const T* vc, const int32_t* table, int64_t c0, int64_t c1,
                            int64_t per_block, int64_t block_elems, int64_t head_offset, int64_t head_elems) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t b = c0 / per_block, end = (c1 - 1) / per_block; b <= end; ++b) {
    const int64_t base = int64_t(table[b]) * block_elems + head_offset;
    for (int64_t e = 0; e < head_elems; e += kLine) {
      prefetch_l2(kc + base + e);
      prefetch_l2(vc + base + e);
    }
  }
}

// One kv head of one sequence for query tokens [q_begin, q_end): rows are (token, head of the group).
template <typename T>
void attention_item(const WorkItem& w, const T* q, T* out, const T* kc, const T* vc, const int32_t* tables,
                    const int32_t* seq_lens, const int32_t* qsl, int64_t table_width, int64_t heads,
                    int64_t kv_heads, int64_t d, int64_t bs, int64_t q_stride, float scale, float* scratch) {
  const int64_t g = heads / kv_heads, nv = d / 16;
  const int64_t q_len = qsl[w.seq + 1] - qsl[w.seq];
  const int64_t pos0 = seq_lens[w.seq] - q_len + (w.q_begin - qsl[w.seq]);  // position of row 0
  const int64_t rows = (w.q_end - w.q_begin) * g, last_pos = pos0 + (rows - 1) / g;
  float* qs = scratch;         // [rows, d] scaled queries
  float* acc = qs + rows * d;  // [rows, d]
  float* m = acc + rows * d;   // [rows]
  float* l = m + rows;         // [rows]
  float* corr = l + rows;      // [kGroupRows] a row group's rescale factors
  float* p = corr + kGroupRows;  // [kGroupRows, kTileLanes] a row group's scores over the tile, then probabilities
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (w.q_begin + r / g) * q_stride + (w.kv_head * g + r % g) * d;
    for (int64_t v = 0; v < nv; ++v)
      store16(qs + r * d + 16 * v, load16(src + 16 * v) * set1(scale));
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  const int32_t* table = tables + w.seq * table_width;
  const int64_t cs = std::min<int64_t>(16, bs), per_block = bs / cs, head_elems = d * bs;
  const int64_t block_elems = kv_heads * head_elems, num_chunks = last_pos / cs + 1;
  const int64_t head_offset = w.kv_head * head_elems;
  Chunk<T> ch[kTileChunks];
  prefetch_chunks(kc, vc, table, 0, std::min(kTileChunks, num_chunks), per_block, block_elems, head_offset, head_elems);
  for (int64_t c0 = 0; c0 < num_chunks; c0 += kTileChunks) {
    const int64_t nc = std::min(kTileChunks, num_chunks - c0);
    if (c0 + kTileChunks < num_chunks)
      prefetch_chunks(kc, vc, table, c0 + kTileChunks, std::min(c0 + 2 * kTileChunks, num_chunks), per_block,
                      block_elems, head_offset, head_elems);
    for (int64_t x = 0; x < nc; ++x) {
      const int64_t b = (c0 + x) / per_block, off = ((c0 + x) % per_block) * cs;
      const int64_t base = int64_t(table[b]) * block_elems + head_offset;
      const int64_t key0 = b * bs + off;
      ch[x] = {kc + base + off, vc + base + off * d, key0, std::min(cs, last_pos - key0 + 1)};
    }
    const int64_t first = ch[0].key0 > pos0 ? (ch[0].key0 - pos0) * g : 0;  // earlier rows see none of it
    for (int64_t r = first; r < rows; r += kGroupRows) {
      const int64_t nr = std::min<int64_t>(kGroupRows, rows - r), group_end = pos0 + (r + nr - 1) / g + 1;
      int64_t ncg = 0;
      while (ncg < nc && ch[ncg].key0 < group_end) ++ncg;
      for (int64_t i = 0; i < nr; i += kScoreRows<T>)
        for (int64_t x = 0; x < ncg; x += kScoreChunks<T>)
          upto<kScoreRows<T>>(nr - i, [&](auto NR) {
            upto<kScoreChunks<T>>(ncg - x, [&](auto NC) {
              tile_scores<decltype(NR)::value, decltype(NC)::value>(qs + (r + i) * d, d, ch + x, bs,
                                                                    p + i * kTileLanes + 16 * x, kTileLanes);
            });
          });
      for (int64_t i = 0; i < nr; ++i)
        corr[i] = tile_softmax(p + i * kTileLanes, ch, ncg, pos0 + (r + i) / g, m[r + i], l[r + i]);
      for (int64_t i = 0; i < nr; i += kValueRows<T>)
        for (int64_t v = 0; v < nv; v += kValueVecs<T>)
          upto<kValueRows<T>>(nr - i, [&](auto NR) {
            upto<kValueVecs<T>>(nv - v, [&](auto NV) {
              tile_values<decltype(NR)::value, decltype(NV)::value>(acc + (r + i) * d, d, 16 * v, corr + i,
                                                                    p + i * kTileLanes, kTileLanes, ch, ncg, group_end);
            });
          });
    }
  }
  const int64_t tok_stride = heads * d;
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (w.q_begin + r / g) * tok_stride + (w.kv_head * g + r % g) * d;
    const f32x16 inv = set1(1.0f / l[r]);
    for (int64_t v = 0; v < nv; ++v) store16(dst + 16 * v, load16(acc + r * d + 16 * v) * inv);
  }
}

// q [T, H, D] (token rows may be strided, as a slice of the fused qkv), out [T, H, D] contiguous (rows past
// query_start_loc's last are padding: zeroed); caches [num_blocks, block_size, KVH, D];
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
  dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    parallel_items(items.size(), scratch_floats(tile * g, d), [&](int64_t i, float* buf) {
      attention_item<T>(items[i], q.data_ptr<T>(), out.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), qs, tables.size(1), heads, kv_heads,
                        d, bs, q.stride(0), float(scale), buf);
    });
  });
  if (qs[num_seqs] < q.size(0)) out.narrow(0, qs[num_seqs], q.size(0) - qs[num_seqs]).zero_();  // padding rows
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

}  // namespace
