/* dtrain's NCCL tuner plugin: forces each tensor class's (algorithm, protocol) on that class's communicators.
 *
 * Built by `python -m collectives.nccl build-tuner` (plain C, no CUDA or NCCL headers needed) and loaded by NCCL
 * through NCCL_TUNER_PLUGIN=<path of the .so>. Written from NCCL's src/include/nccl_tuner.h and its example plugin
 * (plugins/tuner/example/); the struct layouts are NCCL's
 * tuner interface versions 3 to 6, declared here by hand so the plugin builds anywhere.
 *
 * Per communicator, at init:
 *   DTRAIN_TUNER_CLASS  the tensor class this communicator serves; dtrain sets it only while that class's process
 *                       group is created (unset: the job's other communicators, which the plugin leaves alone).
 *   DTRAIN_TUNER_RULES  the rules file, one rule a line, `#` comments:
 *                         class,collective,min_bytes,max_bytes,algorithm,protocol,channels
 *                       class `*` serves classes without rules of their own; algorithm or protocol -1 = the cheapest
 *                       enabled cell of the other; max_bytes -1 = no bound; channels -1 = NCCL's count.
 * Per collective (getCollInfo): the first matching rule picks a cell of NCCL's cost table; the plugin writes 0.0 into
 * it, which makes it the cheapest, so NCCL selects it. A cell NCCL disabled (-1.0, NCCL_ALGO_PROTO_IGNORE) cannot be
 * re-enabled: the table is then left as it is and that is logged once per rule and communicator.
 */

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ---- NCCL's plugin ABI (nccl_tuner.h / nccl_common.h), declared by hand ------------------------------------- */

typedef int ncclResult_t; /* an enum in NCCL: ncclSuccess = 0, ncclInternalError = 3, ncclInvalidArgument = 4 */
#define ncclSuccess 0
#define ncclSystemError 2
#define ncclInternalError 3
typedef int ncclFunc_t; /* Broadcast 0, Reduce 1, AllGather 2, ReduceScatter 3, AllReduce 4 */
typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);
#define NCCL_LOG_WARN 2
#define NCCL_LOG_INFO 3
#define NCCL_TUNING 0x40

#define N_ALGOS 7  /* Tree Ring CollNetDirect CollNetChain NVLS NVLSTree PAT (src/include/nccl_tuner.h) */
#define N_PROTOS 3 /* LL LL128 Simple */
#define IGNORE_COST (-1.0f)

/* v5/v6 extra init arguments: read by nobody here, declared for the argument types only. */
typedef struct { int nNvlDomains, minRanksPerNvlDomain, maxRanksPerNvlDomain; } nvlDomainInfo_t;
typedef struct {
  double baseLatencies[7][3];
  double hwLatencies[3][7][3];
  double llMaxBws[4][3];
  double perChMaxRingLL128Bws[4][3];
  double perChMaxTreeLL128Bws[4][3];
  double perChMaxTreeBws[4][3];
  double perChMaxNVLSTreeBws[4][3];
} tunerConstants_t;

/* ---- rules ------------------------------------------------------------------------------------------------ */

#define MAX_RULES 64
#define NAME_LEN 64

typedef struct {
  int coll;          /* ncclFunc_t, -1 = any */
  uint64_t minBytes; /* inclusive */
  uint64_t maxBytes; /* inclusive; UINT64_MAX = no bound */
  int algo, proto;   /* -1 = cheapest enabled cell of the other one */
  int channels;      /* -1 = keep NCCL's */
  int warned;        /* the disabled-cell message was logged for this rule */
} rule_t;

typedef struct {
  char cls[NAME_LEN];
  size_t nRanks, nNodes;
  ncclDebugLogger_t log;
  int nRules;
  rule_t rules[MAX_RULES];
} context_t;

static const char* const ALGO_NAMES[N_ALGOS] = {"tree", "ring", "collnet_direct", "collnet_chain",
                                                "nvls", "nvls_tree", "pat"};
static const char* const PROTO_NAMES[N_PROTOS] = {"ll", "ll128", "simple"};
static const char* const COLL_NAMES[5] = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce"};

#define LOG(ctx, level, ...) \
  do { if ((ctx)->log) (ctx)->log(level, NCCL_TUNING, __FILE__, __LINE__, __VA_ARGS__); } while (0)

static int lookup(const char* s, const char* const* names, int n) {
  if (strcmp(s, "-1") == 0) return -1;
  for (int i = 0; i < n; i++)
    if (strcasecmp(s, names[i]) == 0) return i;
  return -2;
}

static char* trim(char* s) {
  while (*s == ' ' || *s == '\t') s++;
  char* end = s + strlen(s);
  while (end > s && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n' || end[-1] == '\r')) *--end = '\0';
  return s;
}

/* Parse one rule line into `r`; returns 1 when the line belongs to class `cls`, 0 when not, -1 when malformed. */
static int parse_rule(char* line, const char* cls, rule_t* r) {
  char* field[7];
  int n = 0;
  for (char* save = NULL, *tok = strtok_r(line, ",", &save); tok && n < 7; tok = strtok_r(NULL, ",", &save))
    field[n++] = trim(tok);
  if (n != 7) return -1;
  if (strcmp(field[0], cls) != 0) return 0;
  char* end;
  r->coll = lookup(field[1], COLL_NAMES, 5);
  r->minBytes = strtoull(field[2], &end, 10);
  if (*end) return -1;
  r->maxBytes = strcmp(field[3], "-1") == 0 ? UINT64_MAX : strtoull(field[3], &end, 10);
  if (strcmp(field[3], "-1") != 0 && *end) return -1;
  r->algo = lookup(field[4], ALGO_NAMES, N_ALGOS);
  r->proto = lookup(field[5], PROTO_NAMES, N_PROTOS);
  r->channels = (int)strtol(field[6], &end, 10);
  if (*end || r->coll == -2 || r->algo == -2 || r->proto == -2) return -1;
  r->warned = 0;
  return 1;
}

/* Load the rules of class `cls` (or, when it has none, those of `*`). Malformed lines are an error: a rules file is
 * written by dtrain, so a bad line means a bug or a hand edit, never something to skip silently. */
static ncclResult_t load_rules(context_t* ctx, const char* path, const char* cls) {
  FILE* f = fopen(path, "r");
  if (!f) {
    LOG(ctx, NCCL_LOG_WARN, "dtrain tuner: cannot open rules file %s", path);
    return ncclSystemError;
  }
  char line[512];
  int lineno = 0;
  ncclResult_t ret = ncclSuccess;
  ctx->nRules = 0;
  while (fgets(line, sizeof line, f)) {
    lineno++;
    char* s = trim(line);
    if (*s == '\0' || *s == '#') continue;
    rule_t r;
    int ok = parse_rule(s, cls, &r);
    if (ok < 0) {
      LOG(ctx, NCCL_LOG_WARN, "dtrain tuner: %s:%d: malformed rule", path, lineno);
      ret = ncclInternalError;
      break;
    }
    if (ok == 1) {
      if (ctx->nRules == MAX_RULES) {
        LOG(ctx, NCCL_LOG_WARN, "dtrain tuner: %s: more than %d rules for class %s", path, MAX_RULES, cls);
        ret = ncclInternalError;
        break;
      }
      ctx->rules[ctx->nRules++] = r;
    }
  }
  fclose(f);
  return ret;
}

/* ---- the plugin's three calls, version-independent ---------------------------------------------------------- */

static ncclResult_t dtrain_init(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** context) {
  context_t* ctx = (context_t*)calloc(1, sizeof(context_t));
  if (!ctx) return ncclSystemError;
  ctx->nRanks = nRanks;
  ctx->nNodes = nNodes;
  ctx->log = log;
  const char* cls = getenv("DTRAIN_TUNER_CLASS");
  const char* path = getenv("DTRAIN_TUNER_RULES");
  if (cls && *cls && path && *path) {
    snprintf(ctx->cls, NAME_LEN, "%s", cls);
    ncclResult_t ret = load_rules(ctx, path, ctx->cls);
    if (ret == ncclSuccess && ctx->nRules == 0) ret = load_rules(ctx, path, "*");
    if (ret != ncclSuccess) {
      free(ctx);
      return ret;
    }
  }
  LOG(ctx, NCCL_LOG_INFO, "dtrain tuner: communicator of class %s (%zu ranks, %zu nodes): %d rules",
      ctx->cls[0] ? ctx->cls : "(none)", nRanks, nNodes, ctx->nRules);
  *context = ctx;
  return ncclSuccess;
}

/* The cell a rule forces given this cost table, or -1 when its cell (or every candidate cell) is disabled. */
static int pick_cell(const rule_t* r, const float* table, int numAlgo, int numProto) {
  int best = -1;
  for (int a = 0; a < numAlgo; a++) {
    if (r->algo >= 0 && a != r->algo) continue;
    for (int p = 0; p < numProto; p++) {
      if (r->proto >= 0 && p != r->proto) continue;
      float t = table[a * numProto + p];
      if (t < 0) continue; /* NCCL_ALGO_PROTO_IGNORE: NCCL disabled that cell here */
      if (best < 0 || t < table[best]) best = a * numProto + p;
    }
  }
  return best;
}

static ncclResult_t dtrain_get_coll_info(void* context, ncclFunc_t coll, size_t nBytes, float** collCostTable,
                                         int numAlgo, int numProto, int* nChannels) {
  context_t* ctx = (context_t*)context;
  if (!ctx) return ncclInternalError;
  /* NCCL passes its float[numAlgo][numProto] array cast to float** (see the example plugin): index it flat. */
  float* table = (float*)collCostTable;
  for (int i = 0; i < ctx->nRules; i++) {
    rule_t* r = &ctx->rules[i];
    if ((r->coll >= 0 && r->coll != coll) || nBytes < r->minBytes || nBytes > r->maxBytes) continue;
    if ((r->algo >= 0 && r->algo >= numAlgo) || (r->proto >= 0 && r->proto >= numProto)) return ncclSuccess;
    if (r->algo >= 0 || r->proto >= 0) {
      int cell = pick_cell(r, table, numAlgo, numProto);
      if (cell < 0) {
        if (!r->warned) {
          r->warned = 1;
          LOG(ctx, NCCL_LOG_INFO, "dtrain tuner: class %s: %s/%s is disabled by NCCL here; NCCL's choice is kept",
              ctx->cls, r->algo >= 0 ? ALGO_NAMES[r->algo] : "any", r->proto >= 0 ? PROTO_NAMES[r->proto] : "any");
        }
        return ncclSuccess; /* leave NCCL's choice and its channel count alone */
      }
      table[cell] = 0.0f;
    }
    if (r->channels > 0) *nChannels = r->channels;
    return ncclSuccess; /* the first matching rule wins, as in NCCL's example plugin */
  }
  return ncclSuccess;
}

static ncclResult_t dtrain_finalize(void* context) {
  free(context);
  return ncclSuccess;
}

/* ---- the exported versions, v6 to v3: NCCL takes the newest one it knows ------------------------------------ */

static ncclResult_t init_v5(void** context, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                            nvlDomainInfo_t* nvl, tunerConstants_t* constants) {
  (void)commId; (void)nvl; (void)constants; /* NCCL's own constants are left as they are */
  return dtrain_init(nRanks, nNodes, log, context);
}

static ncclResult_t get_coll_info_v4(void* context, ncclFunc_t coll, size_t nBytes, int numPipeOps,
                                     float** table, int numAlgo, int numProto, int regBuff, int* nChannels) {
  (void)numPipeOps; (void)regBuff;
  return dtrain_get_coll_info(context, coll, nBytes, table, numAlgo, numProto, nChannels);
}

static ncclResult_t get_coll_info_v3(void* context, ncclFunc_t coll, size_t nBytes, int numPipeOps,
                                     float** table, int numAlgo, int numProto, int* nChannels) {
  (void)numPipeOps;
  return dtrain_get_coll_info(context, coll, nBytes, table, numAlgo, numProto, nChannels);
}

typedef struct {
  const char* name;
  ncclResult_t (*init)(void**, uint64_t, size_t, size_t, ncclDebugLogger_t, nvlDomainInfo_t*, tunerConstants_t*);
  ncclResult_t (*getCollInfo)(void*, ncclFunc_t, size_t, int, float**, int, int, int, int*);
  ncclResult_t (*finalize)(void*);
  ncclResult_t (*getChunkSize)(void*, ncclFunc_t, size_t, int, int, int, size_t*); /* optional: NULL */
} tuner_v6_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void**, uint64_t, size_t, size_t, ncclDebugLogger_t, nvlDomainInfo_t*, tunerConstants_t*);
  ncclResult_t (*getCollInfo)(void*, ncclFunc_t, size_t, int, float**, int, int, int, int*);
  ncclResult_t (*finalize)(void*);
} tuner_v5_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t, size_t, ncclDebugLogger_t, void**);
  ncclResult_t (*getCollInfo)(void*, ncclFunc_t, size_t, int, float**, int, int, int, int*);
  ncclResult_t (*destroy)(void*);
} tuner_v4_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t, size_t, ncclDebugLogger_t, void**);
  ncclResult_t (*getCollInfo)(void*, ncclFunc_t, size_t, int, float**, int, int, int*);
  ncclResult_t (*destroy)(void*);
} tuner_v3_t;

#define PLUGIN_NAME "dtrain"
const tuner_v6_t ncclTunerPlugin_v6 = {PLUGIN_NAME, init_v5, get_coll_info_v4, dtrain_finalize, NULL};
const tuner_v5_t ncclTunerPlugin_v5 = {PLUGIN_NAME, init_v5, get_coll_info_v4, dtrain_finalize};
const tuner_v4_t ncclTunerPlugin_v4 = {PLUGIN_NAME, dtrain_init, get_coll_info_v4, dtrain_finalize};
const tuner_v3_t ncclTunerPlugin_v3 = {PLUGIN_NAME, dtrain_init, get_coll_info_v3, dtrain_finalize};
