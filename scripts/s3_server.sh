# Start and stop moto_server, a real S3-compatible endpoint, on a free port on 127.0.0.1.
# Sourced by scripts/test.sh; exports the AWS_* variables that hslake and boto3 read.
start_s3_server() {
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  mkdir -p .cache
  moto_server -H 127.0.0.1 -p "$port" > .cache/moto.log 2>&1 &
  S3_SERVER_PID=$!
  for _ in $(seq 100); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/moto-api/')" 2>/dev/null && break
    sleep 0.1
  done
  export AWS_ENDPOINT="http://127.0.0.1:$port" AWS_ALLOW_HTTP=true
  export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1 AWS_DEFAULT_REGION=us-east-1
  export HSLAKE_TEST_S3_ENDPOINT="$AWS_ENDPOINT"
  echo "s3 test server (moto) at $AWS_ENDPOINT" >&2
}

stop_s3_server() {
  [ -n "${S3_SERVER_PID:-}" ] && kill "$S3_SERVER_PID" 2>/dev/null || true
}
