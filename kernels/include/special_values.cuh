// Infinity and NaN as bit patterns: NVRTC compiles without <math.h>, so there is no INFINITY or NAN macro.
// A float is 1 sign bit, 8 exponent bits and 23 mantissa bits; an exponent of all ones with a zero mantissa
// is infinity, with a nonzero mantissa NaN ("quiet" when the mantissa's top bit is set).
#ifndef GPT2_CUPY_SPECIAL_VALUES_CUH
#define GPT2_CUPY_SPECIAL_VALUES_CUH

#define NEGATIVE_INFINITY __uint_as_float(0xff800000u)
#define QUIET_NAN __uint_as_float(0x7fc00000u)

#endif
