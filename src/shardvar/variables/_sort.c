/* A stable sort of integer keys known to lie in [0, bound) (shardvar/variables/_native_sort.py loads this).
 *
 * sv_sort_stable writes the keys ascending (as 32- or 64-bit integers) and, for each, its position in
 * the input; equal keys keep their input order. It is a least-significant-digit radix sort whose
 * digits cover only the bits of bound - 1, split evenly into passes of at most 11 bits: the ids of a
 * 2^18-row table take 2 passes, where torch's radix sort of 32-bit keys takes 4 (and more work per
 * pass). The passes work in `scratch` (4 * n int64), which the caller keeps from call to call: fresh
 * memory would cost a page fault per 4 KiB, as long as the sort itself in a virtual machine. Every
 * key is checked first: returns 0, or 1 + the position of the first key outside [0, bound). No
 * Python here: ctypes calls it without the interpreter's lock.
 */
#include <stdint.h>
#include <string.h>

#define MAX_DIGIT_BITS 11

int sv_sort_abi_version(void) { return 1; }

static uint64_t key_at(const void *keys, int bytes, int64_t i) {
    return bytes == 4 ? (uint64_t)(int64_t)((const int32_t *)keys)[i] : (uint64_t)((const int64_t *)keys)[i];
}

static int64_t first_outside(const void *keys, int bytes, int64_t n, int64_t bound) {
    for (int64_t i = 0; i < n; ++i) {
        int64_t k = bytes == 4 ? (int64_t)((const int32_t *)keys)[i] : ((const int64_t *)keys)[i];
        if (k < 0 || k >= bound)
            return i + 1;
    }
    return 0;
}

/* One stable counting pass on the digit (key >> shift) & mask: from (in, in_order) into (out, out_order);
   in_order NULL means the input positions themselves. */
static void pass(const uint64_t *in, const int64_t *in_order, uint64_t *out, int64_t *out_order, int64_t n,
                 int shift, uint64_t mask) {
    int64_t count[1 << MAX_DIGIT_BITS];
    memset(count, 0, sizeof(int64_t) * (mask + 1));
    for (int64_t i = 0; i < n; ++i)
        ++count[(in[i] >> shift) & mask];
    int64_t at = 0;
    for (uint64_t d = 0; d <= mask; ++d) {
        int64_t c = count[d];
        count[d] = at;
        at += c;
    }
    for (int64_t i = 0; i < n; ++i) {
        int64_t to = count[(in[i] >> shift) & mask]++;
        out[to] = in[i];
        out_order[to] = in_order ? in_order[i] : i;
    }
}

/* The keys of a range not much wider than their count: one counting pass over a count per key (in
   cache for tables of up to a few million rows) instead of a pass per digit, whose scattered writes
   each go to one of many pages (on a virtual machine each page-table walk is a two-level walk). */
static void counting(const void *keys, int key_bytes, int64_t n, int64_t bound, void *sorted, int sorted_bytes,
                     int64_t *order, int32_t *next) {
    memset(next, 0, sizeof(int32_t) * (size_t)bound);
    for (int64_t i = 0; i < n; ++i)
        ++next[key_at(keys, key_bytes, i)];
    int32_t at = 0;
    for (int64_t k = 0; k < bound; ++k) {
        int32_t c = next[k];
        next[k] = at;
        at += c;
    }
    for (int64_t i = 0; i < n; ++i) {
        uint64_t k = key_at(keys, key_bytes, i);
        int32_t to = next[k]++;
        order[to] = i;
        if (sorted_bytes == 4)
            ((int32_t *)sorted)[to] = (int32_t)k;
        else
            ((int64_t *)sorted)[to] = (int64_t)k;
    }
}

int64_t sv_sort_stable(const void *keys, int key_bytes, int64_t n, int64_t bound, void *sorted, int sorted_bytes,
                       int64_t *order, int64_t *scratch) {
    int64_t bad = first_outside(keys, key_bytes, n, bound);
    if (bad)
        return bad;
    if (bound <= 2 * (4 * n) && n < INT32_MAX) {  /* a count per key fits the scratch (4 * n int64) */
        counting(keys, key_bytes, n, bound, sorted, sorted_bytes, order, (int32_t *)scratch);
        return 0;
    }
    int bits = 0;
    while (bits < 63 && ((uint64_t)1 << bits) < (uint64_t)bound)
        ++bits;
    int passes = bits == 0 ? 0 : (bits + MAX_DIGIT_BITS - 1) / MAX_DIGIT_BITS;
    int width = passes ? (bits + passes - 1) / passes : 0;
    uint64_t *buffer = (uint64_t *)scratch;
    int64_t *positions = scratch + 2 * n;
    uint64_t *key_now = buffer, *key_next = buffer + n;
    int64_t *order_now = NULL, *order_next = positions;
    for (int64_t i = 0; i < n; ++i)
        key_now[i] = key_at(keys, key_bytes, i);
    for (int p = 0; p < passes; ++p) {
        pass(key_now, order_now, key_next, order_next, n, p * width, ((uint64_t)1 << width) - 1);
        uint64_t *k = key_now;
        key_now = key_next, key_next = k;
        order_now = order_next, order_next = order_now == positions ? positions + n : positions;
    }
    for (int64_t i = 0; i < n; ++i) {
        if (sorted_bytes == 4)
            ((int32_t *)sorted)[i] = (int32_t)key_now[i];
        else
            ((int64_t *)sorted)[i] = (int64_t)key_now[i];
        order[i] = order_now ? order_now[i] : i;
    }
    return 0;
}
