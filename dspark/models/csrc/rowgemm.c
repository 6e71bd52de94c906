/* y = x @ W.T (+ b) in float32 for a few rows of x (AVX2 + FMA), W packed in panels.
 *
 * Decoding and verification multiply 1-32 rows by each weight matrix: the cost is reading W
 * from memory. W [out, in] is packed once into panels of 8 outputs, [ceil(out / 8)][in][8], so
 * the kernel reads it as one contiguous stream: for each input index i, one 8-weight load of
 * the panel, one broadcast of x[m][i] per row and one FMA per row into accumulators that hold
 * 8 outputs each. Rows go in groups of 8 over a tile of panels small enough to stay in the L2
 * cache, so W comes from memory once per call however many rows there are.
 *
 * Two weight types: float32 panels (dspark_rowgemm) and float16 panels (dspark_rowgemm_f16,
 * F16C conversion on load) for weights whose float32 values are all exact float16 numbers,
 * such as a drafter loaded from a float16 checkpoint: the same float32 products from half the
 * bytes, so both entry points give bit-identical results for such weights.
 *
 * Each output y[m][o] is one FMA chain over i = 0 .. in-1 (then the bias): the same operations
 * whatever the number of rows, so a row's result does not depend on the other rows of the call.
 *
 * Built by dspark/models/cpu_kernels.py with:
 *     cc -O2 -mavx2 -mfma -mf16c -ffp-contract=off -shared -fPIC
 */
#include <immintrin.h>
#include <stdint.h>

#define ROW_GROUP 8
#define TILE_BYTES (192 * 1024)

#define LOAD_f32(ptr) _mm256_loadu_ps(ptr)
#define LOAD_f16(ptr) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ptr)))

static inline void store(float *dst, __m256 v, const float *bias, int n)
{
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int k = 0; k < n; k++) dst[k] = bias ? lanes[k] + bias[k] : lanes[k];
}

/* panels p .. p+PB-1 (outputs 8p .. 8(p+PB)-1) for M rows of x: one function per (weight
 * type, M, PB), so the M x PB accumulators are a fixed-size array kept in registers */
#define BLOCK(T, TY, M, PB)                                                                        \
    static inline __attribute__((always_inline)) void block_##T##_##M##_##PB(                     \
        const float *x, const TY *wp, const float *b, float *y, long in, long out, long p) {       \
        __m256 acc[M][PB];                                                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                        \
            _Pragma("GCC unroll 4") for (int q = 0; q < PB; q++) acc[m][q] = _mm256_setzero_ps();  \
        const TY *base = wp + p * in * 8;                                                          \
        for (long i = 0; i < in; i++) {                                                            \
            __m256 wv[PB];                                                                         \
            _Pragma("GCC unroll 4") for (int q = 0; q < PB; q++)                                   \
                wv[q] = LOAD_##T(base + (q * in + i) * 8);                                         \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                                  \
                __m256 xv = _mm256_broadcast_ss(x + m * in + i);                                   \
                _Pragma("GCC unroll 4") for (int q = 0; q < PB; q++)                               \
                    acc[m][q] = _mm256_fmadd_ps(wv[q], xv, acc[m][q]);                             \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 4") for (int q = 0; q < PB; q++) {                                     \
            long o = (p + q) * 8;                                                                  \
            int n = out - o < 8 ? (int)(out - o) : 8;                                              \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                    \
                store(y + m * out + o, acc[m][q], b ? b + o : 0, n);                               \
        }                                                                                          \
    }

/* panels p0 .. p1-1 for M rows (1 <= M <= 8): blocks of as many panels as fit in the 16 vector
 * registers with M accumulators per panel, then single panels */
#define SPAN(T, TY, M, PB)                                                                  \
    static void span_##T##_##M(const float *x, const TY *wp, const float *b, float *y,      \
                               long in, long out, long p0, long p1) {                       \
        long p = p0;                                                                        \
        for (; p + PB <= p1; p += PB) block_##T##_##M##_##PB(x, wp, b, y, in, out, p);      \
        for (; p < p1; p++) block_##T##_##M##_1(x, wp, b, y, in, out, p);                   \
    }

/* every block and span of one weight type, the span table, and the entry point:
 * x [rows, in], wp [ceil(out / 8), in, 8] (zero-padded), b [out] or NULL, y [rows, out];
 * all contiguous */
#define KERNEL(T, TY, NAME)                                                                        \
    BLOCK(T, TY, 1, 1) BLOCK(T, TY, 2, 1) BLOCK(T, TY, 3, 1) BLOCK(T, TY, 4, 1)                    \
    BLOCK(T, TY, 5, 1) BLOCK(T, TY, 6, 1) BLOCK(T, TY, 7, 1) BLOCK(T, TY, 8, 1)                    \
    BLOCK(T, TY, 1, 4) BLOCK(T, TY, 2, 4) BLOCK(T, TY, 3, 3) BLOCK(T, TY, 4, 2)                    \
    BLOCK(T, TY, 5, 2) BLOCK(T, TY, 6, 2)                                                          \
    SPAN(T, TY, 1, 4) SPAN(T, TY, 2, 4) SPAN(T, TY, 3, 3) SPAN(T, TY, 4, 2)                        \
    SPAN(T, TY, 5, 2) SPAN(T, TY, 6, 2) SPAN(T, TY, 7, 1) SPAN(T, TY, 8, 1)                        \
    typedef void (*span_##T##_fn)(const float *, const TY *, const float *, float *, long, long,   \
                                  long, long);                                                     \
    static const span_##T##_fn SPANS_##T[ROW_GROUP + 1] = {0, span_##T##_1, span_##T##_2,          \
        span_##T##_3, span_##T##_4, span_##T##_5, span_##T##_6, span_##T##_7, span_##T##_8};       \
    void NAME(const float *x, const TY *wp, const float *b, float *y, long rows, long in, long out) \
    {                                                                                              \
        long panels = (out + 7) / 8;                                                               \
        long tile = TILE_BYTES / (in * 8 * (long)sizeof(TY));                                      \
        if (tile < 4) tile = 4;                                                                    \
        for (long p0 = 0; p0 < panels; p0 += tile) {                                               \
            long p1 = p0 + tile < panels ? p0 + tile : panels;                                     \
            for (long m0 = 0; m0 < rows; m0 += ROW_GROUP) {                                        \
                long m = rows - m0 < ROW_GROUP ? rows - m0 : ROW_GROUP;                            \
                SPANS_##T[m](x + m0 * in, wp, b, y + m0 * out, in, out, p0, p1);                   \
            }                                                                                      \
        }                                                                                          \
    }

KERNEL(f32, float, dspark_rowgemm)
KERNEL(f16, uint16_t, dspark_rowgemm_f16)
