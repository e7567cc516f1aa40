/*
 * launch.h - running one process per GPU: the local launcher the `comet` tool and
 * the GPU tests use (it forks the ranks before any CUDA call in the parent), the
 * external-launcher mode (RANK / WORLD_SIZE / LOCAL_RANK and an id file), and a GPU
 * count taken without touching CUDA in the calling process.
 */
#ifndef COMET_LAUNCH_H
#define COMET_LAUNCH_H

#include <stddef.h>
#include <nccl.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cometi_rank_ctx {
    int rank, nranks, local_rank;
    ncclUniqueId id; /* the same on every rank */
} cometi_rank_ctx_t;

/* A rank's body: returns its process exit code (0 success). It runs in its own process
 * and may use CUDA freely. */
typedef int (*cometi_rank_main_t)(const cometi_rank_ctx_t *ctx, void *arg);

/* Visible Hopper (sm_90) devices, counted in a short-lived child so this process stays free of
 * CUDA (a CUDA context does not survive fork). 0 when there is no driver or device;
 * `why` (if not NULL) then says what the probe saw, from cometi_no_gpu where it applies. */
int cometi_probe_gpus(char *why, size_t why_len);

/* Whether the CUDA error `err` (a cudaError_t) means this process has no GPU it can use: no
 * driver, no device visible, a driver older than the runtime, devices unavailable. 1 with a
 * sentence in `why` that says which ("no GPU found: no NVIDIA driver is installed", rather
 * than the runtime's "CUDA driver version is insufficient" for a machine without a driver),
 * else 0. */
int cometi_no_gpu(int err, char *why, size_t len);

/*
 * Fork `nranks` ranks and run `fn` in each. Rank 0 makes the NCCL unique id and the
 * parent passes it to the others, so the parent never touches CUDA or NCCL. When a
 * rank fails (non-zero exit or a signal) or `timeout_s` (> 0) passes, the others are
 * stopped: nobody hangs. Returns 0 when every rank exited 0; else non-zero, with a
 * sentence in `report` naming the first failed rank and why: that rank's exit code where
 * it exited with one, else 1 (a signal, the timeout, a rank that could not start) or 2
 * (`nranks` out of range, no pipe).
 */
int cometi_launch_local(int nranks, cometi_rank_main_t fn, void *arg, int timeout_s, char *report,
                        size_t report_len);

/*
 * Under an external launcher (torchrun, mpirun, srun): read RANK, WORLD_SIZE and
 * LOCAL_RANK (or LOCAL_RANK from RANK), exchange the unique id through `id_file`, and
 * run `fn` here. Returns fn's exit code, or non-zero with `report` set: 2 when the
 * environment is incomplete or rank 0 finds `id_file` in its way, 1 otherwise.
 *
 * Rank 0 writes the file atomically (a temp file beside it, fsynced, then linked to the
 * name, which fails if the name exists: readers never see a partial file, and of two
 * writers one wins) and removes it when it exits: on return, exit(), or a terminating
 * signal left at its default action (only SIGKILL leaves it behind). The file carries
 * the run id (COMET_RUN_ID, else torchrun's TORCHELASTIC_RUN_ID with its restart count,
 * Slurm's job and step, PMIx's namespace, Open MPI's, Flux's, LSF's or PBS's job id,
 * the first set; else one rank 0 makes up) and its writer (host, pid, time). The
 * other ranks wait up to `timeout_s` (0: 120 s) for a file of their run, and report at
 * once, naming the file, what it holds and what to do, a file of another run, one whose
 * writer has exited, or one that is not a comet id file. Without a run id from the
 * launcher a rank can tell a stale file only by its writer having exited, which it can
 * see on the writer's own host alone: set COMET_RUN_ID to tell runs apart everywhere.
 */
int cometi_launch_external(const char *id_file, cometi_rank_main_t fn, void *arg, int timeout_s, char *report,
                           size_t report_len);

/* Inside a rank: the one-line reason the parent shows if this rank fails. */
void cometi_rank_reason(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* write(2) until all n bytes are out (EINTR retried): 0, or -1 with errno set. */
int cometi_write_full(int fd, const void *buf, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* COMET_LAUNCH_H */
