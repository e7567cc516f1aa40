/*
 * id_file.c - the id file of an external launch (torchrun, mpirun): rank 0 publishes the
 * NCCL unique id in a file every rank sees, tagged with the run, and the other ranks wait
 * for it; whatever else is there is explained at once. See id_file.h.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "id_file.h"
#include "launch.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- the id file of an external launch ----
 *
 * Rank 0 publishes the NCCL unique id in a file every rank sees, and the others poll for
 * it. The file carries the run id, so a rank never connects with an id an earlier run
 * left, and who wrote it (host, pid, when), so a stale file can be explained. Rank 0
 * writes a temp file beside it, fsyncs it and links it to the final name: link(2) fails
 * with EEXIST when the name exists, so a reader never sees a partial file and of two
 * writers only one wins. Rank 0 removes the file when it exits, by any road. */

#define ID_MAGIC "COMETID2"
#define ID_WAIT_DEFAULT_S 120
/* How long a reader waits on an empty file: the empty claim that a file system without
 * hard links shows between its O_EXCL create and the rename of the full temp over it. */
#define ID_EMPTY_GRACE_S 5.0

typedef struct id_writer {
    char host[64];
    char boot_id[40]; /* this boot of the kernel: a pid names nothing after a reboot */
    char pid_ns[32];  /* a pid names nothing in another pid namespace */
    int64_t pid;
    uint64_t start;   /* the process's start in clock ticks since boot: pids get reused */
    int64_t written;  /* wall-clock seconds, for the messages */
} id_writer_t;

typedef struct id_file {
    char magic[8];
    char run[200];    /* the run id: the launcher's ("NAME=value") or one rank 0 made */
    int64_t run_made; /* 1: no launcher gave a run id, so rank 0 made this one up */
    id_writer_t writer;
    ncclUniqueId id;
} id_file_t;

static const char *env_set(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* This run's id from the launcher's environment. torchrun's counts its restarts, each
 * attempt a run of its own, and its default "none" (every static run) tells nothing;
 * a Slurm job runs one step per srun, each a run of its own. */
void cometi_id_run(cometi_run_id_t *r)
{
    static const char *others[] = {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "FLUX_JOB_ID", "LSB_JOBID",
                                   "PBS_JOBID"};
    const char *v, *n;
    memset(r, 0, sizeof(*r));
    if ((v = env_set("COMET_RUN_ID"))) {
        snprintf(r->text, sizeof(r->text), "COMET_RUN_ID=%s", v);
    } else if ((v = env_set("TORCHELASTIC_RUN_ID")) && strcmp(v, "none")) {
        n = env_set("TORCHELASTIC_RESTART_COUNT");
        snprintf(r->text, sizeof(r->text), "TORCHELASTIC_RUN_ID=%s restart %s", v, n ? n : "0");
    } else if ((v = env_set("SLURM_JOB_ID"))) {
        n = env_set("SLURM_STEP_ID");
        snprintf(r->text, sizeof(r->text), "SLURM_JOB_ID=%s step %s", v, n ? n : "-");
    } else {
        for (size_t i = 0; i < sizeof(others) / sizeof(others[0]) && !r->text[0]; i++)
            if ((v = env_set(others[i]))) snprintf(r->text, sizeof(r->text), "%s=%s", others[i], v);
    }
    r->made = !r->text[0];
}

static void read_line_file(const char *path, char *out, size_t len)
{
    memset(out, 0, len);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t n = read(fd, out, len - 1);
    close(fd);
    out[n > 0 ? n : 0] = '\0';
    out[strcspn(out, "\n")] = '\0';
}

/* A process's start time from /proc/PID/stat (field 22, counted past the command name,
 * which may hold spaces and parentheses). */
static int proc_start(int64_t pid, uint64_t *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%lld/stat", (long long)pid);
    read_line_file(path, buf, sizeof(buf));
    const char *p = strrchr(buf, ')');
    for (int field = 2; p && field < 22; field++) p = strchr(p + 1, ' '); /* to the space before field 22 */
    if (!p) return -1;
    *start = strtoull(p + 1, NULL, 10);
    return 0;
}

static void whoami(id_writer_t *w)
{
    memset(w, 0, sizeof(*w));
    gethostname(w->host, sizeof(w->host) - 1);
    read_line_file("/proc/sys/kernel/random/boot_id", w->boot_id, sizeof(w->boot_id));
    ssize_t n = readlink("/proc/self/ns/pid", w->pid_ns, sizeof(w->pid_ns) - 1);
    w->pid_ns[n > 0 ? n : 0] = '\0';
    w->pid = getpid();
    proc_start(w->pid, &w->start);
    w->written = time(NULL);
}

enum { WRITER_UNKNOWN, WRITER_RUNNING, WRITER_EXITED };

/* Whether the file's writer still runs: knowable only from the same kernel boot and pid
 * namespace as `me`, where its pid and start time name it for sure. */
static int writer_state(const id_writer_t *w, const id_writer_t *me)
{
    uint64_t start;
    if (!me->boot_id[0] || strcmp(w->boot_id, me->boot_id) || !me->pid_ns[0] || strcmp(w->pid_ns, me->pid_ns))
        return WRITER_UNKNOWN;
    return proc_start(w->pid, &start) == 0 && start == w->start ? WRITER_RUNNING : WRITER_EXITED;
}

/* ---- removing the file this process published ----
 * When the process ends by any road: a return, exit() (atexit), or a terminating signal
 * (launchers stop ranks with SIGTERM, then SIGKILL, which nothing can catch). Plain
 * statics and flags, so the signal handler makes only async-signal-safe calls. */
static struct {
    char path[4096], tmp[4096];
    pid_t pid;  /* a child forked by the rank's body inherits this, and must not remove it */
    dev_t dev;
    ino_t ino;  /* remove the file only while it is still the one this process wrote */
    volatile sig_atomic_t has_tmp, has_file;
} owned;

static const int owned_signals[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL,
                                    SIGPIPE};
#define N_OWNED_SIGNALS (int)(sizeof(owned_signals) / sizeof(owned_signals[0]))
static struct sigaction owned_old[N_OWNED_SIGNALS];
static int owned_hooked[N_OWNED_SIGNALS];

static void remove_owned(void)
{
    struct stat sb;
    if (owned.pid != getpid()) return;
    if (owned.has_tmp) unlink(owned.tmp);
    owned.has_tmp = 0;
    if (owned.has_file && stat(owned.path, &sb) == 0 && sb.st_dev == owned.dev && sb.st_ino == owned.ino)
        unlink(owned.path);
    owned.has_file = 0;
}

static void on_fatal_signal(int sig)
{
    remove_owned();
    raise(sig); /* SA_RESETHAND restored the default action: end as the signal meant */
}

/* Hook only the signals left at their default action: a program with its own handler
 * decides itself how it ends (and exit() still reaches remove_owned). */
static void arm_owned(const char *path)
{
    static int at_exit;
    if (!at_exit) at_exit = atexit(remove_owned) == 0;
    snprintf(owned.path, sizeof(owned.path), "%s", path);
    owned.pid = getpid();
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_fatal_signal;
    sa.sa_flags = SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < N_OWNED_SIGNALS; i++) {
        owned_hooked[i] = sigaction(owned_signals[i], NULL, &owned_old[i]) == 0 &&
                          owned_old[i].sa_handler == SIG_DFL && sigaction(owned_signals[i], &sa, NULL) == 0;
    }
}

/* Put back the old actions, but not over a handler the rank's body installed since. */
void cometi_id_release(void)
{
    struct sigaction now;
    remove_owned();
    for (int i = 0; i < N_OWNED_SIGNALS; i++)
        if (owned_hooked[i] && sigaction(owned_signals[i], NULL, &now) == 0 && now.sa_handler == on_fatal_signal)
            sigaction(owned_signals[i], &owned_old[i], NULL);
    memset(owned_hooked, 0, sizeof(owned_hooked));
}

/* ---- publishing ---- */

enum { PUB_OK, PUB_EXISTS, PUB_FAILED };

static void drop_temp(void)
{
    if (owned.has_tmp && unlink(owned.tmp) != 0 && errno != ENOENT)
        fprintf(stderr, "comet: rank 0: could not remove temp file %s: %s\n", owned.tmp, strerror(errno));
    owned.has_tmp = 0;
}

/* Write `f` to a new temp file beside `path` (owned.tmp) and fsync it; `sb` gets its inode. */
static int write_temp(const char *path, const id_file_t *f, struct stat *sb, char *why, size_t len)
{
    char tmp[sizeof(owned.tmp)];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.XXXXXX", path) >= (int)sizeof(tmp)) {
        snprintf(why, len, "%s", strerror(ENAMETOOLONG));
        return -1;
    }
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, len, "creating %s: %s", tmp, strerror(errno));
        return -1;
    }
    memcpy(owned.tmp, tmp, sizeof(tmp));
    owned.has_tmp = 1;
    int bad = cometi_write_full(fd, f, sizeof(*f)) != 0 || fsync(fd) != 0 || fstat(fd, sb) != 0;
    int e = errno;
    if (close(fd) != 0 && !bad) bad = 1, e = errno;
    if (!bad) return 0;
    snprintf(why, len, "writing %s: %s", tmp, strerror(e));
    drop_temp();
    return -1;
}

/* Where hard links are refused (some FUSE file systems): claim the name with O_EXCL,
 * then rename the full temp over the empty claim. Readers wait a moment on an empty file. */
static int claim_and_rename(const char *path, char *why, size_t len)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) return PUB_EXISTS;
    if (fd < 0) {
        snprintf(why, len, "creating %s: %s", path, strerror(errno));
        return PUB_FAILED;
    }
    close(fd);
    if (rename(owned.tmp, path) == 0) {
        owned.has_tmp = 0;
        return PUB_OK;
    }
    snprintf(why, len, "renaming %s to %s: %s", owned.tmp, path, strerror(errno));
    unlink(path); /* our empty claim */
    return PUB_FAILED;
}

static int publish(const char *path, const id_file_t *f, char *why, size_t len)
{
    struct stat sb;
    if (write_temp(path, f, &sb, why, len) != 0) return PUB_FAILED;
    /* Own the final name before it exists: a signal between the link and the next line
     * must still remove it, and the inode check spares a file another writer made. */
    owned.dev = sb.st_dev;
    owned.ino = sb.st_ino;
    owned.has_file = 1;
    int rc = PUB_OK;
    if (link(owned.tmp, path) != 0) {
        if (errno == EEXIST) {
            rc = PUB_EXISTS;
        } else if (errno == EPERM || errno == EOPNOTSUPP || errno == ENOSYS) {
            rc = claim_and_rename(path, why, len);
        } else {
            snprintf(why, len, "linking %s to %s: %s", owned.tmp, path, strerror(errno));
            rc = PUB_FAILED;
        }
    }
    if (rc != PUB_OK) owned.has_file = 0;
    drop_temp();
    return rc;
}

/* ---- reading ---- */

enum { ID_ABSENT, ID_EMPTY, ID_OK, ID_MALFORMED, ID_UNREADABLE };

static int check_id_file(const id_file_t *f, ssize_t n, char *why, size_t len)
{
    if (n >= 8 && memcmp(f->magic, ID_MAGIC, 8) && !memcmp(f->magic, ID_MAGIC, 7))
        snprintf(why, len, "it is from another version of comet (\"%.8s\", this one writes \"%s\")", f->magic,
                 ID_MAGIC);
    else if (n < 8 || memcmp(f->magic, ID_MAGIC, 8))
        snprintf(why, len, "it does not start with \"%s\"", ID_MAGIC);
    else if ((size_t)n > sizeof(*f))
        snprintf(why, len, "it is longer than %zu bytes", sizeof(*f));
    else if ((size_t)n < sizeof(*f))
        snprintf(why, len, "it has %zd bytes, not %zu (truncated?)", n, sizeof(*f));
    else if (!memchr(f->run, 0, sizeof(f->run)) || !f->run[0] || (f->run_made & ~1) ||
             !memchr(f->writer.host, 0, sizeof(f->writer.host)) ||
             !memchr(f->writer.boot_id, 0, sizeof(f->writer.boot_id)) ||
             !memchr(f->writer.pid_ns, 0, sizeof(f->writer.pid_ns)) || f->writer.pid <= 0)
        snprintf(why, len, "its run id or writer fields are garbled");
    else return ID_OK;
    return ID_MALFORMED;
}

static ssize_t read_upto(int fd, void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* Read and check the file at `path`; `why` says what is wrong with it. ESTALE counts as
 * absent: an NFS client sees it while a file is being replaced. */
static int read_id_file(const char *path, id_file_t *f, char *why, size_t len)
{
    char buf[sizeof(id_file_t) + 1];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 && (errno == ENOENT || errno == ESTALE)) return ID_ABSENT;
    ssize_t n = fd < 0 ? -1 : read_upto(fd, buf, sizeof(buf));
    int e = errno;
    if (fd >= 0) close(fd);
    if (n < 0) {
        snprintf(why, len, "%s", strerror(e));
        return ID_UNREADABLE;
    }
    if (n == 0) return ID_EMPTY;
    memset(f, 0, sizeof(*f));
    memcpy(f, buf, (size_t)n < sizeof(*f) ? (size_t)n : sizeof(*f));
    return check_id_file(f, n, why, len);
}

/* ---- explaining a file that is not this run's ---- */

static void describe_writer(const id_file_t *f, int state, char *out, size_t len)
{
    char when[32] = "?";
    time_t t = (time_t)f->writer.written;
    struct tm tm;
    if (localtime_r(&t, &tm)) strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", &tm);
    char run[240];
    if (f->run_made) snprintf(run, sizeof(run), "no run id from a launcher");
    else snprintf(run, sizeof(run), "run id \"%s\"", f->run);
    snprintf(out, len, "%s, written by pid %lld on host %s at %s%s", run, (long long)f->writer.pid, f->writer.host,
             when, state == WRITER_EXITED ? ", which has exited" : state == WRITER_RUNNING ? ", still running" : "");
}

static int same_run(const id_file_t *f, const cometi_run_id_t *ours)
{
    return ours->made ? f->run_made : !f->run_made && !strcmp(f->run, ours->text);
}

/* This run's file: its run id is this run's (with none from a launcher, one rank 0 made)
 * and its writer has not exited (a rank 0 that died leaves an id nobody answers). */
static int file_is_ours(const id_file_t *f, const cometi_run_id_t *ours, const id_writer_t *me)
{
    return same_run(f, ours) && writer_state(&f->writer, me) != WRITER_EXITED;
}

/* One report for a well-formed file that is in the way: whose it is and what to do. */
static void explain_file(char *out, size_t len, int rank, const char *path, const id_file_t *f, const cometi_run_id_t *ours,
                         const id_writer_t *me)
{
    int state = writer_state(&f->writer, me), same = same_run(f, ours) && !ours->made;
    char who[400], todo[4200];
    describe_writer(f, state, who, sizeof(who));
    const char *what = same && state == WRITER_EXITED ? "has this run's id, but its writer has exited (rank 0 failed "
                                                        "after writing it, or an earlier attempt was killed)"
                       : state == WRITER_EXITED ? "was left by a run whose rank 0 exited without removing it (killed?)"
                       : same                   ? "exists already with this run's id: is a second rank 0 running?"
                       : state == WRITER_RUNNING ? "belongs to another run, still in progress"
                                                 : "is from another run";
    if (same && state != WRITER_EXITED) snprintf(todo, sizeof(todo), "give one process of a run RANK=0");
    else if (state == WRITER_RUNNING) snprintf(todo, sizeof(todo), "name another path for this run");
    else snprintf(todo, sizeof(todo), "remove it (rm %s) and start again, or name a new path for each run", path);
    snprintf(out, len, "rank %d: id file %s %s (%s; this run's id: %s): %s%s", rank, path, what, who,
             ours->made ? "none from a launcher" : ours->text, todo,
             ours->made ? "; set COMET_RUN_ID to one value on every rank of a run (a job id, say) so that ranks tell "
                          "runs apart"
                        : "");
}

static void explain_malformed(char *out, size_t len, int rank, const char *path, const char *why)
{
    snprintf(out, len, "rank %d: id file %s is not a comet id file: %s; expected the %zu bytes that rank 0 writes, "
             "starting \"%s\": remove it (rm %s), or name another path with --id-file", rank, path, why,
             sizeof(id_file_t), ID_MAGIC, path);
}

/* Why rank 0 cannot publish at `path`, where something is in the way. */
static void explain_existing(char *out, size_t len, const char *path, const cometi_run_id_t *ours, const id_writer_t *me)
{
    id_file_t f;
    char why[300] = "";
    switch (read_id_file(path, &f, why, sizeof(why))) {
    case ID_OK: explain_file(out, len, 0, path, &f, ours, me); break;
    case ID_MALFORMED: explain_malformed(out, len, 0, path, why); break;
    case ID_EMPTY:
        snprintf(out, len, "rank 0: id file %s exists and is empty (a writer stopped between claiming and filling "
                 "it?): remove it (rm %s) and start again", path, path);
        break;
    case ID_UNREADABLE: snprintf(out, len, "rank 0: id file %s exists but cannot be read: %s", path, why); break;
    default:
        snprintf(out, len, "rank 0: id file %s appeared while this rank wrote its own and is gone again: is another "
                 "rank 0 using this path?", path);
    }
}

/* The id file's directory must be there before anyone waits on or writes into it. */
static int check_dir(const char *path, int rank, char *report, size_t len)
{
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, sizeof(dir), ".");
    else slash[slash == dir] = '\0'; /* "/x" keeps its "/" */
    struct stat sb;
    int e = stat(dir, &sb) != 0 ? errno : !S_ISDIR(sb.st_mode) ? ENOTDIR : 0;
    if (e) snprintf(report, len, "rank %d: id file %s: its directory %s: %s (it must exist, on storage every rank "
                    "sees)", rank, path, dir, strerror(e));
    return e;
}

/* ---- the two sides ---- */

/* With no run id from the launcher, rank 0 makes one no other run has: its host, pid and
 * the time to the nanosecond. */
static void made_run_id(char *out, size_t len, const id_writer_t *w)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(out, len, "made by rank 0, pid %lld on %s at %lld.%09ld", (long long)w->pid, w->host,
             (long long)ts.tv_sec, ts.tv_nsec);
}

/* Rank 0: make the id and publish it. 0, or the exit code with `report` set. */
int cometi_id_publish(const char *path, const cometi_run_id_t *ours, ncclUniqueId *id, char *report, size_t len)
{
    id_file_t f, seen;
    char why[sizeof(owned.tmp) + 400] = ""; /* room for the temp's path and the reason */
    if (check_dir(path, 0, report, len)) return 2;
    memset(&f, 0, sizeof(f));
    whoami(&f.writer);
    if (read_id_file(path, &seen, why, sizeof(why)) != ID_ABSENT) { /* say so before making an id */
        explain_existing(report, len, path, ours, &f.writer);
        return 2;
    }
    ncclResult_t res = ncclGetUniqueId(id);
    if (res != ncclSuccess) {
        snprintf(report, len, "rank 0: ncclGetUniqueId: %s", ncclGetErrorString(res));
        return 1;
    }
    memcpy(f.magic, ID_MAGIC, sizeof(f.magic));
    f.run_made = ours->made;
    if (ours->made) made_run_id(f.run, sizeof(f.run), &f.writer);
    else snprintf(f.run, sizeof(f.run), "%s", ours->text);
    f.id = *id;
    arm_owned(path);
    int rc = publish(path, &f, why, sizeof(why));
    if (rc == PUB_OK) return 0;
    cometi_id_release();
    if (rc == PUB_EXISTS) explain_existing(report, len, path, ours, &f.writer);
    else snprintf(report, len, "rank 0: cannot write id file %s: %s", path, why);
    return rc == PUB_EXISTS ? 2 : 1;
}

/* Ranks > 0: wait for this run's file. Anything else there is reported at once: a
 * stale or malformed file will not turn into this run's (rank 0 never replaces one). */
int cometi_id_wait(const char *path, const cometi_run_id_t *ours, int rank, int timeout_s, ncclUniqueId *id,
                       char *report, size_t len)
{
    const int limit = timeout_s > 0 ? timeout_s : ID_WAIT_DEFAULT_S;
    const double start = now_s();
    double empty_since = -1;
    id_writer_t me;
    whoami(&me);
    if (check_dir(path, rank, report, len)) return 1;
    for (;;) {
        id_file_t f;
        char why[300] = "";
        int st = read_id_file(path, &f, why, sizeof(why));
        if (st == ID_OK && file_is_ours(&f, ours, &me)) {
            *id = f.id;
            return 0;
        }
        if (st == ID_OK) explain_file(report, len, rank, path, &f, ours, &me);
        if (st == ID_MALFORMED) explain_malformed(report, len, rank, path, why);
        if (st == ID_UNREADABLE) snprintf(report, len, "rank %d: cannot read id file %s: %s", rank, path, why);
        if (st == ID_OK || st == ID_MALFORMED || st == ID_UNREADABLE) return 1;
        if (st != ID_EMPTY) empty_since = -1;
        else if (empty_since < 0) empty_since = now_s();
        if (empty_since >= 0 && now_s() - empty_since > ID_EMPTY_GRACE_S) {
            snprintf(why, sizeof(why), "it stayed empty for %.0f s", ID_EMPTY_GRACE_S);
            explain_malformed(report, len, rank, path, why);
            return 1;
        }
        if (now_s() - start > limit) {
            snprintf(report, len, "rank %d: id file %s did not appear within %d s (did rank 0 start, with the same "
                     "--id-file, on storage this rank sees?)", rank, path, limit);
            return 1;
        }
        usleep(50000);
    }
}
