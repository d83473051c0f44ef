#!/usr/bin/env bash
# Builds Ferry's image with podman from binaries built here, and runs it. Base images cannot be
# pulled here, so the image is assembled FROM scratch with what the published Containerfile's
# runtime stage holds: the three binaries, every shared library they load (as `ldd` lists them,
# with the dynamic loader), a non-root user (65532) and CA certificates. Then each binary
# answers --help inside it, as that user, and the executor checks a configuration.
# Usage: helm/tests/image.sh [BIN_DIR]   (default target/ci)
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${1:-target/ci}
tag=localhost/ferry:test-$$
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"; podman rmi -f "$tag" >/dev/null 2>&1 || true' EXIT

root=$ctx/rootfs
mkdir -p "$root/usr/local/bin" "$root/etc" "$root/tmp" "$root/home/nonroot"
bins=(ferry-scheduler ferry-executor ferry-kv)
for b in "${bins[@]}"; do cp "$bin/$b" "$root/usr/local/bin/"; done
libs=$(for b in "${bins[@]}"; do ldd "$bin/$b"; done |
  awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | sort -u)
for lib in $libs; do cp --parents -L "$lib" "$root/"; done
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$root/etc/group"
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  mkdir -p "$root/etc/ssl/certs" && cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
fi
cat >"$ctx/Containerfile" <<'CF'
FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/bin
USER 65532:65532
EXPOSE 8000 50051 50061 50071
CMD ["ferry-scheduler", "--help"]
CF
podman build -q -t "$tag" "$ctx" >/dev/null
size=$(podman image inspect "$tag" --format '{{.Size}}')
user=$(podman image inspect "$tag" --format '{{.Config.User}}')
[ "$user" = "65532:65532" ] || { echo "image: runs as '$user', expected 65532:65532"; exit 1; }
echo "image: built $tag ($((size / 1048576)) MiB, user $user, $(echo "$libs" | wc -w) libraries)"

# This machine's container runtime: crun cannot set the limits podman asks for, and refuses
# this host's hybrid cgroups; runc with the limits the host already has works.
run() {
  podman run --rm --network none "$tag" "$@" 2>/dev/null && return 0
  podman --runtime runc run --rm --network none \
    --ulimit "nofile=$(ulimit -Sn):$(ulimit -Hn)" --ulimit nproc=4096:4096 "$tag" "$@"
}
for b in "${bins[@]}"; do
  out=$(run "$b" --help)
  grep -q "^Usage: $b" <<<"$out" || { echo "image: $b --help printed: $out"; exit 1; }
  echo "image: $b --help answers inside the image"
done
out=$(run ferry-executor --check-config --listen 0.0.0.0:50061 --plaintext --etcd-endpoints etcd:2379 \
  --model /models/m.gguf)
grep -q "configuration ok" <<<"$out" || { echo "image: --check-config printed: $out"; exit 1; }
kv_out=$(run ferry-kv --check-config)
echo "image: ok ($kv_out)"
