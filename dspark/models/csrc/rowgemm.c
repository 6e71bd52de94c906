/* y = x @ W.T (+ b) in float32 for a few rows of x (AVX2 + FMA), W packed in panels.
 *
 * Decoding and verification multiply a few rows by each weight matrix: the cost is reading W
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
 * Two more weight types hold weights that are exactly those of a block-quantized model (such as
 * the embedded target, whose GGUF stores Q4_1 layers and a Q8_0 embedding): per panel and block
 * of 32 inputs, a record of float32 scales and small integer codes, from which the kernel
 * rebuilds each float32 weight exactly before the same FMA:
 *   q4 (dspark_rowgemm_q4): w = q * d + m, q in 0..15; record = d[8], m[8] (float32), then for
 *      each pair of inputs (2j, 2j+1) 8 bytes, one per output, low nibble for input 2j;
 *   q8 (dspark_rowgemm_q8): w = q * d, q in -128..127; record = d[8] (float32), then for each
 *      input 8 signed bytes, one per output.
 * The products and sums are float32 operations done one at a time (no contraction), exactly as
 * torch computes them when cpu_kernels.py checks that the codes rebuild the weight bit for bit,
 * so these entry points give the same results as the float32 one from a fifth or a quarter of
 * the bytes.
 *
 * Each output y[m][o] is one FMA chain over i = 0 .. in-1 (then the bias): the same operations
 * whatever the number of rows, so a row's result does not depend on the other rows of the call.
 *
 * Built by dspark/models/cpu_kernels.py with:
 *     cc -O2 -mavx2 -mfma -mf16c -ffp-contract=off -shared -fPIC [-fopenmp]
 * -fopenmp only with GCC: the library then shares torch's libgomp (same soname, already loaded),
 * hence torch's thread pool, rather than starting a second pool that would fight it for cores.
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

/* y[m][8(p+q) ..] = acc[m][q] (+ bias) for the M x PB accumulators of a block */
#define STORE_ACCUMULATORS(M, PB)                                                                  \
    _Pragma("GCC unroll 8") for (int q = 0; q < PB; q++) {                                         \
        long o = (p + q) * 8;                                                                      \
        int n = out - o < 8 ? (int)(out - o) : 8;                                                  \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                        \
            store(y + m * out + o, acc[m][q], b ? b + o : 0, n);                                   \
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
        STORE_ACCUMULATORS(M, PB)                                                                  \
    }

/* panels p0 .. p1-1 for M rows (1 <= M <= 8): blocks of PB panels (M x PB accumulators), then
 * single panels */
#define SPAN(T, TY, M, PB)                                                                  \
    static void span_##T##_##M##_##PB(const float *x, const TY *wp, const float *b, float *y, \
                                      long in, long out, long p0, long p1) {                \
        long p = p0;                                                                        \
        for (; p + PB <= p1; p += PB) block_##T##_##M##_##PB(x, wp, b, y, in, out, p);      \
        for (; p < p1; p++) block_##T##_##M##_1(x, wp, b, y, in, out, p);                   \
    }

/* The block shapes (M rows, PB panels) every weight type is compiled with: at most 12
 * accumulators, so they stay in the 16 vector registers beside the weights and broadcasts. Which
 * one is fastest for M rows depends on the CPU (docs/BENCHMARKS.md, sessions 29-30): more panels per
 * block give more independent FMA chains (latency hidden), more streams of weights and more
 * register pressure. The results never depend on the choice: each output is the same FMA chain
 * whatever block holds it. */
#define MAX_PB 8
#define SHAPES(X, T, TY)                                                                           \
    X(T, TY, 1, 1) X(T, TY, 1, 2) X(T, TY, 1, 4) X(T, TY, 1, 8)                                    \
    X(T, TY, 2, 1) X(T, TY, 2, 2) X(T, TY, 2, 4)                                                   \
    X(T, TY, 3, 1) X(T, TY, 3, 2) X(T, TY, 3, 3) X(T, TY, 3, 4)                                    \
    X(T, TY, 4, 1) X(T, TY, 4, 2) X(T, TY, 4, 3)                                                   \
    X(T, TY, 5, 1) X(T, TY, 5, 2) X(T, TY, 6, 1) X(T, TY, 6, 2)                                    \
    X(T, TY, 7, 1) X(T, TY, 8, 1)
#define TABLE_ENTRY(T, TY, M, PB) [M][PB] = span_##T##_##M##_##PB,

/* the span table of one weight type, its current choice per row count (initialised to the
 * defaults D1..D8, panels per block for 1..8 rows), NAME_set_block(m, pb), which sets the
 * choice for m rows and returns 1, or 0 (nothing changed) for a shape not compiled, and
 * NAME_get_block(m), the panels per block in use for m rows (0 for m out of range) */
#define CHOICE(T, TY, NAME, D1, D2, D3, D4, D5, D6, D7, D8)                                         \
    typedef void (*span_##T##_fn)(const float *, const TY *, const float *, float *, long, long,   \
                                  long, long);                                                     \
    static const span_##T##_fn TABLE_##T[ROW_GROUP + 1][MAX_PB + 1] = {SHAPES(TABLE_ENTRY, T, TY)}; \
    static span_##T##_fn SPANS_##T[ROW_GROUP + 1] = {0, span_##T##_1_##D1, span_##T##_2_##D2,      \
        span_##T##_3_##D3, span_##T##_4_##D4, span_##T##_5_##D5, span_##T##_6_##D6,                \
        span_##T##_7_##D7, span_##T##_8_##D8};                                                     \
    int NAME##_set_block(long m, long pb)                                                          \
    {                                                                                              \
        if (m < 1 || m > ROW_GROUP || pb < 1 || pb > MAX_PB || !TABLE_##T[m][pb]) return 0;        \
        SPANS_##T[m] = TABLE_##T[m][pb];                                                           \
        return 1;                                                                                  \
    }                                                                                              \
    int NAME##_get_block(long m)                                                                   \
    {                                                                                              \
        if (m < 1 || m > ROW_GROUP) return 0;                                                      \
        for (int pb = 1; pb <= MAX_PB; pb++)                                                       \
            if (TABLE_##T[m][pb] && TABLE_##T[m][pb] == SPANS_##T[m]) return pb;                   \
        return 0;                                                                                  \
    }

/* the entry point of one weight type: y [rows, out] = x [rows, in] @ W.T (+ b [out] or NULL),
 * all contiguous. The panels are split evenly between `threads` OpenMP threads (the pool torch
 * itself uses, when built with -fopenmp; one thread otherwise); each thread walks its share in
 * tiles of panels small enough to stay in the L2 cache while every group of 8 rows passes */
#define ENTRY(T, TY, NAME, PANEL_BYTES)                                                            \
    void NAME(const float *x, const TY *wp, const float *b, float *y, long rows, long in, long out, \
              long threads)                                                                        \
    {                                                                                              \
        long panels = (out + 7) / 8;                                                               \
        long tile = TILE_BYTES / (PANEL_BYTES);                                                    \
        if (tile < 4) tile = 4;                                                                    \
        if (threads > panels) threads = panels;                                                    \
        if (threads < 1) threads = 1;                                                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static, 1)")                       \
        for (long t = 0; t < threads; t++) {                                                       \
            long first = panels * t / threads, last = panels * (t + 1) / threads;                  \
            for (long p0 = first; p0 < last; p0 += tile) {                                         \
                long p1 = p0 + tile < last ? p0 + tile : last;                                     \
                for (long m0 = 0; m0 < rows; m0 += ROW_GROUP) {                                    \
                    long m = rows - m0 < ROW_GROUP ? rows - m0 : ROW_GROUP;                        \
                    SPANS_##T[m](x + m0 * in, wp, b, y + m0 * out, in, out, p0, p1);               \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* every block and span of one weight type, the span table, and the entry point:
 * x [rows, in], wp [ceil(out / 8), in, 8] (zero-padded), b [out] or NULL, y [rows, out];
 * all contiguous */
#define BLOCKS(T, TY, M, PB) BLOCK(T, TY, M, PB)
#define SPANS(T, TY, M, PB) SPAN(T, TY, M, PB)
#define KERNEL(T, TY, NAME)                                                                        \
    SHAPES(BLOCKS, T, TY)                                                                          \
    SHAPES(SPANS, T, TY)                                                                           \
    CHOICE(T, TY, NAME, 4, 4, 3, 2, 2, 2, 1, 1)                                                    \
    ENTRY(T, TY, NAME, in * 8 * (long)sizeof(TY))

KERNEL(f32, float, dspark_rowgemm)
KERNEL(f16, uint16_t, dspark_rowgemm_f16)

/* 1 when built with OpenMP (the entry points use `threads` threads), else 0 (one thread) */
int dspark_rowgemm_openmp(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ---- block-quantized panels: records of 32 inputs x 8 outputs ---- */

#define QBLOCK_INPUTS 32
#define RECORD_q4 192 /* 8 d + 8 m float32, 16 x 8 code bytes */
#define RECORD_q8 288 /* 8 d float32, 32 x 8 code bytes */

/* the weights of inputs 2j and 2j+1 for the record's 8 outputs */
static inline __attribute__((always_inline)) void pair_q4(const uint8_t *rec, int j, __m256 *w0, __m256 *w1)
{
    __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rec + 64 + 8 * j)));
    __m256 d = _mm256_loadu_ps((const float *)rec), m = _mm256_loadu_ps((const float *)(rec + 32));
    __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(codes, _mm256_set1_epi32(15)));
    __m256 q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(codes, 4));
    *w0 = _mm256_add_ps(_mm256_mul_ps(q0, d), m);
    *w1 = _mm256_add_ps(_mm256_mul_ps(q1, d), m);
}

static inline __attribute__((always_inline)) void pair_q8(const uint8_t *rec, int j, __m256 *w0, __m256 *w1)
{
    __m256 d = _mm256_loadu_ps((const float *)rec);
    const uint8_t *codes = rec + 32 + 16 * j;
    *w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)codes))), d);
    *w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8)))), d);
}

/* as BLOCK, from records: panel p's records for blocks 0 .. in/32-1 are contiguous; each
 * accumulator takes input i then i+1, so the FMA chain is the float32 kernel's */
#define QBLOCK(T, M, PB)                                                                           \
    static inline __attribute__((always_inline)) void block_##T##_##M##_##PB(                     \
        const float *x, const uint8_t *wp, const float *b, float *y, long in, long out, long p) {  \
        __m256 acc[M][PB];                                                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                        \
            _Pragma("GCC unroll 8") for (int q = 0; q < PB; q++) acc[m][q] = _mm256_setzero_ps();  \
        long blocks = in / QBLOCK_INPUTS;                                                          \
        for (long k = 0; k < blocks; k++) {                                                        \
            const float *xk = x + k * QBLOCK_INPUTS;                                               \
            for (int j = 0; j < QBLOCK_INPUTS / 2; j++) {                                          \
                _Pragma("GCC unroll 8") for (int q = 0; q < PB; q++) {                             \
                    __m256 w0, w1;                                                                 \
                    pair_##T(wp + ((p + q) * blocks + k) * RECORD_##T, j, &w0, &w1);               \
                    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                          \
                        acc[m][q] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xk + m * in + 2 * j),  \
                                                    acc[m][q]);                                    \
                        acc[m][q] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xk + m * in + 2 * j + 1), \
                                                    acc[m][q]);                                    \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        STORE_ACCUMULATORS(M, PB)                                                                  \
    }

/* x [rows, in] (in a multiple of 32), wp [ceil(out / 8)][in / 32][record], b [out] or NULL,
 * y [rows, out]. The default shapes are those measured best on a 2-core AMD EPYC (Zen 3): one row
 * takes 8 panels at a time (8 independent FMA chains while the weights stream in), 2-8 rows one
 * panel at a time; there, blocks of 2-4 panels for 2-6 rows made the embedded target's forward of
 * 4 rows take 54-56 ms instead of 33-38 (docs/BENCHMARKS.md, session 22). On a 2-core Intel Xeon
 * with AVX-512 the same one-panel blocks left 2 rows at 1.9x the time of one, and blocks of 2-4
 * panels brought it to 1.2-1.3x (session 29); on the AMD EPYC of session 30, timed on the
 * model's own weights, 4 panels for 2-3 rows made those forwards 7-15 % faster and 2-4 panels for
 * 4-6 rows slower. Hence the choice per machine and model (cpu_kernels.py, `tuned_blocks`).
 * The results are the same either way: a block size only groups outputs, each output's FMA
 * chain is unchanged. */
#define QBLOCKS(T, TY, M, PB) QBLOCK(T, M, PB)
#define QKERNEL(T, NAME)                                                                           \
    SHAPES(QBLOCKS, T, uint8_t)                                                                    \
    SHAPES(SPANS, T, uint8_t)                                                                      \
    CHOICE(T, uint8_t, NAME, 8, 1, 1, 1, 1, 1, 1, 1)                                               \
    ENTRY(T, uint8_t, NAME, (in / QBLOCK_INPUTS) * RECORD_##T)

QKERNEL(q4, dspark_rowgemm_q4)
QKERNEL(q8, dspark_rowgemm_q8)
