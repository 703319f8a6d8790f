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

/* IOR's and mdtest's verify_memory_pattern: every word compared (no early exit: "always
 * read all data to ensure that performance numbers stay the same"), against the stamp
 * (offset or item, writer rank + 1, seed) and then the pattern's bytes */
static int verify(const unsigned char *buf, size_t n, uint64_t item, int writer, uint64_t seed,
                  const unsigned char *body) {
    uint64_t head[3] = {item, (uint64_t)writer + 1, seed};
    unsigned char hb[HEAD];
    for (int k = 0; k < 3; k++) put64(hb + 8 * k, head[k]);
    int error = 0;
    size_t words = n / 8;
    for (size_t i = 0; i < words; i++) {
        uint64_t got, exp;
        memcpy(&got, buf + 8 * i, 8);
        memcpy(&exp, i < 3 ? hb + 8 * i : body + 8 * (i - 3), 8);
        if (got != exp) error = 1;
    }
    for (size_t i = words * 8; i < n; i++) {
        unsigned char exp = i < HEAD ? hb[i] : body[i - HEAD];
        if (buf[i] != exp) error = 1;
    }
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

/* pfind's find_do_readdir + find_do_lstat for one directory: readdir every entry; a
 * directory goes to `*subdirs` (names, each ended by '\0', malloc'ed: free with io5_free);
 * an entry of unknown type is fstatat'ed; every other entry is counted in `*files`, and
 * those whose name matches the pattern (pfind turns -name "*01*" into the basic regex
 * ".*01.*") are lstat'ed by path and matched with -size and -newer (whole seconds of
 * ctime), counted in `*found`. */
static int find_dir(const char *dir, const char *regex, int64_t size, int64_t newer,
                    int64_t *files, int64_t *found, char **subdirs, size_t *sublen,
                    char *err, size_t errlen);

int io5_find_dir(const char *dir, const char *regex, int64_t size, int64_t newer,
                 int64_t *files, int64_t *found, char **subdirs, size_t *sublen, char *err,
                 size_t errlen) {
    /* pfind never calls setlocale: its regex runs in the "C" locale. Python's process
     * is in the user's (UTF-8) one, where glibc's regexec takes the multibyte path */
    locale_t c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0);
    if (c_locale == (locale_t)0) return fail(err, errlen, "newlocale");
    locale_t old_locale = uselocale(c_locale);
    int rc = find_dir(dir, regex, size, newer, files, found, subdirs, sublen, err, errlen);
    uselocale(old_locale);
    freelocale(c_locale);
    return rc;
}

static int find_dir(const char *dir, const char *regex, int64_t size, int64_t newer,
                    int64_t *files, int64_t *found, char **subdirs, size_t *sublen,
                    char *err, size_t errlen) {
    regex_t re;
    if (regcomp(&re, regex, 0) != 0) {
        snprintf(err, errlen, "%s", regex);
        return EINVAL;
    }
    *subdirs = NULL;
    *sublen = 0;
    size_t cap = 0;
    int rc = 0;
    char path[PATH_MAX], job[PATH_MAX];
    struct stat st;
    DIR *d = opendir(dir);
    if (d == NULL) {
        regfree(&re);
        return fail(err, errlen, dir);
    }
    for (;;) {
        errno = 0;
        struct dirent *e = readdir(d);
        if (e == NULL) {
            if (errno) rc = fail(err, errlen, dir);
            break;
        }
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        int is_dir = e->d_type == DT_DIR;
        if (e->d_type == DT_UNKNOWN) { /* pfind: fstatat, then the name test */
            if (fstatat(dirfd(d), e->d_name, &st, 0) != 0) {
                snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
                rc = fail(err, errlen, path);
                break;
            }
            is_dir = S_ISDIR(st.st_mode);
            if (!is_dir) {
                (*files)++;
                if (regexec(&re, e->d_name, 0, NULL, 0) == 0 && (int64_t)st.st_size == size &&
                    (int64_t)st.st_ctime >= newer)
                    (*found)++;
                continue;
            }
        }
        if (is_dir) {
            size_t n = strlen(e->d_name) + 1;
            if (*sublen + n > cap) {
                cap = (cap + n) * 2;
                char *grown = realloc(*subdirs, cap);
                if (grown == NULL) {
                    rc = ENOMEM;
                    break;
                }
                *subdirs = grown;
            }
            memcpy(*subdirs + *sublen, e->d_name, n);
            *sublen += n;
            continue;
        }
        if (regexec(&re, e->d_name, 0, NULL, 0) != 0) {
            (*files)++;
            continue;
        }
        /* enqueue_work names the job "dir/name"; find_do_lstat formats the path again */
        snprintf(job, sizeof job, "%s/%s", dir, e->d_name);
        snprintf(path, sizeof path, "%s", job);
        (*files)++;
        if (lstat(path, &st) != 0) {
            rc = fail(err, errlen, path);
            break;
        }
        if ((int64_t)st.st_size == size && (int64_t)st.st_ctime >= newer) (*found)++;
    }
    closedir(d);
    regfree(&re);
    return rc;
}

void io5_free(void *p) { free(p); }
