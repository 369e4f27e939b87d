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
 * Digests are the canonical (big-endian) XXH3 128-bit form, byte for byte what Python's
 * xxhash.xxh3_128(prefix + data).digest() returns. */

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define STRATA_CHUNK_BYTES (64 * 1024) /* copied, then hashed while still in L1/L2 */

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
    XXH3_state_t state;
    int digest = flags & STRATA_DIGEST;
    for (size_t in_order = 0;; in_order++) {
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
    return 0;
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
