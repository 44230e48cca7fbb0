// One SGD step that a CUDA graph can replay: the learning rate is read from the schedule at the step held in
// device memory, so a replay uses whatever the host (or the graph) wrote there before it.
extern "C" __global__ void sgd_step(float* parameters, const float* gradients, const float* schedule,
                                    const int* step, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float learning_rate = schedule[step[0]];
        parameters[i] -= learning_rate * gradients[i];
    }
}
