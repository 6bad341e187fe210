/* Forked llama.cpp decoders of one model: loads MODEL with mmap
 * (llama_model_load_from_file, LLAMA_LOAD_MODE_MMAP, the weights read through the mapping), then
 * forks PROCS children; each makes its own context and greedily decodes TOKENS tokens
 * of PROMPT, all children in step (a process-shared barrier after every token, as
 * workers serving the same requests would be, or after every layer), and prints
 *     child I: TEXT
 * on stdout and "child I: N tokens in S s (...)" on stderr with its storage reads and
 * resident file and shared memory. PROCS 0 decodes in the process
 * itself, unforked ("child 0").
 *
 * Nothing is computed before the fork: ggml's CPU backend runs on OpenMP, whose runtime
 * does not survive a fork of a process that already used it. The parent only waits, and
 * frees the model after its children are gone.
 *
 * Usage: fork_decode MODEL TOKENS PROCS THREADS STEP PROMPT (STEP: token or layer)
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "llama.h"

static pthread_barrier_t *step;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void quiet(enum ggml_log_level level, const char *text, void *data) {
    (void)data;
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

/* STEP "layer": the children also wait for each other after every layer's output
 * (tensors named l_out-N), through the eval callback, so they read each layer's
 * weights at the same time; "token" waits only after each token. */
static bool layer_step(struct ggml_tensor *t, bool ask, void *data) {
    (void)data;
    bool layer_out = strncmp(ggml_get_name(t), "l_out-", 6) == 0;
    if (ask) return layer_out;
    if (layer_out && step) pthread_barrier_wait(step);
    return true;
}

/* This process's storage reads (/proc/self/io read_bytes) and Rss{File,Shmem} (kB),
 * for the benchmark's comparison with the kernel. */
static void usage(long long *read_bytes, long *rss_file, long *rss_shmem) {
    char line[256];
    *read_bytes = -1;
    *rss_file = *rss_shmem = -1;
    FILE *io = fopen("/proc/self/io", "r");
    while (io && fgets(line, sizeof line, io)) sscanf(line, "read_bytes: %lld", read_bytes);
    if (io) fclose(io);
    FILE *status = fopen("/proc/self/status", "r");
    while (status && fgets(line, sizeof line, status)) {
        sscanf(line, "RssFile: %ld", rss_file);
        sscanf(line, "RssShmem: %ld", rss_shmem);
    }
    if (status) fclose(status);
}

static bool silent_progress(float progress, void *data) {
    (void)progress;
    (void)data;
    return true;
}

static int decode(struct llama_model *model, int who, int tokens, int threads,
                  bool by_layer, const char *prompt) {
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int n_prompt = -llama_tokenize(vocab, prompt, strlen(prompt), NULL, 0, 1, 1);
    llama_token *ids = calloc(n_prompt + tokens + 1, sizeof(llama_token));
    if (llama_tokenize(vocab, prompt, strlen(prompt), ids, n_prompt, 1, 1) < 0) {
        fprintf(stderr, "child %d: tokenizing failed\n", who);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_prompt + tokens + 8;
    cp.n_batch = n_prompt;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.no_perf = 1;
    if (by_layer) {
        cp.cb_eval = layer_step;
        cp.cb_eval_user_data = NULL;
    }
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "child %d: no context\n", who);
        return 1;
    }
    struct llama_sampler *greedy = llama_sampler_init_greedy();
    char text[16384];
    size_t len = 0;
    struct llama_batch batch = llama_batch_get_one(ids, n_prompt);
    double start = now_s();
    int made = 0;
    for (; made < tokens; made++) {
        if (llama_decode(ctx, batch)) {
            fprintf(stderr, "child %d: decode failed\n", who);
            return 1;
        }
        llama_token next = llama_sampler_sample(greedy, ctx, -1);
        if (step) pthread_barrier_wait(step);
        if (llama_vocab_is_eog(vocab, next)) break;
        char piece[256];
        int n = llama_token_to_piece(vocab, next, piece, sizeof piece, 0, 1);
        /* Newlines as \n: one line per child. */
        for (int i = 0; i < n && len + 2 < sizeof text; i++) {
            if (piece[i] == '\n') {
                text[len++] = '\\';
                text[len++] = 'n';
            } else {
                text[len++] = piece[i];
            }
        }
        ids[n_prompt + made] = next;
        batch = llama_batch_get_one(&ids[n_prompt + made], 1);
    }
    double took = now_s() - start;
    /* One write each: the children's lines do not interleave. */
    printf("child %d: %.*s\n", who, (int)len, text);
    fflush(stdout);
    long long read_bytes;
    long rss_file, rss_shmem;
    usage(&read_bytes, &rss_file, &rss_shmem);
    fprintf(stderr,
            "child %d: %d tokens in %.3f s (%.2f tok/s); read_bytes %lld, RssFile %ld kB, "
            "RssShmem %ld kB\n",
            who, made, took, made / took, read_bytes, rss_file, rss_shmem);
    /* A child still in the barrier would wait forever for one that ended early. */
    if (step) {
        for (; made < tokens; made++) pthread_barrier_wait(step);
    }
    llama_sampler_free(greedy);
    llama_free(ctx);
    free(ids);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s MODEL TOKENS PROCS THREADS token|layer PROMPT\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    int tokens = atoi(argv[2]), procs = atoi(argv[3]), threads = atoi(argv[4]);
    bool by_layer = strcmp(argv[5], "layer") == 0;
    const char *prompt = argv[6];
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.load_mode = LLAMA_LOAD_MODE_MMAP;
    mp.n_gpu_layers = 0;
    /* No repacking (llama-completion's --no-repack): every token reads the weights
     * through the mapping, not from a copy in anonymous memory. */
    mp.use_extra_bufts = 0;
    mp.progress_callback = silent_progress;
    struct llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) {
        fprintf(stderr, "loading %s failed\n", path);
        return 1;
    }
    if (procs == 0) return decode(model, 0, tokens, threads, by_layer, prompt);
    step = mmap(NULL, sizeof *step, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    pthread_barrierattr_t shared;
    pthread_barrierattr_init(&shared);
    pthread_barrierattr_setpshared(&shared, PTHREAD_PROCESS_SHARED);
    pthread_barrier_init(step, &shared, procs);
    int failed = 0;
    for (int i = 0; i < procs; i++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            return 1;
        }
        if (pid == 0) _exit(decode(model, i, tokens, threads, by_layer, prompt));
    }
    for (int i = 0; i < procs; i++) {
        int status = 0;
        if (wait(&status) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "a child failed (status %#x)\n", status);
            failed = 1;
        }
    }
    /* The parent's storage reads: its own (loading; under the pager, the service's) and,
     * once reaped, its children's (the kernel adds them to the parent's count). */
    long long read_bytes;
    long rss_file, rss_shmem;
    usage(&read_bytes, &rss_file, &rss_shmem);
    fprintf(stderr, "parent: read_bytes %lld, RssFile %ld kB, RssShmem %ld kB\n", read_bytes,
            rss_file, rss_shmem);
    llama_model_free(model);
    return failed;
}
