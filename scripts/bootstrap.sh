#!/usr/bin/env bash
# Set up everything mig-spawner needs on a fresh Debian machine, idempotently:
# system packages (PostgreSQL for ledger tests, Chromium for browser tests),
# configurable-http-proxy from npm, and a virtualenv with the package installed.
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

if [ ! -x node_modules/.bin/configurable-http-proxy ]; then
    step "installing configurable-http-proxy (npm)"
    npm install --no-audit --no-fund --silent configurable-http-proxy@^5 >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    step "creating .venv"
    python3 -m venv .venv
fi
stamp=.venv/.mig-spawner-installed
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ]; then
    step "installing mig-spawner and its test dependencies into .venv"
    .venv/bin/pip install -q --upgrade pip >/dev/null
    .venv/bin/pip install -q -e '.[test,kube]'
    touch "$stamp"
fi
