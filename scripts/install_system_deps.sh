#!/bin/sh
# System packages the local sandbox needs: bubblewrap (namespaces) and a system python3 inside /usr
# (the calculator tool runs `python3 calc.py` in the sandbox, which only sees /usr, not ~/.pyenv).
# With the argument `test` (make test): also Debian's chromium, which the inspector's browser tests drive.
# As root with apt-get: installs what is missing. Otherwise: prints what to install and exits 0, so
# `make` keeps going; the sandbox itself reports SandboxUnavailable naming anything still missing, and
# the browser tests are skipped saying that chromium is missing.
set -eu

missing=""
command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
[ -x /usr/bin/python3 ] || [ -x /usr/local/bin/python3 ] || missing="$missing python3"
command -v prlimit >/dev/null 2>&1 || missing="$missing util-linux"
# `ip` brings up the loopback of isolation=unshare sandboxes that use sandbox.allowed_hosts (the proxy)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing="$missing iproute2"
browser=""
if [ "${1:-}" = "test" ]; then
    command -v chromium >/dev/null 2>&1 || browser="chromium"
fi

if [ -z "$missing" ] && [ -z "$browser" ]; then
    echo "system deps: ok (bwrap $(bwrap --version 2>/dev/null | cut -d' ' -f2), $(/usr/bin/python3 --version 2>/dev/null || echo python3))"
    exit 0
fi

if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "system deps: installing$missing $browser"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    if [ -n "$missing" ]; then
        # shellcheck disable=SC2086
        apt-get install -y -qq --no-install-recommends $missing
    fi
    # the browser is only for tests: if it cannot be installed here, those tests skip and say so
    if [ -n "$browser" ] && ! apt-get install -y -qq --no-install-recommends chromium; then
        echo "system deps: could not install chromium; tests/inspect/test_browser.py will be skipped" >&2
    fi
else
    echo "system deps: please install:$missing $browser (e.g. sudo apt-get install -y$missing $browser)" >&2
fi
