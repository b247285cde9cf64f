#!/bin/sh
# Start of the compose file's Redis: the ACL users go into a config file (mode 0600, passwords as
# SHA-256 hashes), so no password is on redis-server's command line, which `docker top` and `ps`
# show. The splitbus user may run only the commands splitbus needs (the list is
# splitbus.redis_server.SPLITBUS_COMMANDS; tests/deploy/test_compose.py checks that they agree);
# the default user is off unless SPLITBUS_REDIS_ADMIN_PASSWORD is set. With
# SPLITBUS_REDIS_CLUSTER=yes (the cluster profile's nodes) the node runs in cluster mode, as
# splitbus.redis_cluster's nodes do: the splitbus user may also run what a cluster client needs
# (CLUSTER_CLIENT_COMMANDS there), and replicas log in as a `replicator` user that may only
# replicate, whose password is derived from the admin password (so it needs one). Then the image's
# own entrypoint, which drops to the redis user.
set -eu
: "${SPLITBUS_REDIS_PASSWORD:?set SPLITBUS_REDIS_PASSWORD}"
umask 077
hash() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
COMMANDS="+ping +select +client|setname +client|setinfo +xadd +xread +xreadgroup +xack +xautoclaim +xclaim \
+xpending +xdel +xtrim +xlen +xrange +xrevrange +xgroup|create +xgroup|createconsumer \
+xgroup|delconsumer +xinfo|groups +xinfo|consumers +xinfo|stream +hset +hget +hmget +hgetall \
+hincrby +hdel +zadd +zrange +zrem +zcard +zremrangebyscore +get +set +del +exists +incr +incrby +expire +pexpire \
+persist +ttl +pttl +scan +eval +evalsha +script|load +script|exists +time +info|server"
# Redis 7.0 and 7.1 refuse an ACL rule naming a subcommand they lack (CLIENT SETINFO came in 7.2), as
# splitbus.redis_server.commands_for says: an image of those versions runs without it.
case "$(redis-server --version)" in
  *v=7.0.*|*v=7.1.*) COMMANDS="$(printf %s "$COMMANDS" | sed 's/ +client|setinfo//')" ;;
esac
CLUSTER_COMMANDS="+cluster|slots +cluster|shards +command +asking +readonly +readwrite"
cluster="${SPLITBUS_REDIS_CLUSTER:-no}"
if [ "$cluster" = yes ]; then
  : "${SPLITBUS_REDIS_ADMIN_PASSWORD:?the cluster profile needs SPLITBUS_REDIS_ADMIN_PASSWORD (see docker-compose.yml)}"
  COMMANDS="$COMMANDS $CLUSTER_COMMANDS"
  replication="$(hash "replication:$SPLITBUS_REDIS_ADMIN_PASSWORD")"
fi
conf=/tmp/redis.conf
{
  echo "appendonly yes"
  echo "appendfsync everysec"
  echo "save \"\""
  echo "aof-use-rdb-preamble yes"
  echo "auto-aof-rewrite-min-size 4mb"
  echo "maxmemory ${SPLITBUS_REDIS_MAXMEMORY:-0}"
  echo "maxmemory-policy noeviction"
  echo "user splitbus reset on #$(hash "$SPLITBUS_REDIS_PASSWORD") ~* &* -@all $COMMANDS"
  if [ -n "${SPLITBUS_REDIS_ADMIN_PASSWORD:-}" ]; then
    echo "user default reset on #$(hash "$SPLITBUS_REDIS_ADMIN_PASSWORD") ~* &* +@all"
  else
    echo "user default reset off"
  fi
  if [ "$cluster" = yes ]; then
    echo "cluster-enabled yes"
    echo "cluster-config-file nodes.conf"  # in /data, the node's volume: it restarts as the node it was
    echo "cluster-node-timeout 1000"  # a failed primary's replica takes over in ~2.5 s (Redis's default: 15 s)
    echo "cluster-require-full-coverage no"  # the other primaries keep serving during a failover
    echo "user replicator reset on #$(hash "$replication") ~* &* -@all +psync +replconf +ping"
    echo "masteruser replicator"
    echo "masterauth $replication"  # derived, not a password anyone types; the file is 0600
  fi
} > "$conf"
chown redis:redis "$conf" 2>/dev/null || true
exec docker-entrypoint.sh redis-server "$conf"
