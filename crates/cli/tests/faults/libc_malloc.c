/* Preloaded before libfaketime into redis-server by the fault harness (crates/cli/tests/
 * faults.rs). Debian's redis-server takes malloc and friends from jemalloc, which calls
 * clock_gettime while libfaketime initialises and hangs it ("unexpected recursive calls to
 * clock_gettime()"). Routing the plain allocator symbols to glibc's own allocator breaks
 * that recursion; jemalloc stays loaded for what Redis asks of it by name (its stats). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

void *malloc(size_t n) { return __libc_malloc(n); }
void free(void *p) { __libc_free(p); }
void *calloc(size_t a, size_t b) { return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { return __libc_realloc(p, n); }
void *memalign(size_t a, size_t n) { return __libc_memalign(a, n); }
void *aligned_alloc(size_t a, size_t n) { return __libc_memalign(a, n); }

int posix_memalign(void **out, size_t a, size_t n) {
    void *p = __libc_memalign(a, n);
    if (!p) {
        return 12; /* ENOMEM */
    }
    *out = p;
    return 0;
}

size_t malloc_usable_size(void *p) {
    static size_t (*glibc)(void *);
    if (!glibc) {
        void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
        if (libc) {
            glibc = (size_t (*)(void *))dlvsym(libc, "malloc_usable_size", "GLIBC_2.2.5");
        }
    }
    return glibc ? glibc(p) : 0;
}
