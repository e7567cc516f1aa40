/*
 * params.c - the environment variables libcomet reads (params.h): one table, read once.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "params.h"

typedef struct param {
    const char *name;
    int is_path;    /* a file's path, else an integer in [lo, hi] */
    long def, lo, hi;
    const char *takes; /* what a valid value is, for the error message */
} param_t;

static const param_t table[COMETI_NUM_PARAMS] = {
    [COMETI_PARAM_TIMEOUT_MS] = {"COMET_TIMEOUT_MS", 0, COMETI_DEFAULT_TIMEOUT_MS, 1, 3600000,
                                 "milliseconds, a whole number in 1..3600000"},
    [COMETI_PARAM_PDL] = {"COMET_PDL", 0, 1, 0, 1, "0 (ordinary launches) or 1 (programmatic dependent launch)"},
    [COMETI_PARAM_FIRST_WAVE] = {"COMET_FIRST_WAVE", 0, 1, 0, 1, "0 (no first wave) or 1 (the first wave where it pays)"},
    [COMETI_PARAM_TUNING_FILE] = {"COMET_TUNING_FILE", 1, 0, 0, 0, "the path of a readable regular file"},
};

static long values[COMETI_NUM_PARAMS];
static char paths[COMETI_NUM_PARAMS][4096];
static char load_error[COMETI_ERR_LEN];
static comet_status_t load_status;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static comet_status_t read_one(int i)
{
    const param_t *p = &table[i];
    values[i] = p->def;
    paths[i][0] = '\0';
    const char *v = getenv(p->name);
    if (!v || !*v) return COMET_SUCCESS;
    if (p->is_path) {
        struct stat st;
        if (strlen(v) >= sizeof(paths[i]))
            return cometi_fail(load_error, COMET_INVALID_ARGUMENT, "$%s: a path of %zu characters: at most %zu",
                               p->name, strlen(v), sizeof(paths[i]) - 1);
        if (stat(v, &st) != 0)
            return cometi_fail(load_error, COMET_INVALID_ARGUMENT, "$%s = '%.300s': %s; it takes %s", p->name, v,
                               strerror(errno), p->takes);
        if (!S_ISREG(st.st_mode))
            return cometi_fail(load_error, COMET_INVALID_ARGUMENT, "$%s = '%.300s' is not a regular file; it takes %s",
                               p->name, v, p->takes);
        snprintf(paths[i], sizeof(paths[i]), "%s", v);
        return COMET_SUCCESS;
    }
    char *end;
    errno = 0;
    const long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < p->lo || x > p->hi)
        return cometi_fail(load_error, COMET_INVALID_ARGUMENT, "$%s = '%.100s': it takes %s", p->name, v, p->takes);
    values[i] = x;
    return COMET_SUCCESS;
}

static void load(void)
{
    load_status = COMET_SUCCESS;
    for (int i = 0; i < COMETI_NUM_PARAMS; i++) {
        const comet_status_t st = read_one(i);
        if (st != COMET_SUCCESS && load_status == COMET_SUCCESS) load_status = st;
        if (st != COMET_SUCCESS) values[i] = table[i].def, paths[i][0] = '\0';
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
