/* The native kernels' checks for a target this machine cannot run natively (AArch64, under qemu-user):
 * arm_kernels.py writes the cases (inputs, the torch twins' reference outputs with a bound, the x86
 * build's outputs), this driver runs each kernel on them and checks
 *   close      every output within atol + rtol * |reference| of the reference
 *   invariant  every row computed alone (a decode of one sequence) gives the batched row's bits
 *   x86 bits   the GEMMs' and LoRA's outputs equal the x86 build's bit for bit (simd.h: the same integer
 *              sums and float steps on every target; lora.c: every lane its own sum in a fixed order);
 *              attention and the layer ops are vectorized by the compiler for each target, so for them
 *              it is only reported
 * and exits 1 if any check fails.  Usage: driver cases.bin */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "lora.h"

void qgemm_f32(const float *x, int64_t ldx, const uint8_t *w, int qtype, const float *bias, float *out, int64_t ldo,
               int64_t M, int64_t N, int64_t K);
void qgemm_bf16(const uint16_t *x, int64_t ldx, const uint8_t *w, int qtype, const float *bias, uint16_t *out,
                int64_t ldo, int64_t M, int64_t N, int64_t K);
void gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *out, int64_t ldo, int64_t M,
              int64_t N, int64_t K);
void gemm_bf16(const uint16_t *x, int64_t ldx, const uint32_t *w, const float *bias, uint16_t *out, int64_t ldo,
               int64_t M, int64_t N, int64_t K);
typedef void attention_fn(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                          const float *k_scale, const float *v_scale, const int64_t *block_tables, int64_t max_blocks,
                          const int64_t *span_starts, const int64_t *span_lens, const int64_t *span_ctx0,
                          int64_t spans, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                          float scale, int64_t window, float softcap, const float *sinks, void *out);
attention_fn paged_attention_f32, paged_attention_bf16;
typedef void rms_fn(const void *delta, void *residual, const void *weight, void *out, int64_t tokens, int64_t hidden,
                    float eps);
rms_fn add_rms_norm_f32, add_rms_norm_bf16;
typedef void silu_fn(const void *gate_up, void *out, int64_t tokens, int64_t inter);
silu_fn silu_and_mul_f32, silu_and_mul_bf16;
typedef void lora_fn(const void *x, int64_t x_stride, void *out, int64_t out_stride, int64_t k, int64_t n,
                     int64_t n_pad, int64_t num_segments, const int64_t *starts, const int64_t *lens,
                     const int64_t *weights);
lora_fn lora_f32, lora_bf16;
const char *simd_target(void);

enum { QGEMM = 1, GEMM, ATTENTION, RMS_NORM, SILU, LORA };  /* arm_kernels.py's kinds */
#define MAX_ARRAYS 9

typedef struct {
    char name[48];
    int32_t kind, bf16;
    int64_t p[8];
    float f[4];  /* atol, rtol, then per kind (attention's scale, the norm's eps) */
    int32_t count;
    void *a[MAX_ARRAYS];
    int64_t bytes[MAX_ARRAYS];
} Case;

static int read_case(FILE *in, Case *c) {
    if (fread(c->name, 48, 1, in) != 1) return 0;
    if (fread(&c->kind, 4, 1, in) != 1 || fread(&c->bf16, 4, 1, in) != 1 || fread(c->p, 8, 8, in) != 8 ||
        fread(c->f, 4, 4, in) != 4 || fread(&c->count, 4, 1, in) != 1 || c->count > MAX_ARRAYS) {
        fprintf(stderr, "truncated case file\n");
        exit(2);
    }
    for (int i = 0; i < c->count; i++) {
        if (fread(&c->bytes[i], 8, 1, in) != 1) exit(2);
        c->a[i] = malloc((size_t)c->bytes[i] + 64);  /* 64: kernels may read a vector past a short array */
        if ((int64_t)fread(c->a[i], 1, (size_t)c->bytes[i], in) != c->bytes[i]) exit(2);
    }
    return 1;
}

/* Element i of an output in the case's dtype, as float. */
static float value(const Case *c, const void *out, int64_t i) {
    return c->bf16 ? bf16_to_float(((const uint16_t *)out)[i]) : ((const float *)out)[i];
}

/* How many of n outputs lie outside the bound around the float32 reference. */
static int64_t outside(const Case *c, const void *out, const float *ref, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(value(c, out, i) - ref[i]) <= c->f[0] + c->f[1] * fabsf(ref[i]))) bad++;
    return bad;
}

static int64_t elem(const Case *c) { return c->bf16 ? 2 : 4; }

/* Runs the case's kernel on rows [first, first + rows) of its inputs into out (those rows of the output). */
static void run(const Case *c, int64_t first, int64_t rows, void *out) {
    const int64_t e = elem(c);
    if (c->kind == QGEMM) {
        const int64_t N = c->p[2], K = c->p[3];
        const char *x = (const char *)c->a[0] + first * K * e;
        if (c->bf16) qgemm_bf16((const uint16_t *)x, K, c->a[1], (int)c->p[0], c->a[2], out, N, rows, N, K);
        else qgemm_f32((const float *)x, K, c->a[1], (int)c->p[0], c->a[2], out, N, rows, N, K);
    } else if (c->kind == GEMM) {
        const int64_t N = c->p[1], K = c->p[2];
        const char *x = (const char *)c->a[0] + first * K * e;
        if (c->bf16) gemm_bf16((const uint16_t *)x, K, c->a[1], c->a[2], out, N, rows, N, K);
        else gemm_f32((const float *)x, K, c->a[1], c->a[2], out, N, rows, N, K);
    } else if (c->kind == RMS_NORM) {
        const int64_t hidden = c->p[1];
        char *residual = malloc((size_t)(rows * hidden * e));  /* updated in place: a fresh copy per call */
        memcpy(residual, (const char *)c->a[1] + first * hidden * e, (size_t)(rows * hidden * e));
        (c->bf16 ? add_rms_norm_bf16 : add_rms_norm_f32)((const char *)c->a[0] + first * hidden * e, residual,
                                                         c->a[2], out, rows, hidden, c->f[2]);
        free(residual);
    } else {  /* SILU */
        const int64_t inter = c->p[1];
        (c->bf16 ? silu_and_mul_bf16 : silu_and_mul_f32)((const char *)c->a[0] + first * 2 * inter * e, out, rows,
                                                         inter);
    }
}

/* Attention: the whole step, then each query alone as a decode at its position. */
static int check_attention(const Case *c, void *out, int *same_as_x86) {
    const int64_t heads = c->p[0], kv_heads = c->p[1], head_dim = c->p[2], block_size = c->p[3];
    const int64_t max_blocks = c->p[4], spans = c->p[5], T = c->p[6], row = heads * head_dim * elem(c);
    const int64_t *tables = c->a[3], *starts = c->a[4], *lens = c->a[5], *ctx0 = c->a[6];
    attention_fn *fn = c->bf16 ? paged_attention_bf16 : paged_attention_f32;
    memset(out, 0, (size_t)(T * row));
    fn(c->a[0], heads * head_dim, c->a[1], c->a[2], NULL, NULL, tables, max_blocks, starts, lens, ctx0, spans,
       heads, kv_heads, head_dim, block_size, c->f[2], 0, 0.f, NULL, out);
    int invariant = 1;
    char *alone = malloc((size_t)row);
    for (int64_t s = 0; s < spans; s++)
        for (int64_t i = 0; i < lens[s]; i++) {
            const int64_t r = starts[s] + i, zero = 0, one = 1, ctx = ctx0[s] + i;
            fn((const char *)c->a[0] + r * row, heads * head_dim, c->a[1], c->a[2], NULL, NULL, tables + s * max_blocks,
               max_blocks, &zero, &one, &ctx, 1, heads, kv_heads, head_dim, block_size, c->f[2], 0, 0.f, NULL, alone);
            invariant &= !memcmp(alone, (char *)out + r * row, (size_t)row);
        }
    free(alone);
    *same_as_x86 = !memcmp(out, c->a[8], (size_t)(T * row));
    const int64_t bad = outside(c, out, c->a[7], T * heads * head_dim);
    if (bad) printf("  %lld outputs outside the bound\n", (long long)bad);
    if (!invariant) printf("  a query alone differs from the same query in the step\n");
    return !bad && invariant;
}

/* LoRA: the step's segments in one call, then each row alone (a segment of one row); a row of no adapter,
 * or of one that leaves the layer alone, must keep its base bits. Arrays: x, base, segments [s][3]
 * (first row, rows, adapter or -1), the adapters' padded ranks, their AT, BT and bands one after
 * another, the reference and the x86 output. */
static int check_lora(const Case *c, void *out, int *same_as_x86) {
    const int64_t rows = c->p[0], k = c->p[1], n = c->p[2], n_pad = c->p[3], segments = c->p[4], e = elem(c);
    const int64_t *seg = c->a[2], *ranks = c->a[3], adapters = c->bytes[3] / 8, chunks = n_pad / LORA_CHUNK;
    lora_fn *fn = c->bf16 ? lora_bf16 : lora_f32;
    int64_t address[adapters][4];  /* per adapter: AT, BT, bands, padded rank (csrc/lora.c's weights) */
    for (int64_t a = 0, at = 0, bt = 0; a < adapters; at += k * ranks[a] * e, bt += ranks[a] * n_pad * e, a++) {
        address[a][0] = (int64_t)(intptr_t)((char *)c->a[4] + at);
        address[a][1] = (int64_t)(intptr_t)((char *)c->a[5] + bt);
        address[a][2] = (int64_t)(intptr_t)((int64_t *)c->a[6] + a * chunks * 2);
        address[a][3] = ranks[a];
    }
    int64_t starts[segments], lens[segments], weights[segments][4], owner[rows];
    for (int64_t r = 0; r < rows; r++) owner[r] = -1;
    for (int64_t s = 0; s < segments; s++) {
        const int64_t a = seg[3 * s + 2];
        starts[s] = seg[3 * s], lens[s] = seg[3 * s + 1];
        for (int j = 0; j < 4; j++) weights[s][j] = a >= 0 ? address[a][j] : 0;
        for (int64_t r = starts[s]; r < starts[s] + lens[s] && a >= 0; r++) owner[r] = s;
    }
    memcpy(out, c->a[1], (size_t)(rows * n * e));
    fn(c->a[0], k, out, n, k, n, n_pad, segments, starts, lens, &weights[0][0]);
    int invariant = 1;
    char *alone = malloc((size_t)(n * e));
    for (int64_t r = 0; r < rows; r++) {
        const int64_t s = owner[r], zero = 0, one = 1;
        memcpy(alone, (const char *)c->a[1] + r * n * e, (size_t)(n * e));
        if (s >= 0) fn((const char *)c->a[0] + r * k * e, k, alone, n, k, n, n_pad, 1, &zero, &one, weights[s]);
        invariant &= !memcmp(alone, (char *)out + r * n * e, (size_t)(n * e));
    }
    free(alone);
    *same_as_x86 = !memcmp(out, c->a[8], (size_t)(rows * n * e));
    const int64_t bad = outside(c, out, c->a[7], rows * n);
    if (bad) printf("  %lld of %lld outputs outside the bound\n", (long long)bad, (long long)(rows * n));
    if (!invariant) printf("  a row alone differs from the same row among %lld\n", (long long)rows);
    if (!*same_as_x86) printf("  not the x86 build's bits\n");
    return !bad && invariant && *same_as_x86;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s cases.bin\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[1], "rb");
    if (!in) {
        perror(argv[1]);
        return 2;
    }
    printf("kernels built for simd.h's %s section\n", simd_target());
    int failed = 0, total = 0;
    Case c;
    while (read_case(in, &c)) {
        total++;
        int ok, same;
        const char *x86_note = "";
        if (c.kind == ATTENTION) {
            void *out = malloc((size_t)c.bytes[8]);
            ok = check_attention(&c, out, &same);
            free(out);
        } else if (c.kind == LORA) {
            void *out = malloc((size_t)c.bytes[8]);
            ok = check_lora(&c, out, &same);
            free(out);
        } else {
            /* rows and output width: the reference (float32) holds rows x width values */
            const int64_t rows = c.kind == QGEMM ? c.p[1] : c.p[0];
            const int64_t width = c.kind == QGEMM ? c.p[2] : c.p[1];
            const int ref = c.kind == SILU ? 1 : 3, x86 = c.kind == SILU ? 2 : 4;
            const int64_t row_bytes = width * elem(&c);
            char *out = malloc((size_t)(rows * row_bytes)), *alone = malloc((size_t)row_bytes);
            run(&c, 0, rows, out);
            const int64_t bad = outside(&c, out, c.a[ref], rows * width);
            int invariant = 1;
            for (int64_t r = 0; r < rows; r++) {
                run(&c, r, 1, alone);
                invariant &= !memcmp(alone, out + r * row_bytes, (size_t)row_bytes);
            }
            same = !memcmp(out, c.a[x86], (size_t)(rows * row_bytes));
            if (bad) printf("  %lld of %lld outputs outside the bound\n", (long long)bad, (long long)(rows * width));
            if (!invariant) printf("  a row alone differs from the same row among %lld\n", (long long)rows);
            ok = !bad && invariant;
            if (c.kind == QGEMM || c.kind == GEMM) {
                if (!same) printf("  not the x86 build's bits\n");
                ok &= same;
            }
            free(out);
            free(alone);
        }
        if (c.kind != QGEMM && c.kind != GEMM && c.kind != LORA)
            x86_note = same ? " (the x86 build's bits)" : " (not the x86 build's bits: compiler-vectorized)";
        printf("%s %s%s\n", ok ? "ok  " : "FAIL", c.name, x86_note);
        failed += !ok;
        for (int i = 0; i < c.count; i++) free(c.a[i]);
    }
    fclose(in);
    printf("%d of %d cases passed\n", total - failed, total);
    return failed ? 1 : 0;
}
