#!/usr/bin/env bash
# Build the Kubernetes test cluster's programs from upstream Go modules, once per
# machine: kube-apiserver, kube-scheduler and kube-controller-manager from
# k8s.io/kubernetes, etcd from go.etcd.io/etcd/server/v3 and kwok from
# sigs.k8s.io/kwok, each pinned by a go.mod + go.sum under tools/kube/.
#
# The binaries go to a cache keyed by the Kubernetes version,
#   ${XDG_CACHE_HOME:-$HOME/.cache}/mig-spawner/kube/<version>/bin/
# and are built only when missing or when the pins changed. The build runs under
# `nice -n 19`; its log is kept beside the binaries.
#
# Usage: scripts/kube-build.sh [--print-bin]
#   MIG_SPAWNER_KUBE_VERSION=1.34 selects tools/kube/kubernetes-1.34 (default 1.36).
#   --print-bin prints the bin folder (building first if needed) and nothing else
#   on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

minor=${MIG_SPAWNER_KUBE_VERSION:-1.36}
k8s_dir=tools/kube/kubernetes-$minor
if [ ! -f "$k8s_dir/go.mod" ]; then
    echo "error: MIG_SPAWNER_KUBE_VERSION=$minor: no $k8s_dir/go.mod (have: $(ls tools/kube | sed -n 's/^kubernetes-//p' | tr '\n' ' '))" >&2
    exit 2
fi

print_bin=0
[ "${1:-}" = "--print-bin" ] && print_bin=1
say() { if [ "$print_bin" = 1 ]; then printf '%s\n' "$*" >&2; else printf '%s\n' "$*"; fi; }
step() { say "$(printf '\033[1m==> %s\033[0m' "$*")"; }

# The version each go.mod pins (the first "require" of the module named).
pinned() { awk -v m="$2" '{ sub(/^require /, "") } $1 == m && $2 ~ /^v/ { print $2; exit }' "$1/go.mod"; }
version=$(pinned "$k8s_dir" k8s.io/kubernetes)
etcd_version=$(pinned tools/kube/etcd go.etcd.io/etcd/server/v3)
kwok_version=$(pinned tools/kube/kwok sigs.k8s.io/kwok)

cache=${XDG_CACHE_HOME:-$HOME/.cache}/mig-spawner/kube/$version
bin=$cache/bin
# The pins' fingerprint: a changed go.mod or go.sum rebuilds.
pins=$(cat "$k8s_dir"/go.mod "$k8s_dir"/go.sum tools/kube/etcd/go.{mod,sum} \
           tools/kube/kwok/go.{mod,sum} | sha256sum | cut -c1-16)
programs=(kube-apiserver kube-scheduler kube-controller-manager etcd kwok)

have_all() {
    [ "$(cat "$bin/.pins" 2>/dev/null)" = "$pins" ] || return 1
    for p in "${programs[@]}"; do [ -x "$bin/$p" ] || return 1; done
}

if have_all; then
    [ "$print_bin" = 1 ] && printf '%s\n' "$bin"
    exit 0
fi

if ! command -v go >/dev/null; then
    for g in /usr/local/go/bin/go /usr/lib/go/bin/go; do
        [ -x "$g" ] && PATH=$(dirname "$g"):$PATH && break
    done
fi
command -v go >/dev/null || { echo "error: the Kubernetes test cluster needs Go (1.26 or later) to build" >&2; exit 1; }

mkdir -p "$cache"
# One build at a time per version (a second caller waits for the first).
exec 9>"$cache/.lock"
flock 9
if have_all; then
    [ "$print_bin" = 1 ] && printf '%s\n' "$bin"
    exit 0
fi

log=$cache/build.log
: >"$log"
step "building the Kubernetes test cluster $version (etcd $etcd_version, kwok $kwok_version) into $bin"
say "    once per machine, niced; about 30 minutes on 2 cores when nothing is cached (log: $log)"
export GOTOOLCHAIN=local GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false" CGO_ENABLED=0
staging=$(mktemp -d "$cache/.bin.XXXXXX")
trap 'rm -rf "$staging"; kill "$ticker" 2>/dev/null || true' EXIT

start=$SECONDS
# A line every 30 s with the packages compiled so far (go build -v names each).
( while sleep 30; do
      n=$(grep -c -v -e '^go: ' -e '^#' -e '^==' "$log" || true)
      say "    ... $(( (SECONDS - start) / 60 )) min, $n packages compiled"
  done ) &
ticker=$!

build() {  # build <module dir> <ldflags> <package>=<program>...
    local dir=$1 ldflags=$2; shift 2
    for spec in "$@"; do
        echo "== $spec" >>"$log"
        (cd "$dir" && nice -n 19 go build -v -trimpath -ldflags "-s -w $ldflags" \
            -o "$staging/${spec#*=}" "${spec%=*}") >>"$log" 2>&1 || {
            tail -n 40 "$log" >&2
            echo "error: building ${spec#*=} failed (log: $log)" >&2
            exit 1
        }
        say "    built ${spec#*=} ($(( (SECONDS - start) / 60 )) min)"
    done
}

# kube-apiserver etc. report the pinned version (clients and the scheduler read it).
IFS=. read -r major minor_number _ <<<"${version#v}"
kver="-X k8s.io/component-base/version.gitVersion=$version \
      -X k8s.io/component-base/version.gitMajor=$major \
      -X k8s.io/component-base/version.gitMinor=$minor_number \
      -X k8s.io/component-base/version.gitTreeState=clean"
build "$k8s_dir" "$kver" \
    k8s.io/kubernetes/cmd/kube-apiserver=kube-apiserver \
    k8s.io/kubernetes/cmd/kube-scheduler=kube-scheduler \
    k8s.io/kubernetes/cmd/kube-controller-manager=kube-controller-manager
build tools/kube/etcd "" go.etcd.io/etcd/server/v3=etcd
build tools/kube/kwok "" \
    sigs.k8s.io/kwok/cmd/kwok=kwok

rm -rf "$bin"
mv "$staging" "$bin"
printf '%s\n' "$pins" >"$bin/.pins"
step "built the Kubernetes test cluster in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
[ "$print_bin" = 1 ] && printf '%s\n' "$bin"
exit 0
