#!/usr/bin/env bash
# Triton's compile cache carried between device calls (sourced by the h200-*.sh scripts).
# A fresh H200 machine spends ~2 minutes compiling pdserve's and fla's kernels (warm-up, the gpu
# tests); a call can bring the cache back and the next call carry it (.tcache/, git-ignored):
#   TCACHE_SAVE=1 ... bash docs/h200-serve-bench.sh   # after warm-up: $OUT/triton-cache.tgz.* (15 MiB parts)
#   mkdir -p .tcache && cp FILES_AT/triton-cache.tgz.* .tcache/   # then carry .tcache
# The cache's groups name absolute paths: it is restored to the same place, ~/.triton/cache.
# Autotuners' picks (fla's GDN kernels autotune) are kept in the same cache and come back with it
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
TCACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
tcache_restore() {
    ls .tcache/triton-cache.tgz.* >/dev/null 2>&1 || return 0
    mkdir -p "$TCACHE_DIR" && cat .tcache/triton-cache.tgz.* | tar xzf - -C "$TCACHE_DIR"
    echo "triton cache: restored $(find "$TCACHE_DIR" -name '*.json' -path '*__grp__*' | wc -l) kernels"
}
tcache_save() {  # tcache_save OUT
    [ -n "${TCACHE_SAVE:-}" ] && [ -d "$TCACHE_DIR" ] || return 0
    tar czf - -C "$TCACHE_DIR" . | command split -b 15M -d - "$1/triton-cache.tgz."  # not the caller's split()
    echo "triton cache: saved $(du -sh "$TCACHE_DIR" | cut -f1) as $(ls "$1"/triton-cache.tgz.* | wc -l) part(s)"
}
