/* What both test stubs share: the call log ($FERRO_STUB_LOG.<pid>, one line per call) and integer settings. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void record(const char* fmt, ...) {
  const char* base = getenv("FERRO_STUB_LOG");
  if (!base) return;
  char path[4096];
  snprintf(path, sizeof path, "%s.%d", base, (int)getpid());
  FILE* f = fopen(path, "a");
  if (!f) return;
  va_list ap; va_start(ap, fmt); vfprintf(f, fmt, ap); va_end(ap);
  fputc('\n', f);
  fclose(f);
}

static int env_int(const char* name, int fallback) {
  const char* v = getenv(name);
  return v ? atoi(v) : fallback;
}
