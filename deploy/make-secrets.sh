#!/bin/sh
# The two secrets every pdserve deployment needs, as files for compose's `secrets:` (or for
# `kubectl create secret generic --from-file`): docs/deploy.md.
#   sh deploy/make-secrets.sh [DIR]        # DIR: default ./secrets (compose's PDSERVE_SECRETS_DIR)
# DIR is made 0700 (only you reach the files on the host); each file is 0644, since compose
# bind-mounts it as it is and the containers' non-root user (uid 1000) must read it.
# Existing files are kept: delete them to make new ones (then restart every service).
set -eu
dir="${1:-./secrets}"
mkdir -p "$dir"
chmod 0700 "$dir"
for name in internal-secret redis-password; do
    if [ ! -s "$dir/$name" ]; then
        # 48 random bytes as 64 URL-safe characters: printable, no spaces (what pdserve accepts)
        head -c 48 /dev/urandom | base64 | tr '+/' '-_' | tr -d '\n=' >"$dir/$name"
        echo "wrote $dir/$name"
    fi
    chmod 0644 "$dir/$name"
done
