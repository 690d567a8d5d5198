/* A stand-in libnccl for tests on machines without a GPU.
 *
 * It records every call with the arguments it received (one line each, to
 * $FERRO_STUB_LOG.<pid>), so a prototype ferro declares wrongly shows up as a
 * wrong value in the log, and returns injected result codes:
 *   FERRO_STUB_FAIL=ncclAllReduce=6     that function returns 6 (last error says so)
 *   FERRO_STUB_NCCL_VERSION=21500       what ncclGetVersion reports (default 22703)
 *   FERRO_STUB_INIT_POLLS=N             non-blocking init/split stays in progress for N polls (default 2)
 *   FERRO_STUB_INIT_HANG=1              ... forever
 *   FERRO_STUB_ASYNC_ERROR=N            ncclCommGetAsyncError reports N once init is done
 * "Device" memory is host memory here. Collectives behave as on a communicator
 * of one rank (copies), and touch memory only for counts below 2^30 elements.
 */
#include <stdint.h>
#include <string.h>

#include "stub_log.h"

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct {
  size_t size; unsigned int magic; unsigned int version; int blocking;
  int cgaClusterSize; int minCTAs; int maxCTAs; const char* netName;
} ncclConfig_t;
typedef struct { int nranks; int rank; int polls_left; } stub_comm;

static char last_error[256] = "";

static int injected(const char* name) {
  const char* spec = getenv("FERRO_STUB_FAIL");
  size_t n = strlen(name);
  if (spec && strncmp(spec, name, n) == 0 && spec[n] == '=') {
    snprintf(last_error, sizeof last_error, "stub: injected failure in %s", name);
    return atoi(spec + n + 1);
  }
  return 0;
}


static size_t dtype_size(int t) {
  static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
  return (t >= 0 && t < 12) ? sizes[t] : 1;
}

static void copy(void* dst, const void* src, size_t count, int dtype) {
  if (dst != src && count < ((size_t)1 << 30)) memcpy(dst, src, count * dtype_size(dtype));
}

#define INJECT(name) do { int r_ = injected(name); if (r_) return r_; } while (0)

int ncclGetVersion(int* version) { *version = env_int("FERRO_STUB_NCCL_VERSION", 22703); return 0; }

int ncclGetUniqueId(ncclUniqueId* id) {
  INJECT("ncclGetUniqueId");
  for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 7 + 3);
  id->internal[5] = 0; /* a zero byte inside: the id must travel whole, not as a C string */
  record("ncclGetUniqueId");
  return 0;
}

static unsigned long long id_sum(const ncclUniqueId* id) {
  unsigned long long s = 0;
  for (int i = 0; i < 128; i++) s += (unsigned long long)(unsigned char)id->internal[i] * (unsigned long long)(i + 1);
  return s;
}

static stub_comm* new_comm(int nranks, int rank, int blocking) {
  stub_comm* c = calloc(1, sizeof *c);
  c->nranks = nranks; c->rank = rank;
  c->polls_left = blocking ? 0 : (getenv("FERRO_STUB_INIT_HANG") ? -1 : env_int("FERRO_STUB_INIT_POLLS", 2));
  return c;
}

int ncclCommInitRankConfig(void** comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  record("ncclCommInitRankConfig nranks=%d rank=%d id_sum=%llu config_size=%zu magic=%x version=%u blocking=%d",
         nranks, rank, id_sum(&id), config->size, config->magic, config->version, config->blocking);
  INJECT("ncclCommInitRankConfig");
  stub_comm* c = new_comm(nranks, rank, config->blocking);
  *comm = c;
  return c->polls_left ? 7 : 0;
}

int ncclCommSplit(void* comm, int color, int key, void** newcomm, ncclConfig_t* config) {
  record("ncclCommSplit color=%d key=%d blocking=%d", color, key, config->blocking);
  INJECT("ncclCommSplit");
  if (color < 0) { *newcomm = NULL; return 0; }
  stub_comm* c = new_comm(0, key, config->blocking);
  *newcomm = c;
  return c->polls_left ? 7 : 0;
}

int ncclCommGetAsyncError(void* comm, int* error) {
  stub_comm* c = comm;
  if (c->polls_left < 0) { *error = 7; return 0; }
  if (c->polls_left > 0) { c->polls_left--; *error = 7; return 0; }
  *error = env_int("FERRO_STUB_ASYNC_ERROR", 0);
  if (*error) snprintf(last_error, sizeof last_error, "stub: injected asynchronous error %d", *error);
  return 0;
}

int ncclCommFinalize(void* comm) { record("ncclCommFinalize"); INJECT("ncclCommFinalize"); return 0; }
int ncclCommDestroy(void* comm) { record("ncclCommDestroy"); free(comm); return 0; }
int ncclCommAbort(void* comm) { record("ncclCommAbort"); return 0; }
int ncclCommCount(void* comm, int* count) { *count = ((stub_comm*)comm)->nranks; return 0; }
int ncclCommCuDevice(void* comm, int* device) { *device = 0; return 0; }
int ncclCommUserRank(void* comm, int* rank) { *rank = ((stub_comm*)comm)->rank; return 0; }

const char* ncclGetErrorString(int result) {
  static char text[64];
  snprintf(text, sizeof text, "stub error string %d", result);
  return text;
}
const char* ncclGetLastError(void* comm) { return last_error; }

int ncclAllReduce(const void* send, void* recv, size_t count, int dtype, int op, void* comm, void* stream) {
  record("ncclAllReduce count=%zu dtype=%d op=%d stream=%p inplace=%d", count, dtype, op, stream, send == recv);
  INJECT("ncclAllReduce");
  copy(recv, send, count, dtype);
  return 0;
}

int ncclBroadcast(const void* send, void* recv, size_t count, int dtype, int root, void* comm, void* stream) {
  record("ncclBroadcast count=%zu dtype=%d root=%d stream=%p", count, dtype, root, stream);
  INJECT("ncclBroadcast");
  copy(recv, send, count, dtype);
  return 0;
}

int ncclReduce(const void* send, void* recv, size_t count, int dtype, int op, int root, void* comm, void* stream) {
  record("ncclReduce count=%zu dtype=%d op=%d root=%d stream=%p", count, dtype, op, root, stream);
  INJECT("ncclReduce");
  copy(recv, send, count, dtype);
  return 0;
}

int ncclAllGather(const void* send, void* recv, size_t count, int dtype, void* comm, void* stream) {
  record("ncclAllGather count=%zu dtype=%d stream=%p", count, dtype, stream);
  INJECT("ncclAllGather");
  copy(recv, send, count, dtype);
  return 0;
}

int ncclReduceScatter(const void* send, void* recv, size_t count, int dtype, int op, void* comm, void* stream) {
  record("ncclReduceScatter count=%zu dtype=%d op=%d stream=%p", count, dtype, op, stream);
  INJECT("ncclReduceScatter");
  copy(recv, send, count, dtype);
  return 0;
}

int ncclSend(const void* send, size_t count, int dtype, int peer, void* comm, void* stream) {
  record("ncclSend count=%zu dtype=%d peer=%d stream=%p", count, dtype, peer, stream);
  INJECT("ncclSend");
  return 0;
}

int ncclRecv(void* recv, size_t count, int dtype, int peer, void* comm, void* stream) {
  record("ncclRecv count=%zu dtype=%d peer=%d stream=%p", count, dtype, peer, stream);
  INJECT("ncclRecv");
  return 0;
}

int ncclGroupStart(void) { record("ncclGroupStart"); return 0; }
int ncclGroupEnd(void) { record("ncclGroupEnd"); INJECT("ncclGroupEnd"); return 0; }
