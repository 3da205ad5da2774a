/* Row-wise updates of distinct table rows in one pass (shardvar/optim/_kernel.py loads this).
 *
 * sv_rowwise_update updates, for each i, row rows[i] of a float32 table and its row-wise state
 * (acc; rows NULL: every row, in order), by one of two rules (g = grad[i] + weight_decay * w, ms = |g|^2 / dim):
 *   Adagrad:  acc += ms;  w -= lr * g / (sqrt(acc) + eps)
 *   Adam:     m = lerp(m, g, 1 - beta1);  acc = beta2 * acc + (1 - beta2) * ms;
 *             w -= lr / (1 - beta1^t) * m / (sqrt(acc) / sqrt(1 - beta2^t) + eps)   (m: one per element)
 * reading and writing each row once, where the torch ops read it five times (gather, norm,
 * divide, scatter back, the state alike). The rows must be distinct (one row, one update).
 * Every row id is checked before any row changes: returns 0, or 1 + the position of the first id
 * outside [0, num_rows). One thread: on 2 cores, a second thread of its own beside torch's OpenMP
 * pool (whose threads spin a while after each parallel region) made the fused collection step of
 * issue 37 ~40 ms slower, not faster. No Python here: ctypes calls it without the interpreter's lock.
 *
 * sv_bags_rowwise_update takes a sum bag's gradient whole: the ids of each bag (bag b holds ids
 * [offsets[b], offsets[b + 1]), the last to n), the gradient of each bag, and updates every distinct
 * row with the sum of the gradients of the bags that hold it, added in the order of the ids (the
 * order a stable sort and a segment sum add them in: the same sum, bit for bit). No sort: each id
 * finds its row's slot in a hash table of the batch's distinct rows (open addressing, 2-4 entries
 * per id), and the rows' sums are made `chunk` slots at a time, so the memory the sums take is
 * bounded whatever the batch.
 */
#include <math.h>
#include <stdint.h>

int sv_optim_abi_version(void) { return 4; }

#define RULE_ADAGRAD 0
#define RULE_ADAM 1

typedef struct {
    int64_t rule;
    float lr, eps, decay;
    float beta1_weight;                  /* Adam: 1 - beta1, the first moment's lerp weight */
    float beta2, one_minus_beta2;        /* Adam */
    float sqrt_bias2, step_size;         /* Adam: sqrt(1 - beta2^t), -lr / (1 - beta1^t) */
    float *moment;                       /* Adam's first moment: a row per table row */
    int64_t moment_stride;
} rule_t;

typedef struct {
    float *weight;
    int64_t weight_stride;
    float *acc;  /* the row-wise state: Adagrad's sum, Adam's second moment */
    int64_t acc_stride;
    const int64_t *rows;
    const float *grad;
    int64_t grad_stride, dim, lo, hi;
    const rule_t *rule;
} job_t;

/* |x|^2 of a row in LANES independent sums (one chain of dependent adds would cost its latency per
   element), then summed pairwise. */
#define LANES 8

static float row_squares(const float *g, const float *w, float decay, int64_t dim) {
    float lane[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES)
        for (int k = 0; k < LANES; ++k) {
            float x = decay != 0.0f ? g[d + k] + decay * w[d + k] : g[d + k];
            lane[k] += x * x;
        }
    for (; d < dim; ++d) {
        float x = decay != 0.0f ? g[d] + decay * w[d] : g[d];
        lane[d % LANES] += x * x;
    }
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int k = 0; k < width; ++k)
            lane[k] += lane[k + width];
    return lane[0];
}

/* Rows are random: each waits for memory unless asked for ahead (a row's work is too long for the
   processor to run far enough ahead by itself). */
#define AHEAD 8

static void fetch(const float *row, int64_t dim) {
    for (int64_t b = 0; b < dim * (int64_t)sizeof(float); b += 64)
        __builtin_prefetch((const char *)row + b, 1);
}

static void adagrad_row(const job_t *j, float *w, float *acc, const float *g) {
    const rule_t *r = j->rule;
    const int64_t dim = j->dim;
    const float decay = r->decay, step = -r->lr;
    float norm = sqrtf(row_squares(g, w, decay, dim));
    float total = *acc + norm * norm / (float)(dim > 0 ? dim : 1);
    *acc = total;
    float denominator = sqrtf(total) + r->eps;
    if (decay != 0.0f)
        for (int64_t d = 0; d < dim; ++d)
            w[d] = w[d] + step * ((g[d] + decay * w[d]) / denominator);
    else
        for (int64_t d = 0; d < dim; ++d)
            w[d] = w[d] + step * (g[d] / denominator);
}

static void adam_row(const job_t *j, float *w, float *acc, float *m, const float *g) {
    const rule_t *r = j->rule;
    const int64_t dim = j->dim;
    const float decay = r->decay, a = r->beta1_weight, b = 1.0f - a;
    float norm = sqrtf(row_squares(g, w, decay, dim));
    for (int64_t d = 0; d < dim; ++d) {  /* torch's lerp: the form it takes for the weight */
        float x = decay != 0.0f ? g[d] + decay * w[d] : g[d];
        m[d] = a < 0.5f ? m[d] + a * (x - m[d]) : x - (x - m[d]) * b;
    }
    float second = *acc * r->beta2 + r->one_minus_beta2 * (norm * norm / (float)(dim > 0 ? dim : 1));
    *acc = second;
    float denominator = sqrtf(second) / r->sqrt_bias2 + r->eps;
    for (int64_t d = 0; d < dim; ++d)
        w[d] = w[d] + r->step_size * (m[d] / denominator);
}

static int64_t row_at(const job_t *j, int64_t i) { return j->rows ? j->rows[i] : i; }

static void update_rows(const job_t *j) {
    const rule_t *r = j->rule;
    for (int64_t i = j->lo; i < j->hi; ++i) {
        if (i + AHEAD < j->hi) {
            int64_t next = row_at(j, i + AHEAD);
            fetch(j->weight + next * j->weight_stride, j->dim);
            __builtin_prefetch(j->acc + next * j->acc_stride, 1);
            if (r->rule == RULE_ADAM)
                fetch(r->moment + next * r->moment_stride, j->dim);
        }
        int64_t row = row_at(j, i);
        float *w = j->weight + row * j->weight_stride, *acc = j->acc + row * j->acc_stride;
        const float *g = j->grad + i * j->grad_stride;
        if (r->rule == RULE_ADAM)
            adam_row(j, w, acc, r->moment + row * r->moment_stride, g);
        else
            adagrad_row(j, w, acc, g);
    }
}

int64_t sv_rowwise_update(float *weight, int64_t weight_stride, int64_t num_rows, float *acc, int64_t acc_stride,
                          const int64_t *rows, int64_t count, const float *grad, int64_t grad_stride, int64_t dim,
                          const rule_t *rule) {
    for (int64_t i = 0; rows && i < count; ++i)
        if (rows[i] < 0 || rows[i] >= num_rows)
            return i + 1;
    job_t job = {weight, weight_stride, acc, acc_stride, rows, grad, grad_stride, dim, 0, count, rule};
    update_rows(&job);
    return 0;
}

/* A slot per distinct row of the batch: keys[h] the row (-1: free), slots[h] its slot. */
static int32_t slot_of(int64_t row, int64_t *keys, int32_t *slots, int64_t mask, int64_t *rows, int32_t *count) {
    uint64_t h = ((uint64_t)row * 0x9E3779B97F4A7C15ull) >> 17;
    for (;; ++h) {
        int64_t at = (int64_t)(h & (uint64_t)mask);
        if (keys[at] == row)
            return slots[at];
        if (keys[at] < 0) {
            keys[at] = row, slots[at] = *count, rows[*count] = row;
            return (*count)++;
        }
    }
}

static int64_t id_at(const void *ids, int bytes, int64_t i) {
    return bytes == 4 ? (int64_t)((const int32_t *)ids)[i] : ((const int64_t *)ids)[i];
}

/* info[0]: 0, or 1 (an id outside the table: info[1] its position) or 2 (offsets out of order: info[1]
   the bag); info[2]: how many distinct rows were updated. */
void sv_bags_rowwise_update(float *weight, int64_t weight_stride, int64_t num_rows, float *acc, int64_t acc_stride,
                            const void *ids, const void *offsets, int index_bytes, int64_t n, int64_t bags,
                            const float *grad, int64_t grad_stride, int64_t dim, const rule_t *rule, int64_t *keys,
                            int32_t *slots, int64_t capacity, int32_t *id_slot, int64_t *rows, float *sums,
                            int64_t chunk, int64_t *info) {
    info[0] = info[1] = info[2] = 0;
    for (int64_t i = 0; i < n; ++i) {
        int64_t row = id_at(ids, index_bytes, i);
        if (row < 0 || row >= num_rows) {
            info[0] = 1, info[1] = i;
            return;
        }
    }
    for (int64_t b = 0; b < bags; ++b) {
        int64_t lo = id_at(offsets, index_bytes, b), hi = b + 1 < bags ? id_at(offsets, index_bytes, b + 1) : n;
        if (lo < 0 || lo > hi || hi > n || (b == 0 && lo != 0)) {
            info[0] = 2, info[1] = b;
            return;
        }
    }
    for (int64_t h = 0; h < capacity; ++h)
        keys[h] = -1;
    int32_t count = 0;
    for (int64_t i = 0; i < n; ++i)
        id_slot[i] = slot_of(id_at(ids, index_bytes, i), keys, slots, capacity - 1, rows, &count);
    for (int64_t first = 0; first < count; first += chunk) {
        int64_t last = first + chunk < count ? first + chunk : count;
        for (int64_t k = 0; k < (last - first) * dim; ++k)
            sums[k] = 0.0f;
        for (int64_t b = 0; b < bags; ++b) {
            int64_t lo = id_at(offsets, index_bytes, b), hi = b + 1 < bags ? id_at(offsets, index_bytes, b + 1) : n;
            const float *g = grad + b * grad_stride;
            for (int64_t i = lo; i < hi; ++i) {
                int64_t s = id_slot[i];
                if (s < first || s >= last)
                    continue;
                float *sum = sums + (s - first) * dim;
                for (int64_t d = 0; d < dim; ++d)
                    sum[d] += g[d];
            }
        }
        job_t job = {weight, weight_stride, acc, acc_stride, rows + first, sums, dim, dim, 0, last - first, rule};
        update_rows(&job);
    }
    info[2] = count;
}
