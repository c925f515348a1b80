// Tessera's CUDA kernels, compiled at run time by NVRTC (no headers needed).
//
// Element types: f32 (`float`), f64 (`double`), bf16 (`bf16`, bits in an
// unsigned short). bf16 computes in f32 and rounds once per output element
// (round to nearest even, NaN kept quiet), as the CPU kernels do; sums and the
// statistics of softmax, normalisations and cross entropy accumulate in f64.
// Every kernel loops over its grid (grid-stride), so any grid size is correct.

typedef unsigned short bf16;
typedef long long i64;
#define NEG_INF (-__longlong_as_double(0x7ff0000000000000LL))

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ double to_f(double x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __uint_as_float(((unsigned int)x) << 16); }

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}
template <typename T> __device__ __forceinline__ T from_d(double x) { return from_f<T>((float)x); }
template <> __device__ __forceinline__ double from_d<double>(double x) { return x; }
// From the compute type (f32, or f64 for f64) to T, rounding once.
template <typename T> __device__ __forceinline__ T from_a(typename Acc<T>::type x);
template <> __device__ __forceinline__ float from_a<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_a<bf16>(float x) { return from_f<bf16>(x); }
template <> __device__ __forceinline__ double from_a<double>(double x) { return x; }
__device__ __forceinline__ void store(float* o, float x) { *o = x; }
__device__ __forceinline__ void store(bf16* o, float x) { *o = from_f<bf16>(x); }
__device__ __forceinline__ void store(double* o, double x) { *o = x; }

// Math in the argument's precision: f32 arguments call the f32 functions
// (a bare `exp(float)` could promote to f64, several times slower).
__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_erf(float x) { return erff(x); }
__device__ __forceinline__ double m_erf(double x) { return erf(x); }
__device__ __forceinline__ float m_erfc(float x) { return erfcf(x); }
__device__ __forceinline__ double m_erfc(double x) { return erfc(x); }
__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }

#define MAX_DIMS 8
#define GRID_LOOP(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// The shape of an output and the strides (in elements) of up to two inputs
// over it (stride 0 broadcasts), plus the inputs' offsets.
struct Geo {
    int rank;
    i64 numel;
    i64 shape[MAX_DIMS];
    i64 sa[MAX_DIMS];
    i64 sb[MAX_DIMS];
    i64 oa;
    i64 ob;
};

__device__ __forceinline__ void offsets(const Geo& g, i64 i, i64* a, i64* b) {
    i64 oa = g.oa, ob = g.ob;
    if (g.numel < 2147483647LL) {
        // 32-bit division is several times cheaper than 64-bit on the GPU.
        unsigned int j = (unsigned int)i;
        for (int d = g.rank - 1; d >= 0; --d) {
            unsigned int n = (unsigned int)g.shape[d];
            unsigned int k = j % n;
            j /= n;
            oa += (i64)k * g.sa[d];
            ob += (i64)k * g.sb[d];
        }
    } else {
        for (int d = g.rank - 1; d >= 0; --d) {
            i64 n = g.shape[d];
            i64 k = i % n;
            i /= n;
            oa += k * g.sa[d];
            ob += k * g.sb[d];
        }
    }
    *a = oa;
    *b = ob;
}


// ---- copies and casts ------------------------------------------------------
// Copies read `in` through strides sa and write `out` through strides sb.

template <typename T> __device__ void copy_strided(T* out, const T* in, Geo g) {
    GRID_LOOP(i, g.numel) {
        i64 a, b;
        offsets(g, i, &a, &b);
        out[b] = in[a];
    }
}
extern "C" __global__ void copy_w1(unsigned char* o, const unsigned char* x, Geo g) { copy_strided(o, x, g); }
extern "C" __global__ void copy_w2(unsigned short* o, const unsigned short* x, Geo g) { copy_strided(o, x, g); }
extern "C" __global__ void copy_w4(unsigned int* o, const unsigned int* x, Geo g) { copy_strided(o, x, g); }
extern "C" __global__ void copy_w8(unsigned long long* o, const unsigned long long* x, Geo g) { copy_strided(o, x, g); }

// Zeroes [i, j], j > i, inside the diagonal tiles (block × block) of count
// row-major [m, n] matrices: one thread per (matrix, row, column of its tile).
template <typename W> __device__ void causal_zero(W* c, i64 count, i64 m, i64 n, i64 block) {
    i64 width = min(block, n);
    GRID_LOOP(t, count * m * width) {
        i64 jj = t % width, q = t / width;
        i64 i = q % m, b = q / m;
        i64 j = (i / block) * block + jj;
        if (j > i && j < n) c[(b * m + i) * n + j] = (W)0;
    }
}
extern "C" __global__ void causal_zero_w2(unsigned short* c, i64 k, i64 m, i64 n, i64 b) { causal_zero(c, k, m, n, b); }
extern "C" __global__ void causal_zero_w4(unsigned int* c, i64 k, i64 m, i64 n, i64 b) { causal_zero(c, k, m, n, b); }
extern "C" __global__ void causal_zero_w8(unsigned long long* c, i64 k, i64 m, i64 n, i64 b) { causal_zero(c, k, m, n, b); }

// Copies whose innermost dim is dense on both sides, in words of W: `inner`
// words per row, the rows placed by g (over the outer dims, strides in
// words). One thread per word; the index arithmetic is per row, not per
// element.
struct __align__(16) Word16 { unsigned long long lo, hi; };
template <typename W> __device__ void copy_words(W* out, const W* in, i64 words, i64 inner, Geo g) {
    bool small = words < 2147483647LL;
    GRID_LOOP(t, words) {
        i64 row = small ? (i64)((unsigned int)t / (unsigned int)inner) : t / inner;
        i64 j = t - row * inner;
        i64 a, b;
        offsets(g, row, &a, &b);
        out[b + j] = in[a + j];
    }
}
extern "C" __global__ void copy_words_w1(unsigned char* o, const unsigned char* x, i64 w, i64 n, Geo g) { copy_words(o, x, w, n, g); }
extern "C" __global__ void copy_words_w2(unsigned short* o, const unsigned short* x, i64 w, i64 n, Geo g) { copy_words(o, x, w, n, g); }
extern "C" __global__ void copy_words_w4(unsigned int* o, const unsigned int* x, i64 w, i64 n, Geo g) { copy_words(o, x, w, n, g); }
extern "C" __global__ void copy_words_w8(unsigned long long* o, const unsigned long long* x, i64 w, i64 n, Geo g) { copy_words(o, x, w, n, g); }
extern "C" __global__ void copy_words_w16(Word16* o, const Word16* x, i64 w, i64 n, Geo g) { copy_words(o, x, w, n, g); }

template <typename S, typename D> __device__ void cast_strided(D* out, const S* in, Geo g) {
    GRID_LOOP(i, g.numel) {
        i64 a, b;
        offsets(g, i, &a, &b);
        out[i] = from_d<D>((double)to_f(in[a]));
    }
}
// Four elements of T loaded or stored at once.
template <typename T> struct __align__(4 * sizeof(T)) Quad { T v[4]; };

// Casts of dense inputs: element i to element i, no index arithmetic, four
// elements per thread when both ends are aligned to four, then the tail.
template <typename S, typename D> __device__ void cast_dense(D* out, const S* in, i64 n) {
    bool quads = ((unsigned long long)out % sizeof(Quad<D>)) == 0 && ((unsigned long long)in % sizeof(Quad<S>)) == 0;
    i64 nq = quads ? n / 4 : 0;
    GRID_LOOP(q, nq) {
        Quad<S> a = ((const Quad<S>*)in)[q];
        Quad<D> o;
#pragma unroll
        for (int k = 0; k < 4; ++k) o.v[k] = from_d<D>((double)to_f(a.v[k]));
        ((Quad<D>*)out)[q] = o;
    }
    GRID_LOOP(t, n - nq * 4) {
        i64 i = nq * 4 + t;
        out[i] = from_d<D>((double)to_f(in[i]));
    }
}
extern "C" __global__ void cast_dense_f32_bf16(bf16* o, const float* x, i64 n) { cast_dense(o, x, n); }
extern "C" __global__ void cast_dense_bf16_f32(float* o, const bf16* x, i64 n) { cast_dense(o, x, n); }
extern "C" __global__ void cast_dense_f32_f64(double* o, const float* x, i64 n) { cast_dense(o, x, n); }
extern "C" __global__ void cast_dense_f64_f32(float* o, const double* x, i64 n) { cast_dense(o, x, n); }
extern "C" __global__ void cast_dense_bf16_f64(double* o, const bf16* x, i64 n) { cast_dense(o, x, n); }
extern "C" __global__ void cast_f32_bf16(bf16* o, const float* x, Geo g) { cast_strided(o, x, g); }
extern "C" __global__ void cast_bf16_f32(float* o, const bf16* x, Geo g) { cast_strided(o, x, g); }
extern "C" __global__ void cast_f32_f64(double* o, const float* x, Geo g) { cast_strided(o, x, g); }
extern "C" __global__ void cast_f64_f32(float* o, const double* x, Geo g) { cast_strided(o, x, g); }
extern "C" __global__ void cast_bf16_f64(double* o, const bf16* x, Geo g) { cast_strided(o, x, g); }
extern "C" __global__ void cast_f64_bf16(bf16* o, const double* x, Geo g) {
    // f64 to bf16 rounds once, from the f64 value (through f32 would round twice).
    GRID_LOOP(i, g.numel) {
        i64 a, b;
        offsets(g, i, &a, &b);
        double v = x[a];
        float f = (float)v;
        // Nudge f toward v by its lowest bit when the f32 rounding landed on a
        // bf16 tie, so that the second rounding goes the way v lies.
        unsigned int u = __float_as_uint(f);
        if ((u & 0xffffu) == 0x8000u && (double)f != v) {
            u += ((double)f < v) == (f > 0.0f) ? 1u : (unsigned int)-1;
            f = __uint_as_float(u);
        }
        o[i] = from_f<bf16>(f);
    }
}

// ---- element-wise ------------------------------------------------------------

// Each op is a functor over the compute type A (f32, or f64 for f64).
#define BINARY_OPS(X)                                   \
    X(add, a + b)                                       \
    X(sub, a - b)                                       \
    X(mul, a * b)                                       \
    X(div, a / b)                                       \
    X(maximum, (a != a || a > b) ? a : b)               \
    X(minimum, (a != a || a < b) ? a : b)               \
    X(pow, pow_(a, b))                                  \
    X(gelu_backward, gelu_bwd(a, b))                    \
    X(silu_backward, silu_bwd(a, b))

__device__ __forceinline__ float pow_(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double pow_(double a, double b) { return pow(a, b); }
__device__ __forceinline__ float gelu_bwd(float g, float x) {
    float cdf = 0.5f * erfcf(-x * 0.70710678118654752f);
    float pdf = 0.39894228040143268f * expf(-0.5f * x * x);
    return g * (cdf + x * pdf);
}
__device__ __forceinline__ double gelu_bwd(double g, double x) {
    double cdf = 0.5 * erfc(-x * 0.70710678118654752);
    double pdf = 0.39894228040143268 * exp(-0.5 * x * x);
    return g * (cdf + x * pdf);
}
__device__ __forceinline__ float silu_bwd(float g, float x) {
    float s = 1.0f / (1.0f + expf(-x));
    return g * s * (1.0f + x * (1.0f - s));
}
__device__ __forceinline__ double silu_bwd(double g, double x) {
    double s = 1.0 / (1.0 + exp(-x));
    return g * s * (1.0 + x * (1.0 - s));
}

#define BINARY_FUNCTOR(name, expr) \
    struct Op_##name { template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return expr; } };
BINARY_OPS(BINARY_FUNCTOR)

#define UNARY_OPS(X)                                                 \
    X(neg, -x)                                                       \
    X(exp, m_exp(x))                                                   \
    X(log, m_log(x))                                                   \
    X(sqrt, m_sqrt(x))                                                 \
    X(rsqrt, (A)1 / m_sqrt(x))                                         \
    X(tanh, m_tanh(x))                                                 \
    X(erf, m_erf(x))                                                   \
    X(gelu, (A)0.5 * x * m_erfc(-x * (A)0.70710678118654752))          \
    X(relu, x <= (A)0 ? (A)0 : x)                                    \
    X(sigmoid, (A)1 / ((A)1 + m_exp(-x)))                              \
    X(silu, x / ((A)1 + m_exp(-x)))                                    \
    X(abs, m_abs(x))                                                  \
    X(square, x * x)

#define UNARY_FUNCTOR(name, expr) \
    struct Op_##name { template <typename A> __device__ __forceinline__ A operator()(A x) const { return expr; } };
UNARY_OPS(UNARY_FUNCTOR)

// 16 bytes of T: N elements loaded or stored at once.
template <typename T> struct __align__(16) Pack {
    enum { N = 16 / sizeof(T) };
    T v[N];
};

__device__ __forceinline__ bool aligned16(const void* a, const void* b, const void* c) {
    return ((((unsigned long long)a) | ((unsigned long long)b) | ((unsigned long long)c)) & 15ull) == 0;
}

// out = f(x, y) for dense x, y: 16 bytes per thread when aligned, then the tail.
template <typename T, typename F> __device__ void dense2(T* out, const T* x, const T* y, i64 n, F f) {
    typedef typename Acc<T>::type A;
    const int N = Pack<T>::N;
    i64 nv = aligned16(out, x, y) ? n / N : 0;
    GRID_LOOP(v, nv) {
        Pack<T> a = ((const Pack<T>*)x)[v], b = ((const Pack<T>*)y)[v], o;
#pragma unroll
        for (int k = 0; k < N; ++k) store(&o.v[k], f((A)to_f(a.v[k]), (A)to_f(b.v[k])));
        ((Pack<T>*)out)[v] = o;
    }
    GRID_LOOP(t, n - nv * N) {
        i64 i = nv * N + t;
        store(&out[i], f((A)to_f(x[i]), (A)to_f(y[i])));
    }
}

// out = f(x, s) for dense x and a scalar.
template <typename T, typename F> __device__ void dense_scalar(T* out, const T* x, double s, i64 n, F f) {
    typedef typename Acc<T>::type A;
    const int N = Pack<T>::N;
    A b = (A)s;
    i64 nv = aligned16(out, x, x) ? n / N : 0;
    GRID_LOOP(v, nv) {
        Pack<T> a = ((const Pack<T>*)x)[v], o;
#pragma unroll
        for (int k = 0; k < N; ++k) store(&o.v[k], f((A)to_f(a.v[k]), b));
        ((Pack<T>*)out)[v] = o;
    }
    GRID_LOOP(t, n - nv * N) {
        i64 i = nv * N + t;
        store(&out[i], f((A)to_f(x[i]), b));
    }
}

// out = f(x) for dense x.
template <typename T, typename F> __device__ void dense1(T* out, const T* x, i64 n, F f) {
    typedef typename Acc<T>::type A;
    const int N = Pack<T>::N;
    i64 nv = aligned16(out, x, x) ? n / N : 0;
    GRID_LOOP(v, nv) {
        Pack<T> a = ((const Pack<T>*)x)[v], o;
#pragma unroll
        for (int k = 0; k < N; ++k) store(&o.v[k], f((A)to_f(a.v[k])));
        ((Pack<T>*)out)[v] = o;
    }
    GRID_LOOP(t, n - nv * N) {
        i64 i = nv * N + t;
        store(&out[i], f((A)to_f(x[i])));
    }
}

// out = f(x[i], y[offsets]) through strides (broadcast, views).
template <typename T, typename F> __device__ void strided2(T* out, const T* x, const T* y, Geo g, F f) {
    typedef typename Acc<T>::type A;
    GRID_LOOP(i, g.numel) {
        i64 ia, ib;
        offsets(g, i, &ia, &ib);
        store(&out[i], f((A)to_f(x[ia]), (A)to_f(y[ib])));
    }
}

// out = f(x[i], y[i % period]) for dense x and a dense y that repeats (a bias).
// Four elements per thread when the period is a multiple of four and all
// three ends are aligned to four (one index modulo per four), then the tail.
template <typename T, typename F> __device__ void rows2(T* out, const T* x, const T* y, i64 n, i64 period, F f) {
    typedef typename Acc<T>::type A;
    bool small = n < 2147483647LL;
    unsigned long long ends = (unsigned long long)out | (unsigned long long)x | (unsigned long long)y;
    i64 nq = (period % 4 == 0 && ends % sizeof(Quad<T>) == 0) ? n / 4 : 0;
    GRID_LOOP(q, nq) {
        i64 i = 4 * q;
        i64 j = small ? (i64)((unsigned int)i % (unsigned int)period) : i % period;
        Quad<T> a = ((const Quad<T>*)x)[q], b = *(const Quad<T>*)(y + j), o;
#pragma unroll
        for (int k = 0; k < 4; ++k) store(&o.v[k], f((A)to_f(a.v[k]), (A)to_f(b.v[k])));
        ((Quad<T>*)out)[q] = o;
    }
    GRID_LOOP(t, n - nq * 4) {
        i64 i = nq * 4 + t;
        i64 j = small ? (i64)((unsigned int)i % (unsigned int)period) : i % period;
        store(&out[i], f((A)to_f(x[i]), (A)to_f(y[j])));
    }
}

#define BINARY_KERNELS_T(name, T, ty)                                                                                    \
    extern "C" __global__ void binary_##name##_##ty(T* o, const T* a, const T* b, Geo g) { strided2(o, a, b, g, Op_##name()); } \
    extern "C" __global__ void dense_##name##_##ty(T* o, const T* a, const T* b, i64 n) { dense2(o, a, b, n, Op_##name()); }   \
    extern "C" __global__ void rows_##name##_##ty(T* o, const T* a, const T* b, i64 n, i64 p) { rows2(o, a, b, n, p, Op_##name()); } \
    extern "C" __global__ void scalar_##name##_##ty(T* o, const T* a, double s, i64 n) { dense_scalar(o, a, s, n, Op_##name()); }
#define BINARY_KERNELS(name, expr) BINARY_KERNELS_T(name, float, f32) BINARY_KERNELS_T(name, double, f64) BINARY_KERNELS_T(name, bf16, bf16)
BINARY_OPS(BINARY_KERNELS)

#define UNARY_KERNELS_T(name, T, ty) \
    extern "C" __global__ void unary_##name##_##ty(T* o, const T* x, i64 n) { dense1(o, x, n, Op_##name()); }
#define UNARY_KERNELS(name, expr) UNARY_KERNELS_T(name, float, f32) UNARY_KERNELS_T(name, double, f64) UNARY_KERNELS_T(name, bf16, bf16)
UNARY_OPS(UNARY_KERNELS)

extern "C" __global__ void fill_f32(float* o, double v, i64 n) { GRID_LOOP(i, n) o[i] = (float)v; }
extern "C" __global__ void fill_f64(double* o, double v, i64 n) { GRID_LOOP(i, n) o[i] = v; }
extern "C" __global__ void fill_bf16(bf16* o, double v, i64 n) { GRID_LOOP(i, n) o[i] = from_d<bf16>(v); }

// ---- block reductions --------------------------------------------------------

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024).
__device__ double block_sum(double v) {
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = (threadIdx.x < warps) ? part[threadIdx.x] : 0.0;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    __shared__ double total;
    if (threadIdx.x == 0) total = v;
    __syncthreads();
    return total;
}

// Maximum of `v` over the block; NaN wins.
__device__ double block_max(double v) {
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) {
        double w = __shfl_down_sync(0xffffffffu, v, o);
        v = (v != v || v >= w) ? v : w;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = (threadIdx.x < warps) ? part[threadIdx.x] : NEG_INF;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) {
            double w = __shfl_down_sync(0xffffffffu, v, o);
            v = (v != v || v >= w) ? v : w;
        }
    __shared__ double total;
    if (threadIdx.x == 0) total = v;
    __syncthreads();
    return total;
}

// out[r] = scale · Σ_j x[r, j] (or the maximum), one block per row.
template <typename T> __device__ void reduce_rows(T* out, const T* x, i64 rows, i64 n, double scale, int is_max) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * n;
        double acc = is_max ? NEG_INF : 0.0;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            double v = (double)to_f(row[j]);
            acc = is_max ? ((acc != acc || acc >= v) ? acc : v) : acc + v;
        }
        acc = is_max ? block_max(acc) : block_sum(acc);
        if (threadIdx.x == 0) out[r] = from_d<T>(is_max ? acc : acc * scale);
    }
}
extern "C" __global__ void reduce_rows_f32(float* o, const float* x, i64 rows, i64 n, double s, int m) { reduce_rows(o, x, rows, n, s, m); }
extern "C" __global__ void reduce_rows_f64(double* o, const double* x, i64 rows, i64 n, double s, int m) { reduce_rows(o, x, rows, n, s, m); }
extern "C" __global__ void reduce_rows_bf16(bf16* o, const bf16* x, i64 rows, i64 n, double s, int m) { reduce_rows(o, x, rows, n, s, m); }

// ---- softmax family -----------------------------------------------------------

// How many keys of row `r` count: all, or with a causal mask over rows of
// `period` queries, keys 0..=q for query q = r % period.
__device__ __forceinline__ i64 kept(i64 r, i64 n, i64 period) { return period > 0 ? min(n, r % period + 1) : n; }

// Softmax (log = 0) or log-softmax (log = 1) of scale · x along rows of n.
template <typename T> __device__ void softmax_rows(T* out, const T* x, i64 rows, i64 n, double scale, i64 period, int log_) {
    typedef typename Acc<T>::type A;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * n;
        T* o = out + r * n;
        i64 keep = kept(r, n, period);
        // The scaled score rounded to the dtype, as mul_scalar leaves it.
        #define SCORE(j) ((double)to_f(from_d<T>((double)((A)to_f(row[j]) * (A)scale))))
        double m = NEG_INF;
        for (i64 j = threadIdx.x; j < keep; j += blockDim.x) { double v = SCORE(j); m = (m != m || m >= v) ? m : v; }
        m = block_max(m);
        double s = 0.0;
        for (i64 j = threadIdx.x; j < keep; j += blockDim.x) s += (double)m_exp((A)(SCORE(j) - m));
        s = block_sum(s);
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            if (j >= keep) { o[j] = from_d<T>(log_ ? NEG_INF : 0.0); continue; }
            double v = SCORE(j) - m;
            o[j] = log_ ? from_d<T>(v - log(s)) : from_d<T>((double)m_exp((A)v) * (1.0 / s));
        }
        #undef SCORE
    }
}
extern "C" __global__ void softmax_rows_f32(float* o, const float* x, i64 rows, i64 n, double sc, i64 p, int l) { softmax_rows(o, x, rows, n, sc, p, l); }
extern "C" __global__ void softmax_rows_f64(double* o, const double* x, i64 rows, i64 n, double sc, i64 p, int l) { softmax_rows(o, x, rows, n, sc, p, l); }
extern "C" __global__ void softmax_rows_bf16(bf16* o, const bf16* x, i64 rows, i64 n, double sc, i64 p, int l) { softmax_rows(o, x, rows, n, sc, p, l); }

// dx = scale · y · (g − Σ g·y) along rows; with a causal mask over rows of
// `period` queries (period > 0) only the kept keys are read, and the masked
// ones get 0 · scale whatever g holds there.
template <typename T> __device__ void softmax_backward_rows(T* out, const T* g, const T* y, i64 rows, i64 n, double scale, i64 period) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* gr = g + r * n;
        const T* yr = y + r * n;
        i64 keep = kept(r, n, period);
        double dot = 0.0;
        for (i64 j = threadIdx.x; j < keep; j += blockDim.x) dot += (double)to_f(gr[j]) * (double)to_f(yr[j]);
        dot = block_sum(dot);
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            double v = j < keep ? (double)to_f(yr[j]) * ((double)to_f(gr[j]) - dot) : 0.0;
            out[r * n + j] = from_d<T>(v * scale);
        }
    }
}
extern "C" __global__ void softmax_backward_rows_f32(float* o, const float* g, const float* y, i64 rows, i64 n, double s, i64 p) { softmax_backward_rows(o, g, y, rows, n, s, p); }
extern "C" __global__ void softmax_backward_rows_f64(double* o, const double* g, const double* y, i64 rows, i64 n, double s, i64 p) { softmax_backward_rows(o, g, y, rows, n, s, p); }
extern "C" __global__ void softmax_backward_rows_bf16(bf16* o, const bf16* g, const bf16* y, i64 rows, i64 n, double s, i64 p) { softmax_backward_rows(o, g, y, rows, n, s, p); }

// ---- rows in one warp -------------------------------------------------------------
// Rows of at most 32·PER elements, one warp each (blockDim.x / 32 rows per
// block): the row is read once into registers (element lane + 32·i in slot i)
// and its statistics reduce by shuffles, with no block barrier. The arithmetic
// is the block kernels' above; only the order of the f64 sums differs.

__device__ __forceinline__ double warp_max(double v) {
    for (int o = 16; o > 0; o >>= 1) {
        double w = __shfl_xor_sync(0xffffffffu, v, o);
        v = (v != v || v >= w) ? v : w;
    }
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
#define WARP_ROWS(r, rows)                                                                  \
    const int lane = threadIdx.x & 31;                                                      \
    const i64 warps_ = (i64)gridDim.x * (blockDim.x >> 5);                                  \
    for (i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < (rows); r += warps_)

// The largest of the warp's values; NaN wins. In the compute type: the maximum
// of values of that type is one of them, so no f64 is needed to hold it.
__device__ __forceinline__ float warp_max_acc(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = (v != v || v >= w) ? v : w;
    }
    return v;
}
__device__ __forceinline__ double warp_max_acc(double v) { return warp_max(v); }

template <typename T, int PER> __device__ void softmax_warp(T* out, const T* x, i64 rows, i64 n, double scale, i64 period, int log_) {
    typedef typename Acc<T>::type A;
    WARP_ROWS(r, rows) {
        const T* row = x + r * n;
        T* o = out + r * n;
        i64 keep = kept(r, n, period);
        // The scaled score rounded to the dtype, as mul_scalar leaves it (exact
        // in A); its maximum in A, and x − max in A (the rounding of the exact
        // difference, as the block kernel's f64 difference cast to A): the
        // block kernel's values with f64 only for the sum.
        A v[PER];
        A m = (A)NEG_INF;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            i64 j = lane + 32 * i;
            v[i] = (A)0;
            if (j < keep) {
                v[i] = (A)to_f(from_a<T>((A)to_f(row[j]) * (A)scale));
                m = (m != m || m >= v[i]) ? m : v[i];
            }
        }
        m = warp_max_acc(m);
        double s = 0.0;
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (lane + 32 * i < keep) s += (double)m_exp((A)(v[i] - m));
        s = warp_sum(s);
        const double inv = 1.0 / s;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            i64 j = lane + 32 * i;
            if (j >= n) continue;
            if (j >= keep) { o[j] = from_d<T>(log_ ? NEG_INF : 0.0); continue; }
            o[j] = log_ ? from_d<T>(((double)v[i] - (double)m) - log(s)) : from_d<T>((double)m_exp((A)(v[i] - m)) * inv);
        }
    }
}

template <typename T, int PER> __device__ void softmax_backward_warp(T* out, const T* g, const T* y, i64 rows, i64 n, double scale, i64 period) {
    typedef typename Acc<T>::type A;
    WARP_ROWS(r, rows) {
        A gv[PER], yv[PER];
        i64 keep = kept(r, n, period);
        double dot = 0.0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            i64 j = lane + 32 * i;
            gv[i] = (A)0;
            yv[i] = (A)0;
            if (j < keep) {
                gv[i] = (A)to_f(g[r * n + j]);
                yv[i] = (A)to_f(y[r * n + j]);
                dot += (double)gv[i] * (double)yv[i];
            }
        }
        dot = warp_sum(dot);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            i64 j = lane + 32 * i;
            if (j < n) out[r * n + j] = from_d<T>(j < keep ? (double)yv[i] * ((double)gv[i] - dot) * scale : 0.0 * scale);
        }
    }
}

// Layer norm (rms = 0) or RMSNorm (rms = 1) of rows of at most 32·PER: norm_rows in one warp.
template <typename T, int PER> __device__ void norm_warp(T* out, double* mean_out, double* rstd_out, const T* x, const T* w, const T* b,
                                                         i64 rows, i64 n, double eps, int rms) {
    typedef typename Acc<T>::type A;
    WARP_ROWS(r, rows) {
        A xv[PER];
        double s = 0.0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            i64 j = lane + 32 * i;
            xv[i] = j < n ? (A)to_f(x[r * n + j]) : (A)0;
            s += (double)xv[i];
        }
        double mean = rms ? 0.0 : warp_sum(s) / (double)n;
        double q = 0.0;
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (lane + 32 * i < n) { double d = (double)xv[i] - mean; q += d * d; }
        q = warp_sum(q);
        double rstd = 1.0 / sqrt(q / (double)n + eps);
        A am = (A)mean, ar = (A)rstd;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            i64 j = lane + 32 * i;
            if (j >= n) continue;
            A v = (xv[i] - am) * ar;
            if (rms) {
                T y1;
                store(&y1, v);
                v = (A)to_f(y1);
            }
            if (w) v *= (A)to_f(w[j]);
            if (b) v += (A)to_f(b[j]);
            store(&out[r * n + j], v);
        }
        if (lane == 0) { mean_out[r] = mean; rstd_out[r] = rstd; }
    }
}

// dx of layer norm or RMSNorm for rows of at most 32·PER: norm_backward_rows in
// one warp (g and x kept in registers; h and x̂ recomputed as that kernel does).
template <typename T, int PER> __device__ void norm_backward_warp(T* out, const T* g, const T* x, const T* w, const double* mean_in,
                                                                  const double* rstd_in, i64 rows, i64 n, int rms) {
    typedef typename Acc<T>::type A;
    WARP_ROWS(r, rows) {
        double mean = mean_in[r], rstd = rstd_in[r];
        A gv[PER], xv[PER];
        double sh = 0.0, shx = 0.0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            i64 j = lane + 32 * i;
            gv[i] = (A)0;
            xv[i] = (A)0;
            if (j < n) {
                gv[i] = (A)to_f(g[r * n + j]);
                xv[i] = (A)to_f(x[r * n + j]);
                double h = (double)gv[i] * (w ? (double)to_f(w[j]) : 1.0);
                sh += h;
                shx += h * (((double)xv[i] - mean) * rstd);
            }
        }
        sh = warp_sum(sh) / (double)n;
        shx = warp_sum(shx) / (double)n;
        if (rms) sh = 0.0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            i64 j = lane + 32 * i;
            if (j >= n) continue;
            double h = (double)gv[i] * (w ? (double)to_f(w[j]) : 1.0);
            double xh = ((double)xv[i] - mean) * rstd;
            out[r * n + j] = from_d<T>(rstd * (h - sh - xh * shx));
        }
    }
}

#define WARP_KERNELS_T(PER, T, ty)                                                                                              \
    extern "C" __global__ void softmax_warp##PER##_##ty(T* o, const T* x, i64 rows, i64 n, double sc, i64 p, int l) {            \
        softmax_warp<T, PER>(o, x, rows, n, sc, p, l);                                                                           \
    }                                                                                                                            \
    extern "C" __global__ void softmax_backward_warp##PER##_##ty(T* o, const T* g, const T* y, i64 rows, i64 n, double s,        \
                                                                 i64 p) {                                                        \
        softmax_backward_warp<T, PER>(o, g, y, rows, n, s, p);                                                                   \
    }                                                                                                                            \
    extern "C" __global__ void norm_warp##PER##_##ty(T* o, double* m, double* rs, const T* x, const T* w, const T* b, i64 rows, \
                                                     i64 n, double eps, int rms) {                                               \
        norm_warp<T, PER>(o, m, rs, x, w, b, rows, n, eps, rms);                                                                 \
    }                                                                                                                            \
    extern "C" __global__ void norm_backward_warp##PER##_##ty(T* o, const T* g, const T* x, const T* w, const double* m,        \
                                                              const double* rs, i64 rows, i64 n, int rms) {                      \
        norm_backward_warp<T, PER>(o, g, x, w, m, rs, rows, n, rms);                                                             \
    }
#define WARP_KERNELS(PER) WARP_KERNELS_T(PER, float, f32) WARP_KERNELS_T(PER, double, f64) WARP_KERNELS_T(PER, bf16, bf16)
WARP_KERNELS(1)
WARP_KERNELS(2)
WARP_KERNELS(4)
WARP_KERNELS(8)
WARP_KERNELS(16)
WARP_KERNELS(32)

// ---- normalisations ---------------------------------------------------------------

// Layer norm (rms = 0) or RMSNorm (rms = 1) of rows of n: y = x̂·w + b with
// x̂ = (x − mean)·rstd (no mean for RMSNorm); writes mean and rstd per row (f64).
template <typename T> __device__ void norm_rows(T* out, double* mean_out, double* rstd_out, const T* x, const T* w, const T* b,
                                                i64 rows, i64 n, double eps, int rms) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * n;
        double s = 0.0;
        if (!rms) {
            for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += (double)to_f(row[j]);
            s = block_sum(s);
        }
        double mean = rms ? 0.0 : s / (double)n;
        double q = 0.0;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) { double d = (double)to_f(row[j]) - mean; q += d * d; }
        q = block_sum(q);
        double rstd = 1.0 / sqrt(q / (double)n + eps);
        // The per-element affine in the compute type (f32 for f32 and bf16).
        typedef typename Acc<T>::type A;
        A am = (A)mean, ar = (A)rstd;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            A v = ((A)to_f(row[j]) - am) * ar;
            if (rms) {
                // RMSNorm rounds the normalised value to T before the weight.
                T y1;
                store(&y1, v);
                v = (A)to_f(y1);
            }
            if (w) v *= (A)to_f(w[j]);
            if (b) v += (A)to_f(b[j]);
            store(&out[r * n + j], v);
        }
        if (threadIdx.x == 0) { mean_out[r] = mean; rstd_out[r] = rstd; }
    }
}
extern "C" __global__ void norm_rows_f32(float* o, double* m, double* rs, const float* x, const float* w, const float* b, i64 rows, i64 n, double eps, int rms) { norm_rows(o, m, rs, x, w, b, rows, n, eps, rms); }
extern "C" __global__ void norm_rows_f64(double* o, double* m, double* rs, const double* x, const double* w, const double* b, i64 rows, i64 n, double eps, int rms) { norm_rows(o, m, rs, x, w, b, rows, n, eps, rms); }
extern "C" __global__ void norm_rows_bf16(bf16* o, double* m, double* rs, const bf16* x, const bf16* w, const bf16* b, i64 rows, i64 n, double eps, int rms) { norm_rows(o, m, rs, x, w, b, rows, n, eps, rms); }

// dx of layer norm (rms = 0) or RMSNorm (rms = 1) given dy = g:
// with h = g·w, dx = rstd·(h − mean(h) − x̂·mean(h·x̂)) (no mean(h) term for RMSNorm).
template <typename T> __device__ void norm_backward_rows(T* out, const T* g, const T* x, const T* w, const double* mean_in, const double* rstd_in,
                                                         i64 rows, i64 n, int rms) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        double mean = mean_in[r], rstd = rstd_in[r];
        double sh = 0.0, shx = 0.0;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            double h = (double)to_f(g[r * n + j]) * (w ? (double)to_f(w[j]) : 1.0);
            double xh = ((double)to_f(x[r * n + j]) - mean) * rstd;
            sh += h;
            shx += h * xh;
        }
        sh = block_sum(sh) / (double)n;
        shx = block_sum(shx) / (double)n;
        if (rms) sh = 0.0;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            double h = (double)to_f(g[r * n + j]) * (w ? (double)to_f(w[j]) : 1.0);
            double xh = ((double)to_f(x[r * n + j]) - mean) * rstd;
            out[r * n + j] = from_d<T>(rstd * (h - sh - xh * shx));
        }
    }
}
extern "C" __global__ void norm_backward_rows_f32(float* o, const float* g, const float* x, const float* w, const double* m, const double* rs, i64 rows, i64 n, int rms) { norm_backward_rows(o, g, x, w, m, rs, rows, n, rms); }
extern "C" __global__ void norm_backward_rows_f64(double* o, const double* g, const double* x, const double* w, const double* m, const double* rs, i64 rows, i64 n, int rms) { norm_backward_rows(o, g, x, w, m, rs, rows, n, rms); }
extern "C" __global__ void norm_backward_rows_bf16(bf16* o, const bf16* g, const bf16* x, const bf16* w, const double* m, const double* rs, i64 rows, i64 n, int rms) { norm_backward_rows(o, g, x, w, m, rs, rows, n, rms); }

// Column sums of a [rows, n] matrix in f64: a block of 32 columns × 32 lanes
// (1024 threads) over the rows of chunk blockIdx.y; lane l adds rows l, l + 32,
// ... of the chunk in its column (a warp reads 32 neighbouring columns of one
// row at once), then the 32 lanes' sums are added in lane order. With x not
// null, each element is g·x̂ (x̂ = (x − mean)·rstd of its row): the weight
// gradient of layer norm and RMSNorm. One chunk writes out[j] = scale·sum;
// several write their sums to parts[chunk, j] for column_finish.
template <typename T> __device__ void column_sums(T* out, double* parts, const T* g, const T* x, const double* mean_in,
                                                  const double* rstd_in, i64 rows, i64 n, i64 chunk, double scale) {
    __shared__ double part[32][33];
    int c = threadIdx.x & 31, lane = threadIdx.x >> 5;
    i64 j = (i64)blockIdx.x * 32 + c;
    i64 r0 = (i64)blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
    double acc = 0.0;
    if (j < n) {
        for (i64 r = r0 + lane; r < r1; r += 32) {
            double v = (double)to_f(g[r * n + j]);
            if (x) v *= ((double)to_f(x[r * n + j]) - mean_in[r]) * rstd_in[r];
            acc += v;
        }
    }
    part[lane][c] = acc;
    __syncthreads();
    if (lane == 0 && j < n) {
        double s = 0.0;
        for (int l = 0; l < 32; ++l) s += part[l][c];
        if (parts) parts[(i64)blockIdx.y * n + j] = s;
        else out[j] = from_d<T>(s * scale);
    }
}
// out[j] = scale · Σ_k parts[k, j], chunks added in order.
template <typename T> __device__ void column_finish(T* out, const double* parts, i64 chunks, i64 n, double scale) {
    GRID_LOOP(j, n) {
        double s = 0.0;
        for (i64 k = 0; k < chunks; ++k) s += parts[k * n + j];
        out[j] = from_d<T>(s * scale);
    }
}
#define COLUMN_KERNELS(T, ty)                                                                                            \
    extern "C" __global__ void column_sums_##ty(T* o, double* p, const T* g, const T* x, const double* m, const double* rs, \
                                                i64 rows, i64 n, i64 chunk, double s) {                                  \
        column_sums(o, p, g, x, m, rs, rows, n, chunk, s);                                                               \
    }                                                                                                                    \
    extern "C" __global__ void column_finish_##ty(T* o, const double* p, i64 chunks, i64 n, double s) {                  \
        column_finish(o, p, chunks, n, s);                                                                               \
    }
COLUMN_KERNELS(float, f32)
COLUMN_KERNELS(double, f64)
COLUMN_KERNELS(bf16, bf16)

// ---- cross entropy ------------------------------------------------------------------

// loss[r] = logsumexp(x[r]) − x[r, t[r]] (f64), and, when probs is not null,
// the row's softmax. A target out of range sets *bad to its row + 1. The
// maximum and the sum of exponentials come from one pass over the row (each
// thread rescales its sum when its maximum grows, then the block rescales the
// threads' sums to the row's maximum), four loads in flight per thread; the
// probabilities from a second pass. NaN anywhere in a row makes its loss NaN.
template <typename T> __device__ void cross_entropy_rows(double* loss, T* probs, const T* x, const i64* t, i64 rows, i64 n, i64* bad) {
    typedef typename Acc<T>::type A;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * n;
        double m = NEG_INF, s = 0.0;
        for (i64 j0 = threadIdx.x; j0 < n; j0 += 4 * (i64)blockDim.x) {
            double v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                i64 j = j0 + u * (i64)blockDim.x;
                v[u] = j < n ? (double)to_f(row[j]) : NEG_INF;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (m != m) break;
                if (v[u] != v[u]) { m = v[u]; s = v[u]; break; }
                if (v[u] == NEG_INF) continue;
                if (v[u] > m) { s *= exp(m - v[u]); m = v[u]; }
                s += (double)m_exp((A)(v[u] - m));
            }
        }
        double rm = block_max(m);
        s = block_sum(s == 0.0 || m != m ? s : s * exp(m - rm));
        m = rm;
        i64 target = t[r];
        if (threadIdx.x == 0) {
            if (target < 0 || target >= n) { atomicMax((unsigned long long*)bad, (unsigned long long)(r + 1)); loss[r] = 0.0; }
            else loss[r] = log(s) + m - (double)to_f(row[target]);
        }
        if (probs)
            for (i64 j = threadIdx.x; j < n; j += blockDim.x)
                probs[r * n + j] = from_d<T>((double)m_exp((A)((double)to_f(row[j]) - m)) * (1.0 / s));
    }
}
extern "C" __global__ void cross_entropy_rows_f32(double* l, float* p, const float* x, const i64* t, i64 rows, i64 n, i64* bad) { cross_entropy_rows(l, p, x, t, rows, n, bad); }
extern "C" __global__ void cross_entropy_rows_f64(double* l, double* p, const double* x, const i64* t, i64 rows, i64 n, i64* bad) { cross_entropy_rows(l, p, x, t, rows, n, bad); }
extern "C" __global__ void cross_entropy_rows_bf16(double* l, bf16* p, const bf16* x, const i64* t, i64 rows, i64 n, i64* bad) { cross_entropy_rows(l, p, x, t, rows, n, bad); }

// dx = scale · (p − onehot(t)) from probabilities p, one block per row, four
// elements in flight per thread.
template <typename T> __device__ void cross_entropy_backward(T* out, const T* p, const i64* t, i64 rows, i64 n, double scale) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 target = t[r];
        const T* pr = p + r * n;
        T* o = out + r * n;
        for (i64 j0 = threadIdx.x; j0 < n; j0 += 4 * (i64)blockDim.x) {
            double v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                i64 j = j0 + u * (i64)blockDim.x;
                v[u] = j < n ? (double)to_f(pr[j]) : 0.0;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                i64 j = j0 + u * (i64)blockDim.x;
                if (j < n) o[j] = from_d<T>((v[u] - (target == j ? 1.0 : 0.0)) * scale);
            }
        }
    }
}
extern "C" __global__ void cross_entropy_backward_f32(float* o, const float* p, const i64* t, i64 rows, i64 n, double s) { cross_entropy_backward(o, p, t, rows, n, s); }
extern "C" __global__ void cross_entropy_backward_f64(double* o, const double* p, const i64* t, i64 rows, i64 n, double s) { cross_entropy_backward(o, p, t, rows, n, s); }
extern "C" __global__ void cross_entropy_backward_bf16(bf16* o, const bf16* p, const i64* t, i64 rows, i64 n, double s) { cross_entropy_backward(o, p, t, rows, n, s); }

// Σ of n f64 values in order, into one f64 (scale applied).
extern "C" __global__ void sum_f64_ordered(double* out, const double* x, i64 n, double scale) {
    double s = 0.0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += x[j];
    s = block_sum(s);
    if (threadIdx.x == 0) *out = s * scale;
}

// ---- embedding ----------------------------------------------------------------------

// out[i, :] = table[idx[i] − first, :] (rows of d words of any width); an index
// outside [first, first + rows) sets *bad to its position + 1 and writes zeros.
template <typename W> __device__ void embedding(W* out, const W* table, const i64* idx, i64 n, i64 d, i64 rows, i64 first, i64* bad) {
    GRID_LOOP(i, n * d) {
        i64 k = i / d, j = i % d;
        i64 r = idx[k] - first;
        if (r < 0 || r >= rows) {
            if (j == 0) atomicMax((unsigned long long*)bad, (unsigned long long)(k + 1));
            out[i] = (W)0;
        } else {
            out[i] = table[r * d + j];
        }
    }
}
extern "C" __global__ void embedding_w2(unsigned short* o, const unsigned short* t, const i64* idx, i64 n, i64 d, i64 rows, i64 first, i64* bad) { embedding(o, t, idx, n, d, rows, first, bad); }
extern "C" __global__ void embedding_w4(unsigned int* o, const unsigned int* t, const i64* idx, i64 n, i64 d, i64 rows, i64 first, i64* bad) { embedding(o, t, idx, n, d, rows, first, bad); }
extern "C" __global__ void embedding_w8(unsigned long long* o, const unsigned long long* t, const i64* idx, i64 n, i64 d, i64 rows, i64 first, i64* bad) { embedding(o, t, idx, n, d, rows, first, bad); }

// acc[idx[i] − first, :] += g[i, :] into an f32 table (indices outside the
// range are skipped: the rows belong to another rank's shard).
template <typename T> __device__ void embedding_backward(float* acc, const T* g, const i64* idx, i64 n, i64 d, i64 rows, i64 first) {
    GRID_LOOP(i, n * d) {
        i64 k = i / d, j = i % d;
        i64 r = idx[k] - first;
        if (r >= 0 && r < rows) atomicAdd(acc + r * d + j, (float)to_f(g[i]));
    }
}
extern "C" __global__ void embedding_backward_f32(float* a, const float* g, const i64* idx, i64 n, i64 d, i64 rows, i64 first) { embedding_backward(a, g, idx, n, d, rows, first); }
extern "C" __global__ void embedding_backward_bf16(float* a, const bf16* g, const i64* idx, i64 n, i64 d, i64 rows, i64 first) { embedding_backward(a, g, idx, n, d, rows, first); }

// ---- collectives on one GPU ------------------------------------------------------------

#define MAX_PEERS 16
struct Peers {
    int n;
    unsigned long long ptr[MAX_PEERS];
};

// out[i] = op over peers p of peer[p][offset + i], peers in rank order (op: 0
// sum, 1 average, 2 max, 3 min, 4 product), accumulated in the compute type.
template <typename T> __device__ void reduce_peers(T* out, Peers peers, i64 offset, i64 len, int op) {
    typedef typename Acc<T>::type A;
    GRID_LOOP(i, len) {
        A acc = to_f(((const T*)peers.ptr[0])[offset + i]);
        for (int p = 1; p < peers.n; ++p) {
            A v = to_f(((const T*)peers.ptr[p])[offset + i]);
            if (op == 0 || op == 1) acc += v;
            else if (op == 2) acc = (acc != acc || acc >= v) ? acc : v;
            else if (op == 3) acc = (acc != acc || acc <= v) ? acc : v;
            else acc *= v;
        }
        if (op == 1) acc /= (A)peers.n;
        out[i] = from_d<T>((double)acc);
    }
}
extern "C" __global__ void reduce_peers_f32(float* o, Peers p, i64 off, i64 len, int op) { reduce_peers(o, p, off, len, op); }
extern "C" __global__ void reduce_peers_f64(double* o, Peers p, i64 off, i64 len, int op) { reduce_peers(o, p, off, len, op); }
extern "C" __global__ void reduce_peers_bf16(bf16* o, Peers p, i64 off, i64 len, int op) { reduce_peers(o, p, off, len, op); }
// Integers: exact, wrapping as the host's (no average: the caller refuses it).
extern "C" __global__ void reduce_peers_i64(i64* out, Peers peers, i64 offset, i64 len, int op) {
    GRID_LOOP(i, len) {
        unsigned long long acc = (unsigned long long)((const i64*)peers.ptr[0])[offset + i];
        for (int p = 1; p < peers.n; ++p) {
            i64 v = ((const i64*)peers.ptr[p])[offset + i];
            if (op == 0) acc += (unsigned long long)v;
            else if (op == 2) acc = (i64)acc >= v ? acc : (unsigned long long)v;
            else if (op == 3) acc = (i64)acc <= v ? acc : (unsigned long long)v;
            else acc *= (unsigned long long)v;
        }
        out[i] = (i64)acc;
    }
}

// ---- optimizer ---------------------------------------------------------------------------

// One AdamW step in place, PyTorch's `_single_tensor_adam` with decoupled
// weight decay, in f32 with the host's scalars and operation order (so the
// result has the host kernel's bits): lerp for the first moment, no fused
// multiply-adds elsewhere.
struct AdamScalars {
    float decay, lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
    int lerp_small;
};
extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, i64 n, AdamScalars s) {
    float w = s.lerp_weight, w1 = s.lerp_weight - 1.0f;
    GRID_LOOP(i, n) {
        float pi = p[i] * s.decay;
        float gi = g[i];
        float mi = s.lerp_small ? fmaf(w, gi - m[i], m[i]) : fmaf(w1, gi - m[i], gi);
        float vi = v[i] * s.beta2 + s.one_minus_beta2 * gi * gi;
        float denom = sqrtf(vi) / s.bias_correction2_sqrt + s.eps;
        p[i] = pi + s.neg_step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

// ---- attention -----------------------------------------------------------------------------

// Fused causal (or full) attention forward for bf16 on tensor cores (sm_80+):
// per batch entry, out = softmax(q·kᵀ·scale (+ mask))·v and the weights
// `probs`, which the backward reads, without the scores tensor. One warp owns
// 16 query rows, a block 64; the products run on `mma.m16n8k16` with f32
// accumulation, their fragments held in registers in the layouts the PTX ISA
// fixes (a thread of group g = lane/4, t = lane%4 holds rows g and g + 8,
// columns 2t and 2t + 1 of each 8 columns). Two passes over the keys: the
// first finds each row's maximum and sum of exponentials, the second writes
// the normalised weights (rounded to bf16, zeros where masked) and adds their
// product by the values. Scores are rounded to bf16 before scaling and the
// weights before their product, as the chain of bf16 ops rounds them. Each
// block stages 64 keys (and values, transposed) at a time in shared memory
// for its four warps. Rows and keys come in multiples of 16, the last dim of
// every tensor is dense and its rows start at 16-byte boundaries.
#define ATT_DIMS 4
struct AttnGeo {
    int nbatch;
    int causal;
    i64 batch[ATT_DIMS];
    i64 sq[ATT_DIMS], sk[ATT_DIMS], sv[ATT_DIMS], so[ATT_DIMS];
    i64 rq, rk, rv, ro;
    i64 L, S;
    float scale;
    float _pad;
};

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    return (unsigned)from_f<bf16>(lo) | ((unsigned)from_f<bf16>(hi) << 16);
}

__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// The scaled scores of this warp's 16 rows against the 64 keys of the tile
// `ks` in shared memory (row pitch E + 8), the first at index `key0` (tiles
// past `ntiles` of 8 keys and masked keys are −∞).
template <int E> __device__ __forceinline__ void attn_scores(float (&s)[8][4], const unsigned (&qa)[E / 16][4],
                                                             const bf16* ks, i64 key0, int ntiles, i64 row0,
                                                             int causal, float scale, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        if (nt < ntiles) {
            const bf16* kr = ks + (nt * 8 + g) * (E + 8) + 2 * t;
#pragma unroll
            for (int kk = 0; kk < E / 16; ++kk) {
                unsigned b0 = *(const unsigned*)(kr + kk * 16);
                unsigned b1 = *(const unsigned*)(kr + kk * 16 + 8);
                mma_bf16_16816(s[nt], qa[kk], b0, b1);
            }
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            i64 row = row0 + g + (c >= 2 ? 8 : 0);
            i64 col = key0 + nt * 8 + 2 * t + (c & 1);
            float v = to_f(from_f<bf16>(s[nt][c])) * scale;
            s[nt][c] = (nt >= ntiles || (causal && col > row)) ? -__int_as_float(0x7f800000) : v;
        }
    }
}

// Keys [key0, key0 + 64) (those below S) into the shared tile `ks` (row pitch
// E + 8), and when `vt` is not null the values transposed into `vt` (row
// pitch 72), in 16-byte loads by the block's 128 threads.
template <int E> __device__ __forceinline__ void attn_stage(bf16* ks, bf16* vt, const bf16* k, i64 rk, const bf16* v,
                                                            i64 rv, i64 key0, i64 S) {
    for (int c = threadIdx.x; c < 64 * (E / 8); c += blockDim.x) {
        int row = c / (E / 8), col = (c % (E / 8)) * 8;
        if (key0 + row < S) {
            *(Word16*)(ks + row * (E + 8) + col) = *(const Word16*)(k + (key0 + row) * rk + col);
            if (vt) {
                Word16 w = *(const Word16*)(v + (key0 + row) * rv + col);
                const bf16* e = (const bf16*)&w;
#pragma unroll
                for (int i = 0; i < 8; ++i) vt[(col + i) * 72 + row] = e[i];
            }
        }
    }
}

template <int E> __device__ void attention_bf16(bf16* out, bf16* probs, const bf16* q, const bf16* k, const bf16* v, AttnGeo geo) {
    const float NINF = -__int_as_float(0x7f800000);
    __shared__ __align__(16) bf16 ks[64 * (E + 8)];
    __shared__ __align__(16) bf16 vt[E * 72];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // The longest causal rows first.
    const i64 block0 = (i64)(gridDim.y - 1 - blockIdx.y) * 64;
    const i64 row0 = block0 + warp * 16;
    const bool active = row0 < geo.L;
    i64 entry = blockIdx.x, oq = 0, ok = 0, ov = 0, oo = 0;
    for (int d = geo.nbatch - 1; d >= 0; --d) {
        i64 i = entry % geo.batch[d];
        entry /= geo.batch[d];
        oq += i * geo.sq[d]; ok += i * geo.sk[d]; ov += i * geo.sv[d]; oo += i * geo.so[d];
    }
    q += oq; k += ok; v += ov; out += oo;
    probs += (i64)blockIdx.x * geo.L * geo.S;
    unsigned qa[E / 16][4];
#pragma unroll
    for (int kk = 0; kk < E / 16; ++kk) {
        if (!active) break;
        const bf16* r = q + (row0 + g) * geo.rq + kk * 16 + 2 * t;
        qa[kk][0] = *(const unsigned*)r;
        qa[kk][1] = *(const unsigned*)(r + 8 * geo.rq);
        qa[kk][2] = *(const unsigned*)(r + 8);
        qa[kk][3] = *(const unsigned*)(r + 8 * geo.rq + 8);
    }
    // This warp's keys, and the block's (its last rows' keys).
    const i64 key_end = geo.causal ? min(geo.S, row0 + 16) : geo.S;
    const i64 block_end = geo.causal ? min(geo.S, min(geo.L, block0 + 64)) : geo.S;
    // Pass 1: each row's maximum and sum of exponentials (this thread's share
    // of the sum, rescaled as the maximum grows; the group's shares at the end).
    float m[2] = {NINF, NINF}, l[2] = {0.f, 0.f};
    float s[8][4];
    for (i64 key0 = 0; key0 < block_end; key0 += 64) {
        __syncthreads();
        attn_stage<E>(ks, nullptr, k, geo.rk, v, geo.rv, key0, geo.S);
        __syncthreads();
        if (!active || key0 >= key_end) continue;
        int ntiles = (int)min((i64)8, (key_end - key0) / 8);
        attn_scores<E>(s, qa, ks, key0, ntiles, row0, geo.causal, geo.scale, g, t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = NINF;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float mn = fmaxf(m[h], mx);
            if (mn == NINF) continue;
            float sum = l[h] * (m[h] == NINF ? 0.f : expf(m[h] - mn));
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) sum += expf(s[nt][2 * h] - mn) + expf(s[nt][2 * h + 1] - mn);
            l[h] = sum;
            m[h] = mn;
        }
    }
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        inv[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
    }
    // Pass 2: the weights, written out, and their product by the values.
    float o[E / 8][4];
#pragma unroll
    for (int ot = 0; ot < E / 8; ++ot) o[ot][0] = o[ot][1] = o[ot][2] = o[ot][3] = 0.f;
    bf16* p0 = probs + (row0 + g) * geo.S + 2 * t;
    bf16* p1 = p0 + 8 * geo.S;
    for (i64 key0 = 0; key0 < block_end; key0 += 64) {
        __syncthreads();
        attn_stage<E>(ks, vt, k, geo.rk, v, geo.rv, key0, geo.S);
        __syncthreads();
        if (!active || key0 >= key_end) continue;
        int ntiles = (int)min((i64)8, (key_end - key0) / 8);
        attn_scores<E>(s, qa, ks, key0, ntiles, row0, geo.causal, geo.scale, g, t);
        unsigned pr[8][2];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            float w[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                int h = c / 2;
                w[c] = s[nt][c] == NINF ? 0.f : expf(s[nt][c] - m[h]) * inv[h];
            }
            pr[nt][0] = pack_bf16(w[0], w[1]);
            pr[nt][1] = pack_bf16(w[2], w[3]);
            if (nt < ntiles) {
                *(unsigned*)(p0 + key0 + nt * 8) = pr[nt][0];
                *(unsigned*)(p1 + key0 + nt * 8) = pr[nt][1];
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (2 * j < ntiles) {
                unsigned a[4] = {pr[2 * j][0], pr[2 * j][1], pr[2 * j + 1][0], pr[2 * j + 1][1]};
#pragma unroll
                for (int ot = 0; ot < E / 8; ++ot) {
                    const bf16* c = vt + (ot * 8 + g) * 72 + 16 * j + 2 * t;
                    mma_bf16_16816(o[ot], a, *(const unsigned*)c, *(const unsigned*)(c + 8));
                }
            }
        }
    }
    if (!active) return;
    // The masked keys past this warp's rows: zero weights.
    const i64 rest = (geo.S - key_end) / 2;
    for (i64 i = lane; i < 16 * rest; i += 32) {
        i64 r = i / rest, c = key_end + 2 * (i % rest);
        *(unsigned*)(probs + (row0 + r) * geo.S + c) = 0u;
    }
#pragma unroll
    for (int ot = 0; ot < E / 8; ++ot) {
        bf16* r = out + (row0 + g) * geo.ro + ot * 8 + 2 * t;
        *(unsigned*)r = pack_bf16(o[ot][0], o[ot][1]);
        *(unsigned*)(r + 8 * geo.ro) = pack_bf16(o[ot][2], o[ot][3]);
    }
}

extern "C" __global__ void attention_bf16_e16(bf16* o, bf16* p, const bf16* q, const bf16* k, const bf16* v, AttnGeo g) { attention_bf16<16>(o, p, q, k, v, g); }
extern "C" __global__ void attention_bf16_e32(bf16* o, bf16* p, const bf16* q, const bf16* k, const bf16* v, AttnGeo g) { attention_bf16<32>(o, p, q, k, v, g); }
extern "C" __global__ void attention_bf16_e64(bf16* o, bf16* p, const bf16* q, const bf16* k, const bf16* v, AttnGeo g) { attention_bf16<64>(o, p, q, k, v, g); }
extern "C" __global__ void attention_bf16_e128(bf16* o, bf16* p, const bf16* q, const bf16* k, const bf16* v, AttnGeo g) { attention_bf16<128>(o, p, q, k, v, g); }

// ---- batched products ------------------------------------------------------------------------

// The addresses of batches of products' matrices for cuBLAS's pointer-array
// batched product: for product c (of `calls`, a causal part's blocks), out[(3c
// + o)·count + i] is operand o's i-th matrix (a, b, c), at byte strides
// strides[o] over the batch dims from the product's first matrices base[c].
#define MAX_CALLS 8
struct PtrGeo {
    int rank;
    int calls;
    i64 count;
    i64 shape[MAX_DIMS];
    i64 strides[3][MAX_DIMS];
    unsigned long long base[MAX_CALLS][3];
};

extern "C" __global__ void batch_pointers(unsigned long long* out, PtrGeo g) {
    GRID_LOOP(i, g.count * g.calls) {
        i64 call = i / g.count, e = i % g.count, j = e;
        i64 off[3] = {0, 0, 0};
        for (int d = g.rank - 1; d >= 0; --d) {
            i64 k = j % g.shape[d];
            j /= g.shape[d];
            for (int o = 0; o < 3; ++o) off[o] += k * g.strides[o][d];
        }
        for (int o = 0; o < 3; ++o) out[(3 * call + o) * g.count + e] = g.base[call][o] + off[o];
    }
}
