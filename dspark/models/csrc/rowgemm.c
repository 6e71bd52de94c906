/* y = x @ W.T (+ b) in float32 for a few rows of x (AVX2 + FMA), W packed in panels.
 *
 * Decoding and verification multiply 1-16 rows by each weight matrix: the cost is reading W
 * from memory. W [out, in] is packed once into panels of 8 outputs, [ceil(out / 8)][in][8], so
 * the kernel reads it as one contiguous stream: for each input index i, one 8-float load of
 * the panel, one broadcast of x[m][i] per row and one FMA per row into accumulators that hold
 * 8 outputs each. Rows go in groups of 8 over a tile of panels small enough to stay in the L2
 * cache, so W comes from memory once per call however many rows there are.
 *
 * Each output y[m][o] is one FMA chain over i = 0 .. in-1 (then the bias): the same operations
 * whatever the number of rows, so a row's result does not depend on the other rows of the call.
 *
 * Built by dspark/models/cpu_kernels.py with: cc -O2 -mavx2 -mfma -ffp-contract=off -shared -fPIC
 */
#include <immintrin.h>

#define ROW_GROUP 8
#define TILE_BYTES (192 * 1024)

/* panels p .. p+PB-1 (outputs 8p .. 8(p+PB)-1) for M rows of x: one function per (M, PB), so the
 * M x PB accumulators are a fixed-size array the compiler keeps in registers */
#define BLOCK(M, PB)                                                                               \
    static inline __attribute__((always_inline)) void block_##M##_##PB(                           \
        const float *x, const float *wp, const float *b, float *y, long in, long out, long p) {    \
        __m256 acc[M][PB];                                                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                        \
            _Pragma("GCC unroll 4") for (int q = 0; q < PB; q++) acc[m][q] = _mm256_setzero_ps();  \
        const float *base = wp + p * in * 8;                                                       \
        for (long i = 0; i < in; i++) {                                                            \
            __m256 wv[PB];                                                                         \
            _Pragma("GCC unroll 4") for (int q = 0; q < PB; q++)                                   \
                wv[q] = _mm256_loadu_ps(base + (q * in + i) * 8);                                  \
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

static inline void store(float *dst, __m256 v, const float *bias, int n)
{
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int k = 0; k < n; k++) dst[k] = bias ? lanes[k] + bias[k] : lanes[k];
}

/* panels p0 .. p1-1 for M rows (1 <= M <= 8): blocks of as many panels as fit in the 16 vector
 * registers with M accumulators per panel, then single panels */
#define SPAN(M, PB)                                                                \
    BLOCK(M, PB)                                                                   \
    static void span_##M(const float *x, const float *wp, const float *b, float *y, \
                         long in, long out, long p0, long p1) {                     \
        long p = p0;                                                               \
        for (; p + PB <= p1; p += PB) block_##M##_##PB(x, wp, b, y, in, out, p);   \
        for (; p < p1; p++) block_##M##_1(x, wp, b, y, in, out, p);                \
    }
BLOCK(1, 1) BLOCK(2, 1) BLOCK(3, 1) BLOCK(4, 1) BLOCK(5, 1) BLOCK(6, 1)
SPAN(1, 4) SPAN(2, 4) SPAN(3, 3) SPAN(4, 2) SPAN(5, 2) SPAN(6, 2)
#define SPAN1(M)                                                                   \
    BLOCK(M, 1)                                                                    \
    static void span_##M(const float *x, const float *wp, const float *b, float *y, \
                         long in, long out, long p0, long p1) {                     \
        for (long p = p0; p < p1; p++) block_##M##_1(x, wp, b, y, in, out, p);     \
    }
SPAN1(7) SPAN1(8)

typedef void (*span_fn)(const float *, const float *, const float *, float *, long, long, long, long);
static const span_fn SPANS[ROW_GROUP + 1] = {0, span_1, span_2, span_3, span_4, span_5, span_6, span_7, span_8};

/* x [rows, in], wp [ceil(out / 8), in, 8] (zero-padded), b [out] or NULL, y [rows, out];
 * all contiguous float32 */
void dspark_rowgemm(const float *x, const float *wp, const float *b, float *y, long rows, long in, long out)
{
    long panels = (out + 7) / 8;
    long tile = TILE_BYTES / (in * 8 * (long)sizeof(float));
    if (tile < 4) tile = 4;
    for (long p0 = 0; p0 < panels; p0 += tile) {
        long p1 = p0 + tile < panels ? p0 + tile : panels;
        for (long m0 = 0; m0 < rows; m0 += ROW_GROUP) {
            long m = rows - m0 < ROW_GROUP ? rows - m0 : ROW_GROUP;
            SPANS[m](x + m0 * in, wp, b, y + m0 * out, in, out, p0, p1);
        }
    }
}
