/* Row gather and scatter for CPU pools: out[i] = pool[ids[i]] and pool[ids[i]] = src[i], rows of
 * `row_bytes` bytes.
 *
 * At small block sizes each pool row sits at a random address: every row is a new page (a TLB miss)
 * and a new stream the hardware prefetcher must find again, so index_select's and index_copy_'s
 * row-by-row copies wait on DRAM once a row. These loops keep the misses in flight instead (the
 * approach of the open PyTorch PR pytorch/pytorch#192270 for index_select, with a steady distance
 * in cache lines):
 *   - one prefetch of the first line of pool row i + ROWS_AHEAD starts its page walk early;
 *   - gather: while line j of the output is copied, line j + LINES_AHEAD of the concatenated pool
 *     rows is prefetched (a scatter reads its source in order: the hardware prefetcher has it); rows
 *     of more than LINES_AHEAD lines prefetch within the row and then into the next one;
 *   - the destination is written with streaming stores (no read-for-ownership of memory that
 *     would not stay in the cache anyway: the caller uses these loops for 1 MiB and more), as
 *     glibc's memcpy does above its non-temporal threshold; plain stores where rows are not
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
#define ROWS_AHEAD 16
#define LINES_AHEAD 256
#define MAX_THREADS 256

typedef struct {
  char *pool;
  const void *ids;
  int id_bytes;
  int64_t begin, end, row_bytes;
  char *rows; /* the contiguous side: the gather's output, the scatter's source */
  int streaming;
} Range;

static inline int64_t id_at(const void *ids, int id_bytes, int64_t i) {
  return id_bytes == 4 ? (int64_t)((const int32_t *)ids)[i] : ((const int64_t *)ids)[i];
}

/* One cache line, with plain or streaming stores. */
#define COPY_LINE_SSE2(dst, src, streaming)                                                          \
  do {                                                                                               \
    const __m128i a = _mm_loadu_si128((const __m128i *)(src)),                                       \
                  b = _mm_loadu_si128((const __m128i *)((src) + 16)),                                \
                  c = _mm_loadu_si128((const __m128i *)((src) + 32)),                                \
                  d = _mm_loadu_si128((const __m128i *)((src) + 48));                                \
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
    const __m256i a = _mm256_loadu_si256((const __m256i *)(src)),                                    \
                  b = _mm256_loadu_si256((const __m256i *)((src) + 32));                             \
    if (streaming) { _mm256_stream_si256((__m256i *)(dst), a); _mm256_stream_si256((__m256i *)((dst) + 32), b); } \
    else { _mm256_storeu_si256((__m256i *)(dst), a); _mm256_storeu_si256((__m256i *)((dst) + 32), b); } \
  } while (0)
#define COPY_LINE_PLAIN(dst, src, streaming) memcpy((dst), (src), LINE)

/* The loop over one thread's rows, written once for each direction and way of copying a line. */
#define ROWS_RANGE(NAME, ATTRIBUTE, COPY_LINE, SCATTER)                                              \
  ATTRIBUTE static void NAME(const Range *r) {                                                       \
    const int64_t lines = r->row_bytes / LINE, rest = r->row_bytes % LINE, per_row = lines + (rest > 0); \
    /* the gather's prefetch cursor: row pi, line pl of the concatenated pool rows */                \
    int64_t pi = r->begin + (per_row ? LINES_AHEAD / per_row : 0), pl = per_row ? LINES_AHEAD % per_row : 0; \
    for (int64_t i = r->begin; i < r->end; i++) {                                                    \
      if (i + ROWS_AHEAD < r->end) PREFETCH(r->pool + id_at(r->ids, r->id_bytes, i + ROWS_AHEAD) * r->row_bytes); \
      char *in_pool = r->pool + id_at(r->ids, r->id_bytes, i) * r->row_bytes;                        \
      char *in_rows = r->rows + i * r->row_bytes;                                                    \
      const char *src = SCATTER ? in_rows : in_pool;                                                 \
      char *dst = SCATTER ? in_pool : in_rows;                                                       \
      if (!SCATTER && lines > LINES_AHEAD) {                                                         \
        /* a row longer than the distance: ahead in this row, then the next row's first lines (no */ \
        /* cursor to advance a line: 15-45% less time when the rows are already in the cache) */    \
        const char *next = i + 1 < r->end ? r->pool + id_at(r->ids, r->id_bytes, i + 1) * r->row_bytes : NULL; \
        int64_t l = 0;                                                                               \
        for (; l < lines - LINES_AHEAD; l++) {                                                       \
          PREFETCH(src + (l + LINES_AHEAD) * LINE);                                                  \
          COPY_LINE(dst + l * LINE, src + l * LINE, r->streaming);                                   \
        }                                                                                            \
        for (; l < lines; l++) {                                                                     \
          if (next) PREFETCH(next + (l + LINES_AHEAD - lines) * LINE);                               \
          COPY_LINE(dst + l * LINE, src + l * LINE, r->streaming);                                   \
        }                                                                                            \
        if (rest) memcpy(dst + lines * LINE, src + lines * LINE, (size_t)rest);                      \
        continue;                                                                                    \
      }                                                                                              \
      for (int64_t l = 0; l < per_row; l++) {                                                        \
        if (!SCATTER) {                                                                              \
          if (pi < r->end) PREFETCH(r->pool + id_at(r->ids, r->id_bytes, pi) * r->row_bytes + pl * LINE); \
          if (++pl == per_row) { pl = 0; pi++; }                                                     \
        }                                                                                            \
        if (l < lines) COPY_LINE(dst + l * LINE, src + l * LINE, r->streaming);                      \
        else memcpy(dst + l * LINE, src + l * LINE, (size_t)rest);                                   \
      }                                                                                              \
    }                                                                                                \
  }

#if defined(__x86_64__) || defined(__i386__)
ROWS_RANGE(gather_sse2, , COPY_LINE_SSE2, 0)
ROWS_RANGE(gather_avx2, __attribute__((target("avx2"))), COPY_LINE_AVX2, 0)
ROWS_RANGE(scatter_sse2, , COPY_LINE_SSE2, 1)
ROWS_RANGE(scatter_avx2, __attribute__((target("avx2"))), COPY_LINE_AVX2, 1)
#else
ROWS_RANGE(gather_plain, , COPY_LINE_PLAIN, 0)
ROWS_RANGE(scatter_plain, , COPY_LINE_PLAIN, 1)
#endif

static void *gather_range(void *arg) {
  const Range *r = (const Range *)arg;
#if defined(__x86_64__) || defined(__i386__)
  if (__builtin_cpu_supports("avx2")) gather_avx2(r);
  else gather_sse2(r);
  if (r->streaming) _mm_sfence(); /* streaming stores are weakly ordered: publish them before returning */
#else
  gather_plain(r);
#endif
  return NULL;
}

static void *scatter_range(void *arg) {
  const Range *r = (const Range *)arg;
#if defined(__x86_64__) || defined(__i386__)
  if (__builtin_cpu_supports("avx2")) scatter_avx2(r);
  else scatter_sse2(r);
  if (r->streaming) _mm_sfence();
#else
  scatter_plain(r);
#endif
  return NULL;
}

/* Checks every id, then runs `body` over `num_threads` contiguous ranges of rows. */
static int64_t run(void *(*body)(void *), char *pool, int64_t num_rows, int64_t row_bytes, const void *ids,
                   int id_bytes, int64_t n, char *rows, char *dst, int num_threads) {
  for (int64_t i = 0; i < n; i++) {
    const int64_t id = id_at(ids, id_bytes, i);
    if (id < 0 || id >= num_rows) return i;
  }
  if (num_threads < 1) num_threads = 1;
  if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
  if (num_threads > n) num_threads = n > 0 ? (int)n : 1;
  /* streaming stores need 32-byte aligned destinations (AVX2): every row start must be one */
  const int streaming = ((uintptr_t)dst % 32 == 0) && (row_bytes % 32 == 0);
  Range ranges[MAX_THREADS];
  pthread_t threads[MAX_THREADS];
  int started = 0, failed = 0;
  for (int t = 0; t < num_threads; t++)
    ranges[t] = (Range){pool, ids, id_bytes, n * t / num_threads, n * (t + 1) / num_threads, row_bytes, rows, streaming};
  for (int t = 1; t < num_threads; t++) {
    if (pthread_create(&threads[t], NULL, body, &ranges[t]) != 0) { failed = 1; break; }
    started = t;
  }
  if (!failed) body(&ranges[0]);
  for (int t = 1; t <= started; t++) pthread_join(threads[t], NULL);
  return failed ? -2 : -1;
}

/* The version of the calling convention below: native_rows.py refuses a library built from another
 * (a stale in-place build of an editable install). */
int pagedkv_rows_abi(void) { return 3; }

/* Both return -1 on success, or the index of the first id outside [0, num_rows) (nothing written),
 * or -2 when a thread could not be started (some rows are written; the caller redoes the call on
 * one thread, which writes the same bytes). */
int64_t pagedkv_gather_rows(const char *pool, int64_t num_rows, int64_t row_bytes, const void *ids, int id_bytes,
                            int64_t n, char *out, int num_threads) {
  return run(gather_range, (char *)pool, num_rows, row_bytes, ids, id_bytes, n, out, out, num_threads);
}

int64_t pagedkv_scatter_rows(char *pool, int64_t num_rows, int64_t row_bytes, const void *ids, int id_bytes,
                             int64_t n, const char *src, int num_threads) {
  /* a pool row is 32-byte aligned when the pool is and rows are a multiple of 32 bytes */
  return run(scatter_range, pool, num_rows, row_bytes, ids, id_bytes, n, (char *)src, pool, num_threads);
}
