#!/bin/sh
# The compose cluster profile's one-shot init: forms the nodes of SPLITBUS_REDIS_NODES (host:port,
# space-separated: redis-node-0..5) into a cluster of 3 primaries with a replica each, as the admin
# user (its password in REDISCLI_AUTH, never on a command line). A cluster already formed (a restart
# of the deployment) is left as it is. CLUSTER MEET takes addresses, not names: each is resolved.
set -eu
: "${REDISCLI_AUTH:?the cluster profile needs SPLITBUS_REDIS_ADMIN_PASSWORD (see docker-compose.yml)}"
first="${SPLITBUS_REDIS_NODES%% *}"
cli() { redis-cli --no-auth-warning --user default -h "${first%:*}" -p "${first##*:}" "$@"; }
if cli cluster info | grep -q '^cluster_known_nodes:[2-9]'; then
  echo "the cluster is formed already"
else
  addresses=""
  for node in $SPLITBUS_REDIS_NODES; do
    addresses="$addresses $(getent hosts "${node%:*}" | cut -d' ' -f1 | head -n1):${node##*:}"
  done
  # shellcheck disable=SC2086 # one argument per node
  cli --cluster create $addresses --cluster-replicas 1 --cluster-yes
fi
until cli cluster info | grep -q '^cluster_state:ok'; do sleep 0.5; done
echo "the cluster is healthy"
