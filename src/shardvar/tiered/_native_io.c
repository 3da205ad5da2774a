/* Record transfers of a tiered table's backing file (shardvar/tiered/_native.py loads this).
 *
 * sv_transfer moves the whole fixed-size records of ascending ids between a buffer (one record per
 * id, back to back) and a file (record i at header + i * record_bytes). Consecutive ids go in one
 * call. A read is first tried on the calling thread without waiting (preadv2 RWF_NOWAIT: the page
 * cache's records cost a copy); what would wait for the disk is read by up to queue_depth threads,
 * so a disk has many reads in flight. Writes stay on the calling thread (see WRITES_PER_THREAD).
 *
 * Returns 0, an errno, or SV_SHORT (the file ended: a read of 0 bytes, a write of none); on a
 * failure info[0] is the file offset of the lowest failing transfer. info[1] counts the runs that
 * went to the blocking path. No Python here: ctypes calls it without the interpreter's lock.
 *
 * sv_copy_rows copies rows between two row-major arrays by index: a cache's slots and a mapping of the
 * file (or its staging area), a memcpy a row where torch's index_copy_ moves one element at a time;
 * sv_fill_at sets the elements at a batch's indices (index_fill_ costs ~7 ns an index on a cache's flags);
 * sv_move_fields moves a row's fields (its values and its state, in arrays of their own) between its slot
 * and its record in one pass, where a pass per field walks the mapping's pages (and their TLB misses) twice;
 * sv_swap_rows is a row cache's eviction and misses in one call while its file is mapped (RowCache's evict
 * and bring: a dozen torch ops over the victims and the misses, ~2 ms a step at 6k misses, each a pass).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define SV_SHORT (-1)
#define MAX_CALL ((int64_t)1 << 30)  /* Linux moves at most ~2 GiB in one call: loop in pieces */
/* Writes land in the page cache: CPU work in the kernel (~2-5 us a record), which threads only spread
   over cores the step's own threads are using: measured in a training loop on 2 cores, 4k write-backs
   took 32 ms on 16 threads, 15 ms on the calling thread. So writes stay on the calling thread. */
#define WRITES_PER_THREAD ((int64_t)1 << 62)

typedef struct {
    int64_t offset;
    uint8_t *data;
    int64_t length;
} piece;

typedef struct {
    int fd, write;
    piece *pieces;
    int64_t count, next;  /* next: the first piece nobody took yet (atomic) */
    int error;
    int64_t error_at;
    pthread_mutex_t lock;
} job;

int sv_abi_version(void) { return 5; }

/* Move all of one piece, blocking; EINTR is retried, a short call continued. */
static int whole(int fd, int write, int64_t offset, uint8_t *data, int64_t length, int64_t *at) {
    while (length > 0) {
        size_t ask = (size_t)(length < MAX_CALL ? length : MAX_CALL);
        ssize_t done = write ? pwrite(fd, data, ask, (off_t)offset) : pread(fd, data, ask, (off_t)offset);
        if (done < 0 && errno == EINTR)
            continue;
        if (done <= 0) {
            *at = offset;
            return done < 0 ? errno : SV_SHORT;
        }
        offset += done, data += done, length -= done;
    }
    return 0;
}

/* The bytes of a piece the page cache gives at once (from its start), or -errno. */
static int64_t cached(int fd, int64_t offset, uint8_t *data, int64_t length) {
#ifdef RWF_NOWAIT
    int64_t got = 0;
    while (got < length) {
        int64_t left = length - got;
        struct iovec v = {data + got, (size_t)(left < MAX_CALL ? left : MAX_CALL)};
        ssize_t done = preadv2(fd, &v, 1, (off_t)(offset + got), RWF_NOWAIT);
        if (done < 0 && errno == EINTR)
            continue;
        if (done < 0)
            return errno == EAGAIN ? got : -errno;
        if (done == 0)  /* the end of the file: the blocking read says so */
            return got;
        got += done;
    }
    return got;
#else
    (void)fd, (void)offset, (void)data, (void)length;
    return -EOPNOTSUPP;
#endif
}

static void failed(job *j, int error, int64_t at) {
    pthread_mutex_lock(&j->lock);
    if (!j->error || at < j->error_at)  /* the lowest offset: the same error whatever the threads' timing */
        j->error = error, j->error_at = at;
    pthread_mutex_unlock(&j->lock);
}

static void *worker(void *arg) {
    job *j = arg;
    for (;;) {
        /* pieces are taken in ascending order, so when one fails every lower one is taken already:
           those still finish (and may fail lower); nothing new starts */
        if (__atomic_load_n(&j->error, __ATOMIC_RELAXED))
            return NULL;
        int64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->count)
            return NULL;
        int64_t at = 0;
        int error = whole(j->fd, j->write, j->pieces[i].offset, j->pieces[i].data, j->pieces[i].length, &at);
        if (error)
            failed(j, error, at);
    }
}

/* Run the job's pieces on `threads` threads, this one among them (fewer if a thread cannot start). */
static void run(job *j, int64_t threads) {
    pthread_t *started = threads > 1 ? malloc((size_t)(threads - 1) * sizeof(pthread_t)) : NULL;
    int64_t n = 0;
    if (started) {
        sigset_t all, old;  /* the interpreter's signals go to its own threads, not these */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (; n < threads - 1; n++)
            if (pthread_create(&started[n], NULL, worker, j))
                break;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    worker(j);
    for (int64_t t = 0; t < n; t++)
        pthread_join(started[t], NULL);
    free(started);
}

int sv_transfer(int fd, const int64_t *ids, int64_t n, int64_t record_bytes, int64_t header, uint8_t *buffer,
                int write, int nowait, int queue_depth, int64_t *info) {
    info[0] = info[1] = 0;
    if (n <= 0)
        return 0;
    piece *pieces = malloc((size_t)n * sizeof(piece));
    if (!pieces)
        return ENOMEM;
    int64_t count = 0;
    for (int64_t start = 0, end; start < n; start = end) {
        for (end = start + 1; end < n && ids[end] == ids[end - 1] + 1; end++)
            ;
        piece p = {header + ids[start] * record_bytes, buffer + start * record_bytes, (end - start) * record_bytes};
        if (!write && nowait) {
            int64_t got = cached(fd, p.offset, p.data, p.length);
            if (got == -EOPNOTSUPP || got == -EINVAL) {
                nowait = 0;  /* this file system cannot: every read from here on waits, on the threads */
                got = 0;
            } else if (got < 0) {
                free(pieces);
                info[0] = p.offset;
                return (int)-got;
            }
            p.offset += got, p.data += got, p.length -= got;
            if (!p.length)
                continue;
        }
        pieces[count++] = p;
    }
    info[1] = count;
    int64_t per = write ? WRITES_PER_THREAD : 1;
    int64_t threads = (count + per - 1) / per;
    threads = threads < queue_depth ? threads : queue_depth;
    job j = {fd, write, pieces, count, 0, 0, 0, PTHREAD_MUTEX_INITIALIZER};
    if (count)
        run(&j, threads > 1 ? threads : 1);
    free(pieces);
    info[0] = j.error_at;
    return j.error;
}

/* Rows at random places miss every cache level: the next ones are asked for while this one is copied. */
#define AHEAD 8

/* dst row dst_index[i] = src row src_index[i] (either index NULL: row i), for i < n, `width` bytes a row,
   rows `*_stride` bytes apart. Returns 0, or 1 + the first i whose index is outside [0, *_rows): then
   nothing was copied. */
int64_t sv_copy_rows(uint8_t *dst, int64_t dst_stride, int64_t dst_rows, const int64_t *dst_index,
                     const uint8_t *src, int64_t src_stride, int64_t src_rows, const int64_t *src_index,
                     int64_t n, int64_t width) {
    for (int64_t i = 0; i < n; i++) {
        int64_t d = dst_index ? dst_index[i] : i, s = src_index ? src_index[i] : i;
        if (d < 0 || d >= dst_rows || s < 0 || s >= src_rows)
            return i + 1;
    }
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            __builtin_prefetch(dst + (dst_index ? dst_index[i + AHEAD] : i + AHEAD) * dst_stride, 1);
            __builtin_prefetch(src + (src_index ? src_index[i + AHEAD] : i + AHEAD) * src_stride, 0);
        }
        int64_t d = dst_index ? dst_index[i] : i, s = src_index ? src_index[i] : i;
        memcpy(dst + d * dst_stride, src + s * src_stride, (size_t)width);
    }
    return 0;
}

/* dst[index[i]] = *value (`size` bytes an element) for i < n. Returns 0, or 1 + the first i whose index is
   outside [0, length): then nothing was set. */
int64_t sv_fill_at(uint8_t *dst, int64_t size, int64_t length, const int64_t *index, int64_t n, const uint8_t *value) {
    for (int64_t i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= length)
            return i + 1;
    if (size == 1) {
        for (int64_t i = 0; i < n; i++)
            dst[index[i]] = *value;
    } else if (size == 4) {
        uint32_t v;
        memcpy(&v, value, 4);
        for (int64_t i = 0; i < n; i++)
            memcpy(dst + index[i] * 4, &v, 4);
    } else {
        for (int64_t i = 0; i < n; i++)
            memcpy(dst + index[i] * size, value, (size_t)size);
    }
    return 0;
}

/* For i < n, the fields f < nfields of record place[i] (record_stride bytes apart, width[f] bytes at offset[f])
   and row slot[i] of array base[f] (stride[f] bytes apart): into the rows, or from them (write). Returns 0, or
   1 + the first i whose place or slot is outside [0, places) or [0, slots): then nothing was moved. */
int64_t sv_move_fields(uint8_t *records, int64_t record_stride, int64_t places, const int64_t *place, int64_t n,
                       const int64_t *slot, int64_t slots, int64_t nfields, uint8_t *const *base,
                       const int64_t *stride, const int64_t *offset, const int64_t *width, int write) {
    for (int64_t i = 0; i < n; i++)
        if (place[i] < 0 || place[i] >= places || slot[i] < 0 || slot[i] >= slots)
            return i + 1;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            __builtin_prefetch(records + place[i + AHEAD] * record_stride);
            __builtin_prefetch(base[0] + slot[i + AHEAD] * stride[0]);
        }
        uint8_t *record = records + place[i] * record_stride;
        for (int64_t f = 0; f < nfields; f++) {
            uint8_t *row = base[f] + slot[i] * stride[f];
            if (write)
                memcpy(record + offset[f], row, (size_t)width[f]);
            else
                memcpy(row, record + offset[f], (size_t)width[f]);
        }
    }
    return 0;
}

#define ENTRY(p, wide, i) ((wide) ? ((const int64_t *)(p))[i] : (int64_t)((const int32_t *)(p))[i])
#define SET(p, wide, i, v) ((wide) ? (void)(((int64_t *)(p))[i] = (v)) : (void)(((int32_t *)(p))[i] = (int32_t)(v)))

/* Fields f < nfields between record `at` and slot s (see sv_move_fields): into the record where out. */
static void move_row(uint8_t *records, int64_t record_stride, int64_t at, int64_t s, int64_t nfields,
                     uint8_t *const *base, const int64_t *stride, const int64_t *offset, const int64_t *width,
                     int out) {
    uint8_t *record = records + at * record_stride;
    for (int64_t f = 0; f < nfields; f++) {
        uint8_t *row = base[f] + s * stride[f];
        if (out)
            memcpy(record + offset[f], row, (size_t)width[f]);
        else
            memcpy(row, record + offset[f], (size_t)width[f]);
    }
}

/* A row cache's misses brought in, in one pass, while its file is mapped for writes (RowCache's evict and
   bring, the rows at their own places): the victims (ascending slots) give up their rows, the changed ones
   (dirty) written to their homes; then the n new rows (distinct ids, none held: the map holds -1 - place)
   are read from their records into the slots taken, ascending, from the free ones (ascending) merged with
   the victims; each slot's key, home, step (used), use count (count, where not NULL) and dirty flag set, the
   map pointing at it. key and home are int64 where wide_slots, else int32; the map likewise (wide_map).
   slots_out: each id's slot; free_out: the slots left free, ascending. Returns the rows written back, or
   -1 - i for the first bad index i (victims, then free slots, then ids: out of range, out of order, an id
   held or its place out of range; or n > free + victims): then nothing changed. */
int64_t sv_swap_rows(void *map, int wide_map, int64_t rows, void *key, void *home, int wide_slots, int32_t *used,
                     uint8_t *dirty, int32_t *count, int64_t capacity, const int64_t *victims, int64_t nvictims,
                     const int32_t *free_slots, int64_t nfree, const int64_t *ids, int64_t n, int32_t step,
                     uint8_t *records, int64_t record_stride, int64_t places, int64_t nfields, uint8_t *const *base,
                     const int64_t *stride, const int64_t *offset, const int64_t *width, int64_t *slots_out,
                     int32_t *free_out) {
    for (int64_t i = 0; i < nvictims; i++) {
        int64_t v = victims[i], k = v >= 0 && v < capacity ? ENTRY(key, wide_slots, v) : -1;
        int64_t h = k >= 0 ? ENTRY(home, wide_slots, v) : -1;
        if (k < 0 || k >= rows || h < 0 || h >= places || (i && v <= victims[i - 1]))
            return -1 - i;
    }
    for (int64_t i = 0; i < nfree; i++)
        if (free_slots[i] < 0 || free_slots[i] >= capacity || (i && free_slots[i] <= free_slots[i - 1]))
            return -1 - (nvictims + i);
    for (int64_t i = 0; i < n; i++) {
        int64_t id = ids[i], entry = id >= 0 && id < rows ? ENTRY(map, wide_map, id) : 0;
        if (entry >= 0 || -1 - entry >= places || (i && id <= ids[i - 1]) || n > nfree + nvictims)
            return -1 - (nvictims + nfree + i);
    }
    int64_t written = 0;
    for (int64_t i = 0; i < nvictims; i++) {
        int64_t v = victims[i], h = ENTRY(home, wide_slots, v);
        if (i + AHEAD < nvictims && dirty[victims[i + AHEAD]]) {
            __builtin_prefetch(records + ENTRY(home, wide_slots, victims[i + AHEAD]) * record_stride, 1);
            __builtin_prefetch(base[0] + victims[i + AHEAD] * stride[0]);
        }
        if (dirty[v]) {
            move_row(records, record_stride, h, v, nfields, base, stride, offset, width, 1);
            dirty[v] = 0;
            written++;
        }
        SET(map, wide_map, ENTRY(key, wide_slots, v), -1 - h);
        SET(key, wide_slots, v, -1);
    }
    int64_t a = 0, b = 0, taken = 0; /* the free slots and the victims, merged: the first n taken */
    while (a < nfree || b < nvictims) {
        int64_t s = b >= nvictims || (a < nfree && free_slots[a] < victims[b]) ? free_slots[a++] : victims[b++];
        if (taken < n)
            slots_out[taken++] = s;
        else
            free_out[a + b - 1 - n] = (int32_t)s;
    }
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(records + (-1 - ENTRY(map, wide_map, ids[i + AHEAD])) * record_stride);
        int64_t s = slots_out[i], at = -1 - ENTRY(map, wide_map, ids[i]);
        move_row(records, record_stride, at, s, nfields, base, stride, offset, width, 0);
        SET(key, wide_slots, s, ids[i]);
        SET(home, wide_slots, s, at);
        SET(map, wide_map, ids[i], s);
        used[s] = step;
        dirty[s] = 0;
        if (count)
            count[s] = 1;
    }
    return written;
}
