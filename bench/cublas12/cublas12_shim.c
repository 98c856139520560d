/* libcublas.so.12 for a machine that has only CUDA 13's cuBLAS: the eight cuBLAS functions the
 * faiss-gpu-cu12 wheel calls, each forwarded to libcublas.so.13 (same signatures and enum values
 * in both). Bench-only: it lets bench/faiss_gpu.py measure the CUDA-12 FAISS build on the lent
 * GPUs, whose image has CUDA 13 and no CUDA-12 cuBLAS (a 600 MB wheel that cannot be carried).
 * Users on a CUDA-12 cluster install the real libraries with `pip install 'qrag[gpu]'`. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int status_t;       /* cublasStatus_t */
typedef void *handle_t;     /* cublasHandle_t */
typedef int op_t;           /* cublasOperation_t */
typedef int dtype_t;        /* cudaDataType */
typedef int compute_t;      /* cublasComputeType_t */
typedef int algo_t;         /* cublasGemmAlgo_t */
typedef int math_t;         /* cublasMath_t */

static void *target(const char *name) {
    static void *lib = NULL;
    if (lib == NULL) {
        const char *path = getenv("QRAG_CUBLAS13");
        lib = dlopen(path ? path : "libcublas.so.13", RTLD_NOW | RTLD_GLOBAL);
        if (lib == NULL) {
            fprintf(stderr, "cublas12_shim: cannot open CUDA 13's cuBLAS: %s\n", dlerror());
            abort();
        }
    }
    void *fn = dlsym(lib, name);
    if (fn == NULL) {
        fprintf(stderr, "cublas12_shim: %s not in CUDA 13's cuBLAS\n", name);
        abort();
    }
    return fn;
}

#define FORWARD(name, params, args)                                         \
    status_t name params {                                                  \
        static status_t(*fn) params = NULL;                                 \
        if (fn == NULL) fn = (status_t(*) params)target(#name);             \
        return fn args;                                                     \
    }

FORWARD(cublasCreate_v2, (handle_t *h), (h))
FORWARD(cublasDestroy_v2, (handle_t h), (h))
FORWARD(cublasSetStream_v2, (handle_t h, void *stream), (h, stream))
FORWARD(cublasGetMathMode, (handle_t h, math_t *mode), (h, mode))
FORWARD(cublasSetMathMode, (handle_t h, math_t mode), (h, mode))
FORWARD(cublasSgemmEx,
        (handle_t h, op_t ta, op_t tb, int m, int n, int k, const float *alpha, const void *A, dtype_t at, int lda,
         const void *B, dtype_t bt, int ldb, const float *beta, void *C, dtype_t ct, int ldc),
        (h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc))
FORWARD(cublasGemmEx,
        (handle_t h, op_t ta, op_t tb, int m, int n, int k, const void *alpha, const void *A, dtype_t at, int lda,
         const void *B, dtype_t bt, int ldb, const void *beta, void *C, dtype_t ct, int ldc, compute_t ctype, algo_t algo),
        (h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc, ctype, algo))
FORWARD(cublasGemmStridedBatchedEx,
        (handle_t h, op_t ta, op_t tb, int m, int n, int k, const void *alpha, const void *A, dtype_t at, int lda,
         long long sa, const void *B, dtype_t bt, int ldb, long long sb, const void *beta, void *C, dtype_t ct, int ldc,
         long long sc, int batches, compute_t ctype, algo_t algo),
        (h, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc, batches, ctype, algo))
