// Cross-entropy, the first version: one thread per row, three passes over its row (maximum, sum of
// exponentials, gradient). Correct, and slow: the 32 threads of a warp read 32 different rows, V floats
// apart, so each load of a warp touches 32 memory segments instead of one, and a GPU with 8192 rows
// to do has 8192 threads, a few per core, to hide the latency of every read.
extern "C" __global__ void cross_entropy_one_thread_per_row(float* dlogits, float* row_losses, const float* logits,
                                                            const int* targets, int N, int V, int ignore_index,
                                                            float scale)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) {
        return;
    }
    const float* row = logits + (long long)i * V;
    float* dlogits_row = dlogits + (long long)i * V;
    int target = targets[i];
    if (target == ignore_index) {
        for (int j = 0; j < V; ++j) {
            dlogits_row[j] = 0.0f;
        }
        row_losses[i] = 0.0f;
        return;
    }
    float maximum = row[0];
    for (int j = 1; j < V; ++j) {
        maximum = fmaxf(maximum, row[j]);
    }
    float sum = 0.0f;
    for (int j = 0; j < V; ++j) {
        sum += expf(row[j] - maximum);
    }
    float log_sum_exp = maximum + logf(sum);
    row_losses[i] = log_sum_exp - row[target];
    for (int j = 0; j < V; ++j) {
        dlogits_row[j] = (expf(row[j] - log_sum_exp) - (j == target ? 1.0f : 0.0f)) * scale;
    }
}
