/*
 * id_file.h - the id file of an external launch (id_file.c): rank 0 writes the NCCL
 * unique id with the run's id and who wrote it, atomically (a temp file linked to the
 * name: a reader never sees a partial file, of two writers one wins), and removes it when
 * it exits by any road; the other ranks wait for this run's file and report a stale,
 * foreign or malformed one at once, naming the file and what to do.
 */
#ifndef COMET_ID_FILE_H
#define COMET_ID_FILE_H

#include <nccl.h>

#ifdef __cplusplus
extern "C" {
#endif

/* This run's id, from the launcher's environment (COMET_RUN_ID, torchrun's, Slurm's, an
 * MPI's...), or none (made: rank 0 makes one, the others have none to compare). */
typedef struct cometi_run_id {
    char text[200];
    int made;
} cometi_run_id_t;

void cometi_id_run(cometi_run_id_t *r);
/* Rank 0: a new unique id into *id, published at `path`. 0, or an exit code with `report` set. */
int cometi_id_publish(const char *path, const cometi_run_id_t *ours, ncclUniqueId *id, char *report, size_t len);
/* Ranks > 0: this run's id from `path`, waiting up to timeout_s (0: 120 s). 0, or 1 with `report` set. */
int cometi_id_wait(const char *path, const cometi_run_id_t *ours, int rank, int timeout_s, ncclUniqueId *id,
                   char *report, size_t len);
/* Rank 0, once every rank has the id: the file is no longer removed at exit by this process. */
void cometi_id_release(void);

#ifdef __cplusplus
}
#endif

#endif /* COMET_ID_FILE_H */
