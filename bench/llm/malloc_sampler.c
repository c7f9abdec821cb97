/* An LD_PRELOAD sampler for bench/llm/memory_check.py --heap: in each process whose executable path contains
 * $MALLOC_SAMPLER_EXE, a thread writes every $MALLOC_SAMPLER_MS milliseconds (default 20) one line to
 * $MALLOC_SAMPLER_DIR/heap_PID.txt:
 *
 *   CLOCK_MONOTONIC seconds, uordblks, hblkhd, arena, fordblks (glibc's mallinfo2: bytes in use in the heap,
 *   in use in mmapped chunks, the heap's size, free inside it), RssAnon bytes (/proc/self/status)
 *
 * so that a rank's anonymous memory can be split into what malloc has handed out (live), what glibc keeps
 * free inside its heap, and what lies outside malloc (thread stacks, the runtime's own mappings). It changes
 * no allocation: mallinfo2 only reads the arenas' counters under their locks. Build: cc -O2 -shared -fPIC -o
 * libmalloc_sampler.so malloc_sampler.c -lpthread (memory_check.py does). */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static long rss_anon(void) {
  FILE* f = fopen("/proc/self/status", "r");
  char line[256];
  long v = 0;
  if (!f) return 0;
  while (fgets(line, sizeof line, f)) {
    if (!strncmp(line, "RssAnon:", 8)) {
      v = atol(line + 8) * 1024;
      break;
    }
  }
  fclose(f);
  return v;
}

static void* sample(void* arg) {
  (void)arg;
  const char* ms_text = getenv("MALLOC_SAMPLER_MS");
  const int ms = ms_text ? atoi(ms_text) : 20;
  char path[4096];
  snprintf(path, sizeof path, "%s/heap_%d.txt", getenv("MALLOC_SAMPLER_DIR"), (int)getpid());
  FILE* out = fopen(path, "w");
  if (!out) return NULL;
  for (;;) {
    struct mallinfo2 m = mallinfo2();
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    fprintf(out, "%.4f %zu %zu %zu %zu %ld\n", t.tv_sec + t.tv_nsec / 1e9, m.uordblks, m.hblkhd, m.arena,
            m.fordblks, rss_anon());
    fflush(out);
    usleep((useconds_t)(ms > 0 ? ms : 20) * 1000);
  }
  return NULL;
}

__attribute__((constructor)) static void start_sampler(void) {
  const char* dir = getenv("MALLOC_SAMPLER_DIR");
  const char* want = getenv("MALLOC_SAMPLER_EXE");
  char exe[4096] = {0};
  if (!dir || readlink("/proc/self/exe", exe, sizeof exe - 1) < 0) return;
  if (want && !strstr(exe, want)) return;
  pthread_t thread;
  if (pthread_create(&thread, NULL, sample, NULL) == 0) pthread_detach(thread);
}
