/* A row cache's per-step bookkeeping (shardvar/tiered/_slots_native.py loads this).
 *
 * sv_lookup resolves a batch's ids through the direct map (one int32 or int64 per row: the slot
 * holding it, else a negative place), marks each distinct held slot used at this step, and notes
 * what it changed, so that a batch the cache refuses afterwards is undone exactly. It replaces a
 * dozen torch ops over the batch (a gather, a widening, masks, a scatter, counts), each a pass.
 *
 * sv_smallest is the LRU select: the k positions of least value below a bound, ties to the lower
 * position, in ascending order, where some positions (the free slots) count as one given value.
 * The k-th smallest value is guessed from a sample and checked by one vectorised counting pass
 * (GUESS: a pass or two, as a rule, for a cache's steps); where three guesses miss, a radix select
 * over the values themselves finds it (16 bits a pass). Then one pass collects the positions.
 * Nothing of the cache's size is copied or allocated.
 *
 * No Python here: ctypes calls it without the interpreter's lock.
 */
#include <stdint.h>
#include <string.h>

#define BITS 16
#define BINS ((int64_t)1 << BITS) /* the most bins of a pass */
#define AHEAD 64 /* ids ahead whose map entry is fetched early: the map is far larger than the caches (64: measured
                   * 25% faster than 16 with the slots' steps fetched at half the distance) */

int sv_slots_abi_version(void) { return 3; }

/* Per id its map entry into slot (int64); the positions and ids of misses (negative entries) into
 * missed and missed_ids, ascending; each distinct held slot's used set to step, that slot and its
 * old value into hit and was (at most min(n, capacity) of them). Returns the misses, info[0] the
 * distinct hits; or -1 for an id outside the map or an entry outside the slots (info[0] its
 * position), every used value restored. A slot used at step already is taken as marked by this
 * batch: the cache's steps only grow, so none is before the batch. */
int64_t sv_lookup(const void *map, int wide, int64_t rows, const int64_t *ids, int64_t n, int64_t *slot,
                  int32_t *used, int64_t capacity, int32_t step, int64_t *missed, int64_t *missed_ids,
                  int64_t *hit, int32_t *was, int64_t *info) {
    const int32_t *narrow_map = (const int32_t *)map;
    const int64_t *wide_map = (const int64_t *)map;
    int64_t misses = 0, hits = 0, i;
    for (i = 0; i < n; i++) {
        int64_t id = ids[i];
        if (i + AHEAD < n && (uint64_t)ids[i + AHEAD] < (uint64_t)rows)
            __builtin_prefetch(wide ? (const void *)(wide_map + ids[i + AHEAD])
                                    : (const void *)(narrow_map + ids[i + AHEAD]));
        if (i + AHEAD / 2 < n && (uint64_t)ids[i + AHEAD / 2] < (uint64_t)rows) {
            /* its map entry fetched AHEAD / 2 ids ago: the slot's step is fetched now, written below */
            int64_t near = ids[i + AHEAD / 2], s = wide ? wide_map[near] : narrow_map[near];
            if (s >= 0 && s < capacity)
                __builtin_prefetch(used + s, 1);
        }
        if ((uint64_t)id >= (uint64_t)rows)
            goto bad;
        int64_t s = wide ? wide_map[id] : narrow_map[id];
        slot[i] = s;
        if (s < 0) {
            missed[misses] = i;
            missed_ids[misses++] = id;
            continue;
        }
        if (s >= capacity)
            goto bad;
        if (used[s] != step) {
            hit[hits] = s;
            was[hits++] = used[s];
            used[s] = step;
        }
    }
    info[0] = hits;
    return misses;
bad:
    while (hits-- > 0)
        used[hit[hits]] = was[hits];
    info[0] = i;
    return -1;
}

/* Runs its statements with v (int64_t) and i (the position) for every position of values, in ascending
 * order, v being masked at the positions of skip (ascending, distinct, below n). */
#define SCAN(T, ...)                                                                               \
    do {                                                                                           \
        const T *vals = (const T *)values;                                                         \
        int64_t i = 0;                                                                             \
        for (int64_t f = 0; f <= nskip; f++) {                                                     \
            int64_t end = f < nskip ? skip[f] : n;                                                 \
            for (; i < end; i++) {                                                                 \
                int64_t v = vals[i];                                                               \
                __VA_ARGS__;                                                                       \
            }                                                                                      \
            if (f < nskip) {                                                                       \
                int64_t v = masked;                                                                \
                __VA_ARGS__;                                                                       \
                i++;                                                                               \
            }                                                                                      \
        }                                                                                          \
    } while (0)

#define TOP(T) ((T)(sizeof(T) == 4 ? INT32_MAX : INT64_MAX))
#define BOTTOM(T) ((T)(sizeof(T) == 4 ? INT32_MIN : INT64_MIN))
#define BLOCK 16 /* values tested at once by the collecting pass */

/* Takes position i of value x where x is below lo, or one of the first need equal to it. */
#define TAKE(x, i)                                                                                 \
    do {                                                                                           \
        int64_t x_ = (x);                                                                          \
        if (x_ <= lo && (x_ < lo || need-- > 0)) {                                                 \
            out[taken++] = (i);                                                                    \
            if (taken == k)                                                                        \
                return below;                                                                      \
        }                                                                                          \
    } while (0)

/* Takes the positions TAKE takes, in ascending order; a block of values none of which is at most
 * top (lo within T: no false negative) is passed over after one vectorised test. */
#define COLLECT(T)                                                                                 \
    do {                                                                                           \
        const T *vals = (const T *)values;                                                         \
        T top = lo > (int64_t)TOP(T) ? TOP(T) : lo < (int64_t)BOTTOM(T) ? BOTTOM(T) : (T)lo;       \
        int64_t i = 0;                                                                             \
        for (int64_t f = 0; f <= nskip; f++) {                                                     \
            int64_t end = f < nskip ? skip[f] : n;                                                 \
            while (i < end) {                                                                      \
                if (i + BLOCK <= end) {                                                            \
                    int any = 0;                                                                   \
                    for (int j = 0; j < BLOCK; j++)                                                \
                        any |= vals[i + j] <= top;                                                 \
                    if (!any) {                                                                    \
                        i += BLOCK;                                                                \
                        continue;                                                                  \
                    }                                                                              \
                }                                                                                  \
                for (int64_t stop = i + BLOCK < end ? i + BLOCK : end; i < stop; i++)              \
                    TAKE(vals[i], i);                                                              \
                if (need <= 0 && top == lo && lo > (int64_t)BOTTOM(T))                             \
                    top = (T)(lo - 1); /* the ties are all taken: blocks of them are passed over */ \
            }                                                                                      \
            if (f < nskip) {                                                                       \
                TAKE(masked, i);                                                                   \
                i++;                                                                               \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* Counts each value of [lo, hi] in its bin ((v - lo) >> shift) of hist, those below lo in bin bins,
 * those above hi in bin bins + 1: two copies of the bins (even and odd positions), summed into the
 * first, since a run of equal steps would otherwise wait on one counter. */
#define COUNT(T)                                                                                   \
    do {                                                                                           \
        memset(hist, 0, (size_t)(2 * (bins + 2)) * sizeof(int64_t));                              \
        SCAN(T, hist[((i & 1) ? bins + 2 : 0) +                                                    \
                     (v < lo ? bins : v > hi ? bins + 1 : (int64_t)((uint64_t)(v - lo) >> shift))]++); \
        for (int64_t b = 0; b < bins + 2; b++)                                                     \
            hist[b] += hist[bins + 2 + b];                                                         \
    } while (0)

#define SAMPLES 4096 /* values a guess of the k-th smallest is drawn from */
#define CHUNK ((int64_t)1 << 24) /* values a pass counts in 32-bit counters (vectorised) */

/* c[0], c[1], c[2]: how many values (masked at skip's positions) are below above, below t, equal to t. One
 * pass of compares the compiler vectorises; the skipped positions are put right afterwards. */
#define TALLY(NAME, T)                                                                             \
    static void NAME(const T *vals, int64_t n, const int32_t *skip, int64_t nskip, int64_t masked, \
                     int64_t above, int64_t t, int64_t *c) {                                       \
        T a = (T)above, u = (T)t;                                                                  \
        c[0] = c[1] = c[2] = 0;                                                                    \
        for (int64_t s = 0; s < n; s += CHUNK) {                                                   \
            int32_t b = 0, l = 0, q = 0;                                                           \
            for (int64_t i = s, e = s + CHUNK < n ? s + CHUNK : n; i < e; i++) {                  \
                T v = vals[i];                                                                     \
                b += v < a;                                                                        \
                l += v < u;                                                                        \
                q += v == u;                                                                       \
            }                                                                                      \
            c[0] += b, c[1] += l, c[2] += q;                                                       \
        }                                                                                          \
        for (int64_t f = 0; f < nskip; f++) {                                                      \
            int64_t v = vals[skip[f]];                                                             \
            c[0] += (masked < above) - (v < above);                                                \
            c[1] += (masked < t) - (v < t);                                                        \
            c[2] += (masked == t) - (v == t);                                                      \
        }                                                                                          \
    }

/* The sample's value of rank r (0-based) among its m values: a selection in place (Hoare's). */
static int64_t nth(int64_t *s, int64_t m, int64_t r) {
    int64_t a = 0, b = m - 1;
    while (a < b) {
        int64_t pivot = s[a + (b - a) / 2], i = a, j = b;
        while (i <= j) {
            while (s[i] < pivot)
                i++;
            while (s[j] > pivot)
                j--;
            if (i <= j) {
                int64_t x = s[i];
                s[i++] = s[j], s[j--] = x;
            }
        }
        if (r <= j)
            b = j;
        else if (r >= i)
            a = i;
        else
            return s[r];
    }
    return s[a];
}

/* The k-th smallest value below above guessed from a sample of the values, then checked by counting
 * them all (TALLY), trying the sample's next value up or down where the guess was off: 1 and *lo (it),
 * *need (how many equal to it are among the k smallest), *below (the values below above), or *below
 * alone where fewer than k are; 0 where three tries did not find it (the radix passes then). Most
 * steps of a cache's LRU select end here after a pass or two, where the radix passes take a pass to
 * count into a histogram (several times a vectorised compare) and more where steps span widely. */
#define GUESS(NAME, TALLY_T, T)                                                                    \
    static int NAME(const T *vals, int64_t n, const int32_t *skip, int64_t nskip, int64_t masked,  \
                    int64_t above, int64_t k, int64_t *sample, int64_t *lo, int64_t *need,         \
                    int64_t *below) {                                                              \
        if (n == 0 || k <= 0 || above < (int64_t)BOTTOM(T) || above > (int64_t)TOP(T))            \
            return 0;                                                                              \
        int64_t m = 0, step = n > SAMPLES ? n / SAMPLES : 1, c[3];                                 \
        for (int64_t i = 0; i < n && m < SAMPLES; i += step)                                       \
            if (vals[i] < above)                                                                   \
                sample[m++] = vals[i];                                                             \
        if (m == 0)                                                                                \
            return 0;                                                                              \
        int64_t r = (int64_t)((double)k * (double)m / (double)n);                                  \
        int64_t t = nth(sample, m, r < m ? r : m - 1);                                             \
        for (int tries = 0; tries < 3; tries++) {                                                  \
            TALLY_T(vals, n, skip, nskip, masked, above, t, c);                                    \
            *below = c[0];                                                                         \
            if (c[0] < k)                                                                          \
                return 1;                                                                          \
            if (c[1] < k && k <= c[1] + c[2]) {                                                    \
                *lo = t, *need = k - c[1];                                                         \
                return 1;                                                                          \
            }                                                                                      \
            int up = c[1] + c[2] < k, found = 0;                                                   \
            int64_t next = t;                                                                      \
            for (int64_t j = 0; j < m; j++) /* the sample's nearest value past t, that way */      \
                if (up ? sample[j] > t && (!found || sample[j] < next)                             \
                       : sample[j] < t && (!found || sample[j] > next))                            \
                    next = sample[j], found = 1;                                                   \
            if (!found)                                                                            \
                return 0;                                                                          \
            t = next;                                                                              \
        }                                                                                          \
        return 0;                                                                                  \
    }

/* One function per value type: the loops read the values directly. */
#define SMALLEST(NAME, GUESS_T, T)                                                                 \
    static int64_t NAME(const void *values, int64_t n, const int32_t *skip, int64_t nskip,         \
                        int64_t masked, int64_t above, int64_t k, int64_t *out, int64_t *hist) {   \
        int64_t taken = 0;                                                                         \
        {                                                                                          \
            int64_t lo, need, below;                                                               \
            if (GUESS_T((const T *)values, n, skip, nskip, masked, above, k, hist, &lo, &need, &below)) { \
                if (below >= k)                                                                    \
                    COLLECT(T);                                                                    \
                return below;                                                                      \
            }                                                                                      \
        }                                                                                          \
        /* first the values just below above (a cache's recent steps: all of them, as a rule) */   \
        int64_t window = above < 1 ? 1 : above < BINS ? above : BINS;                              \
        int64_t lo = above - window, hi = above - 1, bins = window, need = k, below;                \
        int shift = 0;                                                                             \
        COUNT(T);                                                                                  \
        below = hist[bins];                                                                        \
        for (int64_t b = 0; b < bins; b++)                                                         \
            below += hist[b];                                                                      \
        if (below < k || k <= 0)                                                                   \
            return below;                                                                          \
        int counted = 1; /* hist holds [lo, hi]'s counts */                                       \
        if (hist[bins] >= need) { /* the k-th smallest is older: narrow from the oldest */         \
            hi = lo - 1, lo = INT64_MAX, counted = 0;                                              \
            SCAN(T, int64_t l = v <= hi ? v : INT64_MAX; lo = l < lo ? l : lo);                    \
        } else {                                                                                   \
            need -= hist[bins];                                                                    \
        }                                                                                          \
        /* the k-th smallest: narrow [lo, hi] to one value, BITS of its span a pass (the values    \
           below lo are counted out of need already) */                                            \
        for (;; counted = 0) {                                                                     \
            uint64_t span = (uint64_t)hi - (uint64_t)lo;                                           \
            shift = 0;                                                                             \
            while ((span >> shift) >= (uint64_t)BINS)                                              \
                shift += BITS;                                                                     \
            if (!counted) {                                                                        \
                bins = (int64_t)(span >> shift) + 1;                                               \
                COUNT(T);                                                                          \
            }                                                                                      \
            int64_t digit = 0;                                                                     \
            while (hist[digit] < need)                                                             \
                need -= hist[digit++];                                                             \
            lo += (int64_t)((uint64_t)digit << shift);                                             \
            if (shift == 0)                                                                        \
                break;                                                                             \
            uint64_t room = ((uint64_t)1 << shift) - 1; /* the digit's values: [lo, lo + room] */  \
            if ((uint64_t)hi - (uint64_t)lo > room)                                                \
                hi = (int64_t)((uint64_t)lo + room);                                               \
        }                                                                                          \
        /* lo is the k-th smallest; need: how many of the values equal to it are taken. The few    \
           taken are found a block at a time (a vectorised test), then one by one */               \
        COLLECT(T);                                                                                \
        return below;                                                                              \
    }

TALLY(tally32, int32_t)
TALLY(tally64, int64_t)
GUESS(guess32, tally32, int32_t)
GUESS(guess64, tally64, int64_t)
SMALLEST(smallest32, guess32, int32_t)
SMALLEST(smallest64, guess64, int64_t)

/* The k positions (ascending) of least value below above, ties to the lower position, into out;
 * the value of a position is values[i] (int32, or int64 where wide), or masked at the positions of
 * skip (ascending, distinct). hist: 2 * (BINS + 2) counts of scratch. Returns how many values are below
 * above: where fewer than k, out is left as it was; -1 where skip is not ascending within n. */
int64_t sv_smallest(const void *values, int wide, int64_t n, const int32_t *skip, int64_t nskip, int64_t masked,
                    int64_t above, int64_t k, int64_t *out, int64_t *hist) {
    for (int64_t f = 0; f < nskip; f++)
        if (skip[f] < 0 || skip[f] >= n || (f && skip[f] <= skip[f - 1]))
            return -1;
    return wide ? smallest64(values, n, skip, nskip, masked, above, k, out, hist)
                : smallest32(values, n, skip, nskip, masked, above, k, out, hist);
}
