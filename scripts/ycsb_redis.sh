#!/usr/bin/env bash
# The stock YCSB 0.17.0 redis binding (its RedisClient over jedis 2.9.0, with site.ycsb:core
# 0.17.0 from Maven Central) against `copse serve` and against redis-server with
# `appendonly yes, appendfsync always`, one after the other: a load of RECORDS records, then
# workloads A, B, C, F, D and E for SECONDS each, 16 client threads. Prints a markdown table.
#
# The binding's source and the workload files come from the public YCSB repository at tag
# 0.17.0: cloned from GitHub, or, where GitHub is out of reach, from a local git directory of it
# (YCSB_GIT=/path/to/YCSB.git). Nothing of YCSB is kept in this repository.
#
#   scripts/ycsb_redis.sh                       # RECORDS=1000000 SECONDS=30
#   RECORDS=100000 SECONDS=10 YCSB_GIT=... scripts/ycsb_redis.sh
#
# Needs java, mvn, redis-server and a release build of copse (cargo build --release -p copse-cli).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$ROOT/target/ycsb-redis}
RECORDS=${RECORDS:-1000000}
SECONDS_PER_WORKLOAD=${SECONDS:-30}
THREADS=${THREADS:-16}
WORKLOADS=${WORKLOADS:-a b c f d e}
COPSE=${COPSE:-$ROOT/target/release/copse}
YCSB_TAG=0.17.0

mkdir -p "$WORK"
SRC=$WORK/YCSB-$YCSB_TAG
if [ ! -f "$SRC/redis/src/main/java/site/ycsb/db/RedisClient.java" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC"
    if [ -n "${YCSB_GIT:-}" ]; then
        git --git-dir="$YCSB_GIT" archive "$YCSB_TAG" redis workloads | tar -x -C "$SRC"
    else
        git clone --quiet --depth 1 --branch "$YCSB_TAG" https://github.com/brianfrankcooper/YCSB "$SRC.clone"
        cp -r "$SRC.clone/redis" "$SRC.clone/workloads" "$SRC/" && rm -rf "$SRC.clone"
    fi
fi

# The binding, built as its own Maven project over the published core and jedis.
BUILD=$WORK/binding
if [ ! -f "$BUILD/target/classes/site/ycsb/db/RedisClient.class" ]; then
    mkdir -p "$BUILD/src/main/java/site/ycsb/db"
    cp "$SRC"/redis/src/main/java/site/ycsb/db/*.java "$BUILD/src/main/java/site/ycsb/db/"
    cat > "$BUILD/pom.xml" <<'POM'
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>copse.bench</groupId>
  <artifactId>ycsb-redis-binding</artifactId>
  <version>0.17.0</version>
  <properties>
    <maven.compiler.source>1.8</maven.compiler.source>
    <maven.compiler.target>1.8</maven.compiler.target>
    <project.build.sourceEncoding>UTF-8</project.build.sourceEncoding>
  </properties>
  <dependencies>
    <dependency><groupId>site.ycsb</groupId><artifactId>core</artifactId><version>0.17.0</version></dependency>
    <dependency><groupId>redis.clients</groupId><artifactId>jedis</artifactId><version>2.9.0</version></dependency>
  </dependencies>
</project>
POM
    (cd "$BUILD" && mvn -q -B -Dstyle.color=never compile dependency:copy-dependencies -DoutputDirectory=target/dependency)
fi
CP="$BUILD/target/classes:$BUILD/target/dependency/*"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ping() { for _ in $(seq 1 200); do redis-cli -p "$1" ping >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "server on $1 did not answer" >&2; return 1; }

# ycsb PHASE WORKLOAD PORT LOG: one YCSB run; prints "throughput ops/s".
ycsb() {
    local phase=$1 workload=$2 port=$3 log=$4
    local limits=()
    if [ "$phase" = "-t" ]; then
        limits=(-p operationcount=100000000 -p maxexecutiontime="$SECONDS_PER_WORKLOAD")
    fi
    java -cp "$CP" site.ycsb.Client "$phase" -db site.ycsb.db.RedisClient \
        -P "$SRC/workloads/workload$workload" -p redis.host=127.0.0.1 -p redis.port="$port" \
        -p recordcount="$RECORDS" "${limits[@]}" -threads "$THREADS" > "$log" 2>&1
    grep -q 'Return=ERROR' "$log" && { echo "YCSB reported errors, see $log" >&2; grep 'Return=ERROR' "$log" >&2; }
    awk -F', ' '/\[OVERALL\], Throughput/ {printf "%.0f", $3}' "$log"
}

declare -A RESULT
for server in copse redis-aof-always; do
    port=$(free_port)
    dir=$WORK/$server-data
    rm -rf "$dir" && mkdir -p "$dir"
    if [ "$server" = copse ]; then
        "$COPSE" --path "$dir" serve --port "$port" > "$WORK/$server.log" 2>&1 &
    else
        redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save '' \
            --appendonly yes --appendfsync always > "$WORK/$server.log" 2>&1 &
    fi
    pid=$!
    wait_ping "$port"
    RESULT[$server,load]=$(ycsb -load a "$port" "$WORK/$server-load.txt")
    RESULT[$server,records]=$(redis-cli -p "$port" zcard _indices)
    for w in $WORKLOADS; do
        RESULT[$server,$w]=$(ycsb -t "$w" "$port" "$WORK/$server-$w.txt")
    done
    RESULT[$server,rss]=$(awk '/VmRSS/ {printf "%.0f", $2/1024}' /proc/$pid/status)
    kill -TERM "$pid"; wait "$pid" || true
done

echo "YCSB $YCSB_TAG redis binding (jedis 2.9.0), $RECORDS records, $THREADS threads, ${SECONDS_PER_WORKLOAD} s per workload; ops/s"
printf '| server | load | records in _indices |'; for w in $WORKLOADS; do printf ' %s |' "${w^^}"; done; printf ' RSS MiB |\n'
printf '|---|--:|--:|'; for w in $WORKLOADS; do printf -- '--:|'; done; printf -- '--:|\n'
for server in copse redis-aof-always; do
    printf '| %s | %s | %s |' "$server" "${RESULT[$server,load]}" "${RESULT[$server,records]}"
    for w in $WORKLOADS; do printf ' %s |' "${RESULT[$server,$w]}"; done
    printf ' %s |\n' "${RESULT[$server,rss]}"
done
printf '| copse ÷ redis | %.2f | |' "$(echo "${RESULT[copse,load]} / ${RESULT[redis-aof-always,load]}" | bc -l)"
for w in $WORKLOADS; do printf ' %.2f |' "$(echo "${RESULT[copse,$w]} / ${RESULT[redis-aof-always,$w]}" | bc -l)"; done
printf ' |\n'
