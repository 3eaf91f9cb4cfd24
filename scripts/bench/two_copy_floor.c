/* The floor of any two-copy transfer between two processes of this machine: process A copies
 * 64 MiB of its private memory, chunk by chunk, into buffers in shared memory, process B copies
 * each chunk out into its private memory (streaming stores), the two pinned one to each core
 * and pipelined through CHUNK_KIB-sized buffers (NBUF of them). This is what a shared-memory
 * broadcast from private tensors does, with nothing else: no descriptors, no timeouts, spinning.
 * Prints the fastest of 20 transfers. Built and run by scripts/bench/two_copy_floor.sh.
 *
 * Usage: two_copy_floor CHUNK_KIB NBUF */
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* dst := src, n a multiple of 64, with streaming stores (as ours writes large outputs). */
static void stream_copy(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const void *)(src + i));
        __m128i b = _mm_loadu_si128((const void *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const void *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const void *)(src + i + 48));
        _mm_stream_si128((void *)(dst + i), a);
        _mm_stream_si128((void *)(dst + i + 16), b);
        _mm_stream_si128((void *)(dst + i + 32), c);
        _mm_stream_si128((void *)(dst + i + 48), d);
    }
    _mm_sfence();
}

struct control {
    _Atomic long put; /* chunks A has put */
    char pad[56];
    _Atomic long taken; /* chunks B has taken */
};

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CHUNK_KIB NBUF\n", argv[0]);
        return 2;
    }
    const size_t total = 64 << 20, chunk = (size_t)atoi(argv[1]) << 10;
    const long nbuf = atoi(argv[2]);
    if (chunk < 64 || total % chunk || nbuf < 2) {
        fprintf(stderr, "CHUNK_KIB must divide 64 MiB, NBUF be 2 or more\n");
        return 2;
    }
    struct control *ctl = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    char *buf = mmap(0, chunk * nbuf, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (ctl == MAP_FAILED || buf == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(buf, 0, chunk * nbuf);
    const int sender = fork() != 0;
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    CPU_SET(sender ? 0 : 1, &cpus);
    sched_setaffinity(0, sizeof cpus, &cpus);
    char *data = aligned_alloc(4096, total);
    memset(data, sender ? 7 : 0, total);
    const long chunks = total / chunk;
    double best = 1e9;
    for (int it = 0; it < 20; it++) {
        const long base = it * chunks;
        /* Both start once the previous transfer is over. */
        while (atomic_load(sender ? &ctl->taken : &ctl->put) < base)
            _mm_pause();
        double t = now();
        for (long g = 0; g < chunks; g++) {
            const long at = base + g;
            char *b = buf + (at % nbuf) * chunk;
            if (sender) {
                while (atomic_load_explicit(&ctl->taken, memory_order_acquire) < at - nbuf + 1)
                    _mm_pause();
                memcpy(b, data + g * chunk, chunk);
                atomic_store_explicit(&ctl->put, at + 1, memory_order_release);
            } else {
                while (atomic_load_explicit(&ctl->put, memory_order_acquire) < at + 1)
                    _mm_pause();
                stream_copy(data + g * chunk, b, chunk);
                atomic_store_explicit(&ctl->taken, at + 1, memory_order_release);
            }
        }
        if (sender)
            while (atomic_load(&ctl->taken) < base + chunks)
                _mm_pause();
        t = now() - t;
        if (t < best)
            best = t;
    }
    if (!sender) {
        if (data[12345] != 7 || data[total - 1] != 7) {
            fprintf(stderr, "wrong bytes received\n");
            return 1;
        }
        return 0;
    }
    int status = 0;
    wait(&status);
    printf("two-copy floor, 64 MiB, chunk %zu KiB, %ld buffers: fastest %.2f ms, %.2f GiB/s\n",
           chunk >> 10, nbuf, best * 1e3, total / best / (1 << 30));
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
