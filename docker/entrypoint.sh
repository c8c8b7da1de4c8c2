#!/bin/sh
# The images' entrypoint: `chattts-serve "$@"`, but `serve` starts only with API keys. A container listens
# on every interface (CHATTTS_SERVE_HOST=0.0.0.0), where a server without keys lets anyone who reaches the
# port synthesise, create and delete voices.
#
#   CHATTTS_SERVE_API_KEYS=k1,k2          the keys (comma-separated), or
#   CHATTTS_SERVE_API_KEYS_FILE=/run/secrets/chattts_api_keys
#                                         a file holding them (a Docker or Kubernetes secret; one per line
#                                         or comma-separated), so the key is not in the container's config
#   CHATTTS_DOCKER_ALLOW_NO_KEYS=1        serve without keys anyway (a port reachable from trusted hosts only)
set -eu

if [ -n "${CHATTTS_SERVE_API_KEYS_FILE:-}" ]; then
    if [ ! -r "$CHATTTS_SERVE_API_KEYS_FILE" ]; then
        echo "chattts-serve: cannot read CHATTTS_SERVE_API_KEYS_FILE=$CHATTTS_SERVE_API_KEYS_FILE" >&2
        exit 2
    fi
    CHATTTS_SERVE_API_KEYS=$(tr -s '\r\n' ',,' < "$CHATTTS_SERVE_API_KEYS_FILE" | sed 's/^,*//; s/,*$//')
    export CHATTTS_SERVE_API_KEYS
fi

if [ "${1:-}" = serve ] && [ -z "${CHATTTS_SERVE_API_KEYS:-}" ] && [ "${CHATTTS_DOCKER_ALLOW_NO_KEYS:-}" != 1 ]; then
    echo "chattts-serve: no API keys. This container listens on every interface: set CHATTTS_SERVE_API_KEYS" \
        "(or CHATTTS_SERVE_API_KEYS_FILE, a mounted secret), or CHATTTS_DOCKER_ALLOW_NO_KEYS=1 on a trusted" \
        "network." >&2
    exit 2
fi

exec chattts-serve "$@"
