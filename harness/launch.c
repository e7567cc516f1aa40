/*
 * launch.c - one process per GPU. The local launcher forks the ranks from a parent
 * that never touches CUDA or NCCL (a CUDA context does not survive fork); rank 0
 * makes the NCCL unique id and the parent relays it. A failed rank stops the others,
 * and the parent says which rank failed and why. See launch.h.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "id_file.h"
#include "launch.h"

#define MAX_LOCAL_RANKS 72
#define REASON_LEN 400

static int reason_fd = -1;

void cometi_rank_reason(const char *fmt, ...)
{
    char buf[REASON_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (reason_fd >= 0) {
        ssize_t unused = write(reason_fd, buf, strlen(buf));
        (void)unused;
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int read_full(int fd, void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}

int cometi_write_full(int fd, const void *buf, size_t n)
{
    size_t put = 0;
    while (put < n) {
        ssize_t r = write(fd, (const char *)buf + put, n - put);
        if (r < 0 && errno == EINTR) continue;
        if (r == 0) errno = EIO;
        if (r <= 0) return -1;
        put += (size_t)r;
    }
    return 0;
}

int cometi_no_gpu(int err, char *why, size_t len)
{
    const cudaError_t e = (cudaError_t)err;
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    int driver = 0, runtime = 0;
    switch (e) {
    case cudaErrorNoDevice:
        snprintf(why, len, "no GPU found: no CUDA device is visible%s%s%s", visible ? " (CUDA_VISIBLE_DEVICES=\"" : "",
                 visible ? visible : "", visible ? "\")" : "");
        return 1;
    case cudaErrorInsufficientDriver:
        /* The runtime says this for no driver at all as for an old one; the driver's
         * version (0 where none is installed) tells them apart. */
        cudaDriverGetVersion(&driver);
        cudaRuntimeGetVersion(&runtime);
        if (driver == 0) snprintf(why, len, "no GPU found: no NVIDIA driver is installed");
        else snprintf(why, len, "no usable GPU: the NVIDIA driver supports CUDA %d.%d, older than the CUDA %d.%d "
                      "runtime comet is built with; update the driver", driver / 1000, driver % 1000 / 10,
                      runtime / 1000, runtime % 1000 / 10);
        return 1;
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorSystemNotReady:
    case cudaErrorCompatNotSupportedOnDevice:
        snprintf(why, len, "no usable GPU: %s", cudaGetErrorString(e));
        return 1;
    default:
        return 0;
    }
}

int cometi_probe_gpus(char *why, size_t why_len)
{
    int fds[2];
    if (why && why_len) why[0] = '\0';
    if (pipe(fds) != 0) return 0;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return 0;
    }
    if (pid == 0) {
        /* Count Hopper devices only: the kernels are built for sm_90a. */
        close(fds[0]);
        int all = 0, n = 0;
        char msg[200] = "";
        cudaError_t e = cudaGetDeviceCount(&all);
        if (e != cudaSuccess) {
            if (!cometi_no_gpu(e, msg, sizeof(msg)))
                snprintf(msg, sizeof(msg), "no usable GPU: cudaGetDeviceCount: %s", cudaGetErrorString(e));
            all = 0;
        }
        for (int d = 0; d < all; d++) {
            int major = 0;
            if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) == cudaSuccess && major == 9) n++;
        }
        if (all > n) snprintf(msg, sizeof(msg), "%s%d CUDA device%s visible, %d of them Hopper (sm_90)",
                              n ? "" : "no usable GPU: ", all, all > 1 ? "s" : "", n);
        cometi_write_full(fds[1], &n, sizeof(n));
        cometi_write_full(fds[1], msg, sizeof(msg));
        _exit(0);
    }
    close(fds[1]);
    int n = 0;
    char msg[200] = "";
    if (read_full(fds[0], &n, sizeof(n)) != 0) n = 0;
    if (read_full(fds[0], msg, sizeof(msg)) != 0) snprintf(msg, sizeof(msg), "the GPU probe process crashed");
    close(fds[0]);
    waitpid(pid, NULL, 0);
    if (why && why_len) snprintf(why, why_len, "%s", msg[0] ? msg : n ? "" : "no GPU found: no CUDA device is visible");
    return n;
}

typedef struct rank_proc {
    pid_t pid;
    int id_wr;     /* parent -> rank: the unique id (ranks > 0) */
    int reason_rd; /* rank -> parent: why it failed */
    int done, status;
} rank_proc_t;

static void describe_exit(int status, char *buf, size_t len)
{
    if (WIFEXITED(status)) snprintf(buf, len, "exit code %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status)) snprintf(buf, len, "killed by signal %d (%s)", WTERMSIG(status),
                                           strsignal(WTERMSIG(status)));
    else snprintf(buf, len, "status 0x%x", status);
}

static int failed(int status) { return !WIFEXITED(status) || WEXITSTATUS(status) != 0; }

/* Rank body: close what belongs to other ranks, get the id, run. Never returns. */
static void run_rank(int r, int nranks, rank_proc_t *procs, int id_rd, int id_from0_wr, int reason_wr,
                     cometi_rank_main_t fn, void *arg)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the launcher */
    for (int q = 0; q < r; q++) {
        close(procs[q].id_wr);
        close(procs[q].reason_rd);
    }
    reason_fd = reason_wr;
    cometi_rank_ctx_t ctx;
    memset(&ctx, 0, sizeof(ctx));
    ctx.rank = r;
    ctx.nranks = nranks;
    ctx.local_rank = r;
    if (r == 0) {
        ncclResult_t res = ncclGetUniqueId(&ctx.id);
        if (res != ncclSuccess) {
            cometi_rank_reason("ncclGetUniqueId: %s", ncclGetErrorString(res));
            _exit(1);
        }
        if (cometi_write_full(id_from0_wr, &ctx.id, sizeof(ctx.id)) != 0) _exit(1);
    } else if (read_full(id_rd, &ctx.id, sizeof(ctx.id)) != 0) {
        cometi_rank_reason("never received the NCCL unique id (rank 0 stopped first)");
        _exit(1);
    }
    close(id_from0_wr);
    if (id_rd >= 0) close(id_rd);
    int code = fn(&ctx, arg);
    fflush(stdout);
    fflush(stderr);
    _exit(code);
}

static void stop_all(rank_proc_t *procs, int n, int sig)
{
    for (int r = 0; r < n; r++)
        if (procs[r].pid > 0 && !procs[r].done) kill(procs[r].pid, sig);
}

int cometi_launch_local(int nranks, cometi_rank_main_t fn, void *arg, int timeout_s, char *report,
                        size_t report_len)
{
    rank_proc_t procs[MAX_LOCAL_RANKS];
    if (report && report_len) report[0] = '\0';
    if (nranks < 1 || nranks > MAX_LOCAL_RANKS) {
        snprintf(report, report_len, "ranks = %d: must be 1..%d", nranks, MAX_LOCAL_RANKS);
        return 2;
    }
    memset(procs, 0, sizeof(procs));
    int id_from0[2];
    if (pipe(id_from0) != 0) {
        snprintf(report, report_len, "pipe: %s", strerror(errno));
        return 2;
    }
    fflush(stdout);
    fflush(stderr);
    /* A rank that dies before the id is relayed closes its pipe: report it, do not die of
     * SIGPIPE. */
    void (*old_pipe)(int) = signal(SIGPIPE, SIG_IGN);
    int started = 0;
    for (int r = 0; r < nranks; r++) {
        int idp[2] = {-1, -1}, rp[2];
        if ((r > 0 && pipe(idp) != 0) || pipe(rp) != 0) break;
        pid_t pid = fork();
        if (pid < 0) break;
        if (pid == 0) {
            close(id_from0[0]);
            if (idp[1] >= 0) close(idp[1]);
            close(rp[0]);
            run_rank(r, nranks, procs, idp[0], id_from0[1], rp[1], fn, arg);
        }
        if (idp[0] >= 0) close(idp[0]);
        close(rp[1]);
        procs[r].pid = pid;
        procs[r].id_wr = idp[1];
        procs[r].reason_rd = rp[0];
        fcntl(rp[0], F_SETFL, O_NONBLOCK);
        started++;
    }
    close(id_from0[1]);

    double start = now_s(), kill_at = 0;
    int first_fail = -1, alive = started, id_sent = 0, timed_out = 0;
    if (started < nranks) {
        snprintf(report, report_len, "could not start rank %d: %s", started, strerror(errno));
        first_fail = started;
        stop_all(procs, started, SIGTERM);
        kill_at = now_s() + 3;
    }
    while (alive > 0) {
        if (!id_sent && first_fail < 0) {
            struct pollfd pfd = {id_from0[0], POLLIN, 0};
            if (poll(&pfd, 1, 20) > 0) {
                ncclUniqueId id;
                if (read_full(id_from0[0], &id, sizeof(id)) == 0) {
                    for (int r = 1; r < nranks; r++) cometi_write_full(procs[r].id_wr, &id, sizeof(id));
                }
                for (int r = 1; r < nranks; r++) close(procs[r].id_wr);
                id_sent = 1;
            }
        } else {
            usleep(20000);
        }
        for (int r = 0; r < started; r++) { /* only our ranks: the caller may have other children */
            int status;
            if (procs[r].done || waitpid(procs[r].pid, &status, WNOHANG) != procs[r].pid) continue;
            procs[r].done = 1;
            procs[r].status = status;
            alive--;
            if (failed(status) && first_fail < 0 && !timed_out) {
                first_fail = r;
                stop_all(procs, started, SIGTERM);
                kill_at = now_s() + 3;
            }
        }
        if (timeout_s > 0 && !timed_out && now_s() - start > timeout_s) {
            timed_out = 1;
            stop_all(procs, started, SIGTERM);
            kill_at = now_s() + 3;
        }
        if (kill_at > 0 && now_s() > kill_at) stop_all(procs, started, SIGKILL);
    }
    if (!id_sent)
        for (int r = 1; r < started; r++) close(procs[r].id_wr);
    close(id_from0[0]);

    int rc = 0;
    if (first_fail >= 0 && first_fail < started) {
        char how[96], reason[REASON_LEN + 1] = "";
        const int status = procs[first_fail].status;
        describe_exit(status, how, sizeof(how));
        ssize_t got = read(procs[first_fail].reason_rd, reason, REASON_LEN);
        reason[got > 0 ? got : 0] = '\0';
        snprintf(report, report_len, "rank %d of %d failed (%s)%s%s; the other ranks were stopped", first_fail,
                 nranks, how, reason[0] ? ": " : "", reason);
        rc = WIFEXITED(status) ? WEXITSTATUS(status) : 1; /* the rank's own code says what failed */
    } else if (first_fail >= 0) {
        rc = 1;
    } else if (timed_out) {
        snprintf(report, report_len, "the %d ranks did not finish within %d s and were stopped", nranks, timeout_s);
        rc = 1;
    }
    for (int r = 0; r < started; r++) close(procs[r].reason_rd);
    signal(SIGPIPE, old_pipe);
    return rc;
}

static int env_int(const char *name, int *out)
{
    const char *v = getenv(name);
    if (!v || !*v) return 0;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < 0 || x > 1000000) return 0;
    *out = (int)x;
    return 1;
}

int cometi_launch_external(const char *id_file, cometi_rank_main_t fn, void *arg, int timeout_s, char *report,
                           size_t report_len)
{
    cometi_rank_ctx_t ctx;
    memset(&ctx, 0, sizeof(ctx));
    if (report && report_len) report[0] = '\0';
    if (!env_int("RANK", &ctx.rank) || !env_int("WORLD_SIZE", &ctx.nranks) || ctx.nranks < 1 ||
        ctx.rank >= ctx.nranks) {
        snprintf(report, report_len, "external launch needs RANK and WORLD_SIZE in the environment, with "
                 "0 <= RANK < WORLD_SIZE (RANK=%s, WORLD_SIZE=%s)", getenv("RANK") ? getenv("RANK") : "unset",
                 getenv("WORLD_SIZE") ? getenv("WORLD_SIZE") : "unset");
        return 2;
    }
    if (!env_int("LOCAL_RANK", &ctx.local_rank)) ctx.local_rank = ctx.rank;
    if (!id_file || !*id_file) {
        snprintf(report, report_len, "external launch needs an id file (--id-file PATH) on storage every rank sees");
        return 2;
    }
    cometi_run_id_t ours;
    cometi_id_run(&ours);
    int rc = ctx.rank == 0 ? cometi_id_publish(id_file, &ours, &ctx.id, report, report_len)
                           : cometi_id_wait(id_file, &ours, ctx.rank, timeout_s, &ctx.id, report, report_len);
    if (rc) return rc;
    rc = fn(&ctx, arg);
    if (ctx.rank == 0) cometi_id_release(); /* every rank has the id, or never will */
    return rc;
}
