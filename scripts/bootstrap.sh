#!/usr/bin/env bash
# Set up everything mig-spawner needs on a fresh Debian machine, idempotently:
# system packages (PostgreSQL for ledger tests, Chromium for browser tests),
# configurable-http-proxy from npm, a virtualenv with the package installed, and the
# Kubernetes test cluster's programs built from upstream Go modules (once per machine,
# cached by version; scripts/kube-build.sh).
# Usage: scripts/bootstrap.sh [--no-system]
set -euo pipefail
cd "$(dirname "$0")/.."

want_system=1
[ "${1:-}" = "--no-system" ] && want_system=0

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [ "$want_system" = 1 ]; then
    missing=()
    command -v chromium >/dev/null || missing+=(chromium)
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
    command -v node >/dev/null || missing+=(nodejs npm)
    if [ ${#missing[@]} -gt 0 ]; then
        step "installing Debian packages: ${missing[*]}"
        if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
fi

if [ ! -x node_modules/.bin/configurable-http-proxy ] || [ package.json -nt node_modules ]; then
    step "installing configurable-http-proxy (npm, from package.json)"
    npm install --no-audit --no-fund --silent >/dev/null
    touch node_modules
fi

if [ ! -x .venv/bin/python ]; then
    step "creating .venv"
    python3 -m venv .venv
fi
stamp=.venv/.mig-spawner-installed
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ]; then
    step "installing mig-spawner and its test dependencies into .venv"
    # pip's output goes to a log that is shown only when the install fails.
    if ! { .venv/bin/pip install -q --upgrade pip &&
           .venv/bin/pip install -q -e '.[test,kube,report,demo]'; } >.venv/pip.log 2>&1; then
        cat .venv/pip.log
        echo "error: installing the Python packages failed (log above)" >&2
        exit 1
    fi
    touch "$stamp"
fi

# The Kubernetes tests' control plane (kube-apiserver, scheduler, controller-manager,
# etcd, KWOK): built once per machine into ~/.cache/mig-spawner/kube/<version>/, niced.
scripts/kube-build.sh
