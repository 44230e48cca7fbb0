// Rank `rank`'s shard of the average of `ranks` buffers of n floats each (buffers[k * n + j] is rank k's
// element j): the first half of a ring all-reduce, done by one kernel that can read every rank's buffer.
// Thread i owns element i of the shard, and adds the ranks in rank order, as the simulated group does.
extern "C" __global__ void reduce_scatter(float* shard, const float* buffers, int ranks, int n, int rank)
{
    int shard_size = n / ranks;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < shard_size) {
        int j = rank * shard_size + i;   // the shard's element i in every rank's buffer
        float sum = 0.0f;
        for (int k = 0; k < ranks; ++k) {
            sum += buffers[(long long)k * n + j];
        }
        shard[i] = sum / ranks;
    }
}
