/*
 * params.h - every environment variable libcomet reads, in one table: its name, default
 * and range, read once per process (at the first comet_comm_create, or the first use),
 * a malformed value an error that names the variable. Environment values override
 * defaults only; the config structs and arguments of comet.h come first.
 */
#ifndef COMET_PARAMS_H
#define COMET_PARAMS_H

#include "base/host.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cometi_param_id {
    COMETI_PARAM_TIMEOUT_MS = 0, /* COMET_TIMEOUT_MS: a device wait's limit when the comm config says 0 */
    COMETI_PARAM_PDL,            /* COMET_PDL: 0 launches every kernel the ordinary way */
    COMETI_PARAM_FIRST_WAVE,     /* COMET_FIRST_WAVE: 0 turns the fused layer0's first wave off */
    COMETI_PARAM_TUNING_FILE,    /* COMET_TUNING_FILE: the tuning file's path ("" none) */
    COMETI_NUM_PARAMS
} cometi_param_id_t;

/* Read the table once (later calls return the first call's result). COMET_SUCCESS, or
 * COMET_INVALID_ARGUMENT with `err` (COMETI_ERR_LEN bytes) naming the variable, its value
 * and what it takes; the tuning file's lines are checked too, by tune.c's own parser.
 * comet_comm_create calls it, and the comet tool before it touches a GPU, so a bad value
 * stops both with the same sentence. */
comet_status_t cometi_params_load(char *err);
/* An integer parameter's value (its default where the table failed to load). */
long cometi_param_int(cometi_param_id_t id);
/* A string parameter's value ("" when unset). */
const char *cometi_param_str(cometi_param_id_t id);
/* "COMET_TIMEOUT_MS", ... */
const char *cometi_param_name(cometi_param_id_t id);

/* Open `path` for reading where it is a regular file: its descriptor, or -1 with `why`
 * saying what is wrong ("Permission denied", "a directory, not a regular file", ...). A
 * fifo is refused without waiting for a writer. What $COMET_TUNING_FILE is checked with
 * when the table is read, and what the tuning file is opened with when it is read. */
int cometi_open_regular(const char *path, char *why, size_t why_len);

/* $COMET_TUNING_FILE's contents, every line parsed and checked as a layer's read of the
 * file checks it, less the limits that need a GPU's SM count: 0, or -1 with `why` naming
 * the line, the field, its value and its limit. Defined by the tuning file's reader
 * (patterns/tune.c), so the table and the layer read one grammar. */
int cometi_tuning_file_check(const char *path, char *why, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* COMET_PARAMS_H */
