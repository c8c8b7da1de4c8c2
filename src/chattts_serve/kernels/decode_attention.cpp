// Decode attention over a bf16 or int8 slot KV cache, one new token per row (see decode_attention.py).
//
// Keys and values are read once, as bf16 or int8, straight from each row's slot of the layer's cache
// [slots, kv_heads, positions, head_dim]; a bf16 cache's dots, softmax and weighted sum run in fp32. An
// int8 cache has one fp32 scale per vector ([slots, kv_heads, positions]): its dots and weighted sums run
// in integers (int16 query and weights against the int8 numbers, Online8), the key's scale multiplies its
// dot (q . s k = s (q . k)) and the value's scale its softmax weight (w s v), so nothing is dequantized
// into memory. The work is
// split flash-decoding style into (row, kv head, chunk of kChunk positions) items, each one pass over
// its keys and values together with an online softmax local to the chunk; the chunks of a row and head
// are then combined in order. The chunk size is a constant, so a row's result never depends on the
// number of threads or on which other rows run in the same step (the engine's batch invariance).
// A prefill's rows (one slot's tokens at consecutive positions) go in groups that widen each block of
// keys and values once for all of them (group_item), each row with the same arithmetic.
//
// Built at first use by torch.utils.cpp_extension with AVX-512 flags (and VNNI's where the CPU has it);
// only loaded on CPUs that have AVX-512.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#ifndef __AVX512F__
#error "decode_attention.cpp needs AVX-512 (built with -mavx512f by decode_attention.py)"
#endif

namespace {

constexpr int64_t kChunk = 512;  // positions per work item (128 KB of keys and values at head_dim 64)
constexpr int64_t kBlock = 4;    // items a thread takes at once (consecutive: a row's chunks and heads)
// Positions ahead whose keys and values an item's first query head prefetches. The cache comes back from
// memory every step (the weights' stream evicts it), in runs of a few KB per (row, head): too short for the
// hardware prefetcher, so the loop waited on each block's misses. Zen 5, an int8 cache, cold: a 32-row step's
// 20 layers 15.8 -> 13.6 ms (2 threads), one row's 0.53 -> 0.44 ms inside the int4 step (1 thread); a bf16
// cache (two lines a position) unchanged. An int8 cache's scales come along (prefetch_scales): without
// them the one-row step's attention was 0.68-0.79 ms, with them 0.44-0.52 (Zen 5, ctx ~195, 1 thread).
// The int8 cache's distance is the build's (decode_attention.py picks it by CPU): on a Zen 4, with the
// integer dots, 16 positions (1 KB a stream) against 32: 32 rows x 150 positions, 20 layers, cold, 5
// alternating runs each, all lower: 1 thread 17.5-19.7 ms against 19.8-23.1, 2 threads 10.0-11.8 against
// 10.7-14.8.
#ifndef CHATTTS_INT8_AHEAD
#define CHATTTS_INT8_AHEAD 32
#endif
template <class T>
constexpr int64_t kAhead = std::is_same_v<T, int8_t> ? CHATTTS_INT8_AHEAD : 32;

// exp(x) for a vector of x <= 0 (scores minus their maximum): 2^n * p(r), r = x - n ln2 in
// [-ln2/2, ln2/2], p the degree-6 Taylor polynomial (relative error < 2e-7, below fp32's rounding
// of the inputs' bf16 products). Inputs under -87 (exp < 1e-38) give 0 or a denormal, as expf.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split: exact first part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 -> 16 fp32: a bf16 is the top half of the fp32 with the same value.
inline __m512 load_bf16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 32 bf16 read as 16 32-bit words: the even elements (low halves) and the odd ones (high halves) as
// fp32, one instruction each. Dots and weighted sums then run on even/odd-split vectors; the query is
// split the same way and the weighted sum is interleaved back once per chunk.
inline __m512 even_bf16(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline __m512 odd_bf16(__m512i w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536))); }

// Sixteen vectors to the vector of their sums, in order: a transposing add tree, ~2 shuffles and one
// add per vector instead of a full horizontal reduction each. `add` adds two vectors' lanes: fp32 (sum16),
// or int32 on the same bits (sum16i): the shuffles only move lanes.
template <class Add>
inline __m512 sum16_by(const __m512* a, Add add) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // 128-bit quarters: b[i] = positions 2i (q0, q1) and 2i+1 (q2, q3)
    b[i] = add(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter j of c[i]: position 4i + j
    c[i] = add(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter j of d[i]: lanes 0-1 position 8i + j, lanes 2-3 position 8i + 4 + j
    d[i] = add(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  // lane 4j + i: position 4i + j
  const __m512 e = add(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

inline __m512 sum16(const __m512* a) {
  return sum16_by(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}

inline __m512i sum16i(const __m512i* a) {  // exact
  __m512 bits[16];
  for (int i = 0; i < 16; ++i) bits[i] = _mm512_castsi512_ps(a[i]);
  return _mm512_castps_si512(sum16_by(bits, [](__m512 x, __m512 y) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
  }));
}

// A head_dim-D row held as W = D / 32 even/odd pairs plus, when D is an odd multiple of 16, a plain tail.
template <int D>
struct Row {
  static constexpr int W = D / 32;
  static constexpr bool kTail = D % 32 != 0;
  __m512 even[W > 0 ? W : 1], odd[W > 0 ? W : 1], tail;

  void zero() {
    for (int w = 0; w < W; ++w) even[w] = odd[w] = _mm512_setzero_ps();
    tail = _mm512_setzero_ps();
  }
  void load_split(const float* x) {  // fp32 in natural order -> even/odd split
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_add_epi32(ie, _mm512_set1_epi32(1));
    for (int w = 0; w < W; ++w) {
      const __m512 lo = _mm512_loadu_ps(x + 32 * w), hi = _mm512_loadu_ps(x + 32 * w + 16);
      even[w] = _mm512_permutex2var_ps(lo, ie, hi);
      odd[w] = _mm512_permutex2var_ps(lo, io, hi);
    }
    if constexpr (kTail) tail = _mm512_loadu_ps(x + 32 * W);
  }
  void store_joined(float* x) const {  // even/odd split -> fp32 in natural order
    const __m512i il = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i ih = _mm512_add_epi32(il, _mm512_set1_epi32(8));
    for (int w = 0; w < W; ++w) {
      _mm512_storeu_ps(x + 32 * w, _mm512_permutex2var_ps(even[w], il, odd[w]));
      _mm512_storeu_ps(x + 32 * w + 16, _mm512_permutex2var_ps(even[w], ih, odd[w]));
    }
    if constexpr (kTail) _mm512_storeu_ps(x + 32 * W, tail);
  }
  // Lane-wise partial products of this (query) row with the bf16 row at p; sum the lanes for the dot.
  __m512 dot_lanes(const at::BFloat16* p) const {
    __m512 acc = _mm512_setzero_ps();
    for (int w = 0; w < W; ++w) {
      const __m512i k = _mm512_loadu_si512(p + 32 * w);
      acc = _mm512_fmadd_ps(even[w], even_bf16(k), acc);
      acc = _mm512_fmadd_ps(odd[w], odd_bf16(k), acc);
    }
    if constexpr (kTail) acc = _mm512_fmadd_ps(tail, load_bf16(p + 32 * W), acc);
    return acc;
  }
  void add(const Row& o) {
    for (int w = 0; w < W; ++w) even[w] = _mm512_add_ps(even[w], o.even[w]), odd[w] = _mm512_add_ps(odd[w], o.odd[w]);
    tail = _mm512_add_ps(tail, o.tail);
  }
  void scale(__m512 f) {
    for (int w = 0; w < W; ++w) even[w] = _mm512_mul_ps(even[w], f), odd[w] = _mm512_mul_ps(odd[w], f);
    tail = _mm512_mul_ps(tail, f);
  }
  void add_scaled(__m512 s, const at::BFloat16* p) {  // this += s * (bf16 row at p)
    for (int w = 0; w < W; ++w) {
      const __m512i v = _mm512_loadu_si512(p + 32 * w);
      even[w] = _mm512_fmadd_ps(s, even_bf16(v), even[w]);
      odd[w] = _mm512_fmadd_ps(s, odd_bf16(v), odd[w]);
    }
    if constexpr (kTail) tail = _mm512_fmadd_ps(s, load_bf16(p + 32 * W), tail);
  }
  // The bf16 row at p widened once into D floats as the two above read it (per pair: even, odd; then the
  // tail), and the same two over that copy: the same products and sums, so the same bits.
  static void widen(const at::BFloat16* p, float* x) {
    for (int w = 0; w < W; ++w) {
      const __m512i k = _mm512_loadu_si512(p + 32 * w);
      _mm512_storeu_ps(x + 32 * w, even_bf16(k));
      _mm512_storeu_ps(x + 32 * w + 16, odd_bf16(k));
    }
    if constexpr (kTail) _mm512_storeu_ps(x + 32 * W, load_bf16(p + 32 * W));
  }
  __m512 dot_lanes(const float* x) const {
    __m512 acc = _mm512_setzero_ps();
    for (int w = 0; w < W; ++w) {
      acc = _mm512_fmadd_ps(even[w], _mm512_loadu_ps(x + 32 * w), acc);
      acc = _mm512_fmadd_ps(odd[w], _mm512_loadu_ps(x + 32 * w + 16), acc);
    }
    if constexpr (kTail) acc = _mm512_fmadd_ps(tail, _mm512_loadu_ps(x + 32 * W), acc);
    return acc;
  }
  void add_scaled(__m512 s, const float* x) {
    for (int w = 0; w < W; ++w) {
      even[w] = _mm512_fmadd_ps(s, _mm512_loadu_ps(x + 32 * w), even[w]);
      odd[w] = _mm512_fmadd_ps(s, _mm512_loadu_ps(x + 32 * w + 16), odd[w]);
    }
    if constexpr (kTail) tail = _mm512_fmadd_ps(s, _mm512_loadu_ps(x + 32 * W), tail);
  }
};

// The bf16 cache's sources of a block of 16 positions for Online: the cache itself (chunk_item) or the
// block widened to fp32 once for a group of a prompt's rows (group_item). Both give the same products.
template <int D>
struct Bf16Cache {
  const at::BFloat16* k;
  const at::BFloat16* v;
  int64_t k_pos, v_pos;
  __m512 dot(const Row<D>& q, int i) const { return q.dot_lanes(k + i * k_pos); }
  void add(Row<D>& acc, __m512 w, int i) const { acc.add_scaled(w, v + i * v_pos); }
};

template <int D>
struct Bf16Wide {
  alignas(64) float k[16 * D];
  alignas(64) float v[16 * D];
  void fill(const Bf16Cache<D>& c, int width) {
    for (int j = 0; j < width; ++j) Row<D>::widen(c.k + j * c.k_pos, k + j * D), Row<D>::widen(c.v + j * c.v_pos, v + j * D);
  }
  __m512 dot(const Row<D>& q, int i) const { return q.dot_lanes(k + i * D); }
  void add(Row<D>& acc, __m512 w, int i) const { acc.add_scaled(w, v + i * D); }
};

// ---------------------------------------------------------------------------------------------------
// The int8 cache in integers. Widening int8 keys and values to fp32 costs two conversions a 16 numbers
// before each FMA: on a Zen 4 (512-bit work double-pumped on 256-bit units) that was ~16 ns a (head,
// position) at head_dim 64 on one core, most of a 32-row step's attention. Instead the query is rounded
// once to int16 (q * scale over its largest |value| times 32767: 15 bits, 1/258 of the int8 key's own
// step) and each dot is an exact int32 sum of int16 x int8 products (vpdpwssd, or vpmaddwd + vpaddd
// without VNNI: the same integers); each block's softmax weights times the values' scales are rounded
// to int16 over the block's largest (same 15 bits) and multiply pairs of positions' values the same
// way, the block's int32 sums then scaled into the fp32 output once. Integer sums are exact, so any
// order and any path (the cache or a group's widened block) gives the same bits; what changes against
// fp32 arithmetic is the two roundings, ~4e-6 of a score's and a weight's size (tests/kernels).
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// Shapes of a head_dim-D row in int16: C full 32-number vectors and, when D is an odd multiple of 16, a
// tail of 16 (upper half zero). A pair of positions' values takes two vectors per 32 numbers (each lane
// one number of both positions) and one for the tail.
template <int D>
struct Shape16 {
  static constexpr int C = D / 32;
  static constexpr bool kTail = D % 32 != 0;
  static constexpr int KW = C + (kTail ? 1 : 0);      // a key's vectors
  static constexpr int VW = 2 * C + (kTail ? 1 : 0);  // a pair of values' vectors
};

// Key row at p (int8) as KW int16 vectors, natural order.
template <int D>
inline __m512i key16(const int8_t* p, int w) {
  if (w < Shape16<D>::C) return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * w)));
  return _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * w))));
}

// Values at a and b (int8) as VW vectors of int16 pairs (a's number, b's number) per 32-bit lane. Per 32
// numbers the bytes interleave within 128-bit lanes: vector 2c holds numbers 0-7 and 16-23, 2c + 1 8-15
// and 24-31 (Online8 puts them back in order once a chunk); the tail's 16 are in order.
template <int D>
inline __m512i value_pair(const int8_t* a, const int8_t* b, int w) {
  constexpr int C = Shape16<D>::C;
  if (w < 2 * C) {
    const int c = w / 2;
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * c));
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * c));
    return _mm512_cvtepi8_epi16(w % 2 == 0 ? _mm256_unpacklo_epi8(x, y) : _mm256_unpackhi_epi8(x, y));
  }
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 32 * C));
  const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32 * C));
  return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(x, y), _mm_unpacklo_epi8(x, y)));
}

// The int8 cache's sources of a block for Online8: the cache, or the block widened to int16 once for a
// group (its pairs made for positions 2j, 2j + 1; past the block's width, the last position twice).
template <int D>
struct Int8Cache {
  const int8_t* k;
  const int8_t* v;
  int64_t k_pos, v_pos;
  __m512i dot(const __m512i* q, int i) const {
    __m512i acc = _mm512_setzero_si512();
    for (int w = 0; w < Shape16<D>::KW; ++w) acc = dpwssd(acc, q[w], key16<D>(k + i * k_pos, w));
    return acc;
  }
  // acc += positions i0 and i1's values weighted by the int16 pair `w` (i1 == i0 when the block's last
  // position is alone: its weight is then 0).
  void add_pair(__m512i* acc, __m512i w, int i0, int i1) const {
    for (int x = 0; x < Shape16<D>::VW; ++x) acc[x] = dpwssd(acc[x], w, value_pair<D>(v + i0 * v_pos, v + i1 * v_pos, x));
  }
};

template <int D>
struct Int8Wide {
  static constexpr int KW = Shape16<D>::KW, VW = Shape16<D>::VW;
  __m512i k[16 * KW];
  __m512i v[8 * VW];
  void fill(const Int8Cache<D>& c, int width) {
    for (int j = 0; j < width; ++j)
      for (int w = 0; w < KW; ++w) k[j * KW + w] = key16<D>(c.k + j * c.k_pos, w);
    for (int j = 0; 2 * j < width; ++j) {
      const int8_t* a = c.v + 2 * j * c.v_pos;
      const int8_t* b = 2 * j + 1 < width ? a + c.v_pos : a;
      for (int w = 0; w < VW; ++w) v[j * VW + w] = value_pair<D>(a, b, w);
    }
  }
  __m512i dot(const __m512i* q, int i) const {
    __m512i acc = _mm512_setzero_si512();
    for (int w = 0; w < KW; ++w) acc = dpwssd(acc, q[w], k[i * KW + w]);
    return acc;
  }
  // A row whose block ends at i0 weighs i0 + 1 by 0: the widened pair's second number then adds 0, as
  // the cache's duplicate does.
  void add_pair(__m512i* acc, __m512i w, int i0, int) const {
    for (int x = 0; x < VW; ++x) acc[x] = dpwssd(acc[x], w, v[i0 / 2 * VW + x]);
  }
};

template <class T>
struct Layout {
  const float* q;  // [rows, heads, D], each row's heads contiguous; times `scale` as it is loaded
  const T* k;
  const T* v;
  int64_t k_slot, k_head, k_pos;  // strides (elements) of the cache views; head_dim is contiguous
  int64_t v_slot, v_head, v_pos;
  int64_t heads, rep;
  int64_t q_row = 0;  // q's row stride (elements)
  float scale = 1.0f;
  // int8 only (else null): one scale per vector, [slots, kv_heads, positions] with positions contiguous.
  const float* ks = nullptr;
  const float* vs = nullptr;
  int64_t ks_slot = 0, ks_head = 0, vs_slot = 0, vs_head = 0;
};

// Where an item's keys and values (and an int8 cache's scales) start, and how many positions it has.
template <class T>
struct Span {
  const T* k = nullptr;
  const T* v = nullptr;
  const float* ks = nullptr;  // int8 only
  const float* vs = nullptr;
  int64_t n = 0;
};

// Item (slot, kv head g, positions [p0, p1))'s span.
template <class T>
Span<T> span(const Layout<T>& L, int64_t slot, int64_t g, int64_t p0, int64_t p1) {
  Span<T> s{L.k + slot * L.k_slot + g * L.k_head + p0 * L.k_pos, L.v + slot * L.v_slot + g * L.v_head + p0 * L.v_pos,
            nullptr, nullptr, p1 - p0};
  if (L.ks) s.ks = L.ks + slot * L.ks_slot + g * L.ks_head + p0, s.vs = L.vs + slot * L.vs_slot + g * L.vs_head + p0;
  return s;
}

// Positions [a, b) of a span into L1 (past its end: nothing).
template <int D, class T>
inline void prefetch(const Layout<T>& L, const Span<T>& s, int64_t a, int64_t b) {
  for (int64_t i = a; i < std::min(b, s.n); ++i)
    for (int64_t o = 0; o < static_cast<int64_t>(D * sizeof(T)); o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(s.k + i * L.k_pos) + o, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(s.v + i * L.v_pos) + o, _MM_HINT_T0);
    }
}

// An int8 span's key and value scales for positions [a, b) into L1 (past its end: nothing). A block's key
// scales multiply its dots before its softmax can start, so a scale line that comes from memory stalls
// the whole block: sixteen positions' scales are one line (or two, where the run straddles), read once.
template <class T>
inline void prefetch_scales(const Span<T>& s, int64_t a, int64_t b) {
  if (!s.ks || a >= s.n) return;
  const int64_t last = std::min(b, s.n) - 1;
  for (int64_t i = a; i < last; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(s.ks + i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(s.vs + i), _MM_HINT_T0);
  }
  _mm_prefetch(reinterpret_cast<const char*>(s.ks + last), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(s.vs + last), _MM_HINT_T0);
}

// A (row, query head)'s output from its chunks' parts (max score, sum of exp, weighted value sum; `stride`
// floats apart), in chunk order: rescaled to the largest max, summed, then divided.
template <int D>
inline void combine(const float* base, int64_t chunks, int64_t stride, float* o) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < chunks; ++c) m = std::max(m, base[c * stride]);
  float total = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = base + c * stride;
    const float f = std::exp(p[0] - m);
    const __m512 w = _mm512_set1_ps(f);
    total += f * p[1];
    for (int j = 0; j < D; j += 16) {
      const __m512 prev = c == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + j);
      _mm512_storeu_ps(o + j, _mm512_fmadd_ps(w, _mm512_loadu_ps(p + 2 + j), prev));
    }
  }
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (int j = 0; j < D; j += 16) _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_loadu_ps(o + j), inv));
}

// One query head's online softmax over a span's positions, a block of at most 16 at a time: the block's
// dots, its max, what was summed rescaled when the max grows, then its weights times the values added
// in. `src` gives the lanes of the block's key i's dot with q (`dot`) and adds w times its value i
// (`add`): read from the cache (chunk_item) or from a block widened once for a group of rows
// (group_item). Either way the same products and sums in the same order: the same bits.
template <int D>
struct Online {
  Row<D> q, out, odd_out;  // odd_out: the odd positions' sum, a second chain of FMAs
  float m;
  __m512 sum;

  void start(const float* qp, float scale) {
    q.load_split(qp);
    q.scale(_mm512_set1_ps(scale));  // the one rounding of q * scale, as a scaled copy would have it
    out.zero(), odd_out.zero();
    m = -std::numeric_limits<float>::infinity();
    sum = _mm512_setzero_ps();
  }
  template <class Src>
  inline void block(int cnt, const float*, const float*, const Src& src) {
    const __mmask16 live = static_cast<__mmask16>((1u << cnt) - 1);
    __m512 lanes[16];
    for (int i = 0; i < 16; ++i) lanes[i] = i < cnt ? src.dot(q, i) : _mm512_setzero_ps();
    const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, sum16(lanes));
    const float block_max = _mm512_reduce_max_ps(scores);
    if (block_max > m) {  // rescale what was summed under the old max (m = -inf: nothing yet, factor 0)
      const __m512 factor = exp_nonpositive(_mm512_set1_ps(m - block_max));
      out.scale(factor), odd_out.scale(factor);
      sum = _mm512_mul_ps(sum, factor);
      m = block_max;
    }
    const __m512 w = exp_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(m)));  // masked lanes: 0
    sum = _mm512_add_ps(sum, w);
    alignas(64) float e[16];
    _mm512_store_ps(e, w);
    int i = 0;
    for (; i + 2 <= cnt; i += 2) {
      src.add(out, _mm512_set1_ps(e[i]), i);
      src.add(odd_out, _mm512_set1_ps(e[i + 1]), i + 1);
    }
    if (i < cnt) src.add(out, _mm512_set1_ps(e[i]), i);
  }
  // The part: max score, sum of exp, weighted value sum (D floats).
  void finish(float* dst) {
    out.add(odd_out);
    dst[0] = m;
    dst[1] = _mm512_reduce_add_ps(sum);
    out.store_joined(dst + 2);
  }
};

// Online for the int8 cache: the same softmax, the dots and the weighted sum in integers (see Int8Cache).
// A block's dots: the int32 sums to fp32, times the query's scale, times the keys' scales. Its weights
// times the values' scales (`e`, the softmax's sum takes the weights alone) become int16 over their
// largest, and each pair of positions' values is added in by one vpdpwssd a vector; the block's sums
// then go into the fp32 output times the weights' scale.
template <int D>
struct Online8 {
  static constexpr int KW = Shape16<D>::KW, VW = Shape16<D>::VW;
  __m512i q[KW];
  float qs;
  __m512 out[VW];  // in value_pair's lane order
  float m;
  __m512 sum;

  void start(const float* qp, float scale) {
    alignas(64) float x[KW * 32] = {};
    const __m512 f = _mm512_set1_ps(scale);
    __m512 big = _mm512_setzero_ps();
    for (int j = 0; j < D; j += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(qp + j), f);  // q * scale rounded once, as fp32's
      _mm512_store_ps(x + j, v);
      big = _mm512_max_ps(big, _mm512_abs_ps(v));
    }
    const float amax = _mm512_reduce_max_ps(big);
    qs = amax > 0.0f ? amax / 32767.0f : 0.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    for (int w = 0; w < KW; ++w) {  // |x| * inv <= 32767 (+ rounding): the codes fit int16
      const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(x + 32 * w), inv));
      const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(x + 32 * w + 16), inv));
      q[w] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtsepi32_epi16(lo)), _mm512_cvtsepi32_epi16(hi), 1);
    }
    for (int x2 = 0; x2 < VW; ++x2) out[x2] = _mm512_setzero_ps();
    m = -std::numeric_limits<float>::infinity();
    sum = _mm512_setzero_ps();
  }
  template <class Src>
  inline void block(int cnt, const float* ks, const float* vs, const Src& src) {
    const __mmask16 live = static_cast<__mmask16>((1u << cnt) - 1);
    __m512i lanes[16];
    for (int i = 0; i < 16; ++i) lanes[i] = i < cnt ? src.dot(q, i) : _mm512_setzero_si512();
    const __m512 dots = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum16i(lanes)), _mm512_set1_ps(qs)),
                                      _mm512_maskz_loadu_ps(live, ks));
    const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, dots);
    const float block_max = _mm512_reduce_max_ps(scores);
    if (block_max > m) {
      const __m512 factor = exp_nonpositive(_mm512_set1_ps(m - block_max));
      for (int x = 0; x < VW; ++x) out[x] = _mm512_mul_ps(out[x], factor);
      sum = _mm512_mul_ps(sum, factor);
      m = block_max;
    }
    const __m512 w = exp_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(m)));  // masked lanes: 0
    sum = _mm512_add_ps(sum, w);
    const __m512 e = _mm512_mul_ps(w, _mm512_maskz_loadu_ps(live, vs));
    const float emax = _mm512_reduce_max_ps(e);
    if (!(emax > 0.0f)) return;  // every weight 0 (underflow, or zero values' scales): nothing to add
    const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(e, _mm512_set1_ps(32767.0f / emax)));
    alignas(32) int32_t pairs[8];  // pair j: positions 2j and 2j + 1's int16 weights
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), _mm512_cvtsepi32_epi16(codes));
    __m512i acc[2][VW];  // even and odd pairs: two chains
    for (int x = 0; x < VW; ++x) acc[0][x] = acc[1][x] = _mm512_setzero_si512();
    for (int j = 0; 2 * j < cnt; ++j)
      src.add_pair(acc[j & 1], _mm512_set1_epi32(pairs[j]), 2 * j, 2 * j + 1 < cnt ? 2 * j + 1 : 2 * j);
    const __m512 s = _mm512_set1_ps(emax / 32767.0f);
    for (int x = 0; x < VW; ++x) out[x] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_add_epi32(acc[0][x], acc[1][x])), out[x]);
  }
  void finish(float* dst) {
    dst[0] = m;
    dst[1] = _mm512_reduce_add_ps(sum);
    constexpr int C = Shape16<D>::C;
    for (int c = 0; c < C; ++c) {  // numbers 0-7 | 16-23 and 8-15 | 24-31 back in order, by 128-bit quarters
      _mm512_storeu_ps(dst + 2 + 32 * c, _mm512_shuffle_f32x4(out[2 * c], out[2 * c + 1], 0x44));
      _mm512_storeu_ps(dst + 2 + 32 * c + 16, _mm512_shuffle_f32x4(out[2 * c], out[2 * c + 1], 0xEE));
    }
    if constexpr (Shape16<D>::kTail) _mm512_storeu_ps(dst + 2 + 32 * C, out[2 * C]);
  }
};

// What each cache's loop uses: its online state, its cache source and its widened block.
template <int D, class T>
struct Kind;
template <int D>
struct Kind<D, at::BFloat16> {
  using State = Online<D>;
  using Cache = Bf16Cache<D>;
  using Wide = Bf16Wide<D>;
};
template <int D>
struct Kind<D, int8_t> {
  using State = Online8<D>;
  using Cache = Int8Cache<D>;
  using Wide = Int8Wide<D>;
};

// One item: row `row` (cache slot `slot`), kv head `g`, positions [p0, p1). Writes for each of the
// kv head's `rep` query heads the chunk's max score, its sum of exp and its weighted value sum
// (D floats) at part + r * (D + 2).
//
// Keys and values are read in the same loop, 16 positions at a time, with the softmax kept online
// (Online): two streams in flight at once read the slot layout's runs of a few tens of KB markedly
// faster than one pass over keys then one over values. Query heads of a kv head run one after another
// over the same chunk: its keys and values (kChunk * D * 2 bytes each) come from memory once and then
// from cache.
//
// `next`: the item this thread takes after this one (empty if unknown), whose first positions are
// prefetched while this one computes. `final`: where the kv head's query heads' outputs go when this item
// is its row's only chunk (else null): the item combines its one part itself (`combine`, as `run` would),
// so a prompt's thousands of rows are not combined one after another on one thread.
template <int D, class T>
void chunk_item(const Layout<T>& L, int64_t row, int64_t slot, int64_t g, int64_t p0, int64_t p1, float* part,
                const Span<T>& next, float* final) {
  constexpr bool kScaled = std::is_same_v<T, int8_t>;
  const Span<T> cur = span(L, slot, g, p0, p1);
  const int64_t n = cur.n;
  const T* k0 = cur.k;
  const T* v0 = cur.v;
  const float* ks0 = cur.ks;
  const float* vs0 = cur.vs;
  for (int64_t r = 0; r < L.rep; ++r) {
    typename Kind<D, T>::State s;
    s.start(L.q + row * L.q_row + (g * L.rep + r) * D, L.scale);
    if (r == 0) {  // the kv head's other query heads find the chunk in cache
      prefetch<D>(L, cur, 0, kAhead<T>);
      prefetch<D>(L, next, 0, kAhead<T>);
      prefetch_scales(cur, 0, kAhead<T>);
      prefetch_scales(next, 0, kAhead<T>);
    }
    for (int64_t p = 0; p < n; p += 16) {
      if (r == 0) prefetch<D>(L, cur, p + kAhead<T>, p + kAhead<T> + 16);
      if constexpr (kScaled) {
        // The line of the block ahead's first scales (its second line, where it straddles, is the next
        // block's first). Two plain prefetches: the same through prefetch_scales ran ~0.3 ms slower a
        // step, reason not found.
        if (r == 0 && p + kAhead<T> < n) {
          _mm_prefetch(reinterpret_cast<const char*>(ks0 + p + kAhead<T>), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vs0 + p + kAhead<T>), _MM_HINT_T0);
        }
      }
      s.block(static_cast<int>(std::min<int64_t>(16, n - p)), kScaled ? ks0 + p : nullptr, kScaled ? vs0 + p : nullptr,
              typename Kind<D, T>::Cache{k0 + p * L.k_pos, v0 + p * L.v_pos, L.k_pos, L.v_pos});
    }
    alignas(64) float one[D + 2];
    float* dst = final ? one : part + r * (D + 2);
    s.finish(dst);
    if (final) combine<D>(one, 1, 0, final + r * D);
  }
}

constexpr int64_t kGroup = 8;  // rows of one prompt that share a widened block (group_item)

// Rows row0 .. row0 + G - 1 (G <= kGroup) of one slot at consecutive positions, each its only chunk: a
// prompt's tokens in a prefill, row i attending over positions 0 .. last[row0] + i. Each block of 16
// positions is widened once (keys and values: to fp32, or an int8 cache's to int16) and read by every row
// of the group that reaches it, instead of each row converting the same keys and values again; each row's
// arithmetic is chunk_item's (Online, Online8), so its bits are the ones it gets alone. Writes the rows'
// outputs (combined as a one-chunk row's) into out.
template <int D, class T>
void group_item(const Layout<T>& L, int64_t row0, int64_t G, int64_t slot, int64_t g, const int64_t* last,
                const Span<T>& next, float* out) {
  constexpr bool kScaled = std::is_same_v<T, int8_t>;
  const Span<T> cur = span(L, slot, g, 0, last[row0 + G - 1] + 1);  // the longest row's positions
  typename Kind<D, T>::Wide wide;
  typename Kind<D, T>::State s[kGroup];
  for (int64_t r = 0; r < L.rep; ++r) {
    for (int64_t i = 0; i < G; ++i) s[i].start(L.q + (row0 + i) * L.q_row + (g * L.rep + r) * D, L.scale);
    if (r == 0) {
      prefetch<D>(L, cur, 0, kAhead<T>);
      prefetch<D>(L, next, 0, kAhead<T>);
      prefetch_scales(cur, 0, kAhead<T>);
      prefetch_scales(next, 0, kAhead<T>);
    }
    for (int64_t p = 0; p < cur.n; p += 16) {
      if (r == 0) prefetch<D>(L, cur, p + kAhead<T>, p + kAhead<T> + 16), prefetch_scales(cur, p + kAhead<T>, p + kAhead<T> + 16);
      const int64_t width = std::min<int64_t>(16, cur.n - p);
      wide.fill({cur.k + p * L.k_pos, cur.v + p * L.v_pos, L.k_pos, L.v_pos}, static_cast<int>(width));
      for (int64_t i = 0; i < G; ++i) {
        const int64_t n = last[row0 + i] + 1;
        if (p >= n) continue;  // this row ends before the block
        s[i].block(static_cast<int>(std::min<int64_t>(16, n - p)), kScaled ? cur.ks + p : nullptr,
                   kScaled ? cur.vs + p : nullptr, wide);
      }
    }
    for (int64_t i = 0; i < G; ++i) {
      alignas(64) float one[D + 2];
      s[i].finish(one);
      combine<D>(one, 1, 0, out + ((row0 + i) * L.heads + g * L.rep + r) * D);
    }
  }
}

// Rows in units: a group of up to kGroup rows of one slot at consecutive positions under kChunk (a
// prompt's tokens: group_item, one item per kv head), else one row (chunk_item, one item per kv head and
// chunk). unit[u] is unit u's first row (unit[units] = rows).
inline std::vector<int64_t> units_of(const int64_t* slots, const int64_t* last, int64_t rows) {
  std::vector<int64_t> unit;
  for (int64_t r = 0; r < rows;) {
    unit.push_back(r);
    int64_t G = 1;
    if (last[r] < kChunk)
      while (G < kGroup && r + G < rows && slots[r + G] == slots[r] && last[r + G] == last[r] + G &&
             last[r + G] < kChunk)
        ++G;
    r += G;
  }
  unit.push_back(rows);
  return unit;
}

template <int D, class T>
void run(const Layout<T>& L, const int64_t* slots, const int64_t* last, int64_t rows, int64_t kv_heads, float* out) {
  const std::vector<int64_t> unit = units_of(slots, last, rows);
  const int64_t units = static_cast<int64_t>(unit.size()) - 1;
  // A unit's items: per kv head, its chunks (a group: one). first[u]: unit u's first item, in (unit, kv
  // head, chunk) order.
  const auto chunks_of = [&](int64_t u) {
    return unit[u + 1] - unit[u] > 1 ? int64_t{1} : (last[unit[u]] + kChunk) / kChunk;
  };
  std::vector<int64_t> first(units + 1, 0);
  for (int64_t u = 0; u < units; ++u) first[u + 1] = first[u] + kv_heads * chunks_of(u);
  const int64_t items = first[units];
  const int64_t part_size = L.rep * (D + 2);
  // Written by the items of rows with more than one chunk only (and read by them only): not zeroed.
  std::unique_ptr<float[]> parts(new float[items * part_size]);

  // Threads take blocks of items from a shared counter rather than fixed halves: on a busy machine a
  // thread that loses its core for a while does not hold the others at the end (and ragged rows
  // balance themselves). Which thread computes an item does not change its result.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t begin; (begin = next.fetch_add(kBlock)) < items;) {
      const int64_t end = std::min(items, begin + kBlock);
      int64_t u = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
      // Item `it` of unit `v`: its kv head and positions (a group's: its longest row's).
      const auto locate = [&](int64_t it, int64_t v, int64_t& g, int64_t& p0, int64_t& p1) {
        const int64_t chunks = chunks_of(v), local = it - first[v], tail = last[unit[v + 1] - 1];
        g = local / chunks, p0 = local % chunks * kChunk, p1 = std::min(tail + 1, p0 + kChunk);
      };
      for (int64_t it = begin; it < end; ++it) {
        while (it >= first[u + 1]) ++u;
        int64_t g, p0, p1;
        locate(it, u, g, p0, p1);
        Span<T> next;
        if (it + 1 < end) {  // the block's next item (a unit's items are consecutive: this unit's or the next's)
          const int64_t nu = it + 1 < first[u + 1] ? u : u + 1;
          int64_t ng, np0, np1;
          locate(it + 1, nu, ng, np0, np1);
          next = span(L, slots[unit[nu]], ng, np0, np1);
        }
        const int64_t row = unit[u], G = unit[u + 1] - row;
        if (G > 1) {
          group_item<D, T>(L, row, G, slots[row], g, last, next, out);
        } else {
          const bool alone = last[row] < kChunk;  // the row's only chunk
          chunk_item<D, T>(L, row, slots[row], g, p0, p1, parts.get() + it * part_size, next,
                              alone ? out + (row * L.heads + g * L.rep) * D : nullptr);
        }
      }
    }
  });

  // Combine the chunks of each (row, query head) with more than one (the others combined themselves),
  // on this thread: a few FLOPs per value, less than what a second parallel region costs to start (on a
  // busy machine, up to a scheduler time slice while the other thread waits for a core). Such a row is
  // a unit of its own.
  for (int64_t u = 0; u < units; ++u) {
    const int64_t chunks = chunks_of(u), row = unit[u];
    if (chunks == 1) continue;
    for (int64_t h = 0; h < L.heads; ++h) {
      const int64_t g = h / L.rep, r = h % L.rep;
      combine<D>(parts.get() + (first[u] + g * chunks) * part_size + r * (D + 2), chunks, part_size,
                 out + (row * L.heads + h) * D);
    }
  }
}

// The checks both ops share; returns the query with each row's heads contiguous (the decode step's q is
// a view of its q/k/v rows: taken as it is, no copy).
at::Tensor check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                 const at::Tensor& last) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be float32 [rows, heads, head_dim]");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(), "k and v must be [slots, kv_heads, positions, head_dim]");
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && q.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "head_dim must be contiguous in k and v");
  TORCH_CHECK(slots.scalar_type() == at::kLong && last.scalar_type() == at::kLong, "slots and last must be int64");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(slots.numel() == rows && last.numel() == rows, "one slot and one last position per row");
  TORCH_CHECK(k.size(3) == d, "q and k head_dim differ");
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(d % 16 == 0 && d <= 128, "head_dim must be a multiple of 16, at most 128");
  const at::Tensor sl = slots.contiguous(), ls = last.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* lp = ls.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < k.size(0), "slot ", sp[i], " out of range");
    TORCH_CHECK(lp[i] >= 0 && lp[i] < k.size(2), "last position ", lp[i], " out of range");
  }
  return q.stride(2) == 1 && q.stride(1) == d ? q : q.contiguous();
}

template <class T>
at::Tensor dispatch(const Layout<T>& L, const at::Tensor& q, const at::Tensor& k, const at::Tensor& slots,
                    const at::Tensor& last) {
  const int64_t rows = q.size(0), d = q.size(2), kv_heads = k.size(1);
  at::Tensor out = at::empty({rows, q.size(1), d}, q.options());
  if (rows == 0) return out;
  const at::Tensor sl = slots.contiguous(), ls = last.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* lp = ls.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  switch (d / 16) {
    case 1: run<16, T>(L, sp, lp, rows, kv_heads, o); break;
    case 2: run<32, T>(L, sp, lp, rows, kv_heads, o); break;
    case 3: run<48, T>(L, sp, lp, rows, kv_heads, o); break;
    case 4: run<64, T>(L, sp, lp, rows, kv_heads, o); break;
    case 5: run<80, T>(L, sp, lp, rows, kv_heads, o); break;
    case 6: run<96, T>(L, sp, lp, rows, kv_heads, o); break;
    case 7: run<112, T>(L, sp, lp, rows, kv_heads, o); break;
    default: run<128, T>(L, sp, lp, rows, kv_heads, o); break;
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const at::Tensor& last, double scale) {
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16, "k and v must be bfloat16");
  const at::Tensor qs = check(q, k, v, slots, last);
  Layout<at::BFloat16> L{qs.data_ptr<float>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(),
                         k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                         q.size(1), q.size(1) / k.size(1)};
  L.q_row = qs.stride(0), L.scale = static_cast<float>(scale);  // ATen's q * scale: a float times float(scale)
  return dispatch<at::BFloat16>(L, qs, k, slots, last);
}

at::Tensor decode_attention_int8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& slots,
                                 const at::Tensor& last, double scale) {
  TORCH_CHECK(k.scalar_type() == at::kChar && v.scalar_type() == at::kChar, "k and v must be int8");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat, "scales must be float32");
  TORCH_CHECK(k_scale.dim() == 3 && v_scale.dim() == 3 && k_scale.sizes() == k.sizes().slice(0, 3) &&
                  v_scale.sizes() == v.sizes().slice(0, 3),
              "scales must be [slots, kv_heads, positions] of k and v");
  TORCH_CHECK(k_scale.stride(2) == 1 && v_scale.stride(2) == 1, "positions must be contiguous in the scales");
  TORCH_CHECK(k_scale.device().is_cpu() && v_scale.device().is_cpu(), "CPU tensors only");
  const at::Tensor qs = check(q, k, v, slots, last);
  Layout<int8_t> L{qs.data_ptr<float>(), k.data_ptr<int8_t>(), v.data_ptr<int8_t>(),
                   k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                   q.size(1), q.size(1) / k.size(1)};
  L.q_row = qs.stride(0), L.scale = static_cast<float>(scale);
  L.ks = k_scale.data_ptr<float>(), L.vs = v_scale.data_ptr<float>();
  L.ks_slot = k_scale.stride(0), L.ks_head = k_scale.stride(1);
  L.vs_slot = v_scale.stride(0), L.vs_head = v_scale.stride(1);
  return dispatch<int8_t>(L, qs, k, slots, last);
}

}  // namespace

TORCH_LIBRARY(chattts_decode_attention, m) {
  m.def("bf16(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor last, float scale) -> Tensor");
  m.def("int8(Tensor q, Tensor k, Tensor v, Tensor k_scale, Tensor v_scale, Tensor slots, Tensor last, float scale) -> Tensor");
  m.impl("bf16", c10::DispatchKey::CPU, &decode_attention);
  m.impl("int8", c10::DispatchKey::CPU, &decode_attention_int8);
}
