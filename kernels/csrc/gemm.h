// Small-batch matmul for decode steps: y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for a few dozen rows of x,
// with w packed once into column panels so that a row of x is broadcast against 16 outputs per instruction.
// float32: panel [K][16]; bfloat16: panel [K / 2][16][2], pairs of k for dot_pairs (vdpbf16ps on AVX512-BF16),
// which adds both products of a pair to the float32 sum. Each thread takes blocks of 32 outputs; a block's weights
// (K x 32) are read from memory once and reused from L2 by every group of up to gemm_max_mr<T> rows of x.
#pragma once
#include "simd.h"

namespace {

constexpr int64_t PANEL = 16;
constexpr int GEMM_COLS = 2;  // panels per block (the packing and the threads' unit of work)
// Rows per tile, per ISA (vec.h's kTiles), and panels per tile: a tile holds MR x cols accumulators, the
// cols weight vectors of one k and a broadcast. float32 also keeps a chunk's partial sums (below).
template <typename T> constexpr GemmTiles gemm_tiles = kTiles.gemm_bf16;
template <> constexpr GemmTiles gemm_tiles<float> = kTiles.gemm_f32;
template <typename T> constexpr int gemm_max_mr = gemm_tiles<T>.rows;
template <typename T, int MR>
constexpr int gemm_tile_cols = gemm_tiles<T>.narrow_from <= MR && MR <= gemm_tiles<T>.narrow_to ? 1 : GEMM_COLS;

// Brings the next block (both panels) into L2 while a block is computed, spread over the block's row groups:
// group g of G, stepped once per k (bfloat16: per k pair) by its first tile, prefetches lines
// [g L / G, (g + 1) L / G) of the L 64-byte lines of each panel, so the block's first group does not stall
// on memory alone.
struct Ahead {
  const char* next;
  int64_t panel_bytes, line, rem, groups;
  Ahead(const void* next_block, int64_t panel_bytes, int64_t lines, int64_t g, int64_t groups)
      : next(static_cast<const char*>(next_block)), panel_bytes(panel_bytes), line(g * lines / groups),
        rem(g * lines % groups), groups(groups) {}
  inline void step() {
    if (++rem < groups) return;
    rem = 0;
    fetch();
  }
  inline void step(int64_t n) {
    for (rem += n; rem >= groups; rem -= groups) fetch();
  }
  inline void fetch() {
    prefetch_l2(next + line * 64);
    prefetch_l2(next + panel_bytes + line * 64);
    ++line;
  }
};

// float32 sums k in chunks of GEMM_KC, each in fresh registers added to the total: one running sum over
// K = 256 had 3x torch's error against float64.
constexpr int64_t GEMM_KC = 32;

// NC panels (K * PANEL apart) of the block at wp; Fetch: steps ahead.
template <int MR, int NC, bool Fetch>
inline void gemm_tile(const float* x, const float*, int64_t K, const float* wp, Ahead& ahead,
                      f32x16 (&acc)[MR][NC]) {
  Ahead a = ahead;  // a local copy stays in registers
  f32x16 part[MR][NC];
  for (int64_t k0 = 0; k0 < K; k0 += GEMM_KC) {
    const int64_t end = std::min(K, k0 + GEMM_KC);
    if constexpr (Fetch) a.step(end - k0);
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < NC; ++c) part[m][c] = zero();
    for (int64_t k = k0; k < end; ++k) {
      const f32x16 w0 = load16(wp + k * PANEL), w1 = NC > 1 ? load16(wp + k * PANEL + K * PANEL) : w0;
      for (int m = 0; m < MR; ++m) {
        const f32x16 xv = set1(x[m * K + k]);
        part[m][0] = fma(xv, w0, part[m][0]);
        if constexpr (NC > 1) part[m][NC - 1] = fma(xv, w1, part[m][NC - 1]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < NC; ++c) acc[m][c] = acc[m][c] + part[m][c];
  }
  ahead = a;
}

// Pair p of every row: (x[2p], x[2p + 1]), or (x[K - 1], 0) where Whole is false (the last pair of an odd K).
// xf: x in float32 where !kNativePairDot.
template <int MR, int NC, bool Whole>
inline void gemm_pair(const bf16* x, const float* xf, int64_t K, int64_t p, const bf16* wk, int64_t panel,
                      f32x16 (&acc)[MR][NC]) {
  const bf16x32 w0 = load_pairs(wk), w1 = NC > 1 ? load_pairs(wk + panel) : w0;
  for (int m = 0; m < MR; ++m) {
    const PairX xv = pair_x(x + m * K + 2 * p, xf + m * K + 2 * p, Whole);
    acc[m][0] = dot_pairs(acc[m][0], xv, w0);
    if constexpr (NC > 1) acc[m][NC - 1] = dot_pairs(acc[m][NC - 1], xv, w1);
  }
}

// NC panels (panel elements apart) of the block at wp; Fetch: steps ahead.
template <int MR, int NC, bool Fetch>
inline void gemm_tile(const bf16* x, const float* xf, int64_t K, const bf16* wp, Ahead& ahead,
                      f32x16 (&acc)[MR][NC]) {
  const int64_t pairs = K / 2, panel = (K + 1) / 2 * 2 * PANEL;
  for (int64_t p = 0; p < pairs; ++p) {
    if constexpr (Fetch) ahead.step();
    gemm_pair<MR, NC, true>(x, xf, K, p, wp + p * 2 * PANEL, panel, acc);
  }
  if (K % 2) {
    if constexpr (Fetch) ahead.step();
    gemm_pair<MR, NC, false>(x, xf, K, pairs, wp + pairs * 2 * PANEL, panel, acc);
  }
}

// Panels [c0, c0 + NC) of the block of outputs [n0, n0 + PANEL * GEMM_COLS).
template <typename T, int MR, int NC, bool Fetch>
void gemm_pass(const T* x, const float* xf, int64_t K, const T* wp, Ahead& ahead, const T* bias, T* y, int64_t N,
               int64_t n0, int c0) {
  const int64_t panel = (std::is_same_v<T, bf16> ? (K + 1) / 2 * 2 : K) * PANEL;
  f32x16 acc[MR][NC];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = zero();
  gemm_tile<MR, NC, Fetch>(x, xf, K, wp + c0 * panel, ahead, acc);
  for (int c = 0; c < NC; ++c) {
    const int64_t n = n0 + (c0 + c) * PANEL;
    if (n >= N) break;
    const int64_t cols = std::min<int64_t>(PANEL, N - n);
    const f32x16 b = bias ? load_n(bias + n, cols) : zero();
    for (int m = 0; m < MR; ++m) {
      alignas(64) T out[PANEL];
      store16(out, acc[m][c] + b);
      std::copy(out, out + cols, y + m * N + n);
    }
  }
}

// A tile of one panel takes the block's panels in turn, the first stepping ahead.
template <typename T, int MR>
void gemm_block(const T* x, const float* xf, int64_t K, const T* wp, Ahead& ahead, const T* bias, T* y, int64_t N,
                int64_t n0) {
  constexpr int NC = gemm_tile_cols<T, MR>;
  gemm_pass<T, MR, NC, true>(x, xf, K, wp, ahead, bias, y, N, n0, 0);
  if constexpr (NC == 1) {
    static_assert(GEMM_COLS == 2);
    if (n0 + PANEL < N) gemm_pass<T, MR, NC, false>(x, xf, K, wp, ahead, bias, y, N, n0, 1);
  }
}

template <typename T, int MR = 1>
void gemm_rows(int64_t rows, const T* x, const float* xf, int64_t K, const T* wp, Ahead& ahead, const T* bias, T* y,
               int64_t N, int64_t n0) {
  if constexpr (MR < gemm_max_mr<T>) {
    if (rows != MR) return gemm_rows<T, MR + 1>(rows, x, xf, K, wp, ahead, bias, y, N, n0);
  }
  gemm_block<T, MR>(x, xf, K, wp, ahead, bias, y, N, n0);
}

int64_t padded_k(int64_t K, at::ScalarType t) { return t == at::kBFloat16 ? (K + 1) / 2 * 2 : K; }
int64_t gemm_panels(int64_t N) { return (N + PANEL * GEMM_COLS - 1) / (PANEL * GEMM_COLS) * GEMM_COLS; }

// w [N, K] -> [panels, K', 16] (float32) or [panels, K' / 2, 32] (bfloat16, k pairs), zero-padded to whole blocks.
torch::Tensor pack_gemm(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "pack_gemm: w must be a float32 or bfloat16 [N, K] matrix");
  const int64_t N = w.size(0), K = w.size(1), panels = gemm_panels(N);
  const int64_t Kp = padded_k(K, w.scalar_type()), step = w.scalar_type() == at::kBFloat16 ? 2 : 1;
  auto padded = torch::zeros({panels * PANEL, Kp}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  // [panels, 16, Kp / step, step] -> [panels, Kp / step, 16, step]
  return padded.view({panels, PANEL, Kp / step, step}).permute({0, 2, 1, 3}).contiguous()
      .view({panels, Kp / step, PANEL * step});
}

torch::Tensor gemm_packed(torch::Tensor x, torch::Tensor wp, int64_t N, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1, "gemm_packed: x must be contiguous [rows, K]");
  const int64_t K = x.size(1), panels = gemm_panels(N);
  TORCH_CHECK(wp.scalar_type() == x.scalar_type() && wp.is_contiguous() && wp.dim() == 3 && wp.size(0) == panels
                  && wp.size(1) * wp.size(2) == padded_k(K, x.scalar_type()) * PANEL,
              "gemm_packed: wp must be pack_gemm's layout of an [N, K] weight of x's dtype");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type()),
              "gemm_packed: bias must be [N] of x's dtype");
  auto y = torch::empty({x.size(0), N}, x.options());
  const int64_t rows = x.size(0), blocks = panels / GEMM_COLS;
  dispatch(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    const int64_t groups = (rows + gemm_max_mr<T> - 1) / gemm_max_mr<T>;
    const T* xp = x.data_ptr<T>();
    // bfloat16 without a native pair dot broadcasts x's elements from a float32 copy (exact)
    torch::Tensor x32 = std::is_same_v<T, bf16> && !kNativePairDot ? x.to(at::kFloat) : torch::Tensor();
    const float* xf = x32.defined() ? x32.data_ptr<float>() : nullptr;
    const T* w = wp.data_ptr<T>();
    const T* b = bias ? bias->data_ptr<T>() : nullptr;
    T* yp = y.data_ptr<T>();
    const int64_t panel = wp.size(1) * wp.size(2);
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk)
        for (int64_t g = 0, m0 = 0; g < groups; ++g) {  // rows split evenly: float32 20 -> 6, 7, 7
          const int64_t mr = (rows - m0) / (groups - g);
          const T* wb = w + blk * GEMM_COLS * panel;
          Ahead ahead(wb + GEMM_COLS * panel, panel * sizeof(T), panel * sizeof(T) / 64, g, groups);
          gemm_rows<T>(mr, xp + m0 * K, xf ? xf + m0 * K : nullptr, K, wb, ahead, b, yp + m0 * N, N,
                       blk * GEMM_COLS * PANEL);
          m0 += mr;
        }
    });
  });
  return y;
}

}  // namespace
