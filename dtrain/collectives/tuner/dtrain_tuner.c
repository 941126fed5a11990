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
 *   NCCL_TUNER_CONFIG_FILE  a config file of NCCL's example tuner plugin (ext-tuner/example/README.md), read
 *                       unchanged, for every communicator, after the class's rules (its lines may also stand in
 *                       the rules file above):
 *                         collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks[,numPipeOps
 *                         [,regBuff]]
 *                       matched as that plugin matches them: nNodes, nRanks, numPipeOps, regBuff -1 = any;
 *                       channels -1 = NCCL's count; max_bytes -1 = no bound (its strtoull reads -1 as the largest
 *                       size). Unlike it, a name it does not know is an error, not ring/simple/allreduce, and an
 *                       unmatched collective keeps NCCL's channel count (the example sets 1 before matching).
 * Per collective (getCollInfo): the first matching rule picks a cell of NCCL's cost table; the plugin writes 0.0 into
 * it, which makes it the cheapest, so NCCL selects it. A cell NCCL disabled (-1.0, NCCL_ALGO_PROTO_IGNORE) cannot be
 * re-enabled: a dtrain rule then leaves the table as it is, an example-format rule passes to the next rule (as the
 * example plugin does); either is logged once per rule and communicator.
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

#define MAX_RULES 256
#define NAME_LEN 64
#define EXAMPLE_MIN_FIELDS 8  /* the example plugin's format: up to nRanks; numPipeOps and regBuff optional */
#define EXAMPLE_MAX_FIELDS 10

typedef struct {
  int coll;          /* ncclFunc_t, -1 = any */
  uint64_t minBytes; /* inclusive */
  uint64_t maxBytes; /* inclusive; UINT64_MAX = no bound */
  int algo, proto;   /* -1 = cheapest enabled cell of the other one */
  int channels;      /* -1 = keep NCCL's */
  int nNodes, nRanks, numPipeOps, regBuff; /* the example plugin's format; -1 = any (dtrain's rules: always -1) */
  int example;       /* from the example plugin's format: a disabled cell passes to the next rule */
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

/* Split `line` at commas into at most `max` trimmed fields; returns how many there were (max + 1: too many). */
static int split(char* line, char** field, int max) {
  int n = 0;
  for (char *save = NULL, *tok = strtok_r(line, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (n == max) return max + 1;
    field[n++] = trim(tok);
  }
  return n;
}

/* A whole decimal number in [lo, hi]; 0 when `s` is not one. */
static int parse_int(const char* s, long lo, long hi, int* out) {
  char* end;
  long v = strtol(s, &end, 10);
  if (!*s || *end || v < lo || v > hi) return 0;
  *out = (int)v;
  return 1;
}

static int parse_size(const char* s, int allowNone, uint64_t* out) {
  char* end;
  if (allowNone && strcmp(s, "-1") == 0) { *out = UINT64_MAX; return 1; }
  if (!*s || *s == '-' || *s == '+') return 0;
  *out = strtoull(s, &end, 10);
  return *end == '\0';
}

/* dtrain's rule: class,collective,min_bytes,max_bytes,algorithm,protocol,channels. */
static int parse_dtrain(char** field, rule_t* r) {
  r->coll = lookup(field[1], COLL_NAMES, 5);
  r->algo = lookup(field[4], ALGO_NAMES, N_ALGOS);
  r->proto = lookup(field[5], PROTO_NAMES, N_PROTOS);
  r->nNodes = r->nRanks = r->numPipeOps = r->regBuff = -1;
  r->example = 0;
  return r->coll != -2 && r->algo != -2 && r->proto != -2 && parse_size(field[2], 0, &r->minBytes) &&
         parse_size(field[3], 1, &r->maxBytes) && parse_int(field[6], -1, 1 << 20, &r->channels);
}

/* A name exactly as NCCL's example plugin spells it (strcmp there): its index, or -1. */
static int lookup_exact(const char* s, const char* const* names, int n) {
  for (int i = 0; i < n; i++)
    if (strcmp(s, names[i]) == 0) return i;
  return -1;
}

/* The example plugin's rule: collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks
 * [,numPipeOps[,regBuff]]; names exactly as that plugin spells them, every one named (no -1 algorithm). */
static int parse_example(char** field, int n, rule_t* r) {
  r->coll = lookup_exact(field[0], COLL_NAMES, 5);
  r->algo = lookup_exact(field[3], ALGO_NAMES, N_ALGOS);
  r->proto = lookup_exact(field[4], PROTO_NAMES, N_PROTOS);
  r->numPipeOps = r->regBuff = -1;
  r->example = 1;
  return r->coll >= 0 && r->algo >= 0 && r->proto >= 0 && parse_size(field[1], 0, &r->minBytes) &&
         parse_size(field[2], 1, &r->maxBytes) && parse_int(field[5], -1, 1 << 20, &r->channels) &&
         r->channels != 0 && parse_int(field[6], -1, 1 << 20, &r->nNodes) && r->nNodes != 0 &&
         parse_int(field[7], -1, 1 << 30, &r->nRanks) && r->nRanks != 0 &&
         (n < 9 || (parse_int(field[8], -1, 1 << 20, &r->numPipeOps) && r->numPipeOps != 0)) &&
         (n < 10 || parse_int(field[9], -1, 1, &r->regBuff));
}

/* Load a rules file: dtrain's rules of class `cls` (or, when it has none, those of `*`; none when `cls` is NULL,
 * or when `exampleOnly`) then the example plugin's rules, in file order, after any rules already loaded. Malformed
 * lines are an error: `python -m collectives.nccl` checks a file before a job (one line naming file and line), so
 * a bad line here means the file changed since, never something to skip silently. */
static ncclResult_t load_rules(context_t* ctx, const char* path, const char* cls, int exampleOnly) {
  FILE* f = fopen(path, "r");
  if (!f) {
    LOG(ctx, NCCL_LOG_WARN, "dtrain tuner: cannot open rules file %s", path);
    return ncclSystemError;
  }
  rule_t* own = (rule_t*)calloc(3 * MAX_RULES, sizeof(rule_t)); /* then star, then example */
  if (!own) {
    fclose(f);
    return ncclSystemError;
  }
  rule_t *star = own + MAX_RULES, *example = own + 2 * MAX_RULES;
  int nOwn = 0, nStar = 0, nExample = 0;
  char line[512];
  int lineno = 0;
  ncclResult_t ret = ncclSuccess;
  while (ret == ncclSuccess && fgets(line, sizeof line, f)) {
    lineno++;
    char* s = trim(line);
    if (*s == '\0' || *s == '#') continue;
    char* field[EXAMPLE_MAX_FIELDS];
    int n = split(s, field, EXAMPLE_MAX_FIELDS);
    if (n >= EXAMPLE_MIN_FIELDS && strcmp(field[0], "collective_type") == 0) continue; /* a spreadsheet's heading */
    rule_t r;
    memset(&r, 0, sizeof r);
    int ok = 0;
    rule_t* into = NULL;
    int* count = NULL;
    if (n == 7 && !exampleOnly) {
      ok = parse_dtrain(field, &r);
      if (cls && strcmp(field[0], cls) == 0) { into = own; count = &nOwn; }
      else if (strcmp(field[0], "*") == 0) { into = star; count = &nStar; }
    } else if (n >= EXAMPLE_MIN_FIELDS && n <= EXAMPLE_MAX_FIELDS) {
      ok = parse_example(field, n, &r);
      into = example;
      count = &nExample;
    }
    if (!ok) {
      LOG(ctx, NCCL_LOG_WARN, "dtrain tuner: %s:%d: malformed rule", path, lineno);
      ret = ncclInternalError;
    } else if (into && *count == MAX_RULES) {
      LOG(ctx, NCCL_LOG_WARN, "dtrain tuner: %s: more than %d rules", path, MAX_RULES);
      ret = ncclInternalError;
    } else if (into) {
      into[(*count)++] = r;
    }
  }
  fclose(f);
  const rule_t* mine = nOwn ? own : star;
  int nMine = !cls ? 0 : nOwn ? nOwn : nStar; /* a communicator without a class: no class rules, not even `*` */
  if (ret == ncclSuccess && ctx->nRules + nMine + nExample > MAX_RULES) {
    LOG(ctx, NCCL_LOG_WARN, "dtrain tuner: more than %d rules in all", MAX_RULES);
    ret = ncclInternalError;
  }
  if (ret == ncclSuccess) {
    memcpy(ctx->rules + ctx->nRules, mine, nMine * sizeof(rule_t));
    ctx->nRules += nMine;
    memcpy(ctx->rules + ctx->nRules, example, nExample * sizeof(rule_t));
    ctx->nRules += nExample;
  }
  free(own);
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
  const char* example = getenv("NCCL_TUNER_CONFIG_FILE"); /* the example plugin's variable, its file unchanged */
  if (cls && *cls) snprintf(ctx->cls, NAME_LEN, "%s", cls);
  ncclResult_t ret = ncclSuccess;
  if (path && *path) ret = load_rules(ctx, path, ctx->cls[0] ? ctx->cls : NULL, 0);
  if (ret == ncclSuccess && example && *example) ret = load_rules(ctx, example, NULL, 1);
  if (ret != ncclSuccess) {
    free(ctx);
    return ret;
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

/* regBuff -1: the caller (interface v3) does not say, so a rule asking for one value does not match. */
static ncclResult_t dtrain_get_coll_info(void* context, ncclFunc_t coll, size_t nBytes, int numPipeOps,
                                         float** collCostTable, int numAlgo, int numProto, int regBuff,
                                         int* nChannels) {
  context_t* ctx = (context_t*)context;
  if (!ctx) return ncclInternalError;
  /* NCCL passes its float[numAlgo][numProto] array cast to float** (see the example plugin): index it flat. */
  float* table = (float*)collCostTable;
  for (int i = 0; i < ctx->nRules; i++) {
    rule_t* r = &ctx->rules[i];
    if ((r->coll >= 0 && r->coll != coll) || nBytes < r->minBytes || nBytes > r->maxBytes) continue;
    if ((r->nNodes != -1 && (size_t)r->nNodes != ctx->nNodes) ||
        (r->nRanks != -1 && (size_t)r->nRanks != ctx->nRanks) ||
        (r->numPipeOps != -1 && r->numPipeOps != numPipeOps) || (r->regBuff != -1 && r->regBuff != regBuff))
      continue;
    if ((r->algo >= 0 && r->algo >= numAlgo) || (r->proto >= 0 && r->proto >= numProto)) {
      if (r->example) continue; /* the example plugin: out of this table's bounds, try the next rule */
      return ncclSuccess;
    }
    if (r->algo >= 0 || r->proto >= 0) {
      int cell = pick_cell(r, table, numAlgo, numProto);
      if (cell < 0) {
        if (!r->warned) {
          r->warned = 1;
          LOG(ctx, NCCL_LOG_INFO, "dtrain tuner: class %s: %s/%s is disabled by NCCL here; %s",
              ctx->cls[0] ? ctx->cls : "(none)", r->algo >= 0 ? ALGO_NAMES[r->algo] : "any",
              r->proto >= 0 ? PROTO_NAMES[r->proto] : "any",
              r->example ? "trying the next rule" : "NCCL's choice is kept");
        }
        if (r->example) continue; /* as the example plugin: the next matching rule may apply */
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
  return dtrain_get_coll_info(context, coll, nBytes, numPipeOps, table, numAlgo, numProto, regBuff, nChannels);
}

static ncclResult_t get_coll_info_v3(void* context, ncclFunc_t coll, size_t nBytes, int numPipeOps,
                                     float** table, int numAlgo, int numProto, int* nChannels) {
  return dtrain_get_coll_info(context, coll, nBytes, numPipeOps, table, numAlgo, numProto, -1, nChannels);
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
