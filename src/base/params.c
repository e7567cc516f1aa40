/*
 * params.c - the environment variables libcomet reads (params.h): one table, read once.
 */
#define _POSIX_C_SOURCE 200809L /* open flags, fstat and the file kinds */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/params.h"

typedef struct param {
    const char *name;
    int is_path;    /* a file's path, else an integer in [lo, hi] */
    long def, lo, hi;
    const char *takes; /* what a valid value is, for the error message */
    /* A path's contents checked by the code that reads them (NULL: none): 0, or -1 with `why`. */
    int (*contents)(const char *path, char *why, size_t len);
} param_t;

static const param_t table[COMETI_NUM_PARAMS] = {
    [COMETI_PARAM_TIMEOUT_MS] = {"COMET_TIMEOUT_MS", 0, COMETI_DEFAULT_TIMEOUT_MS, 1, 3600000,
                                 "milliseconds, a whole number in 1..3600000"},
    [COMETI_PARAM_PDL] = {"COMET_PDL", 0, 1, 0, 1, "0 (ordinary launches) or 1 (programmatic dependent launch)"},
    [COMETI_PARAM_FIRST_WAVE] = {"COMET_FIRST_WAVE", 0, 1, 0, 1, "0 (no first wave) or 1 (the first wave where it pays)"},
    [COMETI_PARAM_TUNING_FILE] = {"COMET_TUNING_FILE", 1, 0, 0, 0, "the path of a readable regular file",
                                  cometi_tuning_file_check},
};

static long values[COMETI_NUM_PARAMS];
static char paths[COMETI_NUM_PARAMS][4096];
static char load_error[COMETI_ERR_LEN];
static comet_status_t load_status;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static const char *file_kind(mode_t m)
{
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a fifo" : S_ISSOCK(m) ? "a socket" :
           S_ISCHR(m) ? "a character device" : S_ISBLK(m) ? "a block device" : "something else";
}

int cometi_open_regular(const char *path, char *why, size_t why_len)
{
    /* O_NONBLOCK: opening a fifo for reading would otherwise wait for a writer, and a
     * settings file must never hang the caller. It changes nothing for a regular file. */
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        snprintf(why, why_len, "%s", strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(why, why_len, "%s, not a regular file", file_kind(st.st_mode));
        close(fd);
        return -1;
    }
    return fd;
}

/* A whole decimal number in [lo, hi], nothing before or after it (strtol alone would take
 * leading blanks and a '+'). */
static int parse_long(const char *v, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    const long x = strtol(v, &end, 10);
    if ((*v != '-' && (*v < '0' || *v > '9')) || errno || end == v || *end || x < lo || x > hi) return -1;
    *out = x;
    return 0;
}

/* Fills `msg` (COMETI_ERR_LEN bytes) on failure. */
static comet_status_t read_path(int i, const char *v, char *msg)
{
    const param_t *p = &table[i];
    char why[128];
    if (strlen(v) >= sizeof(paths[i]))
        return cometi_fail(msg, COMET_INVALID_ARGUMENT, "$%s: a path of %zu characters: at most %zu", p->name,
                           strlen(v), sizeof(paths[i]) - 1);
    const int fd = cometi_open_regular(v, why, sizeof(why));
    if (fd < 0)
        return cometi_fail(msg, COMET_INVALID_ARGUMENT, "$%s = '%.300s': %s; it takes %s", p->name, v, why,
                           p->takes);
    close(fd);
    char bad[COMETI_ERR_LEN - 32];
    if (p->contents && p->contents(v, bad, sizeof(bad)))
        return cometi_fail(msg, COMET_INVALID_ARGUMENT, "$%s: %s", p->name, bad);
    snprintf(paths[i], sizeof(paths[i]), "%s", v);
    return COMET_SUCCESS;
}

static comet_status_t read_one(int i, char *msg)
{
    const param_t *p = &table[i];
    values[i] = p->def;
    paths[i][0] = '\0';
    const char *v = getenv(p->name);
    if (!v || !*v) return COMET_SUCCESS;
    if (p->is_path) return read_path(i, v, msg);
    if (parse_long(v, p->lo, p->hi, &values[i]))
        return cometi_fail(msg, COMET_INVALID_ARGUMENT, "$%s = '%.100s': it takes %s", p->name, v, p->takes);
    return COMET_SUCCESS;
}

static void load(void)
{
    load_status = COMET_SUCCESS;
    for (int i = 0; i < COMETI_NUM_PARAMS; i++) {
        char msg[COMETI_ERR_LEN];
        const comet_status_t st = read_one(i, msg);
        if (st == COMET_SUCCESS) continue;
        values[i] = table[i].def, paths[i][0] = '\0';
        /* The first bad variable is the one reported, its message with its status. */
        if (load_status == COMET_SUCCESS) load_status = st, memcpy(load_error, msg, sizeof(load_error));
    }
}

comet_status_t cometi_params_load(char *err)
{
    pthread_once(&once, load);
    if (load_status != COMET_SUCCESS) return cometi_fail(err, load_status, "%s", load_error);
    return COMET_SUCCESS;
}

long cometi_param_int(cometi_param_id_t id)
{
    pthread_once(&once, load);
    return values[id];
}

const char *cometi_param_str(cometi_param_id_t id)
{
    pthread_once(&once, load);
    return paths[id];
}

const char *cometi_param_name(cometi_param_id_t id) { return table[id].name; }
