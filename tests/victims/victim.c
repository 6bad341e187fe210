/* A victim program for the shim tests: maps a file the way its first argument says and
 * prints what it observes (checksums, errno, whether the mapping is the kernel's file
 * mapping), so runs with and without the shim can be compared. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static unsigned long long sum(const unsigned char *p, size_t len) {
  unsigned long long s = 1469598103934665603ULL;
  for (size_t i = 0; i < len; i++) s = (s ^ p[i]) * 1099511628211ULL;
  return s;
}

/* "file" if /proc/self/maps shows a file at addr, "anon" otherwise. */
static const char *kind(void *addr) {
  char want[32], line[4096];
  snprintf(want, sizeof want, "%lx-", (unsigned long)addr);
  FILE *maps = fopen("/proc/self/maps", "r");
  const char *result = "none";
  while (fgets(line, sizeof line, maps)) {
    if (strncmp(line, want, strlen(want)) == 0) {
      result = strchr(line, '/') ? "file" : "anon";
      break;
    }
  }
  fclose(maps);
  return result;
}

static void *map(const char *path, int prot, int flags, size_t *len) {
  int fd = open(path, (prot & PROT_WRITE) && (flags & MAP_SHARED) ? O_RDWR : O_RDONLY);
  if (fd < 0) { perror(path); exit(2); }
  struct stat st;
  fstat(fd, &st);
  *len = st.st_size;
  void *p = mmap(NULL, *len, prot, flags, fd, 0);
  if (p == MAP_FAILED) { perror("mmap"); exit(2); }
  close(fd);
  return p;
}

/* Readers for "threads-exit": random pages of the mapping, forever. */
static volatile unsigned char *shared_p;
static volatile size_t shared_len;
static volatile int go;

static void *reader(void *arg) {
  unsigned long long seed = (unsigned long long)(long)arg * 2654435761ULL + 1;
  unsigned long long s = 0;
  while (!go) usleep(100);
  for (;;) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    s += shared_p[(seed >> 16) % shared_len];
  }
  return (void *)(long)s;
}

/* For "straddle": loads that each need two pages at once. */
typedef uint64_t unaligned_u64 __attribute__((aligned(1), may_alias));
static size_t straddle_threads;

static void *straddler(void *arg) {
  size_t first = (size_t)arg, pages = shared_len / 4096;
  unsigned long long s = 0;
  /* One unaligned 8-byte load across each page boundary this thread takes: a single
   * instruction that faults on the page before, then, retried, on the page after. */
  for (size_t page = 1 + first; page < pages; page += straddle_threads)
    s += *(volatile const unaligned_u64 *)(shared_p + page * 4096 - 4);
  return (void *)(uintptr_t)s;
}

/* For "sum-then-wait-for-sigint". */
static volatile sig_atomic_t interrupted;
static void on_sigint(int signal) { (void)signal; interrupted = 1; }
/* For "fork-bypass": which process is exiting, and proof that its exit got past every
 * atexit handler registered after this one (the shim's among them). */
static const char *role = "parent";

static void report_exit(void) {
  printf("exit complete %s\n", role);
  fflush(stdout);
}

/* A child made without the fork symbol: maps a model file of its own and unmaps the
 * parent's range (absent here: MADV_DONTFORK), as any process may. */
static void bypass_child(const char *other, unsigned char *parent_p, size_t parent_len) {
  alarm(20); /* alarms are not inherited: a hang ends in SIGALRM, not in a stuck test */
  printf("child pid %d\n", (int)getpid());
  size_t len;
  unsigned char *q = map(other, PROT_READ, MAP_PRIVATE, &len);
  printf("child sum %llx kind %s\n", sum(q, len), kind(q));
  printf("child munmap parent range %d\n", munmap(parent_p, parent_len));
  fflush(stdout);
  exit(0);
}

/* Creates a child the way `how` says, bypassing the fork symbol: 0 in the child. */
static pid_t bypass_fork(const char *how) {
  if (!strcmp(how, "_Fork")) return _Fork();
  if (!strcmp(how, "syscall")) return (pid_t)syscall(SYS_fork);
  fprintf(stderr, "unknown fork way %s\n", how);
  exit(2);
}

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  const char *mode = argv[1];
  const char *path = argc > 2 ? argv[2] : NULL;
  size_t len;
  if (!strcmp(mode, "read")) {
    /* Read-only shared map, like llama.cpp: whole-file checksum twice, then unmap an
     * unaligned head, checksum the rest, unmap the rest. */
    unsigned char *p = map(path, PROT_READ, MAP_SHARED | MAP_POPULATE, &len);
    printf("kind %s\n", kind(p));
    madvise(p, len, MADV_WILLNEED);
    printf("sum %llx\n", sum(p, len));
    printf("sum again %llx\n", sum(p, len));
    size_t head = 1781760; /* llama.cpp's GGUF head: not a multiple of 64K */
    if (head > len / 2) head = 4096 * 3;
    if (munmap(p, head)) perror("munmap head");
    printf("rest %llx\n", sum(p + head, len - head));
    madvise(p + head, len - head, MADV_DONTNEED);
    printf("after dontneed %llx\n", sum(p + head, len - head));
    if (munmap(p + head, len - head)) perror("munmap rest");
    /* The freed addresses work as ordinary memory again. */
    void *again = mmap(p, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ((char *)again)[0] = 1;
    printf("reuse ok\n");
    return 0;
  }
  if (!strcmp(mode, "pread")) {
    /* Reads the file with pread, never mapping it: llama.cpp's -lm none. */
    int fd = open(path, O_RDONLY);
    if (fd < 0) { perror(path); exit(2); }
    unsigned char buffer[65536];
    unsigned long long s = 1469598103934665603ULL;
    off_t at = 0;
    ssize_t n;
    while ((n = pread(fd, buffer, sizeof buffer, at)) > 0) {
      for (ssize_t i = 0; i < n; i++) s = (s ^ buffer[i]) * 1099511628211ULL;
      at += n;
    }
    printf("sum %llx\n", s);
    close(fd);
    return 0;
  }
  if (!strcmp(mode, "open-and-wait")) {
    /* Opens the file and waits, never mapping it, until a signal ends the program. */
    int fd = open(path, O_RDONLY);
    if (fd < 0) { perror(path); exit(2); }
    printf("opened\n");
    fflush(stdout);
    for (;;) pause();
  }
  if (!strcmp(mode, "sum-then-wait-for-sigint")) {
    /* Reads the whole file, then waits for ^C and ends normally on it (through exit(),
     * so the shim writes its report), as an interactive program does. */
    unsigned char *p = map(path, PROT_READ, MAP_SHARED, &len);
    signal(SIGINT, on_sigint);
    printf("sum %llx kind %s\n", sum(p, len), kind(p));
    printf("waiting\n");
    fflush(stdout);
    while (!interrupted) pause();
    printf("interrupted\n");
    exit(0);
  }
  if (!strcmp(mode, "sum-exit") && argc > 3) {
    /* Reads the whole file, then exits with the status given: through exit(), so the
     * shim's exit handler writes its report. */
    unsigned char *p = map(path, PROT_READ, MAP_SHARED, &len);
    printf("sum %llx kind %s\n", sum(p, len), kind(p));
    exit(atoi(argv[3]));
  }
  if (!strcmp(mode, "threads-exit")) {
    /* Threads started before and during the load, reading while the program exits: the
     * exit must not hang on faults in flight. */
    pthread_t t[4];
    for (long i = 0; i < 2; i++) pthread_create(&t[i], NULL, reader, (void *)i);
    unsigned char *p = map(path, PROT_READ, MAP_SHARED, &len);
    shared_len = len;
    shared_p = p;
    go = 1;
    for (long i = 2; i < 4; i++) pthread_create(&t[i], NULL, reader, (void *)i);
    printf("kind %s\n", kind(p));
    printf("first %llx\n", sum(p, 4096));
    usleep(300000);
    printf("exiting with reads in flight\n");
    fflush(stdout);
    exit(0);
  }
  if (!strcmp(mode, "permuted")) {
    /* Passes over 64 KiB chunks in a fixed order no readahead can guess (i * 37 mod n),
     * one byte per page: a format-less file whose access order can only be learned. */
    int passes = argc > 3 ? atoi(argv[3]) : 4;
    unsigned char *p = map(path, PROT_READ, MAP_SHARED, &len);
    size_t chunk = 65536, n = len / chunk;
    unsigned long long s = 0;
    for (int pass = 0; pass < passes; pass++)
      for (size_t i = 0; i < n; i++) {
        size_t c = (i * 37) % n;
        for (size_t o = 0; o < chunk; o += 4096) s = s * 31 + p[c * chunk + o];
      }
    printf("kind %s\n", kind(p));
    printf("permuted %llx\n", s);
    return 0;
  }
  if (!strcmp(mode, "private-writable")) {
    unsigned char *p = map(path, PROT_READ | PROT_WRITE, MAP_PRIVATE, &len);
    printf("kind %s\n", kind(p));
    p[100] ^= 0xff;
    printf("sum %llx\n", sum(p, len));
    return 0;
  }
  if (!strcmp(mode, "shared-writable")) {
    unsigned char *p = map(path, PROT_READ | PROT_WRITE, MAP_SHARED, &len);
    printf("kind %s\n", kind(p));
    p[200] = 0x5a;
    msync(p, len, MS_SYNC);
    int fd = open(path, O_RDONLY);
    unsigned char b = 0;
    pread(fd, &b, 1, 200);
    printf("written through %x\n", b);
    printf("sum %llx\n", sum(p, len));
    return 0;
  }
  if (!strcmp(mode, "anonymous")) {
    len = 8 << 20;
    unsigned char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    printf("kind %s\n", kind(p));
    for (size_t i = 0; i < len; i += 4096) p[i] = (unsigned char)i;
    printf("sum %llx\n", sum(p, len));
    return 0;
  }
  if (!strcmp(mode, "fork")) {
    unsigned char *p = map(path, PROT_READ, MAP_PRIVATE, &len);
    size_t at = len / 2 + 12345;
    printf("parent byte %x\n", p[at]);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      /* Never zeros: either the file's byte, or a fault that kills this child. */
      printf("child byte %x\n", p[at]);
      fflush(stdout);
      _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) printf("child signal %d\n", WTERMSIG(status));
    else printf("child exit %d\n", WEXITSTATUS(status));
    printf("parent after %x\n", p[at]);
    printf("sum %llx\n", sum(p, len));
    return 0;
  }
  if (!strcmp(mode, "lock")) {
    unsigned char *p = map(path, PROT_READ, MAP_SHARED, &len);
    int rc = mlock(p, 65536);
    printf("mlock small %d\n", rc);
    if (rc == 0) munlock(p, 65536);
    errno = 0;
    rc = mlock(p, len);
    printf("mlock all %d errno %s\n", rc, rc ? strerrorname_np(errno) : "0");
    if (rc == 0) munlock(p, len);
    /* The kernel takes any start and rounds it down to its page: so must the shim (an
     * unaligned one reached the kernel, which locked the region and so broke eviction).
     * Left locked: the stats at exit show what was pinned. */
    rc = mlock(p + 100, 65536);
    printf("mlock unaligned %d\n", rc);
    printf("sum %llx\n", sum(p, len));
    printf("sum again %llx\n", sum(p, len));
    return 0;
  }
  if (!strcmp(mode, "advice")) {
    /* Advice that drops pages, and advice the shim does not know (64: no such advice). */
    unsigned char *p = map(path, PROT_READ, MAP_SHARED, &len);
    printf("sum %llx\n", sum(p, len));
    /* The end: read last, so resident. */
    int rc = madvise(p + len - 65536, 65536, MADV_DONTNEED_LOCKED);
    printf("dontneed_locked %d\n", rc);
    printf("sum again %llx\n", sum(p, len));
    errno = 0;
    rc = madvise(p + len - 65536, 65536, 64);
    printf("unknown advice %d errno %s\n", rc, rc ? strerrorname_np(errno) : "0");
    printf("sum last %llx\n", sum(p, len));
    return 0;
  }
  if (!strcmp(mode, "remap")) {
    unsigned char *p = map(path, PROT_READ, MAP_SHARED, &len);
    void *q = mremap(p, len, len + 4096, MREMAP_MAYMOVE);
    if (q == MAP_FAILED) {
      printf("mremap failed %s\n", strerrorname_np(errno));
      printf("sum %llx\n", sum(p, len));
    } else {
      printf("mremap ok\n");
      printf("sum %llx\n", sum(q, len));
    }
    return 0;
  }
  if (!strcmp(mode, "fork-bypass")) {
    /* fork-bypass MODEL OTHER daemon|_Fork|syscall: read the model, make a child without
     * the fork symbol; the child maps OTHER and exits; the parent (gone with daemon)
     * waits, reads again and exits. Every process bounds itself with alarm(). */
    const char *other = argv[3], *how = argv[4];
    alarm(30);
    atexit(report_exit); /* before the first mapping: runs after the shim's handler */
    unsigned char *p = map(path, PROT_READ, MAP_PRIVATE, &len);
    printf("parent pid %d\n", (int)getpid());
    printf("parent sum %llx kind %s\n", sum(p, len), kind(p));
    fflush(stdout);
    if (!strcmp(how, "daemon")) {
      /* glibc's daemon forks with its internal __fork; the caller _exits inside it. */
      if (daemon(1, 1) != 0) { perror("daemon"); return 2; }
      role = "daemon child";
      bypass_child(other, p, len);
    }
    pid_t pid = bypass_fork(how);
    if (pid < 0) { perror(how); return 2; }
    if (pid == 0) {
      role = "child";
      bypass_child(other, p, len);
    }
    int status;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) printf("child signal %d\n", WTERMSIG(status));
    else printf("child exit %d\n", WEXITSTATUS(status));
    printf("parent after sum %llx\n", sum(p, len));
    printf("system %d\n", WEXITSTATUS(system("exit 3")));
    fflush(stdout);
    return 0;
  }
  if (!strcmp(mode, "straddle") && argc > 3) {
    /* argv[3] threads straddle the file's page boundaries together, each its own. */
    unsigned char *p = map(path, PROT_READ, MAP_SHARED, &len);
    shared_p = p;
    shared_len = len;
    straddle_threads = strtoul(argv[3], NULL, 0);
    pthread_t t[64];
    unsigned long long total = 0;
    for (size_t i = 0; i < straddle_threads && i < 64; i++)
      pthread_create(&t[i], NULL, straddler, (void *)i);
    for (size_t i = 0; i < straddle_threads && i < 64; i++) {
      void *s;
      pthread_join(t[i], &s);
      total += (uintptr_t)s;
    }
    printf("straddled %llx\n", total);
    return 0;
  }
  if (!strcmp(mode, "read-forever")) {
    /* Reads the whole file over and over, with no signal handler: a signal's default
     * action ends it, exit handlers unrun (no core file for SIGQUIT). */
    struct rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    unsigned char *p = map(path, PROT_READ, MAP_SHARED, &len);
    printf("sum %llx\n", sum(p, len));
    fflush(stdout);
    /* The sum is used, so every pass reads the file. */
    for (unsigned long long first = sum(p, len);;)
      if (sum(p, len) != first) printf("the file changed\n");
  }
  if (!strcmp(mode, "nest")) {
    /* Unmaps the head of one model mapping (as llama.cpp does), then maps a second model
     * until the kernel places it in that hole, inside the first one's old extent (at most
     * 64 tries; the copies placed elsewhere stay mapped so the next try goes lower). Both
     * must read their files' bytes, the first one's above the second one too. */
    size_t head = strtoul(argv[4], NULL, 0), blen = 0;
    unsigned char *a = map(path, PROT_READ, MAP_SHARED, &len), *b = NULL;
    if (munmap(a, head)) perror("munmap head");
    int nested = 0;
    for (int i = 0; i < 64 && !nested; i++) {
      b = map(argv[3], PROT_READ, MAP_SHARED, &blen);
      nested = b >= a && b < a + head;
    }
    printf("nested %d\n", nested);
    printf("b sum %llx\n", sum(b, blen));
    printf("a rest %llx\n", sum(a + head, len - head));
    return 0;
  }
  if (!strcmp(mode, "exec-child")) {
    /* Does a program this one executes see the shim? */
    const char *preload = getenv("LD_PRELOAD");
    printf("own LD_PRELOAD has shim %d\n", preload && strstr(preload, "hyperoffload") != NULL);
    fflush(stdout);
    execlp("sh", "sh", "-c", "case \"$LD_PRELOAD\" in *hyperoffload*) echo child has shim 1;; *) echo child has shim 0;; esac", (char *)NULL);
    return 3;
  }
  if (!strcmp(mode, "fork-partial")) {
    /* A mapping at a file offset with its head unmapped (as llama.cpp unmaps the GGUF
     * metadata) and a second mapping of the same file; the parent reads a little, forks;
     * the child sums what is still mapped of both, the parent the same after it. */
    int fd = open(path, O_RDONLY);
    if (fd < 0) { perror(path); return 2; }
    struct stat st;
    fstat(fd, &st);
    size_t offset = 1 << 20, head = 64 << 10, first_len = st.st_size - offset;
    unsigned char *a = mmap(NULL, first_len, PROT_READ, MAP_PRIVATE, fd, offset);
    unsigned char *b = mmap(NULL, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (a == MAP_FAILED || b == MAP_FAILED) { perror("mmap"); return 2; }
    close(fd);
    printf("munmap head %d\n", munmap(a, head));
    printf("kind %s\n", kind(b));
    printf("parent first byte %x\n", a[head + 4096]);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      printf("child sums %llx %llx\n", sum(a + head, first_len - head), sum(b, st.st_size));
      fflush(stdout);
      _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) printf("child signal %d\n", WTERMSIG(status));
    else printf("child exit %d\n", WEXITSTATUS(status));
    printf("parent sums %llx %llx\n", sum(a + head, first_len - head), sum(b, st.st_size));
    return 0;
  }
  if (!strcmp(mode, "spawn-child")) {
    /* Does a child process (another pid, through system's posix_spawn) see the shim? */
    fflush(stdout);
    int status = system("case \"$LD_PRELOAD\" in *hyperoffload*) echo child has shim 1;; *) echo child has shim 0;; esac");
    return WIFEXITED(status) ? WEXITSTATUS(status) : 4;
  }
  return 2;
}
