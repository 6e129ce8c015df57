/* Row gather for CPU pools: out[i] = pool[ids[i]], rows of `row_bytes` bytes.
 *
 * At small block sizes each row sits at a random address: every row is a new page (a TLB miss) and
 * a new stream the hardware prefetcher must find again, so index_select's row-by-row copy waits on
 * DRAM once a row. This loop keeps the misses in flight instead (the approach of the open PyTorch
 * PR pytorch/pytorch#192270 for index_select, with a steady distance in cache lines):
 *   - one prefetch of the first line of row i + ROWS_AHEAD starts its page walk early;
 *   - while line j of the output is copied, line j + LINES_AHEAD of the concatenated rows is prefetched;
 *   - the output is written with streaming stores (no read-for-ownership of the destination, which
 *     would not stay in the cache anyway: the caller uses this loop for outputs of 1 MiB and more),
 *     as glibc's memcpy does above its non-temporal threshold; plain stores where rows are not
 *     32-byte aligned.
 * Rows are split over `num_threads` POSIX threads in contiguous ranges.
 * Called through ctypes by pagedkv/backends/native_rows.py, which documents the arguments.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#endif

#define LINE 64
#ifndef ROWS_AHEAD
#define ROWS_AHEAD 16
#endif
#ifndef LINES_AHEAD
#define LINES_AHEAD 256
#endif
#define MAX_THREADS 256

typedef struct {
  const char *pool;
  const void *ids;
  int id_bytes;
  int64_t begin, end, row_bytes;
  char *out;
  int streaming;
} Range;

static inline int64_t id_at(const Range *r, int64_t i) {
  return r->id_bytes == 4 ? (int64_t)((const int32_t *)r->ids)[i] : ((const int64_t *)r->ids)[i];
}

/* One cache line (or the row's last, shorter piece), with plain or streaming stores. */
#define COPY_LINE_SSE2(dst, src, streaming)                                                          \
  do {                                                                                               \
    const __m128i a = _mm_loadu_si128((const __m128i *)(src)), b = _mm_loadu_si128((const __m128i *)((src) + 16)), \
                  c = _mm_loadu_si128((const __m128i *)((src) + 32)), d = _mm_loadu_si128((const __m128i *)((src) + 48)); \
    if (streaming) {                                                                                 \
      _mm_stream_si128((__m128i *)(dst), a); _mm_stream_si128((__m128i *)((dst) + 16), b);           \
      _mm_stream_si128((__m128i *)((dst) + 32), c); _mm_stream_si128((__m128i *)((dst) + 48), d);   \
    } else {                                                                                         \
      _mm_storeu_si128((__m128i *)(dst), a); _mm_storeu_si128((__m128i *)((dst) + 16), b);           \
      _mm_storeu_si128((__m128i *)((dst) + 32), c); _mm_storeu_si128((__m128i *)((dst) + 48), d);   \
    }                                                                                                \
  } while (0)
#define COPY_LINE_AVX2(dst, src, streaming)                                                          \
  do {                                                                                               \
    const __m256i a = _mm256_loadu_si256((const __m256i *)(src)), b = _mm256_loadu_si256((const __m256i *)((src) + 32)); \
    if (streaming) { _mm256_stream_si256((__m256i *)(dst), a); _mm256_stream_si256((__m256i *)((dst) + 32), b); } \
    else { _mm256_storeu_si256((__m256i *)(dst), a); _mm256_storeu_si256((__m256i *)((dst) + 32), b); } \
  } while (0)
#define COPY_LINE_PLAIN(dst, src, streaming) memcpy((dst), (src), LINE)

/* The loop over one thread's rows, written once for each way of copying a line. */
#define GATHER_RANGE(NAME, ATTRIBUTE, COPY_LINE)                                                     \
  ATTRIBUTE static void NAME(const Range *r) {                                                       \
    const int64_t lines = r->row_bytes / LINE, rest = r->row_bytes % LINE, per_row = lines + (rest > 0); \
    /* the prefetch cursor: row pi, line pl of the concatenated rows, LINES_AHEAD lines ahead */     \
    int64_t pi = r->begin + (per_row ? LINES_AHEAD / per_row : 0), pl = per_row ? LINES_AHEAD % per_row : 0; \
    for (int64_t i = r->begin; i < r->end; i++) {                                                    \
      if (i + ROWS_AHEAD < r->end) PREFETCH(r->pool + id_at(r, i + ROWS_AHEAD) * r->row_bytes);       \
      const char *src = r->pool + id_at(r, i) * r->row_bytes;                                         \
      char *dst = r->out + i * r->row_bytes;                                                         \
      for (int64_t l = 0; l < per_row; l++) {                                                        \
        if (pi < r->end) PREFETCH(r->pool + id_at(r, pi) * r->row_bytes + pl * LINE);                 \
        if (++pl == per_row) { pl = 0; pi++; }                                                       \
        if (l < lines) COPY_LINE(dst + l * LINE, src + l * LINE, r->streaming);                      \
        else memcpy(dst + l * LINE, src + l * LINE, (size_t)rest);                                   \
      }                                                                                              \
    }                                                                                                \
  }

#if defined(__x86_64__) || defined(__i386__)
GATHER_RANGE(gather_range_sse2, , COPY_LINE_SSE2)
GATHER_RANGE(gather_range_avx2, __attribute__((target("avx2"))), COPY_LINE_AVX2)
#else
GATHER_RANGE(gather_range_plain, , COPY_LINE_PLAIN)
#endif

static void *gather_range(void *arg) {
  const Range *r = (const Range *)arg;
#if defined(__x86_64__) || defined(__i386__)
  if (__builtin_cpu_supports("avx2")) gather_range_avx2(r);
  else gather_range_sse2(r);
  if (r->streaming) _mm_sfence(); /* streaming stores are weakly ordered: publish them before returning */
#else
  gather_range_plain(r);
#endif
  return NULL;
}

/* The version of the calling convention below: native_rows.py refuses a library built from another
 * (a stale in-place build of an editable install). */
int pagedkv_rows_abi(void) { return 2; }

/* Returns -1 on success, or the index of the first id outside [0, num_rows) (nothing written),
 * or -2 when a thread could not be started (the rows of the started threads are written; the
 * caller redoes the whole gather). */
int64_t pagedkv_gather_rows(const char *pool, int64_t num_rows, int64_t row_bytes, const void *ids, int id_bytes,
                            int64_t n, char *out, int num_threads) {
  for (int64_t i = 0; i < n; i++) {
    const int64_t id = id_bytes == 4 ? (int64_t)((const int32_t *)ids)[i] : ((const int64_t *)ids)[i];
    if (id < 0 || id >= num_rows) return i;
  }
  if (num_threads < 1) num_threads = 1;
  if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
  if (num_threads > n) num_threads = n > 0 ? (int)n : 1;
  /* streaming stores need 32-byte aligned destinations (AVX2): every row start must be one */
  const int streaming = ((uintptr_t)out % 32 == 0) && (row_bytes % 32 == 0);
  Range ranges[MAX_THREADS];
  pthread_t threads[MAX_THREADS];
  int started = 0, failed = 0;
  for (int t = 0; t < num_threads; t++) {
    ranges[t] = (Range){pool, ids, id_bytes, n * t / num_threads, n * (t + 1) / num_threads, row_bytes, out, streaming};
  }
  for (int t = 1; t < num_threads; t++) {
    if (pthread_create(&threads[t], NULL, gather_range, &ranges[t]) != 0) { failed = 1; break; }
    started = t;
  }
  if (!failed) gather_range(&ranges[0]);
  for (int t = 1; t <= started; t++) pthread_join(threads[t], NULL);
  return failed ? -2 : -1;
}
