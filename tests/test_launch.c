/*
 * test_launch.c - the launcher (no GPU needed): one process per rank, a failed or crashed
 * rank stopping the others, the timeout; and under an external launcher the id file: the
 * run it belongs to, stale and malformed files reported at once, removed at exit by any
 * road, write errors, and one writer winning a race.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "comet.h"
#include "../harness/launch.h"
#include "testutil.h"

/* ---- launcher ---- */

typedef struct launch_probe {
    int rank_seen[8];
    int nranks_seen[8];
    unsigned char id[8][sizeof(ncclUniqueId)];
} launch_probe_t;

static int record_rank(const cometi_rank_ctx_t *ctx, void *arg)
{
    launch_probe_t *p = arg;
    p->rank_seen[ctx->rank] = ctx->rank + 100;
    p->nranks_seen[ctx->rank] = ctx->nranks;
    memcpy(p->id[ctx->rank], &ctx->id, sizeof(ncclUniqueId));
    return 0;
}

int test_launch_all_ranks_succeed(void)
{
    launch_probe_t *p = mmap(NULL, sizeof(*p), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED);
    memset(p, 0, sizeof(*p));
    char report[512];
    int rc = cometi_launch_local(3, record_rank, p, 20, report, sizeof(report));
    if (rc) printf("report: %s\n", report);
    CHECK_EQ(rc, 0);
    for (int r = 0; r < 3; r++) {
        CHECK_EQ(p->rank_seen[r], r + 100);
        CHECK_EQ(p->nranks_seen[r], 3);
        CHECK(memcmp(p->id[r], p->id[0], sizeof(ncclUniqueId)) == 0);
    }
    static const unsigned char zero[sizeof(ncclUniqueId)];
    CHECK(memcmp(p->id[0], zero, sizeof(zero)) != 0);
    return 0;
}

static int rank1_fails(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    if (ctx->rank == 1) {
        cometi_rank_reason("boom: the test made rank 1 fail");
        return 3;
    }
    sleep(60); /* would hang the test if the launcher did not stop it */
    return 0;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int test_launch_failed_rank_stops_others(void)
{
    char report[512];
    double t0 = mono_s();
    int rc = cometi_launch_local(4, rank1_fails, NULL, 0, report, sizeof(report));
    double took = mono_s() - t0;
    printf("report: %s (%.2f s)\n", report, took);
    CHECK_EQ(rc, 3); /* the failed rank's own exit code: the tool's codes say what failed */
    CHECK_CONTAINS(report, "rank 1 of 4 failed (exit code 3): boom: the test made rank 1 fail");
    CHECK(took < 10);
    return 0;
}

static int rank2_crashes(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    if (ctx->rank == 2) raise(SIGSEGV);
    sleep(60);
    return 0;
}

int test_launch_crashed_rank_is_reported(void)
{
    char report[512];
    int rc = cometi_launch_local(3, rank2_crashes, NULL, 0, report, sizeof(report));
    printf("report: %s\n", report);
    CHECK_EQ(rc, 1);
    CHECK_CONTAINS(report, "rank 2 of 3 failed (killed by signal 11");
    return 0;
}

static int sleeps(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)ctx, (void)arg;
    sleep(60);
    return 0;
}

int test_launch_timeout_stops_ranks(void)
{
    char report[512];
    double t0 = mono_s();
    int rc = cometi_launch_local(2, sleeps, NULL, 1, report, sizeof(report));
    CHECK_EQ(rc, 1);
    CHECK_CONTAINS(report, "did not finish within 1 s");
    CHECK(mono_s() - t0 < 10);
    return 0;
}

/* No usable GPU, in words a user reads: "no GPU found" for no device and for no driver at
 * all (where the runtime itself says "CUDA driver version is insufficient"), the other
 * errors left to their callers; the probe says the same with no device visible. */
int test_launch_no_gpu_words(void)
{
    char why[300];
    unsetenv("CUDA_VISIBLE_DEVICES");
    CHECK_EQ(cometi_no_gpu(cudaErrorNoDevice, why, sizeof(why)), 1);
    CHECK(strcmp(why, "no GPU found: no CUDA device is visible") == 0);
    setenv("CUDA_VISIBLE_DEVICES", "", 1);
    CHECK_EQ(cometi_no_gpu(cudaErrorNoDevice, why, sizeof(why)), 1);
    CHECK_CONTAINS(why, "no GPU found: no CUDA device is visible (CUDA_VISIBLE_DEVICES=\"\")");
    int driver = -1;
    cudaDriverGetVersion(&driver);
    CHECK_EQ(cometi_no_gpu(cudaErrorInsufficientDriver, why, sizeof(why)), 1);
    printf("driver %d: %s\n", driver, why);
    CHECK_CONTAINS(why, driver == 0 ? "no GPU found: no NVIDIA driver is installed" : "no usable GPU: the NVIDIA "
                                                                                      "driver supports CUDA");
    CHECK(!strstr(why, "insufficient"));
    CHECK_EQ(cometi_no_gpu(cudaErrorDevicesUnavailable, why, sizeof(why)), 1);
    CHECK_CONTAINS(why, "no usable GPU: ");
    CHECK_EQ(cometi_no_gpu(cudaErrorMemoryAllocation, why, sizeof(why)), 0);
    CHECK_EQ(cometi_no_gpu(cudaErrorInvalidValue, why, sizeof(why)), 0);
    /* The probe, with no device visible (driver or none). */
    CHECK_EQ(cometi_probe_gpus(why, sizeof(why)), 0);
    printf("probe: %s\n", why);
    CHECK_CONTAINS(why, "no GPU found: ");
    return 0;
}

/* ---- external launch: the id file ---- */

static int returns_rank_plus_40(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)arg;
    return 40 + ctx->rank + 10 * ctx->local_rank;
}

/* What ranks forked by a test share with it. */
typedef struct ext_shared {
    unsigned char id[2][sizeof(ncclUniqueId)];
    char report[16][600];
    int go, release, held; /* __atomic: start together; let holders return; holders running */
} ext_shared_t;

static ext_shared_t *ext_shared(void)
{
    ext_shared_t *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) return NULL;
    memset(sh, 0, sizeof(*sh));
    return sh;
}

static void set_rank(int rank, int world)
{
    char v[16];
    snprintf(v, sizeof(v), "%d", rank);
    setenv("RANK", v, 1);
    setenv("LOCAL_RANK", v, 1);
    snprintf(v, sizeof(v), "%d", world);
    setenv("WORLD_SIZE", v, 1);
}

/* The tests set the run id themselves: none may come from a launcher the tests run under. */
static void clear_run_ids(void)
{
    static const char *names[] = {"COMET_RUN_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID",
                                  "SLURM_STEP_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "FLUX_JOB_ID",
                                  "LSB_JOBID", "PBS_JOBID"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) unsetenv(names[i]);
}

/* A rank that records its id and holds on (rank 0: keeps its file) until the test lets go. */
static int hold_until_released(const cometi_rank_ctx_t *ctx, void *arg)
{
    ext_shared_t *sh = arg;
    memcpy(sh->id[ctx->rank], &ctx->id, sizeof(ctx->id));
    __atomic_add_fetch(&sh->held, 1, __ATOMIC_SEQ_CST);
    for (int i = 0; i < 20000 && !__atomic_load_n(&sh->release, __ATOMIC_SEQ_CST); i++) usleep(1000);
    return 40 + ctx->rank;
}

/* A rank that records its id and returns at once. */
static int record_id(const cometi_rank_ctx_t *ctx, void *arg)
{
    ext_shared_t *sh = arg;
    memcpy(sh->id[ctx->rank], &ctx->id, sizeof(ctx->id));
    return 40 + ctx->rank;
}

/* cometi_launch_external as `rank` of 2 in a child, after sh->go when `sh` is given;
 * its report lands in sh->report[slot]. Exits with the launch's code. */
static pid_t spawn_rank(int rank, const char *path, cometi_rank_main_t fn, ext_shared_t *sh, int slot,
                        void (*before)(void))
{
    pid_t pid = fork();
    if (pid != 0) return pid;
    set_rank(rank, 2);
    if (before) before();
    while (sh && !__atomic_load_n(&sh->go, __ATOMIC_SEQ_CST)) usleep(100);
    char report[600];
    int rc = cometi_launch_external(path, fn, sh, 30, report, sizeof(report));
    if (sh) snprintf(sh->report[slot], sizeof(sh->report[slot]), "%s", report);
    _exit(rc);
}

static int wait_status(pid_t pid)
{
    int status = -1;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    return status;
}

static int exists(const char *path) { return access(path, F_OK) == 0; }

static int wait_until_exists(const char *path)
{
    for (int i = 0; i < 2000 && !exists(path); i++) usleep(5000);
    return exists(path);
}

/* Entries of `dir` whose name holds `part`. */
static int count_entries(const char *dir, const char *part)
{
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += strstr(e->d_name, part) != NULL;
    if (d) closedir(d);
    return n;
}

static void remove_dir(const char *dir)
{
    char p[600];
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
        if (unlink(p) != 0) rmdir(p);
    }
    if (d) closedir(d);
    rmdir(dir);
}

static int make_dir(char *dir, size_t len)
{
    snprintf(dir, len, "/tmp/comet_idtest_XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static pid_t stale_writer; /* the pid that wrote the last stale file */

static int dies_by_sigkill(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)ctx, (void)arg;
    raise(SIGKILL);
    return 0;
}

/* What a run killed hard leaves: rank 0 published its file, then died of SIGKILL. */
static int leave_stale_file(const char *path)
{
    pid_t writer = spawn_rank(0, path, dies_by_sigkill, NULL, 0, NULL);
    int status = wait_status(writer);
    stale_writer = writer;
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    CHECK(exists(path));
    return 0;
}

/* A reader's launch, timed: a file that will never be this run's must be reported at
 * once, far inside the 30 s it would wait for one to appear. */
static int read_as_rank1(const char *path, char *report, size_t len, double *took)
{
    set_rank(1, 2);
    double t0 = mono_s();
    int rc = cometi_launch_external(path, returns_rank_plus_40, NULL, 30, report, len);
    *took = mono_s() - t0;
    printf("rank 1 (%.2f s): %s\n", *took, report);
    return rc;
}

int test_launch_external_env(void)
{
    char report[600], dir[64], path[128];
    clear_run_ids();
    unsetenv("RANK");
    setenv("WORLD_SIZE", "2", 1);
    CHECK_EQ(cometi_launch_external("/tmp/x", returns_rank_plus_40, NULL, 5, report, sizeof(report)), 2);
    CHECK_CONTAINS(report, "RANK=unset");
    CHECK(make_dir(dir, sizeof(dir)) == 0);
    snprintf(path, sizeof(path), "%s/comet.id", dir);
    set_rank(0, 1);
    CHECK_EQ(cometi_launch_external(NULL, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 2);
    CHECK_CONTAINS(report, "--id-file");
    /* A world of one: rank 0 runs, and its file is gone when it returns. */
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 40);
    CHECK(!exists(path));
    /* Rank 1 takes the id of a rank 0 that holds its file. */
    ext_shared_t *sh = ext_shared();
    CHECK(sh);
    sh->go = 1;
    pid_t r0 = spawn_rank(0, path, hold_until_released, sh, 0, NULL);
    CHECK(wait_until_exists(path));
    set_rank(1, 2);
    CHECK_EQ(cometi_launch_external(path, record_id, sh, 5, report, sizeof(report)), 41);
    CHECK(memcmp(sh->id[0], sh->id[1], sizeof(ncclUniqueId)) == 0);
    /* A second rank 0, while the first holds the file: no run id to compare, so another run. */
    set_rank(0, 2);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 2);
    printf("second rank 0: %s\n", report);
    CHECK_CONTAINS(report, path);
    CHECK_CONTAINS(report, "belongs to another run, still in progress");
    CHECK_CONTAINS(report, "set COMET_RUN_ID");
    __atomic_store_n(&sh->release, 1, __ATOMIC_SEQ_CST);
    int status = wait_status(r0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 40);
    CHECK(!exists(path));
    set_rank(1, 2);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 1, report, sizeof(report)), 1);
    CHECK_CONTAINS(report, "did not appear within 1 s");
    /* With a run id: the same holds, and the second rank 0 is told it is one of this run. */
    setenv("COMET_RUN_ID", "run-a", 1);
    sh->release = 0;
    r0 = spawn_rank(0, path, hold_until_released, sh, 0, NULL);
    CHECK(wait_until_exists(path));
    CHECK_EQ(cometi_launch_external(path, record_id, sh, 5, report, sizeof(report)), 41);
    CHECK(memcmp(sh->id[0], sh->id[1], sizeof(ncclUniqueId)) == 0);
    set_rank(0, 2);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 2);
    CHECK_CONTAINS(report, "exists already with this run's id: is a second rank 0 running?");
    CHECK_CONTAINS(report, "give one process of a run RANK=0");
    setenv("COMET_RUN_ID", "run-b", 1);
    double took;
    CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
    CHECK_CONTAINS(report, "belongs to another run, still in progress");
    CHECK_CONTAINS(report, "name another path for this run");
    CHECK(took < 2);
    __atomic_store_n(&sh->release, 1, __ATOMIC_SEQ_CST);
    status = wait_status(r0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 40);
    CHECK(!exists(path));
    remove_dir(dir);
    return 0;
}

/* Change the writer's boot id in the file, as if another machine had written it: then
 * nobody here can tell whether the writer still runs. */
static int as_if_from_another_host(const char *path)
{
    char boot[40] = "", buf[4096];
    FILE *b = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!b || !fgets(boot, sizeof(boot), b) || strlen(boot) < 36) return -1;
    fclose(b);
    int fd = open(path, O_RDWR);
    ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof(buf));
    char *at = n > 0 ? memmem(buf, (size_t)n, boot, 36) : NULL;
    if (!at) return -1;
    *at = *at == '0' ? '1' : '0';
    ssize_t w = pwrite(fd, buf, (size_t)n, 0);
    close(fd);
    return w == n ? 0 : -1;
}

/* Give the file's dead writer's pid to a live process (init, started long before), as
 * pid reuse would: its start time still tells them apart. */
static int as_if_pid_reused(const char *path)
{
    char buf[4096];
    int64_t old = stale_writer, now = 1;
    int fd = open(path, O_RDWR);
    ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof(buf));
    char *at = n > 0 ? memmem(buf, (size_t)n, &old, sizeof(old)) : NULL;
    if (at) memcpy(at, &now, sizeof(now));
    ssize_t w = at ? pwrite(fd, buf, (size_t)n, 0) : -1;
    if (fd >= 0) close(fd);
    return w == n ? 0 : -1;
}

int test_launch_id_file_stale_run(void)
{
    char report[600], dir[64], path[128], rm[160];
    double took;
    clear_run_ids();
    CHECK(make_dir(dir, sizeof(dir)) == 0);
    snprintf(path, sizeof(path), "%s/comet.id", dir);
    snprintf(rm, sizeof(rm), "rm %s", path);
    /* Run a was killed hard; run b starts with the same path. */
    setenv("COMET_RUN_ID", "run-a", 1);
    CHECK(leave_stale_file(path) == 0);
    setenv("COMET_RUN_ID", "run-b", 1);
    set_rank(0, 2);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 30, report, sizeof(report)), 2);
    printf("rank 0: %s\n", report);
    CHECK_CONTAINS(report, path);
    CHECK_CONTAINS(report, "was left by a run whose rank 0 exited without removing it");
    CHECK_CONTAINS(report, "run id \"COMET_RUN_ID=run-a\"");
    CHECK_CONTAINS(report, "this run's id: COMET_RUN_ID=run-b");
    CHECK_CONTAINS(report, rm);
    CHECK(exists(path)); /* named, not removed: it is not this rank's to remove */
    CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
    CHECK_CONTAINS(report, "was left by a run whose rank 0 exited without removing it");
    CHECK_CONTAINS(report, rm);
    CHECK(took < 2);
    /* A rank of run a itself: the id is its run's, but nobody will answer it. */
    setenv("COMET_RUN_ID", "run-a", 1);
    CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
    CHECK_CONTAINS(report, "has this run's id, but its writer has exited");
    CHECK(took < 2);
    CHECK(as_if_pid_reused(path) == 0);
    CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
    CHECK_CONTAINS(report, "has this run's id, but its writer has exited");
    /* Written on another host: run b's ranks still know it is not theirs; run a's take it. */
    if (as_if_from_another_host(path) == 0) {
        setenv("COMET_RUN_ID", "run-b", 1);
        CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
        CHECK_CONTAINS(report, "is from another run");
        CHECK_CONTAINS(report, rm);
        CHECK(took < 2);
        setenv("COMET_RUN_ID", "run-a", 1);
        CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 51);
    } else {
        printf("no boot id to change: the other-host case is not checked\n");
    }
    CHECK(unlink(path) == 0);
    /* No run id from a launcher: the writer's exit is what shows the file stale, and the
     * report says how to give runs an id. */
    unsetenv("COMET_RUN_ID");
    CHECK(leave_stale_file(path) == 0);
    set_rank(0, 2);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 30, report, sizeof(report)), 2);
    printf("rank 0: %s\n", report);
    CHECK_CONTAINS(report, "was left by a run whose rank 0 exited without removing it");
    CHECK_CONTAINS(report, "set COMET_RUN_ID to one value on every rank");
    CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
    CHECK_CONTAINS(report, rm);
    CHECK(took < 2);
    /* torchrun's run id with its restart count: a later attempt does not take the id of an
     * earlier one. */
    CHECK(unlink(path) == 0);
    setenv("TORCHELASTIC_RUN_ID", "job7", 1);
    setenv("TORCHELASTIC_RESTART_COUNT", "0", 1);
    CHECK(leave_stale_file(path) == 0);
    setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);
    CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
    CHECK_CONTAINS(report, "TORCHELASTIC_RUN_ID=job7 restart 0");
    CHECK_CONTAINS(report, "this run's id: TORCHELASTIC_RUN_ID=job7 restart 1");
    remove_dir(dir);
    return 0;
}

static int write_file(const char *path, const void *buf, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int ok = fd >= 0 && write(fd, buf, n) == (ssize_t)n;
    if (fd >= 0) close(fd);
    return ok ? 0 : -1;
}

static int read_whole(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY);
    ssize_t n = fd < 0 ? -1 : read(fd, buf, cap);
    if (fd >= 0) close(fd);
    return (int)n;
}

/* A reader meets a file that is not a comet id file: reported at once, with the file and
 * what was expected, whether garbage, truncated or of another version; rank 0 alike. */
static int expect_malformed(const char *path, const char *why)
{
    char report[600];
    double took;
    CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
    CHECK_CONTAINS(report, path);
    CHECK_CONTAINS(report, "is not a comet id file");
    CHECK_CONTAINS(report, why);
    CHECK_CONTAINS(report, "expected the");
    CHECK_CONTAINS(report, "starting \"COMETID2\"");
    CHECK(took < 2);
    set_rank(0, 2);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 30, report, sizeof(report)), 2);
    CHECK_CONTAINS(report, "is not a comet id file");
    CHECK_CONTAINS(report, why);
    return 0;
}

int test_launch_id_file_malformed(void)
{
    char report[600], dir[64], path[128], good[4096], bad[4096];
    double took;
    clear_run_ids();
    setenv("COMET_RUN_ID", "run-m", 1);
    CHECK(make_dir(dir, sizeof(dir)) == 0);
    snprintf(path, sizeof(path), "%s/comet.id", dir);
    CHECK(leave_stale_file(path) == 0); /* a genuine file's bytes, to spoil */
    int n = read_whole(path, good, sizeof(good));
    CHECK(n > 100);
    CHECK(write_file(path, "hello\n", 6) == 0);
    if (expect_malformed(path, "it does not start with \"COMETID2\"")) return 1;
    CHECK(write_file(path, good, (size_t)n / 2) == 0);
    if (expect_malformed(path, "truncated?")) return 1;
    memcpy(bad, good, (size_t)n);
    bad[n] = 'x';
    CHECK(write_file(path, bad, (size_t)n + 1) == 0);
    if (expect_malformed(path, "it is longer than")) return 1;
    memcpy(bad, "COMETID1", 8);
    CHECK(write_file(path, bad, (size_t)n) == 0);
    if (expect_malformed(path, "from another version of comet (\"COMETID1\"")) return 1;
    memcpy(bad, good, (size_t)n);
    memset(bad + 8, 'z', 200); /* the run id, no longer a string */
    CHECK(write_file(path, bad, (size_t)n) == 0);
    if (expect_malformed(path, "garbled")) return 1;
    /* Something that cannot be read: named with the reason. */
    CHECK(unlink(path) == 0 && mkdir(path, 0700) == 0);
    CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
    CHECK_CONTAINS(report, "cannot read id file");
    CHECK_CONTAINS(report, strerror(EISDIR));
    CHECK(took < 2);
    CHECK(rmdir(path) == 0);
    /* Empty: what a writer without hard links shows for a moment, so a short grace, then
     * reported, still far inside the wait limit. */
    CHECK(write_file(path, "", 0) == 0);
    CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
    CHECK_CONTAINS(report, "it stayed empty for 5 s");
    CHECK(took > 4 && took < 10);
    remove_dir(dir);
    return 0;
}

/* Rank 0's body ends in each of the ways a process ends; its file must go every time. */
enum { END_RETURN_OK, END_RETURN_FAIL, END_EXIT, END_SIGTERM, END_SIGSEGV, END_ABORT, END_CHILD_EXITS, END_COUNT };
static int end_how;
static const char *end_path;

static int ends_as_told(const cometi_rank_ctx_t *ctx, void *arg)
{
    (void)ctx, (void)arg;
    if (!exists(end_path)) return 99; /* the file is there while the body runs */
    switch (end_how) {
    case END_RETURN_FAIL: return 7;
    case END_EXIT: exit(5);
    case END_SIGTERM: raise(SIGTERM); break;
    case END_SIGSEGV: raise(SIGSEGV); break;
    case END_ABORT: abort();
    case END_CHILD_EXITS: { /* a child forked by the body ends with exit(): the file stays */
        pid_t c = fork();
        if (c == 0) exit(0);
        wait_status(c);
        return exists(end_path) ? 0 : 98;
    }
    }
    return 0;
}

int test_launch_id_file_removed_at_exit(void)
{
    char dir[64], path[128], report[600];
    clear_run_ids();
    CHECK(make_dir(dir, sizeof(dir)) == 0);
    snprintf(path, sizeof(path), "%s/comet.id", dir);
    end_path = path;
    static const int sig[END_COUNT] = {[END_SIGTERM] = SIGTERM, [END_SIGSEGV] = SIGSEGV, [END_ABORT] = SIGABRT};
    static const int code[END_COUNT] = {[END_RETURN_FAIL] = 7, [END_EXIT] = 5};
    for (end_how = 0; end_how < END_COUNT; end_how++) {
        int status = wait_status(spawn_rank(0, path, ends_as_told, NULL, 0, NULL));
        if (sig[end_how]) CHECK(WIFSIGNALED(status) && WTERMSIG(status) == sig[end_how]); /* ends as it would have */
        else CHECK(WIFEXITED(status) && WEXITSTATUS(status) == code[end_how]);
        CHECK(!exists(path));
    }
    /* Stopped from outside, as a launcher stops its ranks. */
    ext_shared_t *sh = ext_shared();
    CHECK(sh);
    sh->go = 1;
    pid_t r0 = spawn_rank(0, path, hold_until_released, sh, 0, NULL);
    CHECK(wait_until_exists(path));
    for (int i = 0; i < 2000 && !__atomic_load_n(&sh->held, __ATOMIC_SEQ_CST); i++) usleep(1000);
    kill(r0, SIGTERM);
    int status = wait_status(r0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM);
    CHECK(!exists(path));
    /* In this process: the return path removes it and leaves the signals as they were. */
    set_rank(0, 1);
    end_how = END_RETURN_OK;
    CHECK_EQ(cometi_launch_external(path, ends_as_told, NULL, 5, report, sizeof(report)), 0);
    CHECK(!exists(path));
    struct sigaction sa;
    CHECK(sigaction(SIGTERM, NULL, &sa) == 0 && sa.sa_handler == SIG_DFL);
    CHECK_EQ(count_entries(dir, ".tmp."), 0);
    remove_dir(dir);
    return 0;
}

static void tiny_file_limit(void)
{
    struct rlimit rl = {100, 100}; /* the id file is larger: its write fails midway */
    signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &rl);
}

int test_launch_id_file_write_errors(void)
{
    char dir[64], path[128], report[600];
    double took;
    clear_run_ids();
    CHECK(make_dir(dir, sizeof(dir)) == 0);
    /* A directory that does not exist: named, with the reason, by writer and reader. */
    snprintf(path, sizeof(path), "%s/no_such_dir/comet.id", dir);
    set_rank(0, 2);
    CHECK_EQ(cometi_launch_external(path, returns_rank_plus_40, NULL, 5, report, sizeof(report)), 2);
    printf("rank 0: %s\n", report);
    CHECK_CONTAINS(report, path);
    CHECK_CONTAINS(report, strerror(ENOENT));
    CHECK_EQ(read_as_rank1(path, report, sizeof(report), &took), 1);
    CHECK_CONTAINS(report, path);
    CHECK_CONTAINS(report, strerror(ENOENT));
    CHECK(took < 2);
    CHECK_EQ(count_entries(dir, ""), 2); /* "." and "..": nothing left behind */
    /* A write that fails after the temp file exists: the temp goes, the reason is named. */
    snprintf(path, sizeof(path), "%s/comet.id", dir);
    ext_shared_t *sh = ext_shared();
    CHECK(sh);
    sh->go = 1;
    int status = wait_status(spawn_rank(0, path, returns_rank_plus_40, sh, 0, tiny_file_limit));
    printf("rank 0: %s\n", sh->report[0]);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 1);
    CHECK_CONTAINS(sh->report[0], path);
    CHECK_CONTAINS(sh->report[0], strerror(EFBIG));
    CHECK_EQ(count_entries(dir, ""), 2);
    remove_dir(dir);
    return 0;
}

/* Refuse link(2) as a file system without hard links does, so the claim-and-rename road
 * is taken. Returns -1 where seccomp filters cannot be installed. */
static int refuse_hard_links(void)
{
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
#ifdef __NR_link
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_link, 2, 0),
#endif
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_linkat, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
    };
    struct sock_fprog prog = {(unsigned short)(sizeof(f) / sizeof(f[0])), f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0 ? 0 : -1;
}

static void no_hard_links(void)
{
    if (refuse_hard_links() != 0) _exit(TEST_SKIP);
    if (link("/nonexistent/comet", "/nonexistent/comet2") == 0 || errno != EPERM) _exit(97); /* the filter bites */
}

/* Eight rank 0s start together on one path, with a rank 1 reading: one writer wins, the
 * others are refused, the reader takes the winner's id, and nothing is left behind. */
static int race_once(const char *dir, const char *path, void (*before)(void))
{
    enum { WRITERS = 8 };
    ext_shared_t *sh = ext_shared();
    pid_t pid[WRITERS + 1];
    CHECK(sh);
    for (int i = 0; i <= WRITERS; i++) pid[i] = spawn_rank(i < WRITERS ? 0 : 1, path, i < WRITERS ? hold_until_released : record_id, sh, i,
                                                     before);
    __atomic_store_n(&sh->go, 1, __ATOMIC_SEQ_CST);
    int wins = 0, refused = 0, reader = -1, ended = 0, skipped = 0;
    while (ended < WRITERS + 1) {
        int status;
        pid_t p = wait(&status);
        int i = 0;
        while (i <= WRITERS && pid[i] != p) i++;
        CHECK(i <= WRITERS);
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        if (i == WRITERS) reader = code;
        else wins += code == 40, refused += code == 2, skipped += code == TEST_SKIP;
        if (code == 2 && refused == 1) printf("refused: %s\n", sh->report[i]);
        if (++ended == WRITERS) __atomic_store_n(&sh->release, 1, __ATOMIC_SEQ_CST); /* all but the winner */
    }
    if (skipped) return TEST_SKIP;
    if (wins != 1 || refused != WRITERS - 1 || reader != 41) printf("wins %d refused %d reader %d\n", wins, refused, reader);
    CHECK_EQ(wins, 1);
    CHECK_EQ(refused, WRITERS - 1);
    CHECK_EQ(reader, 41);
    CHECK(memcmp(sh->id[0], sh->id[1], sizeof(ncclUniqueId)) == 0);
    CHECK(!exists(path));
    CHECK_EQ(count_entries(dir, ".tmp."), 0);
    munmap(sh, sizeof(*sh));
    return 0;
}

int test_launch_id_file_one_writer_wins(void)
{
    char dir[64], path[128];
    clear_run_ids();
    setenv("COMET_RUN_ID", "race", 1);
    CHECK(make_dir(dir, sizeof(dir)) == 0);
    snprintf(path, sizeof(path), "%s/comet.id", dir);
    for (int round = 0; round < 5; round++)
        if (race_once(dir, path, NULL)) return 1;
    for (int round = 0; round < 5; round++) {
        int rc = race_once(dir, path, no_hard_links);
        if (rc == TEST_SKIP) printf("seccomp is not available: the road without hard links is not checked\n");
        if (rc) return rc == TEST_SKIP ? 0 : 1;
    }
    remove_dir(dir);
    return 0;
}
