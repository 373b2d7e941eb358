#!/usr/bin/env bash
# Downloads, into .whl/, the wheels a CUDA machine without network needs to
# run `scripts/gpu_checks.sh` with its own python3 (3.12, torch with CUDA):
# the gRPC, protobuf and OpenTelemetry families and the test plugins, at the
# versions this checkout's .venv has (those CI tests). Run here, after `make
# test` made .venv; `scripts/device_run.sh` installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
names=(grpcio grpcio-health-checking grpcio-reflection protobuf googleapis-common-protos
       opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-semantic-conventions
       opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
       opentelemetry-instrumentation opentelemetry-instrumentation-grpc
       wrapt typing_extensions smg-grpc-proto pytest pytest-asyncio pytest-timeout)
frozen=$(.venv/bin/pip list --format=freeze)
pins=()
for name in "${names[@]}"; do
    pin=$(grep -i "^${name}==" <<<"$frozen" || grep -i "^${name//-/_}==" <<<"$frozen") || {
        echo "$name is not in .venv: run make test first" >&2; exit 1; }
    pins+=("$pin")
done
rm -rf .whl
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
du -sh .whl
