// Moving floats four at a time. A float4 load or store moves 16 bytes with one instruction, a quarter of
// the instructions (and of their address arithmetic) for the same bytes, but only from an address that is
// a multiple of 16. Kernels that hold a row in registers move it in groups of WIDTH neighbouring floats:
// WIDTH = 4 through float4 (the row's length a multiple of 4 and the array 16-byte aligned), WIDTH = 1 one
// float at a time. WIDTH is a template parameter, a compile-time constant, so the loops unroll and the
// groups live in registers.
#ifndef GPT2_CUPY_FLOAT_GROUPS_CUH
#define GPT2_CUPY_FLOAT_GROUPS_CUH

// WIDTH floats from source into destination when `inside`; zeros otherwise, and nothing is read.
template <int WIDTH>
__device__ __forceinline__ void load_group(float* destination, const float* source, bool inside)
{
    if (!inside) {
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = 0.0f;
        }
    } else if (WIDTH == 4) {
        float4 group = *reinterpret_cast<const float4*>(source);
        destination[0] = group.x;
        destination[1] = group.y;
        destination[2] = group.z;
        destination[3] = group.w;
    } else {
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = source[w];
        }
    }
}

// WIDTH floats from source into destination.
template <int WIDTH>
__device__ __forceinline__ void store_group(float* destination, const float* source)
{
    if (WIDTH == 4) {
        *reinterpret_cast<float4*>(destination) = make_float4(source[0], source[1], source[2], source[3]);
    } else {
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = source[w];
        }
    }
}

// How many floats from `pointer` to the next 16-byte boundary (0 when it is on one): a row that does not
// start on a boundary is walked as this many loose floats, then float4s, then a loose tail.
__device__ __forceinline__ int floats_to_boundary(const float* pointer)
{
    return (int)((16 - (unsigned long long)pointer % 16) % 16 / 4);
}

#endif
