/* A stand-in for libcuda.so.1 with the few entry points test_libcuda.py needs to check LibCuda's
 * plumbing without a GPU: cuInit's failures, error names, device queries, the primary context
 * bound per thread, allocation errors and the JIT error log.
 *
 * It is compiled against the real cuda.h and written with the API's plain names, so the symbols
 * it exports are those cuda.h maps them to (cuMemAlloc -> cuMemAlloc_v2, ...) and its prototypes
 * are the header's: LibCuda binding another name or another signature does not pass. */

#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAKE_DEVICES 2
#define FAKE_DEVICE_BASE 10          /* handles differ from ordinals */
#define FAKE_UNKNOWN_RESULT 12345    /* alloc of this many bytes fails with a code no table knows */

/* State the tests read through ctypes. */
int fake_retained[FAKE_DEVICES];
int fake_set_current_calls;
unsigned long long fake_last_alloc;
unsigned long long fake_last_free;

static struct { int id; } fake_contexts[FAKE_DEVICES];
static __thread CUcontext current;

static const struct { CUresult code; const char *name, *text; } errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
};

static int error_index(CUresult code) {
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == code) return (int)i;
    return -1;
}

CUresult cuGetErrorName(CUresult error, const char **pStr) {
    int i = error_index(error);
    *pStr = i < 0 ? NULL : errors[i].name;
    return i < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **pStr) {
    int i = error_index(error);
    *pStr = i < 0 ? NULL : errors[i].text;
    return i < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* FAKE_CUDA_INIT_RESULT=<CUresult> makes cuInit fail with that code. */
CUresult cuInit(unsigned int Flags) {
    const char *result = getenv("FAKE_CUDA_INIT_RESULT");
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    return result ? (CUresult)atoi(result) : CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *driverVersion) {
    *driverVersion = CUDA_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    *count = FAKE_DEVICES;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (ordinal < 0 || ordinal >= FAKE_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
    *device = FAKE_DEVICE_BASE + ordinal;
    return CUDA_SUCCESS;
}

static int ordinal_of(CUdevice dev) { return dev - FAKE_DEVICE_BASE; }

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    snprintf(name, (size_t)len, "Fake GPU %d", ordinal_of(dev));
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
    *bytes = (size_t)(ordinal_of(dev) + 1) << 34;    /* 16 GiB, 32 GiB: past 32 bits */
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = ordinal_of(dev); break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = 132; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *pi = 49152; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *pi = 32; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    int ordinal = ordinal_of(dev);
    if (ordinal < 0 || ordinal >= FAKE_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
    fake_retained[ordinal]++;
    *pctx = (CUcontext)&fake_contexts[ordinal];
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    int ordinal = ordinal_of(dev);
    if (ordinal < 0 || ordinal >= FAKE_DEVICES || fake_retained[ordinal] == 0) return CUDA_ERROR_INVALID_DEVICE;
    fake_retained[ordinal]--;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    fake_set_current_calls++;
    current = ctx;
    return CUDA_SUCCESS;
}

/* Like the driver, memory calls need a context current on the calling thread. */
CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
    if (current == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    fake_last_alloc = bytesize;
    if (bytesize == FAKE_UNKNOWN_RESULT) return (CUresult)FAKE_UNKNOWN_RESULT;
    if (bytesize > (1ull << 40)) return CUDA_ERROR_OUT_OF_MEMORY;
    *dptr = 0xabcd00000000ull + bytesize;    /* a device pointer past 32 bits */
    return CUDA_SUCCESS;
}

CUresult cuMemFree(CUdeviceptr dptr) {
    if (current == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    fake_last_free = dptr;
    return CUDA_SUCCESS;
}

/* Rejects every image, writing "fake JIT: <its first line>" to the error log option. */
CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,
                            void **optionValues) {
    char *log = NULL;
    size_t size = 0;
    (void)module;
    if (current == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    for (unsigned int i = 0; i < numOptions; i++) {
        if (options[i] == CU_JIT_ERROR_LOG_BUFFER) log = optionValues[i];
        if (options[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) size = (size_t)(unsigned int)(uintptr_t)optionValues[i];
    }
    if (log != NULL && size > 0) {
        const char *text = image;
        snprintf(log, size, "fake JIT: %.*s", (int)strcspn(text, "\n"), text);
    }
    return CUDA_ERROR_INVALID_PTX;
}
