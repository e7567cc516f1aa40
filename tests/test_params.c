/*
 * test_params.c - the environment table (src/params.h): each variable's malformed values
 * (and the tuning file's malformed lines) refused with a message naming it, good values
 * taken, and comet_comm_create stopped by a bad one before it touches NCCL or a GPU. The table is read once per process, so every
 * case runs in a child of its own.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comet.h"
#include "base/params.h"
#include "testutil.h"

typedef struct outcome {
    int status;
    long value;     /* the parameter's value, for integers */
    char str[256];  /* the parameter's value, for paths */
    char msg[COMETI_ERR_LEN];
    int create_status;
    char create_msg[COMETI_ERR_LEN];
} outcome_t;

/* In a child with `name`=`value` set (as user nobody where `nobody` and we are root: root
 * reads any file): load the table, read parameter `id`, and try comet_comm_create_from_id
 * (which checks the environment first). */
static int load_in_child(const char *name, const char *value, cometi_param_id_t id, int nobody, outcome_t *out)
{
    int fds[2];
    if (pipe(fds) != 0) return -1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        setenv(name, value, 1);
        if (nobody && geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(2);
        outcome_t o;
        memset(&o, 0, sizeof(o));
        o.status = cometi_params_load(o.msg);
        o.value = cometi_param_int(id);
        snprintf(o.str, sizeof(o.str), "%s", cometi_param_str(id));
        ncclUniqueId uid;
        memset(&uid, 0, sizeof(uid));
        comet_comm_t comm = NULL;
        o.create_status = o.status != COMET_SUCCESS ? comet_comm_create_from_id(&uid, 1, 0, NULL, &comm) : 0;
        snprintf(o.create_msg, sizeof(o.create_msg), "%s", comet_last_create_error());
        ssize_t unused = write(fds[1], &o, sizeof(o));
        (void)unused;
        _exit(0);
    }
    close(fds[1]);
    ssize_t got = 0, r;
    while (got < (ssize_t)sizeof(*out) && (r = read(fds[0], (char *)out + got, sizeof(*out) - got)) > 0) got += r;
    close(fds[0]);
    waitpid(pid, NULL, 0);
    return got == (ssize_t)sizeof(*out) ? 0 : -1;
}

/* load_in_child with COMET_TUNING_FILE naming `path`, whose text is `text` now. */
static int load_tuning_text(const char *path, const char *text, outcome_t *out)
{
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    const int unwritten = fputs(text, f) < 0;
    if (fclose(f) != 0 || unwritten) return -1;
    return load_in_child("COMET_TUNING_FILE", path, COMETI_PARAM_TUNING_FILE, 0, out);
}

int test_params_table(void)
{
    static const struct {
        const char *name, *value;
        cometi_param_id_t id;
        int ok;
        long want;         /* ok integers: the value taken */
        const char *says;  /* refused: in the message */
    } cases[] = {
        {"COMET_TIMEOUT_MS", "7000", COMETI_PARAM_TIMEOUT_MS, 1, 7000, NULL},
        {"COMET_TIMEOUT_MS", "abc", COMETI_PARAM_TIMEOUT_MS, 0, 0, "$COMET_TIMEOUT_MS = 'abc'"},
        {"COMET_TIMEOUT_MS", "0", COMETI_PARAM_TIMEOUT_MS, 0, 0, "1..3600000"},
        {"COMET_TIMEOUT_MS", "5000x", COMETI_PARAM_TIMEOUT_MS, 0, 0, "'5000x'"},
        {"COMET_TIMEOUT_MS", "99999999999999999999", COMETI_PARAM_TIMEOUT_MS, 0, 0, "COMET_TIMEOUT_MS"},
        {"COMET_PDL", "0", COMETI_PARAM_PDL, 1, 0, NULL},
        {"COMET_PDL", "2", COMETI_PARAM_PDL, 0, 0, "$COMET_PDL = '2'"},
        {"COMET_FIRST_WAVE", "off", COMETI_PARAM_FIRST_WAVE, 0, 0, "$COMET_FIRST_WAVE = 'off'"},
        {"COMET_FIRST_WAVE", "0", COMETI_PARAM_FIRST_WAVE, 1, 0, NULL},
        {"COMET_TIMEOUT_MS", "3600000", COMETI_PARAM_TIMEOUT_MS, 1, 3600000, NULL},
        {"COMET_TIMEOUT_MS", "3600001", COMETI_PARAM_TIMEOUT_MS, 0, 0, "'3600001': it takes milliseconds"},
        {"COMET_TIMEOUT_MS", "-5", COMETI_PARAM_TIMEOUT_MS, 0, 0, "1..3600000"},
        /* The whole string is the number: no blanks or sign before it (strtol takes them). */
        {"COMET_TIMEOUT_MS", " 7000", COMETI_PARAM_TIMEOUT_MS, 0, 0, "$COMET_TIMEOUT_MS = ' 7000'"},
        {"COMET_TIMEOUT_MS", "+7000", COMETI_PARAM_TIMEOUT_MS, 0, 0, "$COMET_TIMEOUT_MS = '+7000'"},
        {"COMET_TIMEOUT_MS", "7000 ", COMETI_PARAM_TIMEOUT_MS, 0, 0, "$COMET_TIMEOUT_MS = '7000 '"},
        {"COMET_TIMEOUT_MS", "0x10", COMETI_PARAM_TIMEOUT_MS, 0, 0, "$COMET_TIMEOUT_MS = '0x10'"},
        {"COMET_PDL", "1.0", COMETI_PARAM_PDL, 0, 0, "$COMET_PDL = '1.0'"},
        {"COMET_PDL", "-1", COMETI_PARAM_PDL, 0, 0, "$COMET_PDL = '-1'"},
        {"COMET_FIRST_WAVE", "1", COMETI_PARAM_FIRST_WAVE, 1, 1, NULL},
        {"COMET_FIRST_WAVE", "2", COMETI_PARAM_FIRST_WAVE, 0, 0, "$COMET_FIRST_WAVE = '2': it takes 0"},
        {"COMET_TUNING_FILE", "/", COMETI_PARAM_TUNING_FILE, 0, 0, "= '/': a directory, not a regular file"},
        {"COMET_TUNING_FILE", "/no/such/comet/file", COMETI_PARAM_TUNING_FILE, 0, 0, "No such file"},
        {"COMET_TUNING_FILE", "/dev/null", COMETI_PARAM_TUNING_FILE, 0, 0, "a character device, not a regular"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        outcome_t o;
        CHECK_EQ(load_in_child(cases[i].name, cases[i].value, cases[i].id, 0, &o), 0);
        printf("%s='%s': %s: %s\n", cases[i].name, cases[i].value, comet_status_string(o.status), o.msg);
        if (cases[i].ok) {
            CHECK_EQ(o.status, COMET_SUCCESS);
            CHECK_EQ(o.value, cases[i].want);
        } else {
            CHECK_EQ(o.status, COMET_INVALID_ARGUMENT);
            CHECK_CONTAINS(o.msg, cases[i].name);
            CHECK_CONTAINS(o.msg, cases[i].says);
            /* The create stops on it, naming it, before NCCL sees the (zero) id. */
            CHECK_EQ(o.create_status, COMET_INVALID_ARGUMENT);
            CHECK_CONTAINS(o.create_msg, cases[i].name);
        }
    }
    /* A readable regular file is taken, path and all. */
    char path[] = "/tmp/comet_params_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    outcome_t o;
    CHECK_EQ(load_in_child("COMET_TUNING_FILE", path, COMETI_PARAM_TUNING_FILE, 0, &o), 0);
    CHECK_EQ(o.status, COMET_SUCCESS);
    CHECK(strcmp(o.str, path) == 0);
    /* Its lines too, by the tuning file's own parser (tune.c): a malformed one is refused at
     * the load, naming the variable, the line, the field and the value, and the create stops
     * on it. A count that only the GPU's SMs limit (dispatch blocks 500) waits for the read
     * that knows them. */
    CHECK_EQ(load_tuning_text(path, "# comment\n2 8 2 4096 14336 8192 : 500 bulk 0 1 dynamic push\n"
                                    "2 8 2 4096 14336 4096 : x bulk 0 1 dynamic push\n", &o), 0);
    printf("COMET_TUNING_FILE='%s' (a malformed line): %s\n", path, o.msg);
    CHECK_EQ(o.status, COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(o.msg, "$COMET_TUNING_FILE");
    CHECK_CONTAINS(o.msg, "line 3: field 7 (dispatch_blocks) = 'x'");
    CHECK_EQ(o.create_status, COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(o.create_msg, "line 3");
    CHECK_EQ(load_tuning_text(path, "2 8 2 4096 14336 8192 : 500 bulk 0 1 dynamic push\n"
                                    "2 8 2 4096 14336 4096 : 4 bulk 0 1 dynamic\n", &o), 0);
    CHECK_EQ(o.status, COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(o.msg, "line 2: 11 fields, want 12");
    CHECK_EQ(load_tuning_text(path, "2 8 2 4096 14336 8192 : 500 bulk 0 1 dynamic push\n", &o), 0);
    CHECK_EQ(o.status, COMET_SUCCESS);
    /* Unreadable (mode 0, read as nobody): refused, and why. */
    CHECK(chmod(path, 0) == 0);
    CHECK_EQ(load_in_child("COMET_TUNING_FILE", path, COMETI_PARAM_TUNING_FILE, 1, &o), 0);
    unlink(path);
    printf("COMET_TUNING_FILE='%s' (mode 0): %s\n", path, o.msg);
    CHECK_EQ(o.status, COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(o.msg, "Permission denied");
    /* A fifo: refused at once, not waiting for a writer (the test's timeout would catch that). */
    CHECK(mkfifo(path, 0600) == 0);
    CHECK_EQ(load_in_child("COMET_TUNING_FILE", path, COMETI_PARAM_TUNING_FILE, 0, &o), 0);
    unlink(path);
    CHECK_EQ(o.status, COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(o.msg, "a fifo, not a regular file");
    /* Two bad variables: the first is reported, with its own message. */
    setenv("COMET_PDL", "2", 1);
    CHECK_EQ(load_in_child("COMET_TIMEOUT_MS", "abc", COMETI_PARAM_TIMEOUT_MS, 0, &o), 0);
    unsetenv("COMET_PDL");
    CHECK_EQ(o.status, COMET_INVALID_ARGUMENT);
    CHECK_CONTAINS(o.msg, "$COMET_TIMEOUT_MS = 'abc'");
    CHECK(!strstr(o.msg, "COMET_PDL"));
    /* Unset: the defaults. */
    unsetenv("COMET_TIMEOUT_MS");
    unsetenv("COMET_PDL");
    CHECK_EQ(cometi_params_load(NULL), COMET_SUCCESS);
    CHECK_EQ(cometi_param_int(COMETI_PARAM_TIMEOUT_MS), COMETI_DEFAULT_TIMEOUT_MS);
    CHECK_EQ(cometi_param_int(COMETI_PARAM_PDL), 1);
    CHECK_CONTAINS(cometi_param_name(COMETI_PARAM_FIRST_WAVE), "COMET_FIRST_WAVE");
    return 0;
}
