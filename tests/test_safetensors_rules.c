/* The safetensors reader follows the reference reader's rules (issue 14, item 11): hand-made
 * files, each imported into an engine with one F32 parameter "a" of one element. Every file the
 * reference refuses is refused with SG_ERR_CORRUPT and a message naming the real reason
 * (overlapping data, bytes after the last tensor, a gap, metadata values that are not strings,
 * a header over the 100,000,000-byte limit, offsets that run backwards, an unknown dtype, a size
 * that does not match the shape, a header that is not UTF-8); every file it accepts imports.
 * python/tests/test_safetensors_rules.py checks the same table against the `safetensors`
 * package itself. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sg_test_check.h"

#define T "\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":"

static const struct {
  const char *label, *json;
  size_t data; /* bytes after the header */
  const char *why; /* NULL: the file must import; else a substring of the refusal */
} k_cases[] = {
    {"plain", "{\"a\":{" T "[0,4]}}", 4, NULL},
    {"metadata of strings", "{\"__metadata__\":{\"k\":\"v\",\"x\":\"\"},\"a\":{" T "[0,4]}}", 4, NULL},
    {"metadata null", "{\"__metadata__\":null,\"a\":{" T "[0,4]}}", 4, NULL},
    {"extra key in a tensor", "{\"a\":{" T "[0,4],\"extra\":[1,{}]}}", 4, NULL},
    {"tensors out of order", "{\"b\":{" T "[4,8]},\"a\":{" T "[0,4]}}", 8, NULL},
    {"empty tensor between", "{\"a\":{" T "[0,4]},\"z\":{\"dtype\":\"F32\",\"shape\":[0],"
     "\"data_offsets\":[4,4]}}", 4, NULL},
    {"other known dtypes", "{\"a\":{" T "[0,4]},\"i\":{\"dtype\":\"I64\",\"shape\":[2],"
     "\"data_offsets\":[4,20]},\"f4\":{\"dtype\":\"F4\",\"shape\":[2],\"data_offsets\":[20,21]}}",
     21, NULL},
    {"spaces after the JSON", "{\"a\":{" T "[0,4]}}     ", 4, NULL},
    {"overlapping data", "{\"a\":{" T "[0,4]},\"b\":{" T "[0,4]}}", 4, "overlap"},
    {"partly overlapping", "{\"a\":{" T "[0,4]},\"b\":{\"dtype\":\"F16\",\"shape\":[2],"
     "\"data_offsets\":[2,6]}}", 6, "overlap"},
    {"bytes after the last tensor", "{\"a\":{" T "[0,4]}}", 8, "after the last tensor"},
    {"no tensors but data", "{}", 4, "after the last tensor"},
    {"a gap", "{\"a\":{" T "[4,8]}}", 8, "belong to no tensor"},
    {"data past the end", "{\"a\":{" T "[0,4]}}", 2, "past the end"},
    {"metadata value a number", "{\"__metadata__\":{\"k\":1},\"a\":{" T "[0,4]}}", 4,
     "not a string"},
    {"metadata value an object", "{\"__metadata__\":{\"k\":{\"x\":\"y\"}},\"a\":{" T "[0,4]}}", 4,
     "not a string"},
    {"metadata a string", "{\"__metadata__\":\"s\",\"a\":{" T "[0,4]}}", 4, "object of strings"},
    {"metadata twice", "{\"__metadata__\":{},\"__metadata__\":{},\"a\":{" T "[0,4]}}", 4,
     "twice"},
    {"offsets backwards", "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,0]}}", 4,
     "end before it begins"},
    {"unknown dtype", "{\"a\":{\"dtype\":\"Q7\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
     "does not define"},
    {"size does not match the shape", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],"
     "\"data_offsets\":[0,4]}}", 4, "need 8 bytes"},
    {"shape overflows", "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],"
     "\"data_offsets\":[0,4]}}", 4, "overflows"},
    {"elements overflow in bytes", "{\"a\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],"
     "\"data_offsets\":[0,4]}}", 4, "overflow 64 bits"},
    {"header not UTF-8", "{\"a\":{" T "[0,4]},\"\xff\":{" T "[4,8]}}", 8, "not valid UTF-8"},
    {"tensor without dtype", "{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "lacks"},
    {"trailing characters", "{\"a\":{" T "[0,4]}}x", 4, "after the header JSON"},
    {"not an object", "[1]", 0, "not a JSON object"},
};

static sg_status import_bytes(sg_engine *e, const char *path, const char *json, size_t data,
                              uint64_t hlen_override) {
  const size_t n = strlen(json);
  const uint64_t hl = hlen_override ? hlen_override : n;
  uint8_t *buf = calloc(8 + n + data + 1, 1);
  for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(hl >> (8 * i));
  memcpy(buf + 8, json, n);
  FILE *f = fopen(path, "wb");
  if (f) {
    fwrite(buf, 1, 8 + n + data, f);
    fclose(f);
  }
  free(buf);
  return sg_import(e, path);
}

int main(void) {
  const char *t = getenv("TMPDIR");
  char dir[300], path[400];
  snprintf(dir, sizeof dir, "%s/sg_strules_XXXXXX", t && *t ? t : "/tmp");
  if (!mkdtemp(dir)) return 1;
  snprintf(path, sizeof path, "%s/x.safetensors", dir);
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  int id = 0;
  if (!CHECK(sg_comm_create_local(1, &c) == SG_OK && sg_engine_create(c, &cfg, &e) == SG_OK &&
                 sg_add_param(e, "a", 1, 0, &id) == SG_OK && sg_finalize(e) == SG_OK,
             "engine with one parameter"))
    return sg_test_summary("");
  for (size_t k = 0; k < sizeof k_cases / sizeof k_cases[0]; k++) {
    const sg_status st = import_bytes(e, path, k_cases[k].json, k_cases[k].data, 0);
    const char *err = sg_last_error();
    if (!k_cases[k].why) {
      CHECK(st == SG_OK, "%s: imports (%s \"%s\")", k_cases[k].label, sg_status_string(st), err);
    } else {
      CHECK(st == SG_ERR_CORRUPT && strstr(err, k_cases[k].why) && !strstr(err, "malformed"),
            "%s: refused, saying \"%s\": %s \"%s\"", k_cases[k].label, k_cases[k].why,
            sg_status_string(st), err);
    }
  }
  /* header lengths: over the format's limit (in a short file) and past the end of the file */
  sg_status st = import_bytes(e, path, "{}", 0, 100000001ull);
  CHECK(st == SG_ERR_CORRUPT && strstr(sg_last_error(), "limit of 100000000"),
        "a header length over the limit says so: \"%s\"", sg_last_error());
  st = import_bytes(e, path, "{\"a\":{" T "[0,4]}}", 4, 1000);
  CHECK(st == SG_ERR_CORRUPT && strstr(sg_last_error(), "exceeds the file"),
        "a header length past the file says so: \"%s\"", sg_last_error());
  /* the export itself follows the rules */
  CHECK(sg_export(e, path) == SG_OK && sg_import(e, path) == SG_OK,
        "sg_export's file imports: %s", sg_last_error());
  unlink(path);
  rmdir(dir);
  sg_engine_destroy(e);
  sg_comm_destroy(c);
  return sg_test_summary("");
}
