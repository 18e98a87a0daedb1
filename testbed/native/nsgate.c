/* vfab-nsgate: start many processes, each in its own network namespace, held at a gate and released together.
 *
 * The client farm's "released together" start (testbed/nsgate.py): 245 DHCP clients that begin at the same
 * moment, as 245 booting hosts would, instead of one after another from a Python loop (where starting them
 * was most of the time measured).  Forking, entering the namespace and the new session happen before the gate;
 * only the exec and the program itself come after it.
 *
 * stdin, one process per line, fields separated by TAB: the namespace path (/run/netns/NAME), then argv.
 * An empty line ends the list.  stdout, then: "pid I PID" for each (I counts from 0), and "ready" once each
 * is in its namespace and session (or has exited: 126 below).
 * stdin "go": every held process goes on to its exec; stdout "go".  Then "exit PID STATUS" (the raw wait
 * status) as each ends, and this program ends after the last.  EOF on stdin before "go" (the caller died or
 * gave up): the held processes exit without running anything.  A child that cannot enter its namespace or
 * exec exits 126 or 127 with a line on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_PROCS 4096
#define MAX_ARGS 64

static int gate[2];
static int ready[2];

static void child(const char *ns, char **argv) {
    int nsfd = open(ns, O_RDONLY | O_CLOEXEC);
    if (nsfd < 0) {
        fprintf(stderr, "vfab-nsgate: %s: %s\n", ns, strerror(errno));
        _exit(126);
    }
    if (setns(nsfd, CLONE_NEWNET) < 0) {
        fprintf(stderr, "vfab-nsgate: setns %s: %s\n", ns, strerror(errno));
        _exit(126);
    }
    close(nsfd);
    setsid();                                   /* a session of its own: the caller signals its group */
    close(ready[0]);
    char in = 'r';
    while (write(ready[1], &in, 1) < 0 && errno == EINTR)
        ;                                       /* in its namespace and session: "ready" waits for this */
    close(ready[1]);
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        if (null > 1)
            close(null);
    }
    close(gate[1]);
    char go;
    ssize_t n;
    do
        n = read(gate[0], &go, 1);              /* one byte each: the caller said go; EOF: it did not */
    while (n < 0 && errno == EINTR);
    if (n != 1)
        _exit(0);
    close(gate[0]);
    execvp(argv[0], argv);
    fprintf(stderr, "vfab-nsgate: exec %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

static int split(char *line, char **fields, int max) {
    int n = 0;
    for (char *tok = strtok(line, "\t"); tok && n < max - 1; tok = strtok(NULL, "\t"))
        fields[n++] = tok;
    fields[n] = NULL;
    return n;
}

int main(void) {
    char line[8192];
    int count = 0;
    signal(SIGPIPE, SIG_IGN);                   /* the caller gone: keep reaping */
    if (pipe2(gate, O_CLOEXEC) < 0 || pipe2(ready, O_CLOEXEC) < 0) {
        perror("vfab-nsgate: pipe");
        return 1;
    }
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (!line[0])
            break;
        char *fields[MAX_ARGS + 2];
        if (split(line, fields, MAX_ARGS + 2) < 2 || count == MAX_PROCS) {
            fprintf(stderr, "vfab-nsgate: bad line or more than %d processes: %.200s\n", MAX_PROCS, line);
            break;                              /* the held ones exit at the EOF of the gate below */
        }
        fflush(stdout);
        pid_t p = fork();
        if (p < 0) {
            perror("vfab-nsgate: fork");
            break;
        }
        if (p == 0)
            child(fields[0], fields + 1);
        printf("pid %d %d\n", count, (int)p);
        count++;
    }
    close(ready[1]);                            /* EOF once every child is in place (or gone) */
    char buf[256];
    for (;;) {
        ssize_t n = read(ready[0], buf, sizeof buf);
        if (n > 0 || (n < 0 && errno == EINTR))
            continue;
        break;
    }
    close(ready[0]);
    printf("ready\n");
    fflush(stdout);
    close(gate[0]);
    if (fgets(line, sizeof line, stdin) && strcmp(line, "go\n") == 0) {
        char ones[256];
        memset(ones, 'g', sizeof ones);
        for (int left = count; left > 0;) {
            ssize_t w = write(gate[1], ones, left < (int)sizeof ones ? left : (int)sizeof ones);
            if (w < 0 && errno == EINTR)
                continue;
            if (w < 0) {
                perror("vfab-nsgate: gate");
                break;
            }
            left -= w;
        }
        printf("go\n");
        fflush(stdout);
    }
    close(gate[1]);                             /* no go: the held processes read EOF and exit */
    for (int left = count; left > 0;) {
        int st;
        pid_t p = wait(&st);
        if (p < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        printf("exit %d %d\n", (int)p, st);
        fflush(stdout);
        left--;
    }
    return 0;
}
