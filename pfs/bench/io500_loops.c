/* The per-item loops of `pfs bench io500` on a POSIX path, in C: where the kernel answers
 * a metadata call in about a microsecond, Python's own cost per call (several) would decide
 * the rate, and mdtest and pfind pay none. Each loop makes the system calls mdtest
 * (hpc/ior src/mdtest.c with aiori-POSIX.c) and pfind (VI4IO/pfind src/pfind.c) make, in
 * the same order; the phase logic, barriers, stonewall wear-out, timing and scoring stay
 * in Python (pfs/bench/io500.py), which calls one function per phase and rank through
 * ctypes (pfs/bench/io500_loops.py builds and loads this file).
 *
 * Every function returns 0 or an errno; on an error `err` holds the path that failed and
 * the counters say how far the loop got. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <regex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <locale.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define HEAD 24 /* the stamp of every file: offset/item, writer rank + 1, seed (<QQQ) */

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void put64(unsigned char *p, uint64_t v) { /* little-endian, as struct '<Q' */
    for (int k = 0; k < 8; k++) p[k] = (unsigned char)(v >> (8 * k));
}

static void stamp(unsigned char *buf, size_t size, uint64_t item, int writer, uint64_t seed) {
    unsigned char head[HEAD];
    put64(head, item);
    put64(head + 8, (uint64_t)writer + 1);
    put64(head + 16, seed);
    memcpy(buf, head, size < HEAD ? size : HEAD);
}

static int fail(char *err, size_t errlen, const char *path) {
    int e = errno ? errno : EIO;
    snprintf(err, errlen, "%s", path);
    return e;
}

/* mdtest's file name: DIR/file.mdtest.RANK.ITEM, built per item as create_file and
 * remove_file build it (one sprintf into a PATH_MAX buffer; GetTimeStamp around the
 * call: gettimeofday) */
static void item_path(char *out, size_t len, const char *dir, int owner, int64_t i) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    snprintf(out, len, "%s/file.mdtest.%d.%lld", dir, owner, (long long)i);
}

/* ... and as mdtest_stat and mdtest_read build it: both PATH_MAX buffers cleared, the
 * name formatted, then the directory put before it through the second buffer */
static void item_path_read(char *item, char *temp, const char *dir, int owner, int64_t i) {
    struct timeval tv;
    memset(item, 0, PATH_MAX);
    memset(temp, 0, PATH_MAX);
    snprintf(item, PATH_MAX, "file.mdtest.%d.%lld", owner, (long long)i);
    snprintf(temp, PATH_MAX, "%s/%s", dir, item);
    strcpy(item, temp);
    gettimeofday(&tv, NULL);
}

/* POSIX_Xfer: lseek to the offset, then write (or read) until done */
static ssize_t xfer(int fd, int write_, unsigned char *buf, size_t len) {
    if (lseek(fd, 0, SEEK_SET) == -1) return -1;
    size_t done = 0;
    while (done < len) {
        ssize_t rc = write_ ? write(fd, buf + done, len - done) : read(fd, buf + done, len - done);
        if (rc < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (rc == 0) break; /* EOF: a short file */
        done += (size_t)rc;
    }
    return (ssize_t)done;
}

/* mdtest create (-F, -w SIZE): open(O_CREAT|O_RDWR, 0664), [lseek, write], close per item,
 * items [*done, stop), checking the stonewall before each (CHECK_STONE_WALL). `data` is
 * the file body: its first 24 bytes are overwritten with each item's stamp. */
int io5_md_create(const char *dir, int rank, int64_t stop, double deadline,
                  unsigned char *data, size_t size, uint64_t seed, int64_t *done,
                  char *err, size_t errlen) {
    char path[PATH_MAX];
    for (int64_t i = *done; i < stop; i++) {
        if (mono() >= deadline) break;
        item_path(path, sizeof path, dir, rank, i);
        int fd = open(path, O_CREAT | O_RDWR, 0664);
        if (fd < 0) return fail(err, errlen, path);
        if (size > 0) {
            stamp(data, size, (uint64_t)i, rank, seed);
            ssize_t n = xfer(fd, 1, data, size);
            if (n != (ssize_t)size) {
                int e = n < 0 ? errno : EIO;
                close(fd);
                errno = e;
                return fail(err, errlen, path);
            }
        }
        if (close(fd) != 0) return fail(err, errlen, path);
        *done = i + 1;
    }
    return 0;
}

/* mdtest stat: stat() of items [0, count) of `owner`; a size other than `size` is a bad one */
int io5_md_stat(const char *dir, int owner, int64_t count, int64_t size, int64_t *done,
                int64_t *bad, char *err, size_t errlen) {
    char path[PATH_MAX], temp[PATH_MAX];
    struct stat st;
    for (int64_t i = 0; i < count; i++) {
        item_path_read(path, temp, dir, owner, i);
        if (stat(path, &st) != 0) return fail(err, errlen, path);
        if ((int64_t)st.st_size != size) (*bad)++;
        *done = i + 1;
    }
    return 0;
}

/* The data: every file and transfer is a 24-byte stamp (offset or item, writer rank + 1,
 * seed: <QQQ) and then the words of IOR's "timestamp" data packet (io500's default
 * dataPacketType; hpc/ior src/utilities.c generate_memory_pattern): word i is
 * (rank << 32) | (signature + i), here with rank 0 and the signature the seed's low 31
 * bits (pfs/bench/io500.py, Rank.reseed), and bytes past the last whole word as the
 * pattern has them. */
enum { DATA_TIMESTAMP, DATA_OFFSET, DATA_INCOMPRESSIBLE, DATA_RANDOM };
#define RANDALGO_GOLDEN_RATIO_PRIME 0x9e37fffffffc0001UL
#define STAMP_WORDS (HEAD / 8)

/* The packet type the reads check, as IOR passes test->dataPacketType into another
 * compilation unit: a variable the compiler cannot fold, so that the loop below is
 * compiled as IOR's is (the type switched per word, not hoisted). */
int io5_packet_type = DATA_TIMESTAMP;

/* IOR's and mdtest's verify_memory_pattern (IOR -R, mdtest -X), its loop as written
 * there: every word's expected value computed in turn (the type switched inside the
 * loop, rand_r once per call), every word compared, no early exit ("always read all
 * data to ensure that performance numbers stay the same"). Words [from, size). */
static int ior_verify_words(const unsigned char *buffer, size_t from, size_t size,
                            uint64_t item, int rand_seed, int pretendRank,
                            int dataPacketType) {
    int error = 0;
    int k = 1;
    uint64_t rand_state_local;
    unsigned seed = (unsigned)rand_seed + (unsigned)pretendRank + (unsigned)item;
    rand_state_local = (uint64_t)rand_r(&seed);
    for (size_t i = from; i < size; i++) {
        uint64_t exp = 0, got;
        switch (dataPacketType) {
        case DATA_RANDOM:
            rand_state_local *= RANDALGO_GOLDEN_RATIO_PRIME;
            rand_state_local >>= 3;
            exp = rand_state_local;
            break;
        case DATA_INCOMPRESSIBLE: {
            unsigned s = (unsigned)rand_seed + (unsigned)pretendRank;
            uint64_t hi = ((uint64_t)rand_r(&s) << 32);
            uint64_t lo = (uint64_t)rand_r(&s);
            exp = hi | lo;
            break;
        }
        case DATA_OFFSET:
        case DATA_TIMESTAMP:
            exp = ((uint64_t)pretendRank) << 32 | ((size_t)rand_seed + i);
            break;
        }
        if (i % 512 == 0 && (dataPacketType != DATA_TIMESTAMP) && dataPacketType != DATA_RANDOM) {
            exp = ((uint32_t)item * k) | ((uint64_t)pretendRank) << 32;
            k++;
        }
        memcpy(&got, buffer + 8 * i, 8);
        if (got != exp) error = 1;
    }
    return error;
}

/* A file or transfer of `n` bytes: the stamp, IOR's words, and the bytes after the last
 * whole word against `body` (the expected bytes after the stamp) */
static int verify(const unsigned char *buf, size_t n, uint64_t item, int writer, uint64_t seed,
                  const unsigned char *body) {
    uint64_t head[STAMP_WORDS] = {item, (uint64_t)writer + 1, seed};
    unsigned char hb[HEAD];
    for (int k = 0; k < STAMP_WORDS; k++) put64(hb + 8 * k, head[k]);
    int error = 0;
    size_t words = n / 8;
    if (memcmp(buf, hb, n < HEAD ? n : HEAD) != 0) error = 1;
    if (words > STAMP_WORDS &&
        ior_verify_words(buf, STAMP_WORDS, words, item, (int)(seed & 0x7fffffff), 0,
                         io5_packet_type))
        error = 1;
    for (size_t i = words * 8 > HEAD ? words * 8 : HEAD; i < n; i++)
        if (buf[i] != body[i - HEAD]) error = 1;
    return error;
}

/* IOR's read loop (-R: READCHECK) on an open file: transfer k at first + k * stride;
 * per transfer invalidate_buffer_pattern, lseek + read (POSIX_Xfer), verify. `body` is
 * the expected bytes after the stamp; the stamp's writer is `writer`. */
int io5_ior_read(int fd, unsigned char *buf, size_t transfer, int64_t count, int64_t first,
                 int64_t stride, int writer, uint64_t seed, const unsigned char *body,
                 int check, int64_t *done, int64_t *bytes, int64_t *bad, char *err,
                 size_t errlen) {
    for (int64_t k = 0; k < count; k++) {
        int64_t off = first + k * stride;
        struct timeval tv; /* IOR's GetTimeStamp before and after each transfer */
        gettimeofday(&tv, NULL);
        buf[0] = (unsigned char)~buf[0];
        if (lseek(fd, off, SEEK_SET) == -1) return fail(err, errlen, "lseek");
        size_t got = 0;
        while (got < transfer) {
            ssize_t rc = read(fd, buf + got, transfer - got);
            if (rc < 0) {
                if (errno == EINTR) continue;
                return fail(err, errlen, "read");
            }
            if (rc == 0) break;
            got += (size_t)rc;
        }
        gettimeofday(&tv, NULL);
        *bytes += (int64_t)got;
        if (got != transfer || (check && verify(buf, got, (uint64_t)off, writer, seed, body)))
            (*bad)++;
        *done = k + 1;
    }
    return 0;
}

/* mdtest read (-e SIZE -X): open(O_RDWR) (mdtest passes O_RDONLY, 0, which aiori-POSIX
 * reads as "neither read-only nor write-only"), lseek, read, compare, close. `body` is
 * the expected bytes after the stamp. */
int io5_md_read(const char *dir, int owner, int64_t count, unsigned char *buf, size_t size,
                const unsigned char *body, uint64_t seed, int check, int64_t *done,
                int64_t *bytes, int64_t *bad, char *err, size_t errlen) {
    char path[PATH_MAX], temp[PATH_MAX];
    for (int64_t i = 0; i < count; i++) {
        item_path_read(path, temp, dir, owner, i);
        int fd = open(path, O_RDWR);
        if (fd < 0) return fail(err, errlen, path);
        buf[0] = (unsigned char)~buf[0]; /* invalidate_buffer_pattern */
        ssize_t n = xfer(fd, 0, buf, size);
        if (n < 0) {
            int e = errno;
            close(fd);
            errno = e;
            return fail(err, errlen, path);
        }
        *bytes += n;
        if ((size_t)n != size) {
            (*bad)++;
        } else if (check && verify(buf, size, (uint64_t)i, owner, seed, body)) {
            (*bad)++;
        }
        if (close(fd) != 0) return fail(err, errlen, path);
        *done = i + 1;
    }
    return 0;
}

/* mdtest remove: unlink() of items [0, count) of `owner` */
int io5_md_unlink(const char *dir, int owner, int64_t count, int64_t *done, char *err,
                  size_t errlen) {
    char path[PATH_MAX];
    for (int64_t i = 0; i < count; i++) {
        item_path(path, sizeof path, dir, owner, i);
        if (unlink(path) != 0) return fail(err, errlen, path);
        *done = i + 1;
    }
    return 0;
}

/* pfind's -name pattern, compiled once as pfind compiles it when it reads its options
 * (pfind turns -name "*01*" into the basic regex ".*01.*" and never calls setlocale: the
 * "C" locale, where Python's process is in the user's UTF-8 one and glibc's regexec
 * would take the multibyte path) */
typedef struct {
    regex_t re;
    locale_t c_locale;
} find_pattern;

/* compile `regex` for io5_find_open; NULL with `*rc` an errno. Kept for the process's
 * life (CLoops compiles one), as pfind keeps its own */
void *io5_find_pattern(const char *regex, int *rc, char *err, size_t errlen) {
    find_pattern *p = calloc(1, sizeof *p);
    if (p == NULL) {
        *rc = ENOMEM;
        return NULL;
    }
    p->c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0);
    if (p->c_locale == (locale_t)0) {
        *rc = fail(err, errlen, "newlocale");
        free(p);
        return NULL;
    }
    locale_t old = uselocale(p->c_locale);
    int bad = regcomp(&p->re, regex, 0);
    uselocale(old);
    if (bad) {
        snprintf(err, errlen, "%s", regex);
        freelocale(p->c_locale);
        free(p);
        *rc = EINVAL;
        return NULL;
    }
    *rc = 0;
    return p;
}

/* pfind's find_do_readdir, a chunk at a time: a cursor holds the open directory between
 * calls (pfind's current_dir) and the pattern (not its own: io5_find_pattern's) */
typedef struct {
    DIR *d;
    find_pattern *pat;
    int64_t size, newer;
    char dir[PATH_MAX];
} find_cursor;

void io5_find_close(void *h) {
    find_cursor *c = h;
    if (c == NULL) return;
    if (c->d) closedir(c->d);
    free(c);
}

/* opendir `dir` for io5_find_chunk; NULL with `*rc` an errno (and `err` the path) */
void *io5_find_open(const char *dir, void *pattern, int64_t size, int64_t newer, int *rc,
                    char *err, size_t errlen) {
    find_cursor *c = calloc(1, sizeof *c);
    if (c == NULL) {
        *rc = ENOMEM;
        return NULL;
    }
    c->pat = pattern;
    c->size = size;
    c->newer = newer;
    snprintf(c->dir, sizeof c->dir, "%s", dir);
    c->d = opendir(dir);
    if (c->d == NULL) {
        *rc = fail(err, errlen, dir);
        io5_find_close(c);
        return NULL;
    }
    *rc = 0;
    return c;
}

static int put_item(char **items, size_t *len, size_t *cap, char kind, const char *name) {
    size_t n = strlen(name) + 2;
    if (*len + n > *cap) {
        size_t want = (*cap + n) * 2;
        char *grown = realloc(*items, want);
        if (grown == NULL) return ENOMEM;
        *items = grown;
        *cap = want;
    }
    (*items)[*len] = kind;
    memcpy(*items + *len + 1, name, n - 1);
    *len += n;
    return 0;
}

/* One call of pfind's find_do_readdir on the cursor: read entries until more than `max`
 * were processed (pfind's max_entries_per_iter, 1000: it stops at the 1,001st's turn),
 * the directory ends, or the queue is full. Every entry that is not a directory and does
 * not match the name is counted in `*files`; a directory ('d') and a matching file ('f')
 * go to `*items` ("<kind><name>\0" each, malloc'ed: free with io5_free) in readdir
 * order, as pfind enqueues them for later; an entry of unknown type is fstatat'ed and, if
 * not a directory, counted and matched at once. When `room` items are queued, the next
 * one that pfind could not enqueue is marked 'D' or 'F' (a directory for its excess list,
 * a file it lstats at once) and the call returns. `*finished`: the directory was
 * closed (io5_find_close is still due). */
int io5_find_chunk(void *h, int64_t max, int64_t room, int64_t *files, int64_t *found,
                   char **items, size_t *itemlen, int *finished, char *err, size_t errlen) {
    find_cursor *c = h;
    size_t cap = 0;
    int64_t processed = 0, queued = 0;
    int rc = 0;
    struct stat st;
    char path[PATH_MAX];
    *items = NULL;
    *itemlen = 0;
    *finished = 0;
    locale_t old = uselocale(c->pat->c_locale);
    for (;;) {
        if (processed > max) goto out; /* pfind: "interrupting readdir" */
        errno = 0;
        struct dirent *e = readdir(c->d);
        if (e == NULL) {
            if (errno) rc = fail(err, errlen, c->dir);
            break;
        }
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        processed++;
        char kind = e->d_type == DT_DIR ? 'd' : 'f';
        if (e->d_type == DT_UNKNOWN) {
            if (fstatat(dirfd(c->d), e->d_name, &st, 0) != 0) {
                snprintf(path, sizeof path, "%s/%s", c->dir, e->d_name);
                rc = fail(err, errlen, path);
                break;
            }
            if (!S_ISDIR(st.st_mode)) {
                (*files)++;
                if (regexec(&c->pat->re, e->d_name, 0, NULL, 0) == 0 &&
                    (int64_t)st.st_ctime >= c->newer && (int64_t)st.st_size == c->size)
                    (*found)++;
                continue;
            }
            kind = 'd';
        } else if (kind == 'f' && regexec(&c->pat->re, e->d_name, 0, NULL, 0) != 0) {
            (*files)++;
            continue;
        }
        if (queued >= room) { /* pfind's enqueue_work failed: the queue is full */
            rc = put_item(items, itemlen, &cap, kind == 'd' ? 'D' : 'F', e->d_name);
            if (rc == 0) goto out;
            break;
        }
        if ((rc = put_item(items, itemlen, &cap, kind, e->d_name)) != 0) break;
        queued++;
    }
    closedir(c->d);
    c->d = NULL;
    *finished = 1;
out:
    uselocale(old);
    return rc;
}

void io5_free(void *p) { free(p); }
