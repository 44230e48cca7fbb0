"""Tensor maps: what a kernel's bulk tensor copies (kernels/include/tma.cuh's tma_load_2d) read to find an array.

    tensor_map(array, box_rows, box_columns, swizzle=128)
        the 128 bytes a kernel takes as a `const __grid_constant__ TensorMap` parameter (a numpy scalar of
        TENSOR_MAP, passed like any argument), describing the 2-D `array` (its rows may lie apart: a row
        stride, in bytes, of a multiple of 16) and the box of box_rows x box_columns elements one copy moves,
        laid out in shared memory in rows of box_columns elements, 16-byte chunks swizzled as wgmma's
        128-byte swizzle reads them (swizzle=128), or not (swizzle=0).

On a GPU the CUDA driver writes the map (cuTensorMapEncodeTiled, through ctypes: CuPy does not wrap it). The
CPU executor has no copy engine and reads its own layout, CPU_TENSOR_MAP below, in the same 128 bytes. The map
holds the array's address: it is valid while the array lives, and a kernel given it reads the array itself.
"""

import ctypes
import functools

import numpy

from gpt2_cupy import backend

TENSOR_MAP = numpy.dtype([("opaque", numpy.uint64, (16,))], align=True)   # struct TensorMap: 128 bytes
# The CPU executor's reading of those 128 bytes (gpt2_cupy/cpu/include/gpt2cupy/ptx.h: CpuTensorMap).
CPU_TENSOR_MAP = numpy.dtype({"names": ["magic", "rank", "address", "element_bytes", "swizzle_bytes", "columns",
                                        "rows", "row_stride", "box_columns", "box_rows"],
                              "formats": [numpy.uint32, numpy.uint32, numpy.uint64, numpy.uint32, numpy.uint32,
                                          numpy.uint64, numpy.uint64, numpy.uint64, numpy.uint32, numpy.uint32],
                              "offsets": [0, 4, 8, 16, 20, 24, 32, 40, 48, 52], "itemsize": 128})
CPU_MAGIC = 0x70616D74           # "tmap", little-endian: the executor refuses 128 bytes without it
SWIZZLES = (0, 128)              # bytes of the swizzle pattern; 0 for none
MAX_BOX = 256                    # elements of a box along each dimension, at most (the copy engine's limit)
ALIGNMENT = 16                   # bytes: the array's address and its row stride are multiples of it

# cuTensorMapEncodeTiled's enumerations (CUDA driver API, cuda.h)
_DRIVER_TYPES = {1: 0, 2: 1, 4: 7}       # element bytes -> CU_TENSOR_MAP_DATA_TYPE_UINT8 / UINT16 / FLOAT32
_DRIVER_SWIZZLE = {0: 0, 128: 3}          # CU_TENSOR_MAP_SWIZZLE_NONE / _128B
_L2_PROMOTION_256B = 3                    # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_INTERLEAVE_NONE, _FILL_ZEROS = 0, 0      # CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE


def tensor_map(array, box_rows, box_columns, swizzle=128):
    """The tensor map of 2-D `array` (its last dimension contiguous) and boxes of box_rows x box_columns."""
    if array.ndim != 2:
        raise ValueError(f"tensor_map: the array must be 2-D, got shape {array.shape}")
    element_bytes = array.dtype.itemsize
    rows, columns = array.shape
    row_stride = array.strides[0]
    if array.strides[1] != element_bytes and columns > 1:
        raise ValueError(f"tensor_map: the array's rows must be contiguous (strides {array.strides})")
    if element_bytes not in _DRIVER_TYPES:
        raise TypeError(f"tensor_map: elements of {element_bytes} bytes ({array.dtype}); 1, 2 or 4 are mapped")
    if swizzle not in SWIZZLES:
        raise ValueError(f"tensor_map: swizzle must be one of {SWIZZLES} bytes, got {swizzle}")
    if swizzle and box_columns * element_bytes != swizzle:
        raise ValueError(f"tensor_map: a box row of {box_columns} x {element_bytes} bytes under the {swizzle}-byte "
                         f"swizzle; it must be exactly {swizzle} bytes")
    if not (0 < box_rows <= MAX_BOX and 0 < box_columns <= MAX_BOX):
        raise ValueError(f"tensor_map: a box of {box_rows} x {box_columns}; each side must be 1 .. {MAX_BOX}")
    if (box_columns * element_bytes) % ALIGNMENT:
        raise ValueError(f"tensor_map: a box row of {box_columns * element_bytes} bytes; it must be a multiple of "
                         f"{ALIGNMENT}")
    address = backend.address(array)
    if address % ALIGNMENT or (rows > 1 and row_stride % ALIGNMENT):
        raise ValueError(f"tensor_map: the array must start on {ALIGNMENT} bytes and its rows lie a multiple of "
                         f"{ALIGNMENT} bytes apart (address {address:#x}, row stride {row_stride})")
    row_stride = max(row_stride, columns * element_bytes)   # a single row's stride is free: make it plausible
    encode = _driver_map if backend.ON_GPU else _cpu_map
    return encode(address, element_bytes, rows, columns, row_stride, box_rows, box_columns, swizzle)


@functools.lru_cache(maxsize=1024)   # a model's products ask for the same few maps at every step
def _cpu_map(address, element_bytes, rows, columns, row_stride, box_rows, box_columns, swizzle):
    fields = numpy.zeros((), dtype=CPU_TENSOR_MAP)
    for name, value in (("magic", CPU_MAGIC), ("rank", 2), ("address", address), ("element_bytes", element_bytes),
                        ("swizzle_bytes", swizzle), ("columns", columns), ("rows", rows),
                        ("row_stride", row_stride), ("box_columns", box_columns), ("box_rows", box_rows)):
        fields[name] = value
    return fields.view(TENSOR_MAP)[()]


@functools.lru_cache(maxsize=None)
def _encode_tiled():
    """The driver's cuTensorMapEncodeTiled, from the libcuda CuPy has loaded."""
    function = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    u32, u64, pointer = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    function.restype = ctypes.c_int
    function.argtypes = [pointer, ctypes.c_int, u32, pointer, ctypes.POINTER(u64), ctypes.POINTER(u64),
                         ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int]
    return function


@functools.lru_cache(maxsize=1024)
def _driver_map(address, element_bytes, rows, columns, row_stride, box_rows, box_columns, swizzle):
    # The driver writes the map where a CUtensorMap would lie: on 64 bytes.
    room = numpy.zeros(TENSOR_MAP.itemsize + 64, dtype=numpy.uint8)
    start = -room.ctypes.data % 64
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    sizes, strides = (u64 * 2)(columns, rows), (u64 * 1)(row_stride)
    box, element_strides = (u32 * 2)(box_columns, box_rows), (u32 * 2)(1, 1)
    status = _encode_tiled()(room.ctypes.data + start, _DRIVER_TYPES[element_bytes], 2, ctypes.c_void_p(address), sizes,
                             strides, box, element_strides, _INTERLEAVE_NONE, _DRIVER_SWIZZLE[swizzle],
                             _L2_PROMOTION_256B, _FILL_ZEROS)
    if status != 0:
        raise RuntimeError(f"tensor_map: cuTensorMapEncodeTiled failed with CUresult {status} (array of {rows} x "
                           f"{columns} elements of {element_bytes} bytes, row stride {row_stride}, box {box_rows} x "
                           f"{box_columns}, swizzle {swizzle})")
    return room[start:start + TENSOR_MAP.itemsize].view(TENSOR_MAP)[0]
