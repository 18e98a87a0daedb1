/*
 * mc_proto.h - the memcached protocol core of the PostMan helper fast path.
 *
 * mc_proto.c is the only C file that knows memcached's syntax: the 8-byte UDP
 * frame header and the ASCII protocol.  Three jobs, no I/O, no logging, no
 * global state (every function works on a context the caller passes):
 *
 * 1. Request parser  mch_req_parse()
 *    One client UDP datagram -> get/gets with its keys (slices into the
 *    datagram), a pass-through command whose framing was checked, or a reject
 *    with a reason (enum mch_rej, counted in struct mch_counters).
 *
 *      UDP frame header (network byte order, memcached protocol.txt):
 *        0      2      4      6      8
 *        +------+------+------+------+---------------------------------+
 *        | rid  | seq  |total | rsvd | ASCII command (+ data block)     |
 *        +------+------+------+------+---------------------------------+
 *      total != 1 is rejected (memcached drops it too); seq and rsvd are
 *      ignored, as memcached does.
 *
 * 2. Coalescer  mch_get_open() / mch_get_add() / mch_get_encode()
 *    Gets from many clients become one "get k1 ... kN\r\n" (or "gets" when
 *    any waiter asked gets; get-waiters then see the cas column removed) in a
 *    caller buffer; keys are deduplicated by mc_batch.c.  Pass-through
 *    commands become one-waiter batches: mch_pass_encode().
 *
 * 3. Response splitter  mch_split_*()
 *    A streaming parser of one TCP connection's answers (any chunking, byte
 *    by byte included) that writes each waiting client's UDP reply through a
 *    callback.  Answers must come in the order the batches were pushed.
 *
 * Datagram layout emitted (payload <= MCH_UDP_MAX = 1400 bytes including the
 * 8-byte header, like memcached's UDP_MAX_PAYLOAD_SIZE): the layout of
 * memcached 1.6 itself.  A reply is a sequence of *messages*, each split into
 * datagrams of <= 1392 data bytes numbered seq 0..total-1 under the client's
 * request id:
 *   - one message per hit key: "VALUE <key> <flags> <bytes>[ <cas>]\r\n"
 *     <data> "\r\n", with "END\r\n" appended to the message of the client's
 *     last key when that key is a hit;
 *   - otherwise "END\r\n" alone as the last message (so a miss-only reply is
 *     one datagram "END\r\n");
 *   - a pass-through command's answer is one message.
 * This is byte-identical, datagram by datagram, to what memcached 1.6.18
 * sends the same client for the same request, except that memcached also
 * emits empty 8-byte frames with total = 0 for a miss that is not the last
 * key; those carry no bytes and are not sent.  Hence every client that works
 * with memcached's own UDP replies works unchanged, and the per-message
 * seq/total framing is exactly protocol.txt's.  Streaming per key is also what
 * lets the splitter run in O(1400) bytes per connection whatever the value
 * sizes.
 *
 * Connection errors (garbage, wrong key order, lengths that lie, error lines
 * where values were due, an over-long reply) make mch_split_feed() return an
 * enum mch_err; the caller then calls mch_split_abort(), which answers the
 * waiters still waiting (see there) and resets the splitter, and reconnects.
 */
#ifndef MCH_PROTO_H
#define MCH_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "mc_batch.h"

#define MCH_UDP_HDR  8u
#define MCH_UDP_MAX  1400u                       /* datagram payload incl. header */
#define MCH_UDP_DATA (MCH_UDP_MAX - MCH_UDP_HDR) /* 1392 reply bytes per datagram */
#define MCH_DGRAM_MAX 65535u                     /* largest request datagram */
#define MCH_KEY_MAX  250u
#define MCH_ITEM_MAX (1024u * 1024u)             /* memcached's default -I 1m */
#define MCH_REQ_MAX_KEYS   MCH_BATCH_MAX_KEYS    /* keys in one get request */
#define MCH_REQ_MAX_TOKENS (MCH_REQ_MAX_KEYS + 2u)
#define MCH_CMD_LINE_MAX   2048u                 /* non-retrieval command lines */
/* longest coalesced line: "gets" + 256 * (" " + 250-byte key) + "\r\n" */
#define MCH_GET_LINE_MAX   (6u + MCH_BATCH_MAX_KEYS * (MCH_KEY_MAX + 1u))
#define MCH_REPLY_LINE_MAX 1024u                 /* one line of a TCP answer */
#define MCH_PASS_REPLY_MAX 65536u                /* a whole pass-through answer */
#define MCH_SPLIT_QUEUE    64u                   /* commands in flight per connection */

enum mch_cmd {
	MCH_CMD_NONE = 0,
	MCH_CMD_GET, MCH_CMD_GETS,
	MCH_CMD_SET, MCH_CMD_ADD, MCH_CMD_REPLACE, MCH_CMD_APPEND, MCH_CMD_PREPEND,
	MCH_CMD_CAS,
	MCH_CMD_DELETE, MCH_CMD_INCR, MCH_CMD_DECR, MCH_CMD_TOUCH,
	MCH_CMD_GAT, MCH_CMD_GATS,
	MCH_CMD_VERSION, MCH_CMD_STATS, MCH_CMD_FLUSH_ALL, MCH_CMD_VERBOSITY,
	MCH_CMD__COUNT
};

/* shape of memcached's answer to a command */
enum mch_shape {
	MCH_SHAPE_VALUES = 0, /* VALUE blocks then END (get, gets, gat, gats) */
	MCH_SHAPE_LINE = 1,   /* one line (STORED, DELETED, 42, VERSION x, ...) */
	MCH_SHAPE_STATS = 2,  /* STAT lines then END */
};

enum mch_rej {
	MCH_REJ_OK = 0,
	MCH_REJ_SHORT,         /* fewer than 8 bytes: no frame header */
	MCH_REJ_MULTI_DGRAM,   /* total != 1: multi-datagram request */
	MCH_REJ_OVERSIZE,      /* datagram over 65535 bytes */
	MCH_REJ_EMPTY,         /* header only */
	MCH_REJ_BINARY,        /* binary protocol (magic 0x80): not handled */
	MCH_REJ_NO_CRLF,       /* no "\r\n"-terminated line (bare "\n" included) */
	MCH_REJ_LINE_TOO_LONG, /* command line over MCH_CMD_LINE_MAX */
	MCH_REJ_BAD_CHAR,      /* NUL, CR or LF inside the command line */
	MCH_REJ_UNKNOWN_CMD,   /* not a memcached command (or garbage) */
	MCH_REJ_UNSUPPORTED,   /* a memcached command helpers do not forward */
	MCH_REJ_BAD_FORMAT,    /* wrong argument count or number syntax */
	MCH_REJ_BAD_KEY,       /* key longer than 250 bytes */
	MCH_REJ_TOO_MANY_KEYS, /* more than MCH_REQ_MAX_KEYS keys */
	MCH_REJ_TOO_LARGE,     /* storage command over the 1 MB item limit */
	MCH_REJ_BAD_DATA,      /* data block shorter/longer than <bytes> or no CRLF */
	MCH_REJ_MULTI_CMD,     /* bytes after the command: several commands */
	MCH_REJ__COUNT
};

enum mch_err {
	MCH_ERR_NONE = 0,
	MCH_ERR_UNSOLICITED,    /* bytes while no answer is due */
	MCH_ERR_LINE_TOO_LONG,  /* line over MCH_REPLY_LINE_MAX */
	MCH_ERR_BAD_LINE,       /* line not ending in CRLF, or not a valid answer */
	MCH_ERR_BAD_VALUE_LINE, /* malformed VALUE line (tokens, numbers, cas) */
	MCH_ERR_TOO_BIG,        /* VALUE length over the item limit */
	MCH_ERR_KEY_ORDER,      /* VALUE for a key not asked at this point */
	MCH_ERR_BAD_DATA,       /* data block not followed by CRLF (length lied) */
	MCH_ERR_ERROR,          /* "ERROR" where values were due */
	MCH_ERR_CLIENT_ERROR,   /* "CLIENT_ERROR ..." where values were due */
	MCH_ERR_SERVER_ERROR,   /* "SERVER_ERROR ..." where values were due */
	MCH_ERR_BAD_REPLY,      /* answer does not fit the pass-through command */
	MCH_ERR_REPLY_TOO_BIG,  /* pass-through answer over MCH_PASS_REPLY_MAX */
	MCH_ERR__COUNT
};

/* A slice of the request datagram. */
struct mch_slice {
	uint16_t off;
	uint16_t len;
};

/* A parsed request: slices point into the caller's datagram (no copies). */
struct mch_req {
	const uint8_t *dg; /* the datagram, header included */
	uint32_t len;
	uint16_t rid;
	uint8_t cmd;     /* enum mch_cmd */
	uint8_t shape;   /* enum mch_shape of its answer */
	uint8_t noreply; /* "noreply" given: answer parsed, not sent */
	uint16_t ntok;   /* tokens, "noreply" excluded */
	uint16_t key0;   /* index of the first key token */
	uint16_t nkeys;
	struct mch_slice data; /* storage commands: the data block, CRLF excluded */
	struct mch_slice tok[MCH_REQ_MAX_TOKENS];
};

/* Counters: the fast path counts, it never logs. */
struct mch_counters {
	uint64_t rx;              /* datagrams parsed */
	uint64_t rx_get, rx_gets; /* accepted retrieval requests */
	uint64_t rx_keys;         /* keys in them */
	uint64_t rx_pass;         /* accepted pass-through commands */
	uint64_t rej[MCH_REJ__COUNT];
	uint64_t b_full;          /* adds refused because the batch was full */
	uint64_t b_cmds;          /* coalesced get commands written */
	uint64_t b_keys;          /* key positions in them */
	uint64_t b_refs;          /* (request, key) pairs they serve: refs - keys = dedup */
	uint64_t b_waiters;       /* client requests they serve */
	uint64_t b_pass;          /* pass-through commands written */
	uint64_t s_values, s_value_bytes, s_misses, s_lines;
	uint64_t s_err[MCH_ERR__COUNT];
	uint64_t tx_dgrams, tx_bytes;
	uint64_t w_done;          /* waiters answered in full */
	uint64_t w_silent;        /* noreply waiters completed without a reply */
	uint64_t w_abort_miss;    /* answered END on a connection error */
	uint64_t w_abort_drop;    /* dropped on a connection error */
};

/* ---- 1. request parser ---- */

/* Parse one datagram (header included).  r is filled when MCH_REJ_OK. */
enum mch_rej mch_req_parse(struct mch_req *r, const uint8_t *dg, size_t len,
			   struct mch_counters *c);

static inline int mch_req_is_get(const struct mch_req *r)
{
	return r->cmd == MCH_CMD_GET || r->cmd == MCH_CMD_GETS;
}

static inline const uint8_t *mch_req_key(const struct mch_req *r, uint32_t i, uint32_t *len)
{
	const struct mch_slice *s = &r->tok[r->key0 + i];

	*len = s->len;
	return r->dg + s->off;
}

/*
 * A datagram the parser rejected may still be one memcached answers (ERROR,
 * CLIENT_ERROR ..., several commands): the helper relays such datagrams to
 * memcached's UDP port as they are (issue 43).  This says whether that is safe:
 * 1 when memcached's shared UDP parser is done with the datagram at its end —
 * every line that starts like a storage command has its declared length + CRLF
 * inside the datagram and within the item limit — and it is not binary or
 * multi-datagram (memcached drops those); 0 otherwise (then it is dropped, as
 * memcached would leave other clients' datagrams swallowed).
 */
int mch_req_relay_safe(const uint8_t *dg, size_t len);

/* ---- 2. coalescer ---- */

/*
 * Start a coalesced get batch: at most max_keys positions and max_line bytes
 * of command line (both clamped to MCH_BATCH_MAX_KEYS / MCH_GET_LINE_MAX;
 * memcached 1.6 accepts multi-get lines far longer, see the tests).
 */
void mch_get_open(struct mch_batch *b, uint32_t max_keys, uint32_t max_line);

/* Add a get/gets request of `client`.  Returns enum mch_badd. */
int mch_get_add(struct mch_batch *b, const struct mch_req *r, uint32_t client,
		struct mch_counters *c);

/*
 * Write the batch's command line (no adds after this); returns its length, 0 if
 * the batch is empty or cap is short.
 */
size_t mch_get_encode(struct mch_batch *b, uint8_t *out, size_t cap, struct mch_counters *c);

/*
 * Make b a one-waiter batch for a pass-through request and write the command
 * to out: the request's tokens joined by single spaces, "noreply" removed (the
 * answer is then parsed and not sent, so every command on the connection gets
 * exactly one answer), and the data block.  Returns the length, 0 if cap is
 * short or r is a get.
 */
size_t mch_pass_encode(struct mch_batch *b, const struct mch_req *r, uint32_t client,
		       uint8_t *out, size_t cap, struct mch_counters *c);

/* ---- 3. response splitter ---- */

struct mch_sink {
	/* one UDP payload (header included, <= MCH_UDP_MAX) for a client */
	void (*dgram)(void *arg, uint32_t client, const uint8_t *dg, uint32_t len);
	/* the batch's answer is complete (or aborted): it may be reused */
	void (*done)(void *arg, struct mch_batch *b);
	void *arg;
};

struct mch_stage {
	uint32_t fill; /* data bytes in buf after the header room */
	uint16_t seq;  /* datagrams already sent of the current message */
	uint8_t buf[MCH_UDP_MAX];
};

struct mch_split {
	struct mch_sink sink;
	struct mch_counters *ctr;
	struct mch_batch *q[MCH_SPLIT_QUEUE];
	uint32_t qhead, qlen;
	uint8_t err;    /* sticky enum mch_err */
	uint8_t state;  /* reading a line or a data block */
	uint8_t groups; /* line variants in use for the current value */
	uint32_t llen;
	uint32_t next_pos;  /* first position not yet answered */
	uint32_t hit;       /* position of the value being streamed */
	uint32_t hits;      /* values seen in the current answer */
	uint32_t data_left; /* data bytes + CRLF still due */
	uint16_t tot_noend[2], tot_end[2];
	uint32_t rlen;
	struct mch_stage st[2]; /* 0: VALUE line as received, 1: cas removed */
	uint8_t line[MCH_REPLY_LINE_MAX];
	uint8_t rbuf[MCH_PASS_REPLY_MAX];
};

void mch_split_init(struct mch_split *s, const struct mch_sink *sink, struct mch_counters *c);

/* Expect b's answer after those already queued.  0, or -1 if the queue is full. */
int mch_split_push(struct mch_split *s, struct mch_batch *b);

/* Feed bytes read from the connection.  MCH_ERR_NONE or the (sticky) error. */
int mch_split_feed(struct mch_split *s, const uint8_t *p, size_t n);

/*
 * After an error or a lost connection: every waiter still waiting is
 * answered "END\r\n" (a miss: always a legal cache answer, and quicker for
 * the client than a timeout) when it waits on a coalesced get and no message
 * of its is half sent; otherwise (half-sent message, or a pass-through
 * command whose effect is unknown) it is dropped, as a lost UDP datagram
 * would be.  All queued batches are completed through sink.done; the
 * splitter is then empty and healthy.
 */
void mch_split_abort(struct mch_split *s);

static inline uint32_t mch_split_pending(const struct mch_split *s)
{
	return s->qlen;
}

/* ---- names for counters and drivers ---- */
const char *mch_rej_name(int rej);
const char *mch_err_name(int err);
const char *mch_cmd_name(int cmd);

#endif /* MCH_PROTO_H */
