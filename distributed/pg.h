/* The process group's and the work handle's insides, shared by pg.c
 * (lifecycle, issue, worker, waits), pg_diag.c (hang diagnostics) and
 * pg_group.c (subgroups). Not installed. */
#ifndef NABLA_DISTRIBUTED_PG_H
#define NABLA_DISTRIBUTED_PG_H

#include <pthread.h>

#include "distributed/internal.h"
#include "util/handle.h"

/* The flight recorder (Note [Hang diagnostics] in pg_diag.c) keeps this
 * many fingerprints per group, and publishes them in as many slots. */
#define NB__FP_SLOTS 16
#define NB__MSG_LEN 2048

typedef enum { NB__W_QUEUED = 0, NB__W_RUNNING, NB__W_DONE } nb__work_state;

/* A process-group backend: what pg.c calls instead of branching on the
 * backend (pg_gloo.c, pg_nccl.c). Backends move bytes. pg.c keeps the
 * queue of unfinished works (issue order), their states, the worker
 * thread of a backend whose calls block, the waits and the watchdog; the
 * collective checks are a layer around the table (pg_check.c). */
typedef struct nb__pg_ops {
    const char *name;
    /* Connects the group's mesh under the store prefix (pg->impl). */
    nb_status (*start)(nb_pg *pg, const char *prefix);
    /* Either: moves w's data to completion, blocking; pg.c calls it on the
     * group's worker thread, one work after another in issue order. On
     * failure `what` says what happened, or, with *explained set, is the
     * whole message (a layer's verdict: pg_check.c). */
    nb_status (*run)(nb_pg *pg, nb_work *w, char *what, size_t len, bool *explained);
    /* Or: starts w from the issuing thread (pg->mu not held), sets it
     * RUNNING, and finishes it when it failed to start. */
    void (*launch)(nb_pg *pg, nb_work *w);
    /* Finishes the works that completed; NULL when `run` finishes them. */
    void (*progress)(nb_pg *pg);
    /* One slice of waiting (and progress); pg->mu held on entry and exit;
     * NULL: wait on pg->cond (the worker signals it). */
    void (*wait_slice)(nb_pg *pg, double *pause);
    /* Before nb_work_wait waits (NCCL: the compute stream waits); may be NULL. */
    nb_status (*order)(nb_work *w);
    /* The group just broke (NCCL: abort the communicator); may be NULL. */
    void (*abort)(nb_pg *pg);
    /* Frees pg->impl; `stuck`: keep what the stuck worker uses (Note
     * [Stuck worker] in pg.c). */
    void (*free)(nb_pg *pg, bool stuck);
    /* Frees w->impl; may be NULL. */
    void (*work_free)(nb_work *w);
    /* All-reduces the sum of one i32 vote over the group (nb_pg_agree). */
    nb_status (*agree)(nb_pg *pg, int32_t *votes);
    /* A small all-gather of host bytes beside collective w (the check
     * layer's headers), under w's sequence number: xpost sends this rank's
     * `n` bytes and posts the receives of every member's into `all` (size x
     * n, rank order); xtest: 1 when they are all there (then the exchange
     * is over and freed), 0 not yet, or a failure status (< 0,
     * nb_last_error() set; freed too); it may block until one of those.
     * xdrop frees one never tested to the end (its group broke).
     * A backend whose `run` moves w's data in one message may send them in
     * the exchange's message, reading w's inputs at xpost (xcarries says
     * when; the caller then posts only when no unfinished collective
     * writes them); `run` then
     * computes from what arrived, with the arithmetic it uses without the
     * exchange, instead of exchanging them again (Gloo: Note [Small
     * collectives in one message] in pg_gloo.c). Every message of a
     * group's exchanges then has one size whatever w, so ranks that
     * disagree about w still meet, and what arrived for a w that the
     * caller does not let run is dropped with it. */
    nb_status (*xpost)(nb_pg *pg, nb_work *w, const void *mine, void *all, size_t n, void **x);
    /* Whether xpost sends w's data (reads its inputs); NULL: never. */
    bool (*xcarries)(const nb_pg *pg, const nb_work *w);
    int (*xtest)(nb_pg *pg, void *x);
    void (*xdrop)(void *x);
} nb__pg_ops;

extern const nb__pg_ops nb__pg_gloo_ops, nb__pg_nccl_ops;
/* pg_gloo.c: a Gloo group's context (tests call the shim with it). */
nb__gloo *nb__pg_gloo(const nb_pg *pg);
/* pg_check.c: the table of the check layer around `base` (the same
 * entries, with run or launch and work_free wrapped); lives as long as
 * the process. */
const nb__pg_ops *nb__pg_checked(const nb__pg_ops *base);

struct nb_work {
    nb_pg *pg;
    const nb__pg_ops *ops;  /* the group's, kept: a handle may outlive its group */
    const nb__pg_ops *base; /* the backend's, under any layer */
    nb__coll coll;
    char fingerprint[160];
    int refs;             /* the user's, plus the group's while unfinished */
    nb__work_state state;
    nb_status status;
    char *msg;            /* failure message, malloc'd */
    double t_issue, t_start; /* t_start: when it became the group's oldest unfinished work */
    double t_end;            /* when it finished (0 while unfinished) */
    bool warned;             /* the stall warning was printed */
    nb_work *next;        /* the group's queue, issue order */
    void *impl;           /* the backend's part (NCCL: its completion event;
                             Gloo: a small collective's data that arrived in
                             the check layer's exchange) */
    void *check;          /* the check layer's: a header exchange posted early */
};

/* One fingerprint of the flight recorder. */
typedef struct nb__fp_entry {
    uint64_t seq; /* 0: empty */
    char fp[160];
} nb__fp_entry;

struct nb_pg {
    nb__handle handle; /* first: Note [Freed handles] in util/handle.h */
    nb_pg *root, *parent;
    char name[64];        /* "world", "world.g1", ... */
    int rank, size;
    int *global;          /* world rank of each member */
    nb_pg_backend backend;
    const nb__pg_ops *ops;  /* what pg.c calls: base, or the check layer around it */
    const nb__pg_ops *base; /* the backend's */
    void *impl;             /* the backend's state */
    nb_device device;
    double timeout_s;
    nb_dist_env env;

    /* World group only (children use root's). */
    nb_store_server *server;
    bool store_secret;    /* the store admits only holders of the run's secret */
    nb__dist_check check; /* NABLA_DIST_CHECK */
    nb_store *store_main;     /* the user's thread: setup, new_group, user keys */
    nb_store *store_monitor;  /* diagnostics, abort polls, the flight recorder's
                                 publications, under monitor_mu */
    pthread_mutex_t monitor_mu;
    /* Liveness (heartbeat.c, Note [Liveness and progress]). */
    double liveness_s, join_s, stall_s;
    nb_store *store_hb;       /* the heartbeat thread's */
    pthread_t hb_thread;
    pthread_mutex_t hb_mu;
    pthread_cond_t hb_cond;
    bool hb_started, hb_stop;
    char store_owner[320];    /* "host h, pid p" of rank 0, which serves the store */
    int64_t *hb_val;          /* per world rank: the counter last read, */
    double *hb_since;         /* and since when (under monitor_mu) */

    /* Every group. */
    int n_children, n_groups_made; /* subgroups alive / ever made from this one */
    struct {
        uint64_t small;         /* Gloo: collectives run by its one-message algorithm
                                   (Note [Small collectives in one message] in pg_gloo.c), */
        uint64_t small_framed;  /* of which the data came in the check layer's exchange */
        uint64_t pair;          /* Gloo: all-reduces of two ranks in one exchange
                                   (Note [All-reduce of two ranks] in pg_gloo.c) */
        uint64_t ring;          /* Gloo: all-reduces of more ranks by the ring on blocking
                                   connections (Note [Ring on blocking connections]) */
        uint64_t headers_early; /* check layer: header exchanges posted while the
                                   previous collective's data moved */
        uint64_t published;     /* flight recorder: fingerprints sent to the store */
    } stats;

    pthread_mutex_t mu;       /* everything below */
    pthread_cond_t cond;
    pthread_t worker;
    bool worker_started, stopping, worker_done;
    nb_work *q_head, *q_tail; /* unfinished works, issue order */
    uint64_t seq;
    nb_status broken;         /* NB_OK until a collective fails */
    char broken_msg[NB__MSG_LEN];
    nb__fp_entry ring[NB__FP_SLOTS]; /* the flight recorder: seq % NB__FP_SLOTS */
    uint64_t ring_published;         /* every entry up to this seq is in the store */

    pthread_mutex_t watch_mu; /* one watchdog at a time */
    double next_poll;
};

/* pg.c */
NB_PLUGIN_API void nb__work_put(nb_work *w);
const nb__pg_ops *nb__pg_ops_of(nb_pg_backend backend);
/* Numbers, fingerprints and queues a collective, and submits it. */
NB_PLUGIN_API nb_work *nb__pg_issue(nb_pg *pg, const nb__coll *c);
/* One round of a wait outside nb_work_wait (the check layer's on an
 * issuing thread): sleeps `pause`, progress, the watchdog. false when the
 * group broke meanwhile. pg->mu not held. */
bool nb__pg_wait_step(nb_pg *pg, double *pause);
/* With pg->mu held: w is finished; unlinks it and starts the next one's clock. */
NB_PLUGIN_API void nb__pg_finish_locked(nb_pg *pg, nb_work *w, nb_status st, const char *msg);
bool nb__pg_is_loopback(const char *addr);
/* Marks the group broken by `w` (first failure wins), with a diagnosis;
 * wakes every waiter. */
NB_PLUGIN_API void nb__pg_fail(nb_pg *pg, nb_work *w, nb_status st, const char *what);
nb_status nb__pg_start_backend(nb_pg *pg, const char *prefix);
nb_pg *nb__pg_alloc(nb_pg *root, nb_pg *parent, int rank, int size);

/* heartbeat.c */
/* Registers this rank (host, pid) and waits for every rank of the world
 * to do the same; names the ranks that never joined. */
nb_status nb__join(nb_pg *root);
nb_status nb__hb_start(nb_pg *root);
void nb__launcher_lifeline(void); /* Note [Launcher lifeline] */
void nb__hb_stop(nb_pg *root);
/* Has a member of pg been silent for the liveness limit? Fills `what`
 * naming it and returns the status to fail with, or NB_OK. */
nb_status nb__hb_check(nb_pg *pg, char *what, size_t len);

/* pg_diag.c */
/* `what` for a wait that lost the store (the failure in nb_last_error()). */
void nb__diag_store_lost(nb_pg *pg, char *what, size_t len);
/* MGET on the world's monitor connection (any number of keys). */
nb_status nb__diag_mget(nb_pg *pg, char **keys, int n, char **values);

/* Notes w's fingerprint in the group's flight recorder (the moment it
 * starts on this rank); nothing leaves the process. */
void nb__diag_record(nb_pg *pg, const nb_work *w);
/* Sends the flight recorder's entries not yet sent to the store (a wait
 * that runs long, a failure's diagnosis). */
void nb__diag_publish(nb_pg *pg);
/* Writes the diagnosis of w's failure: `what` happened, plus who did not
 * arrive or arrived with another collective, and any abort reason. */
void nb__diag_explain(nb_pg *pg, const nb_work *w, const char *what, char *out, size_t len);
/* The message of a collective whose ranks issued different headers
 * (Note [Collective headers] in pg_check.c); `headers`: every member's
 * NB__COLL_HEADER_WORDS words, in rank order. */
void nb__diag_mismatch(nb_pg *pg, const nb_work *w, const int64_t *headers, char *out, size_t len);
/* Compares every member's header (`headers`, in rank order) with w's:
 * NB_OK when all equal; else NB_ERR_MISMATCH with nb__diag_mismatch's
 * message in `out`. What the check layer decides with. */
nb_status nb__diag_headers(nb_pg *pg, const nb_work *w, const int64_t *headers, char *out, size_t len);
/* Quick checks while w runs: has the run been aborted, or did some rank
 * arrive at w's sequence number with another collective? Fills `what`
 * and returns the status to fail with, or NB_OK. */
nb_status nb__diag_check(nb_pg *pg, const nb_work *w, bool check_desync, char *what, size_t len);

#endif
