// One AdamW step with the gradient clipped on the way in: g * min(1, max_norm / (norm + 1e-6)), the norm
// read from device memory, so the gradients are read once and never written.
extern "C" __global__ void adamw_clipped(float* params, float* m, float* v, const float* grads, const float* norm,
                                         float max_norm, float lr, float beta1, float beta2, float eps,
                                         float weight_decay, float bias_correction1, float bias_correction2, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float scale = fminf(1.0f, max_norm / (norm[0] + 1e-6f));
        float g = grads[i] * scale;
        float theta = params[i] - lr * weight_decay * params[i];
        float m_i = beta1 * m[i] + (1.0f - beta1) * g;
        float v_i = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = m_i;
        v[i] = v_i;
        params[i] = theta - lr * (m_i / bias_correction1) / (sqrtf(v_i / bias_correction2) + eps);
    }
}
