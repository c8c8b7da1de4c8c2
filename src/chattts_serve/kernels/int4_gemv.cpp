// 4-bit weight GEMV for 1-8 rows with AVX-512 VNNI (see int4_gemv.py).
//
// y[rows, out] = x[rows, in] @ W^T, W symmetric int4 in blocks of `block` inputs with one scale per
// block and output channel. A decode step at one row is a read of the weights and nothing else, so the
// whole design is about streaming them at the memory's rate:
//
// * The weights are packed once (int4_gemv.py) as one contiguous stream per tile of 32 output
//   channels: per block, block/8 steps of two cache lines (16 channels x 8 inputs each; byte 4l + j
//   holds channel l's input j in its low nibble and input 4 + j in its high one), then the block's 32
//   scales (fp32 or bf16). A tile is read front to back, tiles one after the other: one stream for
//   the hardware prefetcher, no gathers.
// * Codes are stored unsigned (q + 8, 0..15), so a nibble needs only a mask (and a shift) to become a
//   byte that vpdpbusd takes as its unsigned operand; x, quantised per row and block to int8, is the
//   signed operand, four inputs broadcast to all 16 lanes straight from memory. The +8 offset is taken
//   back by starting each block's sums at -8 * (the block's sum of x codes).
// * Each block's int32 sums become fp32 once per block: sum * (weight scale * x scale), accumulated in
//   block order. A row's arithmetic is the same whatever the other rows and the thread count (threads
//   split whole tiles), so the result is deterministic and batch-invariant.
//
// Built at first use by torch.utils.cpp_extension with AVX-512 VNNI flags; only loaded on CPUs with it.

// Per-operator headers, not <ATen/ATen.h>: the build at first use (on the user's machine) takes 14-16 s, not 18.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512VNNI__) || !defined(__AVX512BW__)
#error "int4_gemv.cpp needs AVX-512 VNNI (built with -mavx512vnni by int4_gemv.py)"
#endif

namespace {

constexpr int kTile = 32;    // output channels per tile: two vectors of 16 int32 lanes
constexpr int kMaxRows = 8;  // rows per pass over the weights (their sums stay in registers)
constexpr int64_t kGrain = 4;  // tiles per thread at least (a tile of 768 inputs is ~13 KB)
// Calls of at most this many rows go over the weights in runs of kRunTiles tiles, every pass of rows over
// one run before the next: the run's ~50 KB (768 inputs) stay in L2 across the passes instead of coming
// back from L3 each pass, while x (<= 256 rows x in) stays in L2 too. Wider calls (prompts) keep one run
// of all tiles: their x would no longer fit, and there the runs measured 5-10 % slower. Zen 5, 2 threads,
// gate_up (6144 x 768): 32 rows 0.224 -> 0.193 ms, 256 rows 1.73 -> 1.47 ms (1 thread: +8-26 %).
constexpr int64_t kRunRows = 256;
constexpr int64_t kRunTiles = 4;
// Calls of at least this many rows quantise x on every thread: down's 2048 x 3072 input took ~20 % of
// its call on one (Zen 5, 2 threads: 7.75 -> 6.92 ms).
constexpr int64_t kParallelQuantizeRows = 64;
// decode_layers' own loops (rotary, cache writes, residual adds) split rows across threads past this many
// rows a thread: a decode step's few rows stay on the calling thread (no region to open).
constexpr int64_t kElementwiseRows = 64;

inline int32_t load32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// x [rows, in] fp32 -> codes [rows, in] int8, scales [rows, blocks] and the -8 * sum of codes per block.
// code = round-to-nearest-even(x * (127 / absmax)), scale = absmax / 127 (int4_gemv.quantize_rows).
void quantize_rows(const float* x, int64_t rows, int64_t in, int64_t block, int8_t* q, float* scale,
                   int32_t* corr) {
  const int64_t blocks = in / block;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * in + b * block;
      __m512 m = _mm512_setzero_ps();
      for (int64_t i = 0; i < block; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
      const float amax = _mm512_reduce_max_ps(m);
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      scale[r * blocks + b] = amax / 127.0f;
      const __m512 vinv = _mm512_set1_ps(inv);
      __m512i sum = _mm512_setzero_si512();
      int8_t* qb = q + r * in + b * block;
      for (int64_t i = 0; i < block; i += 16) {
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), vinv));
        sum = _mm512_add_epi32(sum, c);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + i), _mm512_cvtsepi32_epi8(c));
      }
      corr[r * blocks + b] = -8 * _mm512_reduce_add_epi32(sum);
    }
  }
}

struct Args {
  const int8_t* xq;     // [rows, in]
  const float* xs;      // [rows, blocks]
  const int32_t* xc;    // [rows, blocks]
  int64_t in, blocks;
  float* y;             // [rows, out]
  int64_t out;
  int64_t prefetch;     // bytes ahead to prefetch (0: the hardware prefetcher alone)
};

// One tile (32 output channels) for R rows: p is the tile's packed stream, o its first channel.
// A block's 32 channel scales (bf16 or fp32) as two fp32 vectors; returns the stream past them.
template <bool kBf16Scales>
inline const uint8_t* load_scales(const uint8_t* p, __m512& w0, __m512& w1) {
  if constexpr (kBf16Scales) {  // a bf16 is the top half of the fp32 of the same value
    const __m512i raw = _mm512_loadu_si512(p);
    w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
    w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
    return p + 64;
  } else {
    w0 = _mm512_loadu_ps(reinterpret_cast<const float*>(p));
    w1 = _mm512_loadu_ps(reinterpret_cast<const float*>(p + 64));
    return p + 128;
  }
}

template <int R, int KB, bool kBf16Scales>
void tile(const uint8_t* p, const Args& A, int64_t o) {
  __m512 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < A.blocks; ++b) {
    __m512i a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_set1_epi32(A.xc[r * A.blocks + b]);
    const int8_t* xb = A.xq + b * KB * 8;
#pragma GCC unroll 16
    for (int s = 0; s < KB; ++s) {
      if (A.prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(p + A.prefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + A.prefetch + 64), _MM_HINT_T0);
      }
      const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 64);
      p += 128;
      const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
      const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xb + r * A.in + s * 8;
        const __m512i xl = _mm512_set1_epi32(load32(xr)), xh = _mm512_set1_epi32(load32(xr + 4));
        a[r][0] = _mm512_dpbusd_epi32(a[r][0], lo0, xl);
        a[r][1] = _mm512_dpbusd_epi32(a[r][1], lo1, xl);
        a[r][0] = _mm512_dpbusd_epi32(a[r][0], hi0, xh);
        a[r][1] = _mm512_dpbusd_epi32(a[r][1], hi1, xh);
      }
    }
    __m512 w0, w1;
    p = load_scales<kBf16Scales>(p, w0, w1);
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(A.xs[r * A.blocks + b]);
      f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][0]), _mm512_mul_ps(w0, xs), f[r][0]);
      f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][1]), _mm512_mul_ps(w1, xs), f[r][1]);
    }
  }
  const int64_t valid = std::min<int64_t>(kTile, A.out - o);
  const __mmask16 m0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 m1 = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(A.y + r * A.out + o, m0, f[r][0]);
    _mm512_mask_storeu_ps(A.y + r * A.out + o + 16, m1, f[r][1]);
  }
}

// The alternative the VNNI path was measured against (removed: nothing called it): x kept in fp32, each
// nibble turned into an fp32 lane (shift, mask, convert) and multiplied in with an FMA per row, 8 such per
// cache line and row against vpdpbusd's 2: 7.69 ms against 5.21 at 1 row, 10.39 against 5.49 at 4 (one
// thread, block 128, Zen 5, busy box).
using TileFn = void (*)(const uint8_t*, const Args&, int64_t);

template <int KB, bool kBf16>
TileFn pick_rows(int rows) {
  switch (rows) {
    case 1: return tile<1, KB, kBf16>;
    case 2: return tile<2, KB, kBf16>;
    case 3: return tile<3, KB, kBf16>;
    case 4: return tile<4, KB, kBf16>;
    case 5: return tile<5, KB, kBf16>;
    case 6: return tile<6, KB, kBf16>;
    case 7: return tile<7, KB, kBf16>;
    default: return tile<8, KB, kBf16>;
  }
}

TileFn pick(int64_t block, bool bf16_scales, int rows) {
  switch (block) {
    case 32: return bf16_scales ? pick_rows<4, true>(rows) : pick_rows<4, false>(rows);
    case 64: return bf16_scales ? pick_rows<8, true>(rows) : pick_rows<8, false>(rows);
    default: return bf16_scales ? pick_rows<16, true>(rows) : pick_rows<16, false>(rows);
  }
}

// y = x @ W^T; `into`: write y there (rows x out, contiguous: a row block of a bigger buffer) and return an
// empty tensor, instead of a new y.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& blob, int64_t out, int64_t block, bool bf16_scales,
                     int64_t prefetch, float* into = nullptr) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [rows, in]");
  TORCH_CHECK(blob.scalar_type() == at::kByte && blob.is_contiguous(), "the packed weight must be contiguous uint8");
  TORCH_CHECK(x.device().is_cpu() && blob.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(block == 32 || block == 64 || block == 128, "block must be 32, 64 or 128");
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(in > 0 && in % block == 0, "in features (", in, ") must be a positive multiple of the block (", block, ")");
  TORCH_CHECK(out > 0, "out features must be positive");
  const int64_t blocks = in / block, tiles = (out + kTile - 1) / kTile;
  const int64_t tile_bytes = blocks * (block / 8 * 128 + (bf16_scales ? 64 : 128));
  TORCH_CHECK(blob.numel() == tiles * tile_bytes, "packed weight of ", blob.numel(), " bytes, expected ",
              tiles * tile_bytes, " for [", out, ", ", in, "] in blocks of ", block);
  TORCH_CHECK(prefetch >= 0, "prefetch distance must be >= 0");
  at::Tensor y = into ? at::Tensor() : at::empty({rows, out}, x.options());
  if (rows == 0) return y;
  // Per-call scratch, reused: a decode step makes ~80 of these calls.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> xc;
  xq.resize(rows * in), xs.resize(rows * blocks), xc.resize(rows * blocks);
  const float* xf = x.data_ptr<float>();
  // The scratch by pointer: inside a region, the name would be each worker thread's own (empty) copy.
  int8_t* xqw = xq.data();
  float* xsw = xs.data();
  int32_t* xcw = xc.data();
  if (rows >= kParallelQuantizeRows) {  // a row's codes do not depend on which thread makes them
    at::parallel_for(0, rows, kMaxRows, [&](int64_t r0, int64_t r1) {
      quantize_rows(xf + r0 * in, r1 - r0, in, block, xqw + r0 * in, xsw + r0 * blocks, xcw + r0 * blocks);
    });
  } else {
    quantize_rows(xf, rows, in, block, xqw, xsw, xcw);
  }
  const uint8_t* w = blob.data_ptr<uint8_t>();
  float* yp = into ? into : y.data_ptr<float>();
  // One parallel region for all the passes of kMaxRows rows, each thread over its own tiles: a region
  // a pass cost a wake-up and a barrier each (a 2048-row prompt: 256 of them), and those cost far more
  // once another thread's OpenMP team exists (the audio worker's: libgomp then sleeps at once at every
  // barrier when its threads outnumber the cores). (Wide calls add one region to quantise x.)
  // Each (row, tile) is the same call whatever the order, so the runs change no result.
  const int64_t run = rows <= kRunRows ? kRunTiles : tiles;
  at::parallel_for(0, tiles, kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t u0 = t0; u0 < t1; u0 += run) {
      const int64_t u1 = std::min(t1, u0 + run);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int n = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
        const Args A{xqw + r0 * in, xsw + r0 * blocks, xcw + r0 * blocks, in, blocks, yp + r0 * out, out, prefetch};
        const TileFn fn = pick(block, bf16_scales, n);
        for (int64_t t = u0; t < u1; ++t) fn(w + t * tile_bytes, A, t * kTile);
      }
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------------
// The int4 trunk's decode step, every layer in one call (int4_decode.py): at one row the step's weights
// stream in ~4 ms, and the ~15 torch ops a layer makes around its four matmuls (norms, rotary, cache
// writes, SwiGLU, residuals; ~5 ms a step of dispatch and Python) are here plain loops over one row.
// Each row's arithmetic depends on its own values only (batch- and thread-invariant, as the GEMV), and
// it is GPT.decode's to the bit: SiLU is the same ATen call (without Python), the norms ATen's row sums
// and its fp32 arithmetic, rotary, the cache writes and the residual adds the same fp32 operations in the
// same order (built with -ffp-contract=off, so no multiply-add is fused where torch rounds twice).
//
// Packed prompts run through it too (prefill.py): a prompt's tokens are rows at consecutive positions of
// one slot. Every row's key and value are written before any row attends, so each token attends over its
// prompt's keys up to itself: causal prefill, each token's result the one a decode step would give it.

// x*cos + rotate_half(x)*sin on each of `vectors` head vectors of d, in place.
void rotate(float* x, const float* cos, const float* sin, int64_t vectors, int64_t d) {
  const int64_t half = d / 2;
  float tmp[256];
  for (int64_t h = 0; h < vectors; ++h) {
    float* v = x + h * d;
    for (int64_t i = 0; i < half; ++i) tmp[i] = v[i] * cos[i] + (-v[i + half]) * sin[i];
    for (int64_t i = half; i < d; ++i) tmp[i] = v[i] * cos[i] + v[i - half] * sin[i];
    std::memcpy(v, tmp, d * sizeof(float));
  }
}

// at::rms_norm over rows of `hidden` (x contiguous): torch 2.13's composite, x * rsqrt(mean(x^2) + eps) * w,
// where mean is ATen's sum then a true division, in fp32. The row sums stay ATen's (one op, its own
// reduction order); the rest is the same fp32 operations in the same order, so the bits are at::rms_norm's
// (tested against it) for one dispatched op instead of six: ~8 us -> ~2 us a call at one row, 40 a step.
// Rows [r0, r1) of t: t itself when that is all of it (a decode step's buffers are whole: no view to make).
inline at::Tensor rows_of(const at::Tensor& t, int64_t r0, int64_t r1) {
  return r0 == 0 && r1 == t.size(0) ? t : t.slice(0, r0, r1);
}

// Into y [rows, hidden] (contiguous), with sq [>= rows, hidden] and sums [>= rows] as scratch: the step passes
// buffers made once a call (two allocations and their frees less per norm, 40 norms a step).
void rms_norm_into(const at::Tensor& x, const float* wp, double eps, const at::Tensor& sq, const at::Tensor& sums,
                   float* yp) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const float* xp = x.data_ptr<float>();
  const at::Tensor sqr = rows_of(sq, 0, rows);
  at::Tensor sr = rows_of(sums, 0, rows);
  float* qp = sqr.data_ptr<float>();
  at::parallel_for(0, rows, kElementwiseRows, [&](int64_t a, int64_t b) {
    for (int64_t i = a * hidden; i < b * hidden; ++i) qp[i] = xp[i] * xp[i];
  });
  at::sum_out(sr, sqr, {1}, /*keepdim=*/false);  // sum's kernel, into the buffer
  const float* sp = sr.data_ptr<float>();
  const float n = static_cast<float>(hidden), e = static_cast<float>(eps);
  at::parallel_for(0, rows, kElementwiseRows, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float inv = 1.0f / std::sqrt(sp[r] / n + e);
      for (int64_t i = 0; i < hidden; ++i) yp[r * hidden + i] = (xp[r * hidden + i] * inv) * wp[i];
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor sq = at::empty({rows, hidden}, x.options()), sums = at::empty({rows}, x.options());
  at::Tensor y = at::empty({rows, hidden}, x.options());
  rms_norm_into(x, w.data_ptr<float>(), eps, sq, sums, y.data_ptr<float>());
  return y;
}

// One key or value vector into a bf16 cache (round to nearest even, as torch's cast).
void store(const float* x, at::BFloat16* out, float*, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] = at::BFloat16(x[i]);
}

// ... or into an int8 cache with its fp32 scale (kv_int8.quantize: absmax / 127, round half to even).
// Sixteen lanes at a time where d allows (a prompt's prefill writes ~1.5 M of these vectors; one at a time they
// cost ~0.15 s of a 32-prompt burst), the same operations either way: a true division, round half to even,
// and a NaN dropped from the max and clamped to -127 (vmaxps returns its second operand on a NaN, as
// std::max(a, NaN) returns a).
void store(const float* x, int8_t* out, float* scale, int64_t d) {
  float amax = 0.0f;
  if (d % 16 == 0) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m);
    amax = _mm512_reduce_max_ps(m);
  } else {
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  }
  const float s = amax / 127.0f;
  const float div = std::max(s, std::numeric_limits<float>::min());
  if (d % 16 == 0) {
    const __m512 vdiv = _mm512_set1_ps(div), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t i = 0; i < d; i += 16) {
      const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vdiv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 c = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(c)));
    }
  } else {
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] / div))));
  }
  *scale = s;
}

template <class T>
void write_cache(const float* qkv, int64_t width, int64_t k_off, int64_t v_off, const at::Tensor& k,
                 const at::Tensor& v, const c10::optional<at::Tensor>& ks, const c10::optional<at::Tensor>& vs,
                 const int64_t* slots, const int64_t* pos, int64_t r0, int64_t r1, int64_t kv_heads, int64_t d) {
  T* kp = k.data_ptr<T>();
  T* vp = v.data_ptr<T>();
  float* ksp = ks ? ks->data_ptr<float>() : nullptr;
  float* vsp = vs ? vs->data_ptr<float>() : nullptr;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t s = slots[r], t = pos[r];
      const float* src = qkv + r * width;
      float* kscale = ksp ? ksp + s * ks->stride(0) + h * ks->stride(1) + t : nullptr;
      float* vscale = vsp ? vsp + s * vs->stride(0) + h * vs->stride(1) + t : nullptr;
      store(src + k_off + h * d, kp + s * k.stride(0) + h * k.stride(1) + t * k.stride(2), kscale, d);
      store(src + v_off + h * d, vp + s * v.stride(0) + h * v.stride(1) + t * v.stride(2), vscale, d);
    }
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& ks,
                  const c10::optional<at::Tensor>& vs, const at::Tensor& slots, const at::Tensor& pos, double scale) {
  // decode_attention.cpp's ops, through the dispatcher (its library is loaded first: int4_decode.py).
  if (ks) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("chattts_decode_attention::int8", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
    return op.call(q, k, v, *ks, *vs, slots, pos, scale);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("chattts_decode_attention::bf16", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, double)>();
  return op.call(q, k, v, slots, pos, scale);
}

// h [m, hidden] fp32 (rows >= n are padding: their attention output is zero, nothing is written for them);
// norms [layers, 2, hidden]; blobs: per layer the packed qkv, o, gate_up and down weights; blocks: their
// four block sizes; cos, sin [m, head_dim]; k, v [layers, slots, kv_heads, positions, head_dim] bf16 or
// int8 (+ scales [layers, slots, kv_heads, positions]); slots, pos [n]; block_rows: rows per matmul call
// (0: all); final_norm: the model's final RMSNorm weight [hidden], or none; keep: int64 indices of real rows,
// or none (all rows). Returns h after every layer (of the kept rows, in keep's order), through the final norm
// when it is given (the step's rms_norm: F.rms_norm's bits, one call less a step).
//
// keep: a prefill needs each prompt's last row only (its first token's logits); every row's key and value is
// still written at every layer, but the last layer's attention, o projection and MLP run on the kept rows
// alone: 1/20 of a prompt's MACs less (~0.8 of a layer's 9.4 M a token). Rows are independent, so a kept
// row's bits are the ones it gets with every row computed.
at::Tensor decode_layers(const at::Tensor& h_in, const at::Tensor& norms, double eps, at::TensorList blobs,
                         at::IntArrayRef blocks, bool bf16_scales, int64_t intermediate, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                         const at::Tensor& slots, const at::Tensor& pos, int64_t heads, int64_t kv_heads,
                         int64_t prefetch, int64_t threads, int64_t block_rows,
                         const c10::optional<at::Tensor>& final_norm, const c10::optional<at::Tensor>& keep) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat, "h must be fp32 [rows, hidden]");
  const int64_t m = h_in.size(0), hidden = h_in.size(1), layers = norms.size(0);
  const int64_t d = k.size(4), n = slots.numel();
  TORCH_CHECK(norms.dim() == 3 && norms.size(1) == 2 && norms.size(2) == hidden && norms.scalar_type() == at::kFloat &&
                  norms.is_contiguous(),
              "norms must be contiguous fp32 [layers, 2, hidden]");
  TORCH_CHECK(static_cast<int64_t>(blobs.size()) == 4 * layers && blocks.size() == 4, "4 weights a layer, 4 block sizes");
  TORCH_CHECK(k.dim() == 5 && k.size(0) == layers && v.sizes() == k.sizes() && k.size(2) == kv_heads,
              "k and v must be [layers, slots, kv_heads, positions, head_dim]");
  TORCH_CHECK(d <= 256 && d % 2 == 0 && heads % kv_heads == 0 && hidden == heads * d, "bad head layout");
  TORCH_CHECK(k.stride(4) == 1 && v.stride(4) == 1, "head vectors must be contiguous in the cache");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == m && cos.size(1) == d &&
                  cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous fp32 [rows, head_dim]");
  TORCH_CHECK(n <= m && pos.numel() == n && slots.scalar_type() == at::kLong && pos.scalar_type() == at::kLong,
              "one int64 slot and position per real row");
  const bool int8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || k.scalar_type() == at::kBFloat16, "the cache must be bf16 or int8");
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "an int8 cache needs its scales, only it");
  at::Tensor kept;  // keep's rows, checked: indices of real rows
  if (keep) {
    TORCH_CHECK(keep->dim() == 1 && keep->scalar_type() == at::kLong, "keep must be int64 row indices");
    kept = keep->contiguous();
    const int64_t* kp = kept.data_ptr<int64_t>();
    for (int64_t i = 0; i < kept.numel(); ++i) TORCH_CHECK(kp[i] >= 0 && kp[i] < n, "kept row ", kp[i], " is not a real row");
  }
  const at::Tensor sl = slots.contiguous(), ps = pos.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {  // checked once here: the cache writes below index with them
    TORCH_CHECK(sp[i] >= 0 && sp[i] < k.size(1), "slot ", sp[i], " out of range");
    TORCH_CHECK(pp[i] >= 0 && pp[i] < k.size(3), "position ", pp[i], " out of range");
  }
  // threads > 0: this call's parallel regions (the GEMV's, attention's) on that many threads, then the
  // caller's count again (OpenMP's count is per thread: nothing else sees the change). The caller's count
  // is read through torch, which first sets a new thread's count to torch's own (it would otherwise do so
  // inside this call, and the restore would undo it).
  struct Restore {
    int n;
    ~Restore() {
      if (n > 0) omp_set_num_threads(n);
    }
  } restore{threads > 0 ? at::get_num_threads() : 0};
  if (threads > 0) omp_set_num_threads(static_cast<int>(threads));
  const int64_t width = (heads + 2 * kv_heads) * d, qk = (heads + kv_heads) * d;
  // Row blocks: a wide call (packed prompts) runs each GEMV on at most `block_rows` rows at a time, so its
  // x and outputs stay in cache and the GEMV takes its tile runs; a row's arithmetic is the same either way.
  const int64_t rb = block_rows > 0 ? std::min(block_rows, m) : m;
  at::Tensor h = h_in.contiguous().clone();
  at::Tensor qkv = at::empty({m, width}, h.options());
  // Attention's output with zero rows for the padding (none: attention's own output is used as it is).
  at::Tensor attn_in = n < m ? at::zeros({m, heads * d}, h.options()) : at::Tensor();
  at::Tensor o = at::empty({rb, hidden}, h.options());
  at::Tensor gu = at::empty({rb, 2 * intermediate}, h.options());
  at::Tensor act = at::empty({rb, intermediate}, h.options());
  at::Tensor dn = at::empty({rb, hidden}, h.options());
  // The norms' output and scratch, and the views every layer uses, made once a call: at one row a layer's ~25
  // views, allocations and frees cost about as much as its attention (~0.6-0.9 ms a step on a Zen 4).
  at::Tensor xn = at::empty({rb, hidden}, h.options()), sq = at::empty({rb, hidden}, h.options());
  at::Tensor sums = at::empty({rb}, h.options());
  const at::Tensor gate = gu.slice(1, 0, intermediate), up = gu.slice(1, intermediate, 2 * intermediate);
  const at::Tensor q_all = qkv.as_strided({n, heads, d}, {width, d, 1});  // every real row's query heads
  const float* norm_w = norms.data_ptr<float>();  // [layers, 2, hidden]
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  const at::Tensor sl_n = sl.slice(0, 0, n), ps_n = ps.slice(0, 0, n);
  // x[r0:r1] += y[0:r1-r0] (rows on every thread past a decode step's width: no row depends on another's).
  const auto add_rows = [&](at::Tensor& x, const at::Tensor& y, int64_t r0, int64_t r1) {
    float* xp = x.data_ptr<float>();
    const float* yp = y.data_ptr<float>() - r0 * hidden;
    at::parallel_for(r0, r1, kElementwiseRows, [&](int64_t a, int64_t b) {
      for (int64_t i = a * hidden; i < b * hidden; ++i) xp[i] = xp[i] + yp[i];
    });
  };
  // Layer l's o projection and MLP on the residual stream x [rows, hidden] from its attention output a, a block
  // of rows at a time.
  const auto o_and_mlp = [&](int64_t l, at::Tensor& x, const at::Tensor& a) {
    const int64_t rows_all = x.size(0);
    for (int64_t r0 = 0; r0 < rows_all; r0 += rb) {
      const int64_t r1 = std::min(rows_all, r0 + rb), rows = r1 - r0;
      const at::Tensor xnb = rows_of(xn, 0, rows);
      at::Tensor actb = rows_of(act, 0, rows);
      int4_gemv(rows_of(a, r0, r1), blobs[4 * l + 1], hidden, blocks[1], bf16_scales, prefetch, o.data_ptr<float>());
      add_rows(x, o, r0, r1);
      rms_norm_into(rows_of(x, r0, r1), norm_w + (2 * l + 1) * hidden, eps, sq, sums, xnb.data_ptr<float>());
      int4_gemv(xnb, blobs[4 * l + 2], 2 * intermediate, blocks[2], bf16_scales, prefetch, gu.data_ptr<float>());
      // silu(gate) * up, written into act: no temporary the size of a row block's gate (1.5 MB in a prefill)
      at::silu_out(actb, rows_of(gate, 0, rows));
      actb.mul_(rows_of(up, 0, rows));
      int4_gemv(actb, blobs[4 * l + 3], hidden, blocks[3], bf16_scales, prefetch, dn.data_ptr<float>());
      add_rows(x, dn, r0, r1);
    }
  };
  for (int64_t l = 0; l < layers; ++l) {
    // attention: every row's q, k, v (rotated), then every real row's key and value into the cache, then
    // each row over its slot's keys up to its position (so a prompt's tokens see each other causally)
    for (int64_t r0 = 0; r0 < m; r0 += rb) {
      const int64_t r1 = std::min(m, r0 + rb);
      const at::Tensor x = rows_of(xn, 0, r1 - r0);
      rms_norm_into(rows_of(h, r0, r1), norm_w + 2 * l * hidden, eps, sq, sums, x.data_ptr<float>());
      int4_gemv(x, blobs[4 * l], width, blocks[0], bf16_scales, prefetch, qp + r0 * width);
      at::parallel_for(r0, r1, kElementwiseRows, [&](int64_t a, int64_t b) {
        for (int64_t r = a; r < b; ++r) rotate(qp + r * width, cp + r * d, snp + r * d, heads + kv_heads, d);
      });
    }
    const at::Tensor kl = k.select(0, l), vl = v.select(0, l);
    const c10::optional<at::Tensor> ksl = int8 ? c10::optional<at::Tensor>(k_scale->select(0, l)) : c10::nullopt;
    const c10::optional<at::Tensor> vsl = int8 ? c10::optional<at::Tensor>(v_scale->select(0, l)) : c10::nullopt;
    at::parallel_for(0, n, kElementwiseRows, [&](int64_t a, int64_t b) {  // rows write disjoint positions
      if (int8)
        write_cache<int8_t>(qp, width, heads * d, qk, kl, vl, ksl, vsl, sp, pp, a, b, kv_heads, d);
      else
        write_cache<at::BFloat16>(qp, width, heads * d, qk, kl, vl, ksl, vsl, sp, pp, a, b, kv_heads, d);
    });
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    if (keep && l == layers - 1) {  // the kept rows alone from here (their keys and values are all written)
      const int64_t nk = kept.numel();
      const at::Tensor q = qkv.slice(1, 0, heads * d).index_select(0, kept).view({nk, heads, d});
      const at::Tensor a = nk > 0 ? attend(q, kl, vl, ksl, vsl, sl_n.index_select(0, kept), ps_n.index_select(0, kept), scale)
                                        .view({nk, heads * d})
                                  : at::empty({0, heads * d}, h.options());
      h = h.index_select(0, kept);
      o_and_mlp(l, h, a);
      break;
    }
    if (n == m) {  // no padding rows: attention's output is the o projection's input as it is
      o_and_mlp(l, h, attend(q_all, kl, vl, ksl, vsl, sl_n, ps_n, scale).view({m, heads * d}));
      continue;
    }
    if (n > 0) attn_in.slice(0, 0, n).copy_(attend(q_all, kl, vl, ksl, vsl, sl_n, ps_n, scale).view({n, heads * d}));
    o_and_mlp(l, h, attn_in);
  }
  if (final_norm) {
    TORCH_CHECK(final_norm->dim() == 1 && final_norm->size(0) == hidden && final_norm->scalar_type() == at::kFloat &&
                    final_norm->is_contiguous(),
                "final_norm must be contiguous fp32 [hidden]");
    return rms_norm(h, *final_norm, eps);
  }
  return h;
}

// The registered norm (the step's, for its test against at::rms_norm).
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous fp32 [rows, hidden]");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w must be contiguous fp32 [hidden]");
  return rms_norm(x, w, eps);
}

// The registered op: a new y.
at::Tensor gemv_op(const at::Tensor& x, const at::Tensor& blob, int64_t out, int64_t block, bool bf16_scales,
                   int64_t prefetch) {
  return int4_gemv(x, blob, out, block, bf16_scales, prefetch);
}

}  // namespace

TORCH_LIBRARY(chattts_int4_gemv, m) {
  m.def("gemv(Tensor x, Tensor blob, int out, int block, bool bf16_scales, int prefetch) -> Tensor");
  m.def(
      "decode_layers(Tensor h, Tensor norms, float eps, Tensor[] blobs, int[] blocks, bool bf16_scales, "
      "int intermediate, Tensor cos, Tensor sin, Tensor k, Tensor v, Tensor? k_scale, Tensor? v_scale, "
      "Tensor slots, Tensor pos, int heads, int kv_heads, int prefetch, int threads, int block_rows, "
      "Tensor? final_norm=None, Tensor? keep=None) -> Tensor");
  m.impl("gemv", c10::DispatchKey::CPU, &gemv_op);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm_op);
  m.impl("decode_layers", c10::DispatchKey::CPU, &decode_layers);
}
