#!/usr/bin/env bash
# Install check (tests/install.cmake): install_check.sh BUILD_DIR WORK_DIR C_COMPILER VERSION
# Installs BUILD_DIR into WORK_DIR/prefix, then builds and runs a consumer program four ways:
# CMake find_package with shardgrad::shardgrad and shardgrad::shardgrad_static, and pkg-config
# with the shared and the static library. Then README.md's C quick start exactly as the README
# says: installed into "$HOME/.local" (HOME pointed into WORK_DIR), its export lines for
# PKG_CONFIG_PATH and CMAKE_PREFIX_PATH, the program compiled with the command in its first
# comment (pkg-config) and with the README's CMakeLists.txt (find_package), each run without
# LD_LIBRARY_PATH. Ends with "N passed, M failed".
set -u
build=$1 work=$2 cc=$3 version=$4
prefix=$work/prefix
pass=0 fail=0
rm -rf "$work" && mkdir -p "$work/consumer"

check() { # check DESCRIPTION COMMAND... : runs the command, logs its output on failure
  local what=$1
  shift
  if "$@" >"$work/last.log" 2>&1; then
    echo "ok   $what"
    pass=$((pass + 1))
  else
    echo "FAIL $what: $*"
    sed 's/^/     | /' "$work/last.log" | tail -40
    fail=$((fail + 1))
  fi
}

cat >"$work/consumer/consumer.c" <<'C'
/* Uses the installed library: one rank, one parameter, one AdamW step. */
#include <shardgrad.h>
#include <stdio.h>
#include <string.h>

#define TRY(x)                                                                                   \
  do {                                                                                           \
    if ((x) != SG_OK) {                                                                          \
      fprintf(stderr, "%s failed: %s\n", #x, sg_last_error());                                   \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)

int main(void) {
  sg_comm *comm = NULL;
  sg_engine *e = NULL;
  sg_config cfg;
  int id = -1;
  float w[100], g[100];
  for (int i = 0; i < 100; i++) w[i] = 1.0f, g[i] = 0.5f;
  TRY(sg_comm_create_local(1, &comm));
  TRY(sg_config_init(&cfg, sizeof cfg));
  cfg.weight_decay = 0.0f;
  TRY(sg_engine_create(comm, &cfg, &e));
  TRY(sg_add_param(e, "w", 100, 0, &id));
  TRY(sg_finalize(e));
  TRY(sg_set_param(e, id, w, SG_F32));
  void *slot = NULL;
  TRY(sg_grad_ptr(e, id, &slot));
  memcpy(slot, g, sizeof g);
  TRY(sg_grad_ready(e, id));
  TRY(sg_step(e, NULL));
  TRY(sg_get_param(e, id, w, SG_F32));
  sg_engine_destroy(e);
  sg_comm_destroy(comm);
  /* first AdamW step moves every weight by lr (1e-3) against the gradient's sign */
  if (w[0] > 0.9985f && w[0] < 0.9995f) {
    printf("consumer ok: shardgrad %d, w[0] = %.6f\n", sg_version(), w[0]);
    return 0;
  }
  fprintf(stderr, "consumer: unexpected w[0] = %.6f\n", w[0]);
  return 1;
}
C

cat >"$work/consumer/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.18)
project(shardgrad_consumer LANGUAGES C)
find_package(shardgrad 0.1 REQUIRED)
add_executable(consumer consumer.c)
target_link_libraries(consumer PRIVATE shardgrad::shardgrad)
add_executable(consumer_static consumer.c)
target_link_libraries(consumer_static PRIVATE shardgrad::shardgrad_static)
CM

check "cmake --install into $prefix" cmake --install "$build" --prefix "$prefix"
check "header installed" test -f "$prefix/include/shardgrad.h"
libdir=$(dirname "$(find "$prefix" -name 'libshardgrad.so' | head -1)")
check "shared library installed" test -f "$libdir/libshardgrad.so"
check "static library installed" test -f "$libdir/libshardgrad.a"
check "CMake package files installed" test -f "$libdir/cmake/shardgrad/shardgradConfig.cmake" \
  -a -f "$libdir/cmake/shardgrad/shardgradConfigVersion.cmake"
check "pkg-config file installed" test -f "$libdir/pkgconfig/shardgrad.pc"

# find_package
check "consumer configures with find_package(shardgrad)" cmake -S "$work/consumer" \
  -B "$work/consumer/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_BUILD_TYPE=Release
check "consumer builds (shared and static targets)" cmake --build "$work/consumer/build" -j2
check "find_package consumer runs (shared)" "$work/consumer/build/consumer"
check "find_package consumer runs (static)" "$work/consumer/build/consumer_static"
check "static consumer does not load libshardgrad.so" \
  bash -c "! ldd '$work/consumer/build/consumer_static' | grep -q libshardgrad"

# pkg-config
export PKG_CONFIG_PATH="$libdir/pkgconfig"
check "pkg-config version is $version" test "$(pkg-config --modversion shardgrad)" = "$version"
check "pkg-config paths point into the prefix" \
  bash -c "pkg-config --cflags shardgrad | grep -q -- '-I$prefix'"
check "pkg-config consumer builds (shared)" bash -c "'$cc' '$work/consumer/consumer.c' \
  \$(pkg-config --cflags --libs shardgrad) -Wl,-rpath,'$libdir' -o '$work/consumer_pc'"
check "pkg-config consumer runs (shared)" "$work/consumer_pc"
static_libs=$(pkg-config --static --libs shardgrad | sed "s|-lshardgrad|$libdir/libshardgrad.a|")
check "pkg-config consumer builds (static, Libs.private)" bash -c "'$cc' \
  '$work/consumer/consumer.c' \$(pkg-config --cflags shardgrad) $static_libs -o '$work/consumer_pc_static'"
check "pkg-config consumer runs (static)" "$work/consumer_pc_static"

# ---- README.md's C quick start, as a user would follow it ----------------------------------
readme=$(dirname "$0")/../README.md
section() { # the C quick start section of the README
  awk '/^## C quick start/{f=1;next} f&&/^## /{exit} f' "$readme"
}
block() { # block LANG: the first fenced block of that language in the section
  section | awk -v lang="$1" '$0=="```"lang{p=1;next} p&&/^```/{exit} p'
}
qs=$work/readme
mkdir -p "$qs/app" "$qs/home"
block c >"$qs/app/quickstart.c"
block cmake >"$qs/app/CMakeLists.txt"
install_line=$(block sh | grep '^cmake --install ')
exports=$(section | grep '^export ')
cc_line=$(sed -n 's|^/\* \(cc .*\) \*/$|\1|p' "$qs/app/quickstart.c" | head -1)
check "README has the install line, the exports, the cc line and a CMakeLists.txt" \
  test -n "$install_line" -a -n "$exports" -a -n "$cc_line" -a -s "$qs/app/CMakeLists.txt"
# The README's commands, run by bash in a clean environment with HOME inside the work dir; the
# install line's build directory is this build.
readme_env() { # readme_env DIR COMMANDS: runs COMMANDS in DIR after the README's exports
  env -u LD_LIBRARY_PATH -u PKG_CONFIG_PATH -u CMAKE_PREFIX_PATH HOME="$qs/home" \
    PATH="$(dirname "$cc"):$PATH" bash -c "cd '$1' && $exports
$2"
}
check "README: $install_line" readme_env "$qs" "${install_line/ build / $build }"
check "README quick start builds with its cc line (pkg-config)" readme_env "$qs/app" "$cc_line"
check "README quick start (pkg-config) runs without LD_LIBRARY_PATH and fits w + b" \
  readme_env "$qs/app" "./quickstart | tee /dev/stderr | grep -q 'w\[500\] + b = 0.50[0-9] (target 0.5)'"
check "README quick start links the installed library (ldd)" readme_env "$qs/app" \
  "ldd ./quickstart | grep -q '$qs/home/.local/.*libshardgrad.so'"
check "README quick start builds with the README's CMakeLists.txt (find_package)" \
  readme_env "$qs/app" "cmake -S . -B build -DCMAKE_C_COMPILER='$cc' && cmake --build build"
check "README quick start (find_package) runs without LD_LIBRARY_PATH and fits w + b" \
  readme_env "$qs/app" "build/quickstart | grep -q 'w\[500\] + b = 0.50[0-9] (target 0.5)'"

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
