#!/usr/bin/env bash
# Redis topologies for the tests, on loopback, without persistence. Source this file, then:
#   start_redis_servers   a three-node Redis Cluster and a Sentinel setup (a primary, a replica,
#                         one Sentinel); exports KVTIER_TEST_REDIS_CLUSTER_URL and
#                         KVTIER_TEST_REDIS_SENTINEL_URL
#   stop_redis_servers    stops them all and removes their directories (safe to call twice)
# Each start waits at most REDIS_START_WAIT_S seconds per step and fails with the servers' logs.
# (start_/stop_redis_cluster and start_/stop_redis_sentinel do one setup each.)

REDIS_CLUSTER_PORTS=(6391 6392 6393)
REDIS_SENTINEL_PRIMARY_PORT=6394
REDIS_SENTINEL_REPLICA_PORT=6395
REDIS_SENTINEL_PORT=26394
REDIS_SENTINEL_SERVICE=kvtier
REDIS_START_WAIT_S=${REDIS_START_WAIT_S:-20}
REDIS_CLUSTER_DIR=""
REDIS_SENTINEL_DIR=""

_redis_wait() {  # _redis_wait WHAT COMMAND...: until COMMAND succeeds, at most REDIS_START_WAIT_S seconds
    local what=$1 deadline=$((SECONDS + REDIS_START_WAIT_S))
    shift
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "gave up waiting ${REDIS_START_WAIT_S}s for $what" >&2
            return 1
        fi
        sleep 0.1
    done
}

_redis_dump_logs() {
    local log
    for log in "$@"; do
        [ -f "$log" ] && { echo "--- $log" >&2; tail -n 30 "$log" >&2; }
    done
    return 1
}

_redis_pong() { [ "$(redis-cli -p "$1" ping 2>/dev/null)" = "PONG" ]; }
_redis_cluster_ok() { redis-cli -p "$1" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }
_redis_replica_synced() { redis-cli -p "$1" info replication 2>/dev/null | grep -q '^master_link_status:up'; }
_redis_sentinel_sees_replica() {
    redis-cli -p "$REDIS_SENTINEL_PORT" sentinel replicas "$REDIS_SENTINEL_SERVICE" 2>/dev/null \
        | grep -qx "$REDIS_SENTINEL_REPLICA_PORT"
}

_redis_server() {  # _redis_server DIR PORT [ARGS...]: a daemonized server without persistence
    local dir=$1 port=$2
    shift 2
    mkdir -p "$dir"
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
        --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" "$@"
}

_redis_stop_dir() {  # _redis_stop_dir DIR PORT: shut the server down, or kill it by its pid file
    local dir=$1 port=$2
    local pidfile=$dir/redis.pid
    [ -f "$dir/sentinel.pid" ] && pidfile=$dir/sentinel.pid
    redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 \
        || { [ -f "$pidfile" ] && kill -CONT "$(cat "$pidfile")" 2>/dev/null \
             && kill "$(cat "$pidfile")" 2>/dev/null; } \
        || true
}

start_redis_cluster() {
    REDIS_CLUSTER_DIR="$(mktemp -d)"
    local port addresses=() logs=()
    for port in "${REDIS_CLUSTER_PORTS[@]}"; do
        _redis_server "$REDIS_CLUSTER_DIR/$port" "$port" --cluster-enabled yes --cluster-config-file nodes.conf \
            --cluster-node-timeout 3000 --cluster-require-full-coverage no
        addresses+=("127.0.0.1:$port")
        logs+=("$REDIS_CLUSTER_DIR/$port/redis.log")
    done
    for port in "${REDIS_CLUSTER_PORTS[@]}"; do
        _redis_wait "cluster node $port" _redis_pong "$port" || _redis_dump_logs "${logs[@]}" || return 1
    done
    redis-cli --cluster create "${addresses[@]}" --cluster-replicas 0 --cluster-yes >"$REDIS_CLUSTER_DIR/create.log" 2>&1 \
        || _redis_dump_logs "$REDIS_CLUSTER_DIR/create.log" "${logs[@]}" || return 1
    for port in "${REDIS_CLUSTER_PORTS[@]}"; do
        _redis_wait "cluster node $port to join" _redis_cluster_ok "$port" || _redis_dump_logs "${logs[@]}" || return 1
    done
    export KVTIER_TEST_REDIS_CLUSTER_URL="redis-cluster://$(IFS=,; echo "${addresses[*]}")"
}

stop_redis_cluster() {
    [ -n "$REDIS_CLUSTER_DIR" ] || return 0
    local port
    for port in "${REDIS_CLUSTER_PORTS[@]}"; do
        _redis_stop_dir "$REDIS_CLUSTER_DIR/$port" "$port"
    done
    rm -rf "$REDIS_CLUSTER_DIR"
    REDIS_CLUSTER_DIR=""
    return 0
}

start_redis_sentinel() {
    REDIS_SENTINEL_DIR="$(mktemp -d)"
    local dir=$REDIS_SENTINEL_DIR
    local logs=("$dir/primary/redis.log" "$dir/replica/redis.log" "$dir/sentinel.log")
    _redis_server "$dir/primary" "$REDIS_SENTINEL_PRIMARY_PORT" --repl-diskless-sync-delay 0
    _redis_server "$dir/replica" "$REDIS_SENTINEL_REPLICA_PORT" --replicaof 127.0.0.1 "$REDIS_SENTINEL_PRIMARY_PORT"
    cat >"$dir/sentinel.conf" <<CONF
port $REDIS_SENTINEL_PORT
bind 127.0.0.1
dir $dir
daemonize yes
pidfile $dir/sentinel.pid
logfile $dir/sentinel.log
sentinel monitor $REDIS_SENTINEL_SERVICE 127.0.0.1 $REDIS_SENTINEL_PRIMARY_PORT 1
sentinel down-after-milliseconds $REDIS_SENTINEL_SERVICE 1000
sentinel failover-timeout $REDIS_SENTINEL_SERVICE 10000
CONF
    redis-server "$dir/sentinel.conf" --sentinel
    _redis_wait "the replica to sync" _redis_replica_synced "$REDIS_SENTINEL_REPLICA_PORT" \
        || _redis_dump_logs "${logs[@]}" || return 1
    _redis_wait "the Sentinel to see the replica" _redis_sentinel_sees_replica || _redis_dump_logs "${logs[@]}" || return 1
    export KVTIER_TEST_REDIS_SENTINEL_URL="redis-sentinel://127.0.0.1:$REDIS_SENTINEL_PORT/$REDIS_SENTINEL_SERVICE"
}

stop_redis_sentinel() {
    [ -n "$REDIS_SENTINEL_DIR" ] || return 0
    local dir=$REDIS_SENTINEL_DIR
    _redis_stop_dir "$dir" "$REDIS_SENTINEL_PORT"
    _redis_stop_dir "$dir/replica" "$REDIS_SENTINEL_REPLICA_PORT"
    _redis_stop_dir "$dir/primary" "$REDIS_SENTINEL_PRIMARY_PORT"
    rm -rf "$dir"
    REDIS_SENTINEL_DIR=""
    return 0
}

start_redis_servers() { start_redis_cluster && start_redis_sentinel; }
stop_redis_servers() { stop_redis_sentinel; stop_redis_cluster; }
