/* A stand-in CUDA driver (libcuda) for tests on machines without a GPU.
 *
 *   FERRO_STUB_CUDA_INIT=N      cuInit returns N (100: no device)
 *   FERRO_STUB_DEVICES=N        devices visible (default 1)
 *   FERRO_STUB_EVENT_HANG=1     events never complete (work "stuck" on the GPU)
 * Device memory is host memory; calls that order work are recorded in the
 * same log as the NCCL stub's ($FERRO_STUB_LOG.<pid>).
 */
#include <stdint.h>
#include <string.h>

#include "stub_log.h"

static __thread uintptr_t current_context = 0;
static uintptr_t next_handle = 0x5000;


int cuInit(unsigned flags) { return env_int("FERRO_STUB_CUDA_INIT", 0); }
int cuDriverGetVersion(int* v) { *v = 12080; return 0; }
int cuDeviceGetCount(int* n) { *n = env_int("FERRO_STUB_DEVICES", 1); return 0; }
int cuDeviceGet(int* d, int ordinal) { *d = ordinal; return 0; }
int cuDeviceGetPCIBusId(char* text, int len, int device) { snprintf(text, len, "0000:%02x:00.0", device + 1); return 0; }
int cuDevicePrimaryCtxRetain(void** ctx, int device) { *ctx = (void*)(uintptr_t)(0x1000 + device); return 0; }
int cuCtxGetCurrent(void** ctx) { *ctx = (void*)current_context; return 0; }
int cuCtxSetCurrent(void* ctx) { current_context = (uintptr_t)ctx; return 0; }
int cuCtxGetDevice(int* device) { *device = (int)(current_context - 0x1000); return 0; }
int cuStreamCreate(void** stream, unsigned flags) { *stream = (void*)(next_handle++); return 0; }
int cuStreamDestroy_v2(void* stream) { return 0; }
int cuStreamSynchronize(void* stream) { record("cuStreamSynchronize stream=%p", stream); return 0; }
int cuStreamWaitEvent(void* stream, void* event, unsigned flags) {
  record("cuStreamWaitEvent stream=%p event=%p", stream, event);
  return 0;
}
int cuEventCreate(void** event, unsigned flags) { *event = (void*)(next_handle++); return 0; }
int cuEventDestroy_v2(void* event) { return 0; }
int cuEventRecord(void* event, void* stream) { record("cuEventRecord event=%p stream=%p", event, stream); return 0; }
int cuEventQuery(void* event) { return getenv("FERRO_STUB_EVENT_HANG") ? 600 : 0; }
/* Every pointer belongs to the device current on the calling thread (host memory stands in for it). */
int cuPointerGetAttribute(void* data, int attribute, uint64_t pointer) {
  *(int*)data = current_context ? (int)(current_context - 0x1000) : 0;
  return 0;
}
int cuMemAlloc_v2(uint64_t* pointer, size_t size) { *pointer = (uint64_t)(uintptr_t)calloc(1, size ? size : 1); return 0; }
int cuMemFree_v2(uint64_t pointer) { free((void*)(uintptr_t)pointer); return 0; }
int cuMemcpyDtoH_v2(void* dst, uint64_t src, size_t n) {
  record("cuMemcpyDtoH bytes=%zu", n);
  memcpy(dst, (void*)(uintptr_t)src, n);
  return 0;
}
int cuMemcpyHtoD_v2(uint64_t dst, const void* src, size_t n) {
  record("cuMemcpyHtoD bytes=%zu", n);
  memcpy((void*)(uintptr_t)dst, src, n);
  return 0;
}
int cuGetErrorName(int code, const char** name) {
  static char text[64];
  snprintf(text, sizeof text, "CUDA_STUB_ERROR_%d", code);
  *name = text;
  return 0;
}
