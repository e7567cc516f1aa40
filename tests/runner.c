/*
 * runner.c - runs every test of testutil.h's list in its own process with a timeout,
 * prints one line per test (its output under a failure), and ends with
 * "N passed, N failed, N skipped". Exit status 1 when anything failed.
 * Usage: comet_tests [-v] [SUBSTRING...]   (-v: show passing tests' output too;
 * substrings: run only tests whose name contains one)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

typedef struct test_case {
    const char *name;
    int (*fn)(void);
    int timeout_s;
} test_case_t;

#define LIST_TEST(name, timeout) {#name, test_##name, timeout},
static const test_case_t tests[] = {COMET_TESTS(LIST_TEST)};
#undef LIST_TEST

uint64_t test_seed(void)
{
    static uint64_t seed;
    if (seed) return seed;
    const char *env = getenv("COMET_TEST_SEED");
    seed = env && *env ? strtoull(env, NULL, 0) : ((uint64_t)time(NULL) << 20) ^ (uint64_t)getpid();
    if (!seed) seed = 1;
    printf("seed %llu (replay with COMET_TEST_SEED=%llu)\n", (unsigned long long)seed, (unsigned long long)seed);
    return seed;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int selected(const char *name, int argc, char **argv)
{
    int filters = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-v")) continue;
        filters++;
        if (strstr(name, argv[i])) return 1;
    }
    return filters == 0;
}

/* The captured output: all of it for a failure, the last line for a skip. */
static void print_output(FILE *f, int last_line_only)
{
    char line[1024], last[1024] = "";
    rewind(f);
    while (fgets(line, sizeof(line), f)) {
        if (last_line_only) snprintf(last, sizeof(last), "%s", line);
        else printf("    %s", line);
    }
    if (last_line_only) printf(": %s", last[0] ? last : "(no reason given)\n");
}

int main(int argc, char **argv)
{
    int passed = 0, failed = 0, skipped = 0, verbose = 0;
    for (int i = 1; i < argc; i++) verbose |= !strcmp(argv[i], "-v");
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++) {
        const test_case_t *t = &tests[i];
        if (!selected(t->name, argc, argv)) continue;
        FILE *out = tmpfile();
        if (!out) {
            printf("FAIL %s: tmpfile: %s\n", t->name, strerror(errno));
            failed++;
            continue;
        }
        fflush(stdout);
        double start = now_s();
        pid_t pid = fork();
        if (pid == 0) {
            setpgid(0, 0); /* the test and every rank it forks form one group, stopped together */
            dup2(fileno(out), 1);
            dup2(fileno(out), 2);
            setvbuf(stdout, NULL, _IONBF, 0);
            int rc = t->fn();
            fflush(stdout);
            _exit(rc);
        }
        int status = 0, timed_out = 0;
        for (;;) {
            pid_t r = waitpid(pid, &status, WNOHANG);
            if (r == pid) break;
            if (now_s() - start > t->timeout_s) {
                timed_out = 1;
                kill(-pid, SIGKILL);
                kill(pid, SIGKILL);
                waitpid(pid, &status, 0);
                break;
            }
            usleep(10000);
        }
        kill(-pid, SIGKILL); /* ranks a test left behind */
        double took = now_s() - start;
        if (timed_out) {
            printf("FAIL %s: timed out after %d s\n", t->name, t->timeout_s);
            print_output(out, 0);
            failed++;
        } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
            printf("PASS %s (%.2f s)\n", t->name, took);
            if (verbose) print_output(out, 0);
            passed++;
        } else if (WIFEXITED(status) && WEXITSTATUS(status) == TEST_SKIP) {
            printf("SKIP %s", t->name);
            print_output(out, 1);
            skipped++;
        } else {
            if (WIFSIGNALED(status)) printf("FAIL %s: killed by signal %d (%.2f s)\n", t->name, WTERMSIG(status), took);
            else printf("FAIL %s: exit code %d (%.2f s)\n", t->name, WEXITSTATUS(status), took);
            print_output(out, 0);
            failed++;
        }
        fclose(out);
    }
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}
