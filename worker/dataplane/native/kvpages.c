/* Copies between an engine's KV pages and Strata's blocks, for the page layouts of vLLM's CPU
 * attention (worker/dataplane/connectors/pages.py names them), included by copyhash.c.
 *
 * A page of one layer holds, per kv head, K then V of page_tokens tokens, each laid out as the
 * attention kernels read them; a block holds tokens as [tokens, kv_heads, head_dim]. Moving a
 * token's K or V between the two is a small transpose or interleave per page and head (a few
 * KiB, in L1), which a general strided copy does one element at a time with its index arithmetic
 * per element; here K goes through squares of 16 tokens x 16 dimensions, read and written in
 * contiguous runs on both sides, and V in whole rows or pairs of rows. */

enum {
    STRATA_KV_VEC = 0, /* K as [head_dim, page_tokens]; V as [page_tokens, head_dim] */
    STRATA_KV_AMX = 1, /* K as [n/16][head_dim/2][16][2]; V as [head_dim/16][n/2][16][2] */
};

struct strata_kv_geometry {
    uint64_t elem;             /* bytes per element: 2 (bfloat16, float16) or 4 (float32) */
    uint64_t heads;            /* kv heads */
    uint64_t dim;              /* head_dim */
    uint64_t page_tokens;      /* tokens per page */
    uint64_t page_stride;      /* bytes from one page to the next */
    uint64_t head_stride;      /* bytes from one head's K (or V) to the next head's, in a page */
    uint64_t block_tokens;     /* tokens per block on the block side */
    uint64_t block_stride;     /* bytes from one block's first token to the next block's */
    uint64_t token_stride;     /* bytes from one token to the next inside a block */
};

/* Token t's row (kv_heads x head_dim) on the block side. */
static inline char *strata_kv_row(const struct strata_kv_geometry *g, char *tokens, uint64_t t)
{
    return tokens + (t / g->block_tokens) * g->block_stride + (t % g->block_tokens) * g->token_stride;
}

/* K of cpu-vec: column t of a [dim, page_tokens] matrix is token t's head_dim values. A tile of
 * 16 tokens x 16 dimensions at a time goes through a local square, so both the rows of the
 * block side and the columns' runs of 16 tokens are read and written whole. */
#define STRATA_KV_VEC_K(type)                                                                      \
    static void strata_kv_vec_k_##type(type *page, type *const *rows, uint64_t tokens, uint64_t n, \
                                       uint64_t dim, int to_page)                                  \
    {                                                                                              \
        type square[16][16];                                                                       \
        for (uint64_t d0 = 0; d0 < dim; d0 += 16) {                                                \
            uint64_t width = dim - d0 < 16 ? dim - d0 : 16;                                         \
            if (to_page) {                                                                         \
                for (uint64_t t = 0; t < tokens; t++)                                              \
                    for (uint64_t d = 0; d < width; d++)                                           \
                        square[d][t] = rows[t][d0 + d];                                            \
                for (uint64_t d = 0; d < width; d++)                                               \
                    memcpy(page + (d0 + d) * n, square[d], tokens * sizeof(type));                 \
            } else {                                                                               \
                for (uint64_t d = 0; d < width; d++)                                               \
                    memcpy(square[d], page + (d0 + d) * n, tokens * sizeof(type));                 \
                for (uint64_t t = 0; t < tokens; t++)                                              \
                    for (uint64_t d = 0; d < width; d++)                                           \
                        rows[t][d0 + d] = square[d][t];                                            \
            }                                                                                      \
        }                                                                                          \
    }
STRATA_KV_VEC_K(uint16_t)
STRATA_KV_VEC_K(uint32_t)

/* Token t's K or V of head h on the block side. */
#define STRATA_KV_AT(g, tokens, t, h) (strata_kv_row(g, tokens, t) + (h) * (g)->dim * (g)->elem)

/* K of tokens [0, count) of consecutive pages (the first at `page`, at the part's offset) to or
 * from tokens [skip, skip + count) of the block side (`tokens`: a block's token 0). Whole tokens
 * only: where count ends inside a page, that page's other tokens are left as they are. */
static void strata_kv_copy_k(int layout, int to_page, const struct strata_kv_geometry *g, char *page,
                             char *tokens, uint64_t skip, uint64_t count)
{
    const uint64_t n = g->page_tokens, dim = g->dim;
    for (uint64_t first = 0; first < count; first += n) {
        char *p = page + (first / n) * g->page_stride;
        uint64_t in_page = count - first < n ? count - first : n;
        for (uint64_t h = 0; h < g->heads; h++) {
            char *ph = p + h * g->head_stride;
            for (uint64_t t0 = 0; t0 < in_page; t0 += 16) {
                uint64_t width = in_page - t0 < 16 ? in_page - t0 : 16;
                char *rows[16];
                for (uint64_t t = 0; t < width; t++)
                    rows[t] = STRATA_KV_AT(g, tokens, skip + first + t0 + t, h);
                if (layout == STRATA_KV_AMX)
                    /* A group of 16 tokens is [dim/2][16] pairs of dimensions (4 bytes): a K of
                     * vec's shape, 16 tokens long, in 32-bit words. */
                    strata_kv_vec_k_uint32_t((uint32_t *)ph + (t0 / 16) * (dim / 2) * 16,
                                             (uint32_t *const *)rows, width, 16, dim / 2, to_page);
                else if (g->elem == 2)
                    strata_kv_vec_k_uint16_t((uint16_t *)ph + t0, (uint16_t *const *)rows, width, n, dim,
                                             to_page);
                else
                    strata_kv_vec_k_uint32_t((uint32_t *)ph + t0, (uint32_t *const *)rows, width, n, dim,
                                             to_page);
            }
        }
    }
}

/* V, as strata_kv_copy_k copies K. cpu-vec: rows of head_dim, a plain copy per token. cpu-amx:
 * per 16 dimensions, pairs of tokens interleaved ([16 dims][2 tokens] per pair), so two tokens'
 * 16 values are zipped into 32; a lone last token of an odd count fills its half of the pair. */
static void strata_kv_copy_v(int layout, int to_page, const struct strata_kv_geometry *g, char *page,
                             char *tokens, uint64_t skip, uint64_t count)
{
    const uint64_t n = g->page_tokens, dim = g->dim, row = dim * g->elem;
    for (uint64_t first = 0; first < count; first += n) {
        char *p = page + (first / n) * g->page_stride;
        uint64_t in_page = count - first < n ? count - first : n;
        for (uint64_t h = 0; h < g->heads; h++) {
            char *ph = p + h * g->head_stride;
            if (layout == STRATA_KV_VEC) {
                for (uint64_t t = 0; t < in_page; t++) {
                    char *at = STRATA_KV_AT(g, tokens, skip + first + t, h);
                    if (to_page)
                        memcpy(ph + t * row, at, row);
                    else
                        memcpy(at, ph + t * row, row);
                }
                continue;
            }
            for (uint64_t t = 0; t < in_page; t += 2) {
                uint16_t *a = (uint16_t *)STRATA_KV_AT(g, tokens, skip + first + t, h);
                int pair = t + 1 < in_page;
                uint16_t *b = pair ? (uint16_t *)STRATA_KV_AT(g, tokens, skip + first + t + 1, h) : NULL;
                for (uint64_t d0 = 0; d0 < dim; d0 += 16) {
                    uint16_t *at = (uint16_t *)ph + (d0 / 16) * (n / 2) * 32 + (t / 2) * 32;
                    if (to_page && pair) {
                        for (int j = 0; j < 16; j++) {
                            at[2 * j] = a[d0 + j];
                            at[2 * j + 1] = b[d0 + j];
                        }
                    } else if (to_page) {
                        for (int j = 0; j < 16; j++)
                            at[2 * j] = a[d0 + j];
                    } else {
                        for (int j = 0; j < 16; j++)
                            a[d0 + j] = at[2 * j];
                        if (pair)
                            for (int j = 0; j < 16; j++)
                                b[d0 + j] = at[2 * j + 1];
                    }
                }
            }
        }
    }
}

/* Copy `count` tokens of K (part 0) or V (part 1) between `pages` (the address of the first of
 * consecutive pages of one layer, at the part's offset: V's is page_tokens * head_dim elements
 * in) and tokens [skip, skip + count) of the block side (`tokens`: a block's token 0). to_page:
 * block to pages (a load's scatter), else pages to block (a save's gather). Returns 0, or -1 for
 * a geometry the layout cannot have. Runs without the interpreter lock (ctypes). */
int strata_kv_pages(int layout, int part, int to_page, const struct strata_kv_geometry *g, uint64_t pages,
                    uint64_t tokens, uint64_t skip, uint64_t count)
{
    const uint64_t n = g->page_tokens, dim = g->dim, e = g->elem;
    if ((layout != STRATA_KV_VEC && layout != STRATA_KV_AMX) || (e != 2 && e != 4) || n == 0 || dim == 0 ||
        g->block_tokens == 0)
        return -1;
    if (layout == STRATA_KV_AMX && (e != 2 || n % 16 || dim % 16))
        return -1;
    char *page = (char *)(uintptr_t)pages, *block = (char *)(uintptr_t)tokens;
    if (part == 0)
        strata_kv_copy_k(layout, to_page, g, page, block, skip, count);
    else
        strata_kv_copy_v(layout, to_page, g, page, block, skip, count);
    return 0;
}
