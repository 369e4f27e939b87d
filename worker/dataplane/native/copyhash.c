/* Fused copy and xxh3-128 of many memory spans in one call, without the Python interpreter.
 *
 * Each span is copied chunk by chunk where it has a destination (with non-temporal stores for
 * large spans), and each chunk is hashed right after, while the source bytes the copy just
 * read are still in cache: memory sees one read of the source and one write of the
 * destination, as a plain large memcpy does, and the hash runs at cache speed. Loaded with
 * ctypes, so the interpreter lock is released for the whole call. Built twice: for any x86-64
 * (SSE2) and, in copyhash_avx2.c, with AVX2, which the loader picks where the CPU has it.
 *
 * strata_read_hash reads many spans of files (pread, straight into their destinations) and
 * hashes each as it lands, the same way, in one call: the many small reads of layer-wise
 * loading cost one call instead of several interpreter steps each, and never hold the lock.
 *
 * strata_copy_hash_pooled shares one batch of spans between its caller and helper threads that
 * stay awake a moment between batches (see below), so even one small block's copy runs on every
 * core.
 *
 * strata_pool_read is the host tier's verified read of many blocks out of its shared pool in one
 * call: the slot checks before and after the copy, the copy and hash, and the comparisons with
 * the stored checksums, with no interpreter step per block or per layer.
 *
 * strata_kv_pages (kvpages.c) copies K and V between vLLM's CPU attention pages, as its kernels
 * lay them out, and Strata's blocks.
 *
 * Digests are the canonical (big-endian) XXH3 128-bit form, byte for byte what Python's
 * xxhash.xxh3_128(prefix + data).digest() returns. */

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Copied, then hashed while still in L1. One page fits any L1d; with a small L1d the hash reads
 * a 64 KiB chunk back from L2, and elsewhere 4-64 KiB make no consistent difference
 * (benchmarks/README.md). */
#define STRATA_CHUNK_BYTES (4 * 1024)

enum {
    STRATA_DIGEST = 1,      /* hash every span */
    STRATA_NONTEMPORAL = 2, /* copy large spans with streaming stores */
};

static void copy_streaming(char *dst, const char *src, size_t n)
{
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

/* strata_copy_hash (below), returning how many spans this thread did, or -1. */
static long copy_hash_spans(size_t count, const uint64_t *src, const uint64_t *dst,
                            const uint64_t *nbytes, const unsigned char *prefixes,
                            const uint64_t *prefix_offsets, int flags,
                            size_t streaming_min_bytes, unsigned char *digests, uint64_t *next)
{
    XXH3_state_t state;
    int digest = flags & STRATA_DIGEST;
    long done = 0;
    for (size_t in_order = 0;; in_order++, done++) {
        size_t i = next ? (size_t)__atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : in_order;
        if (i >= count)
            break;
        const char *s = (const char *)(uintptr_t)src[i];
        char *d = (char *)(uintptr_t)dst[i];
        size_t n = (size_t)nbytes[i];
        int streaming = (flags & STRATA_NONTEMPORAL) && n >= streaming_min_bytes;
        if (!digest) {
            if (d != NULL && n) {
                if (streaming)
                    copy_streaming(d, s, n);
                else
                    memcpy(d, s, n);
            }
            continue;
        }
        if (XXH3_128bits_reset(&state) != XXH_OK)
            return -1;
        XXH3_128bits_update(&state, prefixes + prefix_offsets[i],
                            (size_t)(prefix_offsets[i + 1] - prefix_offsets[i]));
        for (size_t off = 0; off < n; off += STRATA_CHUNK_BYTES) {
            size_t m = n - off < STRATA_CHUNK_BYTES ? n - off : STRATA_CHUNK_BYTES;
            if (d != NULL) {
                if (streaming)
                    copy_streaming(d + off, s + off, m);
                else
                    memcpy(d + off, s + off, m);
            }
            XXH3_128bits_update(&state, s + off, m);
        }
        XXH128_canonical_t canonical;
        XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state));
        memcpy(digests + 16 * i, canonical.digest, 16);
    }
#if defined(__SSE2__)
    _mm_sfence(); /* streaming stores are visible to other threads once the call returns */
#endif
    return done;
}

/* Copies (where dst[i] is not 0) and hashes (with STRATA_DIGEST) span i for every i, its digest
 * at digests + 16 i. With `next` NULL the spans run in order. Otherwise several threads may call
 * this at once with the same arguments: each claims the next unclaimed span from *next until none
 * is left, so a thread that starts late (woken after the others began) takes fewer spans instead
 * of making the others wait for its fixed share. Returns 0, or -1 when a hash state could not be
 * set up (never on supported platforms). */
int strata_copy_hash(size_t count, const uint64_t *src, const uint64_t *dst,
                     const uint64_t *nbytes, const unsigned char *prefixes,
                     const uint64_t *prefix_offsets, int flags, size_t streaming_min_bytes,
                     unsigned char *digests, uint64_t *next)
{
    return copy_hash_spans(count, src, dst, nbytes, prefixes, prefix_offsets, flags,
                           streaming_min_bytes, digests, next) < 0 ? -1 : 0;
}

static void hash_one(XXH3_state_t *state, const unsigned char *prefix, size_t prefix_len,
                     const char *data, size_t n, unsigned char *digest)
{
    XXH3_128bits_reset(state);
    XXH3_128bits_update(state, prefix, prefix_len);
    XXH3_128bits_update(state, data, n);
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(state));
    memcpy(digest, canonical.digest, 16);
}

/* For each read i: pread nbytes[i] from fds[i] at offsets[i] into dst[i] (retrying short reads
 * and EINTR), then, if it was read whole, hash it as nbytes[i] / hash_bytes consecutive spans:
 * span k (counted over all reads, first_span[i] the first of read i) with prefix k, its 16-byte
 * digest at digests + 16 k. got[i] is the number of bytes read (less at the end of the file) or
 * -errno on an error; the digests of a read that was not read whole are left unset.
 *
 * With `next` NULL the reads run in order. Otherwise several threads may call this at once with
 * the same arguments: each claims the next unclaimed read from *next until none is left, so
 * the reads are shared out as they go and the threads finish together. Returns 0, or -1 when a
 * read's size is not a multiple of hash_bytes. */
int strata_read_hash(size_t count, const int32_t *fds, const uint64_t *offsets,
                     const uint64_t *dst, const uint64_t *nbytes, size_t hash_bytes,
                     const unsigned char *prefixes, const uint64_t *prefix_offsets,
                     const uint64_t *first_span, unsigned char *digests, int64_t *got,
                     uint64_t *next)
{
    XXH3_state_t state;
    for (size_t i = 0; i < count; i++)
        if (hash_bytes == 0 || nbytes[i] % hash_bytes)
            return -1;
    for (size_t in_order = 0;; in_order++) {
        size_t i = next ? (size_t)__atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : in_order;
        if (i >= count)
            break;
        char *d = (char *)(uintptr_t)dst[i];
        size_t n = (size_t)nbytes[i], done = 0;
        int64_t status = 0;
        while (done < n) {
            ssize_t r = pread(fds[i], d + done, n - done, (off_t)(offsets[i] + done));
            if (r < 0) {
                if (errno == EINTR)
                    continue;
                status = -(int64_t)errno;
                break;
            }
            if (r == 0)
                break;
            done += (size_t)r;
        }
        got[i] = status < 0 ? status : (int64_t)done;
        if (status == 0 && done == n) {
            for (size_t j = 0; j < n / hash_bytes; j++) {
                size_t k = (size_t)first_span[i] + j;
                hash_one(&state, prefixes + prefix_offsets[k],
                         (size_t)(prefix_offsets[k + 1] - prefix_offsets[k]),
                         d + j * hash_bytes, hash_bytes, digests + 16 * k);
            }
        }
    }
    return 0;
}

/* ---- Helper threads that stay awake between calls ------------------------------------------
 *
 * A verified copy of one small block (2 MiB: a fraction of a millisecond on one core) is over
 * before a thread woken through the kernel is running, so handing part of it to a sleeping
 * thread costs more than it saves. These helpers instead watch for work for `spin_us` after
 * their last job (with the
 * CPU's pause hint), and only then sleep on a futex: back-to-back copies start on every thread
 * within a fraction of a microsecond, as an OpenMP runtime's threads do. One job runs at a time;
 * a caller that finds the helpers busy with another's job does its own alone, so callers on
 * several threads never wait for each other.
 *
 * A job is open while its caller works on it; a helper joins by adding itself to `state` while
 * the CLOSED bit is clear, then reads the job. The caller closes the job when its own claims run
 * out and waits only for the helpers that joined, so a helper that wakes late finds it closed and
 * never touches memory the caller has given back. */

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define STRATA_RELAX() _mm_pause()
#else
#define STRATA_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

#define STRATA_POOL_MAX 16
#define STRATA_CLOSED (1u << 31)

struct strata_job {
    size_t count;
    const uint64_t *src, *dst, *nbytes;
    const unsigned char *prefixes;
    const uint64_t *prefix_offsets;
    int flags;
    size_t streaming_min_bytes;
    unsigned char *digests;
    uint64_t *next;
};

static struct {
    pthread_mutex_t submit; /* held by the caller whose job is posted */
    pthread_mutex_t setup;
    int helpers;            /* threads started in this process */
    uint64_t spin_ns;
    uint32_t seq;           /* bumped once per job; the futex helpers sleep on */
    uint32_t state;         /* STRATA_CLOSED | number of helpers that joined the current job */
    uint32_t finished;      /* helpers of the current job that are done with it */
    uint32_t sleepers;
    int status;
    uint64_t helper_spans;  /* spans the helpers have done, ever (for tests and operators) */
    struct strata_job job;
} strata_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, 0, 0, 0,
                 STRATA_CLOSED, 0, 0, 0, 0, {0}};

static uint64_t strata_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static long strata_futex(uint32_t *word, int op, uint32_t value)
{
    return syscall(SYS_futex, word, op | FUTEX_PRIVATE_FLAG, value, NULL, NULL, 0);
}

static void *strata_helper(void *unused)
{
    (void)unused;
    uint32_t seen = __atomic_load_n(&strata_pool.seq, __ATOMIC_ACQUIRE);
    for (;;) {
        uint64_t spin_ns = __atomic_load_n(&strata_pool.spin_ns, __ATOMIC_RELAXED);
        uint64_t deadline = strata_now_ns() + spin_ns;
        uint32_t seq;
        unsigned spins = 0;
        while ((seq = __atomic_load_n(&strata_pool.seq, __ATOMIC_ACQUIRE)) == seen) {
            STRATA_RELAX();
            if (++spins % 64)
                continue;
            uint64_t now = strata_now_ns();
            if (!(__atomic_load_n(&strata_pool.state, __ATOMIC_RELAXED) & STRATA_CLOSED)) {
                /* The job this helper left is still running on its caller: the spin counts
                 * from the job's end, not from this helper's last span. */
                deadline = now + spin_ns;
            } else if (now > deadline) {
                __atomic_fetch_add(&strata_pool.sleepers, 1, __ATOMIC_SEQ_CST);
                if (__atomic_load_n(&strata_pool.seq, __ATOMIC_SEQ_CST) == seen)
                    strata_futex(&strata_pool.seq, FUTEX_WAIT, seen);
                __atomic_fetch_sub(&strata_pool.sleepers, 1, __ATOMIC_SEQ_CST);
                deadline = strata_now_ns() + spin_ns;
            }
        }
        seen = seq;
        uint32_t state = __atomic_load_n(&strata_pool.state, __ATOMIC_ACQUIRE);
        while (!(state & STRATA_CLOSED)) {
            if (__atomic_compare_exchange_n(&strata_pool.state, &state, state + 1, 0,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                struct strata_job j = strata_pool.job;
                long done = copy_hash_spans(j.count, j.src, j.dst, j.nbytes, j.prefixes,
                                            j.prefix_offsets, j.flags, j.streaming_min_bytes,
                                            j.digests, j.next);
                if (done < 0)
                    __atomic_store_n(&strata_pool.status, -1, __ATOMIC_RELAXED);
                else
                    __atomic_fetch_add(&strata_pool.helper_spans, (uint64_t)done,
                                       __ATOMIC_RELAXED);
                __atomic_fetch_add(&strata_pool.finished, 1, __ATOMIC_RELEASE);
                break;
            }
        }
    }
    return NULL;
}

static void strata_pool_forked(void)
{
    /* The child has none of the parent's threads; it starts its own when asked. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    strata_pool.submit = fresh;
    strata_pool.setup = fresh;
    strata_pool.helpers = 0;
    strata_pool.sleepers = 0;
    strata_pool.state = STRATA_CLOSED;
}

/* Start helper threads until there are `helpers` (at most STRATA_POOL_MAX), each watching for
 * work for `spin_us` after its last job. Returns how many run. */
int strata_pool_start(int helpers, uint64_t spin_us)
{
    static int registered;
    pthread_mutex_lock(&strata_pool.setup);
    if (!registered) {
        pthread_atfork(NULL, NULL, strata_pool_forked);
        registered = 1;
    }
    if (helpers > STRATA_POOL_MAX)
        helpers = STRATA_POOL_MAX;
    __atomic_store_n(&strata_pool.spin_ns, spin_us * 1000u, __ATOMIC_RELAXED);
    while (strata_pool.helpers < helpers) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        int failed = pthread_create(&thread, &attr, strata_helper, NULL);
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        __atomic_store_n(&strata_pool.helpers, strata_pool.helpers + 1, __ATOMIC_RELEASE);
    }
    int running = strata_pool.helpers;
    pthread_mutex_unlock(&strata_pool.setup);
    return running;
}

/* How many spans the helper threads of this process have done in all. */
uint64_t strata_pool_helper_spans(void)
{
    return __atomic_load_n(&strata_pool.helper_spans, __ATOMIC_RELAXED);
}

/* strata_copy_hash's spans shared between this thread and the helpers (see above); `next` is
 * the batch's claim counter. Runs on this thread alone when there are no helpers or they are
 * busy with another caller's job. Returns what strata_copy_hash returns. */
int strata_copy_hash_pooled(size_t count, const uint64_t *src, const uint64_t *dst,
                            const uint64_t *nbytes, const unsigned char *prefixes,
                            const uint64_t *prefix_offsets, int flags,
                            size_t streaming_min_bytes, unsigned char *digests, uint64_t *next)
{
    if (__atomic_load_n(&strata_pool.helpers, __ATOMIC_RELAXED) == 0 ||
        pthread_mutex_trylock(&strata_pool.submit) != 0)
        return strata_copy_hash(count, src, dst, nbytes, prefixes, prefix_offsets, flags,
                                streaming_min_bytes, digests, next);
    struct strata_job job = {count, src, dst, nbytes, prefixes, prefix_offsets,
                             flags, streaming_min_bytes, digests, next};
    strata_pool.job = job;
    strata_pool.status = 0;
    __atomic_store_n(&strata_pool.finished, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&strata_pool.state, 0, __ATOMIC_RELEASE); /* open */
    __atomic_fetch_add(&strata_pool.seq, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&strata_pool.sleepers, __ATOMIC_SEQ_CST))
        strata_futex(&strata_pool.seq, FUTEX_WAKE, INT_MAX);
    int status = strata_copy_hash(count, src, dst, nbytes, prefixes, prefix_offsets, flags,
                                  streaming_min_bytes, digests, next);
    uint32_t joined =
        __atomic_fetch_or(&strata_pool.state, STRATA_CLOSED, __ATOMIC_ACQ_REL) & ~STRATA_CLOSED;
    for (unsigned spins = 0;
         __atomic_load_n(&strata_pool.finished, __ATOMIC_ACQUIRE) != joined; spins++) {
        if (spins < 4096)
            STRATA_RELAX();
        else
            sched_yield(); /* a helper was preempted mid-span */
    }
    if (status == 0)
        status = __atomic_load_n(&strata_pool.status, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&strata_pool.submit);
    return status;
}

/* ---- Verified reads out of the host tier's shared pool -------------------------------------
 *
 * One call does what a host-tier read of many blocks otherwise does in the interpreter, step by
 * step: for each block, check that its slot is stable (even generation), READY and holds its key;
 * note the generation and the stored checksums; copy and hash every requested layer (shared with
 * the helpers, as strata_copy_hash_pooled); then check the generation again (a writer or an
 * eviction that raced the copy makes it torn: the caller retries) and compare the digests, the
 * recorded size and, for a whole block, the block checksum over the layer checksums. The caller
 * keeps every decision about retries, misses and quarantine; this only reports. */

struct strata_pool_geometry {
    uint64_t meta;   /* address of slot 0's metadata record */
    uint64_t stride; /* bytes from one record to the next */
    uint64_t gen, state, key, nbytes, checksum, layer_sums; /* field offsets in a record */
    uint64_t data;   /* address of slot 0's bytes */
    uint64_t slot_bytes;
    uint64_t layers;      /* of a whole block */
    uint64_t layer_bytes;
    uint64_t block_bytes;
    uint64_t ready;       /* the state value of a readable slot */
};

enum {
    STRATA_READ_OK = 0,
    STRATA_READ_UNSETTLED = -1, /* not READY with this key, or being changed: look again */
    STRATA_READ_TORN = -2,      /* changed during the copy: the bytes were discarded */
    STRATA_READ_SIZE = -3,      /* the slot records another size than the layout's */
    STRATA_READ_BLOCK_SUM = -4, /* the block checksum does not match its layer checksums */
};
#define STRATA_HELPERS 4 /* flag: share the copies with the helper threads */

/* The spans of one batch of pool copies: per layer, the pool's bytes and the caller's memory, and
 * the layer's hash prefix (the block's key, then the layer number, little-endian). */
struct strata_spans {
    size_t count;
    uint64_t *src, *dst, *sizes, *prefix_offsets;
    unsigned char *prefixes, *digests;
};

static void strata_spans_free(struct strata_spans *s)
{
    free(s->src);
    free(s->dst);
    free(s->sizes);
    free(s->prefix_offsets);
    free(s->prefixes);
    free(s->digests);
}

static int strata_spans_alloc(struct strata_spans *s, size_t most)
{
    s->count = 0;
    s->src = malloc((most + 1) * sizeof(uint64_t));
    s->dst = malloc((most + 1) * sizeof(uint64_t));
    s->sizes = malloc((most + 1) * sizeof(uint64_t));
    s->prefix_offsets = malloc((most + 1) * sizeof(uint64_t));
    s->prefixes = malloc(most * 20 + 1);
    s->digests = malloc(most * 16 + 1);
    if (s->src && s->dst && s->sizes && s->prefix_offsets && s->prefixes && s->digests)
        return 0;
    strata_spans_free(s);
    return -1;
}

/* Adds layers [first, first + n) of the block in `slot` (key at `key`): copied from the pool to
 * `memory` (the layers back to back) with `to_pool` 0, from `memory` into the pool with 1. */
static void strata_spans_add(struct strata_spans *s, const struct strata_pool_geometry *g,
                             uint32_t slot, const unsigned char *key, uint32_t first, uint32_t n,
                             uint64_t memory, int to_pool)
{
    uint64_t base = g->data + (uint64_t)slot * g->slot_bytes;
    for (uint32_t j = 0; j < n; j++) {
        size_t k = s->count++;
        uint32_t layer = first + j;
        uint64_t pool = base + (uint64_t)layer * g->layer_bytes;
        uint64_t mine = memory + (uint64_t)j * g->layer_bytes;
        s->src[k] = to_pool ? mine : pool;
        s->dst[k] = to_pool ? pool : mine;
        s->sizes[k] = g->layer_bytes;
        s->prefix_offsets[k] = 20 * k;
        unsigned char *prefix = s->prefixes + 20 * k;
        memcpy(prefix, key, 16);
        prefix[16] = (unsigned char)layer;
        prefix[17] = (unsigned char)(layer >> 8);
        prefix[18] = (unsigned char)(layer >> 16);
        prefix[19] = (unsigned char)(layer >> 24);
    }
    s->prefix_offsets[s->count] = 20 * s->count;
}

/* Copies and hashes every span, with the helpers when `flags` asks for them. */
static int strata_spans_run(struct strata_spans *s, int flags, size_t streaming_min_bytes)
{
    if (!s->count)
        return 0;
    uint64_t next = 0;
    int copy_flags = STRATA_DIGEST | (flags & STRATA_NONTEMPORAL);
    if ((flags & STRATA_HELPERS) && s->count > 1)
        return strata_copy_hash_pooled(s->count, s->src, s->dst, s->sizes, s->prefixes,
                                       s->prefix_offsets, copy_flags, streaming_min_bytes,
                                       s->digests, &next);
    return strata_copy_hash(s->count, s->src, s->dst, s->sizes, s->prefixes, s->prefix_offsets,
                            copy_flags, streaming_min_bytes, s->digests, NULL);
}

/* The block checksum: xxh3-128 of the key, then the layer checksums. */
static void strata_block_digest(const unsigned char *key, const unsigned char *layer_sums,
                                size_t layers, unsigned char *digest)
{
    XXH3_state_t state;
    XXH128_canonical_t canonical;
    XXH3_128bits_reset(&state);
    XXH3_128bits_update(&state, key, 16);
    XXH3_128bits_update(&state, layer_sums, 16 * layers);
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state));
    memcpy(digest, canonical.digest, 16);
}

static char *strata_record(const struct strata_pool_geometry *g, uint32_t slot)
{
    return (char *)(uintptr_t)(g->meta + (uint64_t)slot * g->stride);
}

/* Reads layers [first, first + n) of `count` blocks: block i from slot slots[i], whose key is the
 * 16 bytes at keys + 16 i, into dst[i] (the layers back to back). Per block: status[i] is
 * STRATA_READ_OK, one of the negative codes above, or 1 + the block's layer whose checksum did
 * not match; gens[i] the generation read (for the caller's quarantine); sums + 16 n i the n
 * stored layer checksums and block_sums + 16 i the stored block checksum, as they were before
 * the copy. flags: NONTEMPORAL (streaming stores for spans from streaming_min_bytes),
 * STRATA_HELPERS. Returns 0, or -1 when out of memory or the hash failed (nothing is reported
 * then). */
int strata_pool_read(const struct strata_pool_geometry *g, size_t count, const uint32_t *slots,
                     const unsigned char *keys, const uint64_t *dst, uint32_t first, uint32_t n,
                     int flags, size_t streaming_min_bytes, unsigned char *sums,
                     unsigned char *block_sums, uint64_t *gens, int32_t *status)
{
    struct strata_spans spans;
    uint64_t *recorded = malloc((count ? count : 1) * sizeof(uint64_t));
    if (!recorded || strata_spans_alloc(&spans, count * (size_t)n) != 0) {
        free(recorded);
        return -1;
    }
    for (size_t i = 0; i < count; i++) {
        const char *record = strata_record(g, slots[i]);
        uint64_t gen = __atomic_load_n((const uint64_t *)(record + g->gen), __ATOMIC_ACQUIRE);
        uint32_t state = __atomic_load_n((const uint32_t *)(record + g->state), __ATOMIC_RELAXED);
        gens[i] = gen;
        if ((gen & 1) || state != g->ready || memcmp(record + g->key, keys + 16 * i, 16) != 0) {
            status[i] = STRATA_READ_UNSETTLED;
            continue;
        }
        status[i] = STRATA_READ_OK;
        memcpy(&recorded[i], record + g->nbytes, sizeof(uint64_t));
        memcpy(sums + 16 * (size_t)n * i, record + g->layer_sums + 16 * (size_t)first,
               16 * (size_t)n);
        memcpy(block_sums + 16 * i, record + g->checksum, 16);
        strata_spans_add(&spans, g, slots[i], keys + 16 * i, first, n, dst[i], 0);
    }
    int result = strata_spans_run(&spans, flags, streaming_min_bytes) ? -1 : 0;
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copies above happen before the check below */
    int whole = first == 0 && n == g->layers;
    size_t span = 0;
    for (size_t i = 0; result == 0 && i < count; i++) {
        if (status[i] != STRATA_READ_OK)
            continue;
        const char *record = strata_record(g, slots[i]);
        const unsigned char *want = sums + 16 * (size_t)n * i, *got = spans.digests + 16 * span;
        span += n;
        if (__atomic_load_n((const uint64_t *)(record + g->gen), __ATOMIC_ACQUIRE) != gens[i]) {
            status[i] = STRATA_READ_TORN;
            continue;
        }
        if (recorded[i] != g->block_bytes) {
            status[i] = STRATA_READ_SIZE;
            continue;
        }
        for (uint32_t j = 0; j < n; j++) {
            if (memcmp(got + 16 * j, want + 16 * j, 16) != 0) {
                status[i] = 1 + (int32_t)(first + j);
                break;
            }
        }
        if (status[i] == STRATA_READ_OK && whole) {
            unsigned char block[16];
            strata_block_digest(keys + 16 * i, want, n, block);
            if (memcmp(block, block_sums + 16 * i, 16) != 0)
                status[i] = STRATA_READ_BLOCK_SUM;
        }
    }
    strata_spans_free(&spans);
    free(recorded);
    return result;
}

/* The host tier's put of `count` whole blocks into slots the caller has allocated and holds
 * (WRITING, odd generation): block i is copied from src[i] into slot slots[i], each layer hashed
 * as it is copied (the bytes readers will verify, read once), and the slot's metadata gets the
 * layer checksums, the block checksum over them and the size; sums + 16 layers i and
 * block_sums + 16 i get them too. The caller publishes the slots. flags as strata_pool_read's.
 * Returns 0, or -1 when out of memory or the hash failed (no metadata is written then). */
int strata_pool_fill(const struct strata_pool_geometry *g, size_t count, const uint32_t *slots,
                     const unsigned char *keys, const uint64_t *src, int flags,
                     size_t streaming_min_bytes, unsigned char *sums, unsigned char *block_sums)
{
    struct strata_spans spans;
    size_t layers = (size_t)g->layers;
    if (strata_spans_alloc(&spans, count * layers) != 0)
        return -1;
    for (size_t i = 0; i < count; i++)
        strata_spans_add(&spans, g, slots[i], keys + 16 * i, 0, (uint32_t)layers, src[i], 1);
    int result = strata_spans_run(&spans, flags, streaming_min_bytes) ? -1 : 0;
    for (size_t i = 0; result == 0 && i < count; i++) {
        char *record = strata_record(g, slots[i]);
        memcpy(sums + 16 * layers * i, spans.digests + 16 * layers * i, 16 * layers);
        strata_block_digest(keys + 16 * i, sums + 16 * layers * i, layers, block_sums + 16 * i);
        memcpy(record + g->layer_sums, sums + 16 * layers * i, 16 * layers);
        memcpy(record + g->checksum, block_sums + 16 * i, 16);
        memcpy(record + g->nbytes, &g->block_bytes, sizeof(uint64_t));
    }
    strata_spans_free(&spans);
    return result;
}

/* The copies between vLLM's CPU pages and Strata's blocks. */
#include "kvpages.c"
