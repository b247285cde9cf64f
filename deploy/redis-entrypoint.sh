#!/bin/sh
# Start of the compose file's Redis: the ACL users go into a config file (mode 0600, passwords as
# SHA-256 hashes), so no password is on redis-server's command line, which `docker top` and `ps`
# show. The splitbus user may run only the commands splitbus needs (the list is
# splitbus.redis_server.SPLITBUS_COMMANDS; tests/deploy/test_compose.py checks that they agree);
# the default user is off unless SPLITBUS_REDIS_ADMIN_PASSWORD is set. Then the image's own
# entrypoint, which drops to the redis user.
set -eu
: "${SPLITBUS_REDIS_PASSWORD:?set SPLITBUS_REDIS_PASSWORD}"
umask 077
hash() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
COMMANDS="+ping +select +client|setname +client|setinfo +xadd +xread +xreadgroup +xack +xautoclaim +xclaim \
+xpending +xdel +xtrim +xlen +xrange +xrevrange +xgroup|create +xgroup|createconsumer \
+xgroup|delconsumer +xinfo|groups +xinfo|consumers +xinfo|stream +hset +hget +hmget +hgetall \
+hincrby +hdel +zadd +zrange +zrem +zcard +get +set +del +exists +incr +incrby +expire +pexpire \
+persist +ttl +pttl +scan +eval +evalsha +script|load +script|exists +time"
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
} > "$conf"
chown redis:redis "$conf" 2>/dev/null || true
exec docker-entrypoint.sh redis-server "$conf"
